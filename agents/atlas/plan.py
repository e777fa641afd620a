"""Atlas's temporal plan: who owns each WAN link when, and how the pipelines are staggered.

D data-parallel pipelines cross the same WAN links at the same stage boundaries.  In
lockstep their transfers collide and TCP fair-shares the link: each transfer of S bytes
takes about D*S/B and every pipeline waits that long, so a microbatch costs about C + D*t on
the critical path (C: the slowest stage's compute per microbatch, t = S/B).  The plan
instead ranks the pipelines (the link belongs to the highest-ranked one with data, the
others get what it leaves: work-conserving), so pipeline d's transfer waits for those
ranked above it and then overlaps their compute: the pipelines fall into a staggered rhythm
and a microbatch costs about max(C + t, D*t) (the brief's formulas).  Where only the senders
can act (``paced``), the stagger is made explicit: pipeline d's first stage starts each
iteration d*t after pipeline 0's.

Why a rank order rather than clock-anchored turns for training: the trainers' phase on this
machine wanders by 5-16 ms per operation (CFS quota), so a turn fixed to the clock would
often open for a pipeline that has nothing to send and close on one mid-transfer; a rank
order gives each transfer the whole link exactly when it is sent.  Clock turns remain
available (``WanDirection.set_turns``) and are what the precision test measures.

Everything here is computed from what the run measures: per-stage compute medians from the
workers' timelines, transfer sizes from the transfer records, rates from the topology.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from testbed.messages import Events, Message


@dataclass
class TemporalPlan:
    order: list[str]  # pipeline ranks, "r0" first
    offsets: dict[int, float]  # replica -> start offset of its first stage, s
    transfer_s: float  # one boundary transfer with the whole (slowest crossed) link
    compute_s: float  # the slowest stage's forward + backward per microbatch
    lockstep_s: float  # per-microbatch critical path under fair sharing, C + D*t
    temporal_s: float  # the same under the plan, max(C + t, D*t)
    basis: dict = field(default_factory=dict)  # what it was computed from

    def as_dict(self) -> dict:
        return {"order": self.order, "offsets": {str(k): round(v, 5) for k, v in self.offsets.items()},
                "transfer_s": round(self.transfer_s, 5), "compute_s": round(self.compute_s, 5),
                "lockstep_s": round(self.lockstep_s, 5), "temporal_s": round(self.temporal_s, 5),
                "basis": self.basis}

    def moved(self, other: "TemporalPlan | None", threshold: float) -> bool:
        """Whether this plan differs from ``other`` enough to republish it."""
        if other is None or other.order != self.order:
            return True
        base = max(other.transfer_s, 1e-6)
        return abs(self.transfer_s - other.transfer_s) / base > threshold


def make_plan(replicas: int, compute_s: float, message_bytes: float, link_bytes_s: float,
              basis: dict | None = None, enforced: bool = False,
              pipeline_compute: dict[int, float] | None = None, previous: list[str] | None = None) -> TemporalPlan:
    """``enforced``: the gateways enforce the rank order, which staggers the pipelines by
    itself (a lower-ranked pipeline's transfer waits for the owner's, then overlaps the
    owner's compute), so no start offsets; otherwise (senders pacing themselves) pipeline d
    starts d*t late.

    ``pipeline_compute`` (replica -> its measured compute per iteration) makes the order
    follow the workload: the slowest pipeline first.  The iteration ends when the slowest
    pipeline does (the all-reduce waits for it), so its transfers should never wait; the
    faster ones have slack to wait in.  Without it (or with equal figures) the order is
    r0, r1, ... (``plan: fixed`` always asks for that)."""
    t = message_bytes / link_bytes_s if link_bytes_s > 0 else 0.0
    d = replicas
    ranks = list(range(d))
    if previous:  # pipelines within 5% of each other keep their places: no churn on noise
        ranks.sort(key=lambda r: previous.index(f"r{r}") if f"r{r}" in previous else d + r)
    if pipeline_compute:
        top = max(pipeline_compute.values()) or 1.0
        # in 5% steps below the slowest: every pipeline within 5% of it shares step 0 (stable: ties
        # keep their order); measured from the top, not truncated up to it, which put the slowest
        # by a hair alone in front and reordered the rest on noise
        ranks.sort(key=lambda r: int((top - pipeline_compute.get(r, 0.0)) / top / 0.05))
    return TemporalPlan(
        order=[f"r{r}" for r in ranks],
        offsets={r: 0.0 if enforced else ranks.index(r) * t for r in range(d)},
        transfer_s=t, compute_s=compute_s,
        lockstep_s=compute_s + d * t, temporal_s=max(compute_s + t, d * t),
        basis=basis or {},
    )


class TelemetryWindow:
    """The last few iterations of every worker's intervals and transfer records."""

    def __init__(self, keep_iterations: int = 3, transfer_delays: dict[str, float] | None = None):
        """``transfer_delays``: one-way WAN delay of each cross-DC transfer, keyed
        ``"xfer_act:<receiving stage>"`` / ``"xfer_grad:<receiving stage>"``: with it the
        window also measures the link rate the transfers see (``link_rate``)."""
        self.keep = keep_iterations
        self.compute: dict[tuple[int, int, str], list[float]] = {}  # (stage, it, kind) -> durations
        self.pipeline: dict[tuple[int, int], float] = {}  # (replica, it) -> its busiest stage's compute
        self.message_bytes: list[int] = []
        self.iterations_done: dict[str, int] = {}
        self.delays = transfer_delays or {}
        self.rates: dict[tuple[str, int], list[float]] = {}  # (key, it) -> bytes / (duration - delay)
        self._stage_busy: dict[tuple[int, int, int], float] = {}  # (replica, it, stage) -> compute

    def add(self, worker: str, msg: Message) -> None:
        if not isinstance(msg, Events):
            return
        stage, replica = (int(x) for x in worker[1:].split("r"))
        mine: dict[int, float] = {}
        for ev in msg.events:
            if ev.kind in ("forward", "backward"):
                it = ev.iteration
                self.compute.setdefault((stage, it, ev.kind), []).append(ev.end - ev.start)
                mine[it] = mine.get(it, 0.0) + (ev.end - ev.start)
        for it, busy in mine.items():
            self._stage_busy[(replica, it, stage)] = self._stage_busy.get((replica, it, stage), 0.0) + busy
            self.pipeline[(replica, it)] = max(self.pipeline.get((replica, it), 0.0),
                                               self._stage_busy[(replica, it, stage)])
        for rec in msg.transfers:
            self.message_bytes.append(rec.nbytes)
            delay = self.delays.get(f"{rec.kind}:{stage}")
            took = rec.end - rec.start
            if delay is not None and took - delay > 1e-4:
                self.rates.setdefault((f"{rec.kind}:{stage}", rec.iteration), []).append(rec.nbytes / (took - delay))
        del self.message_bytes[:-256]
        if msg.iteration_done:
            self.iterations_done[worker] = msg.it + 1
            oldest = msg.it + 1 - self.keep
            for key in [k for k in self.compute if k[1] < oldest]:
                del self.compute[key]
            for key in [k for k in self.rates if k[1] < oldest]:
                del self.rates[key]
            for key in [k for k in self.pipeline if k[1] < oldest]:
                del self.pipeline[key]
            for key in [k for k in self._stage_busy if k[1] < oldest]:
                del self._stage_busy[key]

    def min_iterations(self, workers: int) -> int:
        if len(self.iterations_done) < workers:
            return 0
        return min(self.iterations_done.values())

    def slowest_stage_compute(self) -> tuple[float, dict]:
        """max over stages of median(forward) + median(backward), and the per-stage figures."""
        per: dict[int, dict[str, list[float]]] = {}
        for (stage, _it, kind), values in self.compute.items():
            per.setdefault(stage, {}).setdefault(kind, []).extend(values)
        figures = {s: {k: statistics.median(v) for k, v in kinds.items()} for s, kinds in per.items()}
        c = max((f.get("forward", 0.0) + f.get("backward", 0.0) for f in figures.values()), default=0.0)
        return c, figures

    def link_rate(self) -> float | None:
        """Bytes/s of the slowest cross-DC path as its transfers see it: per path the 90th
        percentile of size / (duration - delay) over the transfers of its latest iteration
        (the least contended ones), so a link that changes under the run changes the plan
        one iteration later.  None until measured."""
        latest: dict[str, int] = {}
        for key, it in self.rates:
            latest[key] = max(latest.get(key, -1), it)
        per = []
        for key, it in latest.items():
            v = sorted(self.rates[(key, it)])
            if len(v) >= 2:
                per.append(v[int(0.9 * (len(v) - 1))])
        return min(per) if per else None

    def pipeline_compute(self) -> dict[int, float]:
        """Per pipeline (replica): the median over recent iterations of its busiest stage's
        forward + backward time in an iteration: how long its devices take, whatever the WAN."""
        per: dict[int, list[float]] = {}
        for (replica, _it), busy in self.pipeline.items():
            per.setdefault(replica, []).append(busy)
        return {r: statistics.median(v) for r, v in per.items()}

    def typical_message(self) -> float:
        return float(statistics.median(self.message_bytes)) if self.message_bytes else 0.0
