"""One typed protocol for every message between the testbed's processes.

How it fits: each kind of message is a dataclass (a ``Message`` subclass) with one class
attribute, ``kind``, which names it on the wire; its fields are named (no positional
lists).  ``encode`` turns one into a JSON object ``{"kind": .., field: ..}`` (``line``: the
same, newline-framed, for the stream sockets); ``decode`` turns JSON back into the
dataclass, checking every field against its annotation, and raises ``MessageError`` with one
line that names the kind and the bad field (``message 'events': field 'events[3].start':
expected float, got str``).  Nested parts (an interval, a job) are ``Record`` dataclasses.

The channels that use it, and the kinds each carries:

* telemetry, the run's Unix stream socket (``testbed/run/hub.py``): a worker
  (``testbed/train/worker.py``) or an extension's process says ``Hello``, then ``Ready``,
  ``Events`` (its timeline as it goes), ``Wait``, ``Done`` or ``WorkerError``; a peer may
  send ``Log`` lines for the run's log; the runner sends ``Go``, ``StartOffset`` and ``Bye``;
* the delay line's control socket (``testbed/net/delayline.py``): ``LaneSet`` (a partial
  update: fields left ``UNSET`` are not sent and not changed) and ``LaneStats``, answered
  by ``Ok``, ``Refused`` or ``LaneStatsReply``;
* a turn server's Unix stream socket (``testbed/net/sendturns.py``): a sender's
  ``TurnWant`` is answered ``TurnGrant`` when its pipeline's turn on the link comes; the
  sender says ``TurnDone`` when its message has left;
* the cluster wire (``testbed/cluster/wire.py``): the orchestrator's ``Call`` (an RPC: the
  agent checks the arguments against its op), the agent's ``Answer`` and its events
  ``Telemetry`` (a worker's message, nested), ``Output`` (what a torchrun rank printed),
  ``Exited`` and ``NetworkFailed``.

Extensions declare their own kinds in their own package on the same base (the core names
none of them); a kind is defined once, so extensions name theirs ``<extension>.<name>``.  A
process decodes the kinds whose modules it has imported.

Only the standard library: every process imports this cheaply.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, ClassVar, Union

__all__ = ["UNSET", "AgentGone", "Answer", "Bye", "Call", "Done", "Events", "Exited", "Go", "Hello", "LaneSet", "LaneStats",
           "LaneStatsReply", "Log", "Message", "MessageError", "NetworkFailed", "Ok", "Output", "Ready", "Record", "Refused",
           "Span", "StartOffset", "Telemetry", "TurnDone", "TurnGrant", "TurnWant", "Wait", "WorkerError", "Xfer",
           "decode", "encode", "kinds", "line"]


class MessageError(ValueError):
    """A message that does not decode; the text is one line naming the kind and the field."""


class _Unset:
    """A field that was not given: left out of the JSON (partial updates)."""

    _one = None

    def __new__(cls):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


UNSET: Any = _Unset()

_KINDS: dict[str, type["Message"]] = {}
_HINTS: dict[type, dict[str, tuple[Any, bool]]] = {}


@dataclasses.dataclass
class Record:
    """A named part of a message (an interval, a job): fields, no kind."""

    def to_dict(self) -> dict:
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not UNSET}

    def given(self) -> dict:
        """The fields that are set (not ``UNSET``), as they are."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not UNSET}


@dataclasses.dataclass
class Message(Record):
    """Base of every kind.  A subclass sets ``kind`` and is registered by it."""

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if not kind:
            return
        old = _KINDS.get(kind)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"message kind {kind!r} is already {old.__module__}.{old.__qualname__}")
        _KINDS[kind] = cls

    def to_dict(self) -> dict:
        return {"kind": self.kind, **super().to_dict()}


def kinds() -> dict[str, type[Message]]:
    """Every kind this process knows (the core's, and those of the extensions it imported)."""
    return dict(_KINDS)


def _to_json(v: Any) -> Any:
    if isinstance(v, Record):
        return v.to_dict()
    if isinstance(v, (list, tuple)):
        return [_to_json(x) for x in v]
    if isinstance(v, dict):
        return {k: _to_json(x) for k, x in v.items()}
    return v


