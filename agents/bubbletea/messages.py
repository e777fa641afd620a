"""BubbleTea's own messages, on the testbed's typed base (``testbed/messages.py``).

How it fits: the controller (``controller.py``) sends each prefill server (``server.py``)
``Prefill`` (jobs to run in order until the bubble's predicted end), ``Drop``, ``Drain`` and
``Stop``; a server answers ``ServerReady`` once it has profiled its model, then per job
``Progress``, ``Prefilled`` (its KV cache reached the decode worker) or ``KvFailed``; a
decode worker (``decode.py``) says ``DecodeReady``, then ``Decoded`` or ``DecodeError``.  All
of these are Unix datagrams.  On the run's telemetry hub the controller reads the core's
``Events`` and ``Wait`` (forwarded with the worker's name) and the extension's ``Died``
(``extension.py``: one of BubbleTea's processes ended), and tells the run ``Ready`` and
``Log`` lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from testbed.messages import Message, Record


@dataclass
class Died(Message):
    """To the controller: one of BubbleTea's processes (a prefill server's worker name, or a
    decode worker) has died, and how."""

    kind: ClassVar[str] = "bubbletea.died"
    component: str
    reason: str


@dataclass
class Job(Record):
    rid: int
    tokens: int  # the prompt's length
    output_tokens: int


@dataclass
class Prefill(Message):
    """Run ``jobs`` in order, chunk by chunk, until ``deadlines[0]`` (or a later one while the
    worker's wait board still shows ``wait``); ship each finished cache to ``decode`` (ip, port).
    Sent *ahead* (``lengths`` instead of ``deadlines``): wait on the board for ``wait`` to begin
    (until ``give_up``, monotonic), then run them with deadlines at its start + ``lengths``; a
    wait that has passed, or a ``give_up`` reached, hands the jobs back untouched."""

    kind: ClassVar[str] = "bubbletea.prefill"
    deadlines: list[float]
    chunk: int
    wait: int | None
    decode: list
    jobs: list[Job]
    lengths: list[float] | None = None
    give_up: float | None = None


@dataclass
class Drop(Message):
    kind: ClassVar[str] = "bubbletea.drop"
    rid: int


@dataclass
class Drain(Message):
    """Training is over: ship what is prefilled at once."""

    kind: ClassVar[str] = "bubbletea.drain"


@dataclass
class Stop(Message):
    kind: ClassVar[str] = "bubbletea.stop"


@dataclass
class ServerReady(Message):
    """A prefill server has profiled its model: (prompt tokens, seconds) pairs."""

    kind: ClassVar[str] = "bubbletea.server_ready"
    worker: str
    profile: list[list[float]]


@dataclass
class Chunk(Record):
    """One chunk of a prefill, as the server ran it."""

    start: float
    end: float
    tokens: int


@dataclass
class Progress(Message):
    """A job's state after a ``Prefill``: ``done`` of ``total`` tokens; ``last``: the server is
    free again; ``handed_back``: why jobs sent ahead of a wait were handed back unrun
    ("passed", "timeout" or "interrupted", as ``WaitBoard.await_wait`` says), else empty."""

    kind: ClassVar[str] = "bubbletea.progress"
    worker: str
    rid: int
    done: int
    total: int
    intervals: list[Chunk]
    last: bool = True
    handed_back: str = ""


@dataclass
class Prefilled(Message):
    """A job prefilled and its cache acknowledged by the decode worker."""

    kind: ClassVar[str] = "bubbletea.prefilled"
    worker: str
    rid: int
    kv_bytes: int
    kv_send_s: float
    at: float  # when its prefill ended (its first token exists)
    first_token: int | None = None  # None: emulated (no model ran)


@dataclass
class KvFailed(Message):
    """A KV cache transfer failed (the server itself goes on)."""

    kind: ClassVar[str] = "bubbletea.kv_failed"
    worker: str
    rid: int
    error: str


@dataclass
class DecodeReady(Message):
    kind: ClassVar[str] = "bubbletea.decode_ready"
    decoder: str


@dataclass
class Decoded(Message):
    kind: ClassVar[str] = "bubbletea.decoded"
    decoder: str
    rid: int
    tokens: int
    received: float
    done: float
    token_times: list[float] = field(default_factory=list)


@dataclass
class DecodeError(Message):
    """A batch (or a cache being received) failed: its requests are rejected with ``error``."""

    kind: ClassVar[str] = "bubbletea.decode_error"
    decoder: str
    rids: list[int]
    error: str
