"""Titan's own messages, on the testbed's typed base (``testbed/messages.py``).

How it fits: the emulation (``emulate.py``) drives every media agent (``media.py``) and route
counter (``routecheck.py``) over Unix datagrams: ``StartStreams`` (media agents only),
``Window`` (answered ``WindowReply``: per stream, what arrived since the last window),
``Reroute`` (media agents only: streams in progress change their DSCP, so their route, from
the next packet on), ``Dump`` (everything, to a JSON file), ``Reset`` and ``Quit``; the other answers are the
core's ``Ok`` and ``Refused``.  The Internet hub's delay line takes the core's ``LaneSet``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from testbed.messages import Message, Record


@dataclass
class StreamSpec(Record):
    """One constant-bitrate UDP stream from the agent's host to ``dst``, between two instants
    of CLOCK_MONOTONIC; ``tos``: the DSCP byte that selects the route."""

    sid: int
    dst: str
    ip_kbps: float
    pps: float
    tos: int
    t_start: float
    t_end: float


@dataclass
class StartStreams(Message):
    kind: ClassVar[str] = "titan.start"
    streams: list[StreamSpec]


@dataclass
class Started(Message):
    """How many streams the agent now holds."""

    kind: ClassVar[str] = "titan.started"
    streams: int


@dataclass
class Reroute(Message):
    """Streams ``sids`` this agent sends take ``tos`` (their route) from the next packet on;
    answered ``Rerouted``."""

    kind: ClassVar[str] = "titan.reroute"
    sids: list[int]
    tos: int


@dataclass
class Rerouted(Message):
    """How many of the named streams the agent holds (and so moved)."""

    kind: ClassVar[str] = "titan.rerouted"
    streams: int


@dataclass
class Window(Message):
    kind: ClassVar[str] = "titan.window"


@dataclass
class StreamWindow(Record):
    """What arrived of one stream since the last window."""

    received: int
    seq_lo: int
    seq_hi: int
    owd_p50_ms: float
    jitter_ms: float


@dataclass
class WindowReply(Message):
    kind: ClassVar[str] = "titan.window_reply"
    window: dict[str, StreamWindow]  # stream id (JSON keys are text) -> its window


@dataclass
class Dump(Message):
    """Write everything measured to ``path`` (JSON)."""

    kind: ClassVar[str] = "titan.dump"
    path: str


@dataclass
class Reset(Message):
    kind: ClassVar[str] = "titan.reset"


@dataclass
class Quit(Message):
    kind: ClassVar[str] = "titan.quit"
