"""What a run leaves behind, typed: the records a real run and a simulated one both produce.

How it fits: a worker (``testbed/train/worker.py``) streams its timeline as typed messages
(``testbed/messages.py``: ``Span``, ``Xfer``); the
runner (``runner.py``) turns them into ``Interval`` and ``Transfer`` tuples on a
``WorkerRecord`` per worker, and the whole run into a ``RunRecord``; the simulator
(``sim/build.py``) builds the same ``RunRecord`` from its engine; ``metrics.py`` reads only
these types to write metrics.json, the Chrome trace and the plots.  The tuples are
NamedTuples, so they serialise to the same JSON lists the files have always held.

Clock: every timestamp is on CLOCK_MONOTONIC, which every namespace on the machine shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from testbed.messages import Span, Xfer
    from testbed.spec.experiment import Experiment

BUSY_KINDS = ("forward", "backward", "optimizer")


class Interval(NamedTuple):
    """One typed interval of a worker's timeline.  ``kind``: forward, backward, optimizer
    (the device is busy), recv (waiting for a peer), send (handing a tensor over), allreduce,
    idle.  ``mb``: the microbatch, -1 for none."""

    kind: str
    mb: int
    start: float
    end: float
    iteration: int

    @property
    def busy(self) -> bool:
        return self.kind in BUSY_KINDS


class Transfer(NamedTuple):
    """One cross-worker message: sent at ``start`` (by the sender), fully received at ``end``."""

    kind: str  # xfer_act or xfer_grad
    mb: int
    start: float
    end: float
    nbytes: int
    iteration: int


@dataclass
class WorkerRecord:
    """Everything one worker (stage ``stage`` of replica ``replica``) reported."""

    name: str
    stage: int
    replica: int
    dc: str
    host: str = ""
    ip: str = ""
    device: str = "cpu"
    events: list[Interval] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    iteration_end: dict[int, float] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    # another client of the same device (BubbleTea's prefills): (start, end) intervals, and
    # what the extension that ran them calls them (the label in the trace and the plots)
    cotenant: list[tuple[float, float]] = field(default_factory=list)
    cotenant_kind: str = "co-tenant"

    def add_events(self, events: list[Span]) -> None:
        self.events.extend(Interval(e.kind, e.mb, e.start, e.end, e.iteration) for e in events)

    def add_transfers(self, transfers: list[Xfer]) -> None:
        self.transfers.extend(Transfer(t.kind, t.mb, t.start, t.end, t.nbytes, t.iteration) for t in transfers)

    def describe(self) -> dict:
        return {"stage": self.stage, "replica": self.replica, "dc": self.dc, "host": self.host, "ip": self.ip,
                "device": self.device}


@dataclass
class RunRecord:
    """One run, real or simulated: the experiment as run, every worker's record, and what the
    orchestrator noted.  ``go_time`` is when training started (the go signal)."""

    exp: "Experiment"
    workers: dict[str, WorkerRecord]
    go_time: float = 0.0
    log_lines: list[str] = field(default_factory=list)
    steady_from: int = 0  # the first iteration the summary may count (e.g. once a plan is in force)
    warnings: list[str] = field(default_factory=list)
    wan_check: list[dict] = field(default_factory=list)
    device: dict = field(default_factory=dict)  # what the devices were and where their times came from
    tcp: dict = field(default_factory=dict)  # per host: TCP counters over the training (Network.tcp_counters)
    out_dir: Path | None = None
    time_dilation: float = 1.0  # k: the timestamps are on the emulated clock (``in_emulated_time``)
    # per WAN direction ("src->dst"): counter samples (time, tx_bytes, drops, backlog_bytes)
    link_samples: dict[str, list[tuple[float, int, int, int]]] = field(default_factory=dict)

    def iteration_ends(self) -> list[float]:
        """When the last worker finished each iteration."""
        return [max(w.iteration_end[k] for w in self.workers.values())
                for k in range(self.exp.training.iterations)]


def in_emulated_time(record: RunRecord, k: float) -> RunRecord:
    """``record`` with every timestamp moved to the emulated clock of a run under time
    dilation ``k``: ``go_time + (t - go_time) / k`` (durations k times shorter), so every
    figure made from it is in emulated seconds.  ``k`` = 1 returns ``record`` itself."""
    if k == 1:
        return record
    go = record.go_time

    def t(x: float) -> float:
        return go + (x - go) / k

    workers = {}
    for name, w in record.workers.items():
        workers[name] = replace(
            w, events=[e._replace(start=t(e.start), end=t(e.end)) for e in w.events],
            transfers=[x._replace(start=t(x.start), end=t(x.end)) for x in w.transfers],
            iteration_end={i: t(v) for i, v in w.iteration_end.items()},
            cotenant=[(t(a), t(b)) for a, b in w.cotenant])
    samples = {name: [(t(at), *rest) for at, *rest in s] for name, s in record.link_samples.items()}
    return replace(record, workers=workers, link_samples=samples, time_dilation=k)