def encode(msg: Message) -> bytes:
    """One message as compact JSON."""
    return json.dumps(msg.to_dict(), separators=(",", ":")).encode()


def line(msg: Message) -> bytes:
    """One message as a JSON line (the stream sockets' framing)."""
    return encode(msg) + b"\n"


def decode(data: bytes | str | dict, expect: tuple[type[Message], ...] | None = None) -> Message:
    """The message in ``data`` (JSON text or an already parsed object), checked field by
    field; ``expect``: the kinds this channel takes here (another is an error)."""
    if isinstance(data, dict):
        obj = data
    else:
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise MessageError(f"a message that is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise MessageError(f"a message must be a JSON object, not {_tname(obj)}")
    kind = obj.get("kind")
    if kind is None:
        raise MessageError(f"a message without 'kind' (fields: {', '.join(sorted(obj)) or 'none'})")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown message kind {kind!r}")
    if expect is not None and not issubclass(cls, expect):
        raise MessageError(f"message {kind!r} not expected here (expected {', '.join(c.kind for c in expect)})")
    return _build(cls, obj, kind, "")


def _hints(cls: type) -> dict[str, tuple[Any, bool]]:
    """Field name -> (annotation, has a default), resolved once per class."""
    got = _HINTS.get(cls)
    if got is None:
        hints = typing.get_type_hints(cls)
        got = {f.name: (hints[f.name], f.default is not dataclasses.MISSING or
                        f.default_factory is not dataclasses.MISSING)
               for f in dataclasses.fields(cls) if f.init}
        _HINTS[cls] = got
    return got


def _build(cls: type, obj: dict, kind: str, where: str):
    hints = _hints(cls)
    extra = [k for k in obj if k not in hints and not (k == "kind" and issubclass(cls, Message))]
    if extra:
        raise MessageError(f"message {kind!r}: field {where + extra[0]!r}: unknown (fields: {', '.join(hints)})")
    args = {}
    for name, (tp, optional) in hints.items():
        if name not in obj:
            if not optional:
                raise MessageError(f"message {kind!r}: field {where + name!r}: missing")
            continue
        args[name] = _check(obj[name], tp, kind, where + name)
    return cls(**args)


def _tname(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _bad(kind: str, where: str, expected: str, v: Any) -> MessageError:
    shown = repr(v)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return MessageError(f"message {kind!r}: field {where!r}: expected {expected}, got {_tname(v)} {shown}")


def _describe(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _check(v: Any, tp: Any, kind: str, where: str) -> Any:
    if tp is Any:
        return v
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if v is None:
            if type(None) in args:
                return None
            raise _bad(kind, where, _describe(tp), v)
        last = None
        for a in args:
            if a is type(None):
                continue
            try:
                return _check(v, a, kind, where)
            except MessageError as exc:
                last = exc
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and last is not None and (typing.get_origin(inner[0]) in (list, dict) or
                                                     isinstance(inner[0], type) and issubclass(inner[0], Record)):
            raise last  # the one container it may be: the error inside it
        raise _bad(kind, where, _describe(tp), v)
    if tp is type(None):
        if v is None:
            return None
        raise _bad(kind, where, "null", v)
    if tp is bool:
        if isinstance(v, bool):
            return v
        raise _bad(kind, where, "bool", v)
    if tp is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        raise _bad(kind, where, "int", v)
    if tp is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        raise _bad(kind, where, "float", v)
    if tp is str:
        if isinstance(v, str):
            return v
        raise _bad(kind, where, "str", v)
    if tp is list or origin is list:
        if not isinstance(v, list):
            raise _bad(kind, where, "list", v)
        args = typing.get_args(tp)
        if not args:
            return list(v)
        return [_check(x, args[0], kind, f"{where}[{i}]") for i, x in enumerate(v)]
    if tp is dict or origin is dict:
        if not isinstance(v, dict):
            raise _bad(kind, where, "object", v)
        args = typing.get_args(tp)
        if not args:
            return dict(v)
        return {k: _check(x, args[1], kind, f"{where}.{k}") for k, x in v.items()}
    if isinstance(tp, type) and issubclass(tp, Message):
        if not isinstance(v, dict):
            raise _bad(kind, where, "a message", v)
        try:
            return decode(v, expect=None if tp is Message else (tp,))
        except MessageError as exc:
            raise MessageError(f"message {kind!r}: field {where!r}: {exc}") from None
    if isinstance(tp, type) and issubclass(tp, Record):
        if not isinstance(v, dict):
            raise _bad(kind, where, tp.__name__, v)
        return _build(tp, v, kind, where + ".")
    raise TypeError(f"message {kind!r}: field {where!r}: no check for {tp!r}")


# -- telemetry: workers and extensions' processes <-> the run (testbed/run/hub.py) ----------------
@dataclasses.dataclass
class Span(Record):
    """One interval of a worker's timeline (``testbed/results/records.py``'s ``Interval``)."""

    kind: str  # forward, backward, optimizer, recv, send, allreduce, idle
    mb: int  # the microbatch, -1 for none
    start: float
    end: float
    iteration: int


@dataclasses.dataclass
class Xfer(Record):
    """One cross-worker message, recorded by its receiver (``records.Transfer``)."""

    kind: str  # xfer_act or xfer_grad
    mb: int
    start: float  # sent (the sender's clock)
    end: float  # fully received
    nbytes: int
    iteration: int


@dataclasses.dataclass
class Hello(Message):
    """The first line of a connection: who it is (a worker, or an extension's peer name)."""

    kind: ClassVar[str] = "hello"
    worker: str
    pid: int | None = None


@dataclasses.dataclass
class Ready(Message):
    """Channels open (a worker), or models loaded (an extension's controller)."""

    kind: ClassVar[str] = "ready"


@dataclasses.dataclass
class Go(Message):
    kind: ClassVar[str] = "go"


@dataclasses.dataclass
class StartOffset(Message):
    """To a pipeline's first stage: wait this long before each iteration (a temporal plan)."""

    kind: ClassVar[str] = "start_offset"
    offset_s: float


@dataclasses.dataclass
class Bye(Message):
    """Training is over (to a worker or a peer): end when ready."""

    kind: ClassVar[str] = "bye"


@dataclasses.dataclass
class Events(Message):
    """A part of a worker's timeline; the last of an iteration says so (``iteration_done``,
    with its ``end`` and, at the last stage, its ``loss``).  ``worker``: filled in when the
    run forwards it to a peer."""

    kind: ClassVar[str] = "events"
    it: int
    events: list[Span]
    transfers: list[Xfer] = dataclasses.field(default_factory=list)
    iteration_done: bool = False
    end: float | None = None
    loss: float | None = None
    worker: str | None = None


@dataclasses.dataclass
class Wait(Message):
    """A wait for a peer begins: the ``n``-th of iteration ``it``, at ``t``."""

    kind: ClassVar[str] = "wait"
    it: int
    n: int
    t: float
    worker: str | None = None


@dataclasses.dataclass
class Done(Message):
    kind: ClassVar[str] = "done"
    transfers: list[Xfer] = dataclasses.field(default_factory=list)
    report: dict | None = None


@dataclasses.dataclass
class WorkerError(Message):
    """A worker failed; ``peer``: the pipeline peer that fell silent, if that was it."""

    kind: ClassVar[str] = "error"
    msg: str
    trace: str = ""
    peer: str | None = None
    silent_s: float | None = None


@dataclasses.dataclass
class Log(Message):
    """A line for the run's log, from an extension's process."""

    kind: ClassVar[str] = "log"
    msg: str


# -- the delay line's control socket (testbed/net/delayline.py) ---------------------------------
@dataclasses.dataclass
class LaneSet(Message):
    """Change what a lane does; only the fields given (not ``UNSET``) change.  See
    ``delayline.py`` for each; ``classes: None`` removes the scheduler, ``lease_s: None``
    its lease, ``turns: None`` the clock plan."""

    kind: ClassVar[str] = "lane"
    lane: str
    delay_ms: float = UNSET
    jitter_ms: float = UNSET
    loss: float = UNSET
    rate_mbps: float | None = UNSET
    link_queue_bytes: int = UNSET
    classes: dict[str, list[list[str | None]]] | None = UNSET
    queue_bytes: int | str | None = UNSET
    order: list[str] = UNSET
    turns: dict | None = UNSET
    lease_s: float | None = UNSET


@dataclasses.dataclass
class LaneStats(Message):
    """Per-lane counters (of one lane, or every one)."""

    kind: ClassVar[str] = "lane_stats"
    lane: str | None = None
    turns_since: int | None = None


@dataclasses.dataclass
class LaneStatsReply(Message):
    kind: ClassVar[str] = "lane_stats_reply"
    lanes: dict[str, dict]


@dataclasses.dataclass
class Ok(Message):
    """A control request done."""

    kind: ClassVar[str] = "ok"


@dataclasses.dataclass
class Refused(Message):
    """A control request refused, and why (one line)."""

    kind: ClassVar[str] = "refused"
    error: str


# -- a turn server's socket (testbed/net/sendturns.py) ---------------------------------------
@dataclasses.dataclass
class TurnWant(Message):
    """A sender's message is ready for ``link`` (a WAN direction, ``src->dst``): grant it the
    link when ``pipeline``'s turn comes (beside other holders while their ceilings leave the
    link room)."""

    kind: ClassVar[str] = "turn_want"
    link: str
    pipeline: str
    ceiling_bytes_s: float = 0.0  # the most its connections can carry (N x window / RTT); 0: the whole link


@dataclasses.dataclass
class TurnGrant(Message):
    """The link is the asker's until it says ``TurnDone``."""

    kind: ClassVar[str] = "turn_grant"
    link: str


@dataclasses.dataclass
class TurnDone(Message):
    """The message has left (what is still unacknowledged is in flight, not queued): the link
    goes to the next pipeline, the sender itself among those waiting when ``more``.
    ``nbytes``: the message's size, for the server's counters."""

    kind: ClassVar[str] = "turn_done"
    link: str
    nbytes: int = 0
    more: bool = False  # the sender has its next message ready: it waits for the link again at once


# -- the cluster wire: orchestrator <-> machine agents (testbed/cluster/wire.py) --------------
@dataclasses.dataclass
class Call(Message):
    """A request to a machine agent: its op and arguments (the op's own signature checks them)."""

    kind: ClassVar[str] = "call"
    id: int
    op: str
    args: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Answer(Message):
    """The agent's answer to call ``id``: its result, or the error (one line)."""

    kind: ClassVar[str] = "answer"
    id: int | None
    result: Any = None
    error: str | None = None


@dataclasses.dataclass
class Telemetry(Message):
    """A message from a process on the agent's machine (``msg``; None: its connection closed)."""

    kind: ClassVar[str] = "telemetry"
    name: str
    msg: Message | None
    t: float


@dataclasses.dataclass
class Datagram(Message):
    """A datagram sent on one machine to a ``Launcher.socket`` path whose process is on another
    (``data``: base64): the agent that relays the path sends it up, the orchestrator on to
    the owner machine's agent, which delivers it to the path there."""

    kind: ClassVar[str] = "datagram"
    path: str
    data: str


@dataclasses.dataclass
class Exited(Message):
    """A process the agent started has ended."""

    kind: ClassVar[str] = "exited"
    name: str
    rc: int
    tail: str = ""


@dataclasses.dataclass
class Output(Message):
    """What a job's process on the agent's machine printed (stdout and stderr together), whole
    lines as they come; all of it is sent before its ``Exited``."""

    kind: ClassVar[str] = "output"
    name: str
    text: str


@dataclasses.dataclass
class AgentGone(Message):
    """The connection to a machine's agent closed (made by the orchestrator's reader)."""

    kind: ClassVar[str] = "agent_gone"


@dataclasses.dataclass
class NetworkFailed(Message):
    """The agent's part of the network failed its check (a delay line died, say)."""

    kind: ClassVar[str] = "network_failed"
    error: str
