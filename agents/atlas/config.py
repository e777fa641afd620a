"""Configurations of Atlas's processes: what ``extension.py`` writes, what they read.

How it fits: ``AtlasExtension.start`` builds one ``ControllerConfig`` and, with temporal
sharing, one ``AgentConfig`` per gateway, and starts ``agents.atlas.controller`` and
``agents.atlas.agent`` with them as JSON.  Every default lives here (or in the experiment's
``atlas`` section, which these are built from).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class LinkPlan:
    """One WAN direction that carries pipelines: its classes (pipeline -> address pairs)."""

    classes: dict[str, list[list[str]]]
    rate_mbps: float


@dataclass
class ControllerConfig:
    telemetry: str  # the run's hub
    agents: dict[str, str]  # DC -> its agent's datagram socket
    sharing: str  # temporal | paced
    lease_s: float
    replan_threshold: float
    stages: int
    replicas: int
    warmup_iterations: int
    message_bytes: int  # a boundary tensor's size (until transfers are measured)
    link_bytes_s: float  # the slowest crossed link (until measured)
    transfer_delays_s: dict[str, float] = field(default_factory=dict)  # "xfer_act:<stage>" -> one-way delay
    class_queue: str | None = None  # "share": the pipelines' queues split the link's queue; None: 4 x BDP each
    plan: str = "telemetry"  # telemetry: order from the measured workload; fixed: r0, r1, ...
    links: dict[str, LinkPlan] = field(default_factory=dict)  # "src->dst" -> classes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "ControllerConfig":
        data = json.loads(Path(path).read_text())
        data["links"] = {k: LinkPlan(**v) for k, v in data.get("links", {}).items()}
        return cls(**data)


@dataclass
class AgentLink:
    control: str  # the delay line's control socket
    lane: str  # the lane of this direction in that delay line


@dataclass
class AgentConfig:
    dc: str
    listen: str  # its own datagram socket
    lease_s: float
    links: dict[str, AgentLink] = field(default_factory=dict)  # "src->dst" -> where to enforce
    turns: str | None = None  # enforce at the senders: the turn server's socket (testbed/net/sendturns.py)
    turn_links: list[str] = field(default_factory=list)  # ... and the links it hands out
    turn_rates: dict[str, float] = field(default_factory=dict)  # each one's rate on the wire, bytes/s
    stats: str | None = None  # where to write its counters when it stops (JSON)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "AgentConfig":
        data = json.loads(Path(path).read_text())
        data["links"] = {k: AgentLink(**v) for k, v in data.get("links", {}).items()}
        return cls(**data)
