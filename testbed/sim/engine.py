"""Discrete-event simulator of pipeline + data-parallel training over a WAN.

How it fits: ``build.py`` turns an experiment (the same YAML ``testbed run`` takes) into
``Worker`` programs (the op lists of ``testbed/spec/schedules.py``, the very lists the trainer
executes) and ``Link`` objects (bandwidth, one-way delay, per-connection TCP ceiling);
``Simulator.run`` plays them out; ``build.py`` returns the run's ``records.RunRecord`` and
``testbed/results/metrics.py`` writes the same ``metrics.json`` and Chrome trace as the emulator.

The network is a fluid model.  A transfer is a flow of ``size`` bytes on every link of its
path; while flows share a link, a ``SharingPolicy`` (below) sets their rates, at
most each flow's own ceiling (N connections x window / RTT).  The default policy is
max-min fair sharing (TCP's long-run behaviour); Atlas's temporal sharing plugs in as
another policy without touching the engine (``PriorityPolicy``: the gateway's strict
priority; ``TurnPolicy``: turns taken at the senders, a whole message at a time).  A flow's last byte reaches the receiver one
propagation delay after it leaves.  Rates are recomputed only when a flow starts or ends,
so the cost is events x flows-per-link, not time steps.

Exactness the tests hold it to: with no communication, GPipe and 1F1B bubbles are
(p-1)/(m+p-1); one transfer takes delay + size/bandwidth; k equal transfers started
together on one link each take k times as long.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Callable

from testbed.spec import schedules as sch


@dataclass
class Link:
    name: str
    bandwidth: float  # bytes/s
    delay: float  # s, one way
    flows: list["Flow"] = field(default_factory=list)
    bytes_carried: float = 0.0
    busy_time: float = 0.0
    _last_update: float = 0.0


@dataclass
class Flow:
    fid: int
    links: list[Link]
    remaining: float
    ceiling: float  # bytes/s, this flow's own cap (TCP window / RTT x connections)
    on_done: Callable[[float], None]
    owner: str = ""  # the pipeline (DP replica) it belongs to; policies may use it
    rate: float = 0.0
    version: int = 0
    updated: float = 0.0  # when `remaining` was last brought up to date


class SharingPolicy:
    """Sets the rate of every flow on the links that changed (max-min fair by default)."""

    name = "fair"

    def allocate(self, flows: list[Flow], now: float) -> None:
        # progressive filling over all links the flows touch, each flow capped by its ceiling
        remaining = {id(link): link.bandwidth for f in flows for link in f.links}
        unfixed = set(f.fid for f in flows)
        rate = {f.fid: 0.0 for f in flows}
        by_id = {f.fid: f for f in flows}
        while unfixed:
            # the smallest equal share any link can give its unfixed flows
            share = float("inf")
            counts: dict[int, int] = {}
            for fid in unfixed:
                for link in by_id[fid].links:
                    counts[id(link)] = counts.get(id(link), 0) + 1
            for key, n in counts.items():
                share = min(share, remaining[key] / n)
            fixed_now = []
            for fid in unfixed:
                f = by_id[fid]
                cap = f.ceiling - rate[fid]
                if cap <= share + 1e-12:
                    fixed_now.append((fid, cap))
            if not fixed_now:
                # the bottleneck links saturate: fix every flow crossing one of them
                bottlenecks = {key for key, n in counts.items() if remaining[key] / n <= share + 1e-9}
                fixed_now = [(fid, share) for fid in unfixed
                             if any(id(link) in bottlenecks for link in by_id[fid].links)]
            for fid, inc in fixed_now:
                rate[fid] += inc
                for link in by_id[fid].links:
                    remaining[id(link)] -= inc
                unfixed.discard(fid)
        for f in flows:
            f.rate = rate[f.fid]


class PriorityPolicy(SharingPolicy):
    """Atlas's temporal sharing in the fluid model: strict priority between pipelines.

    The highest-ranked pipeline with a flow on a link gets all it can use (up to its
    ceiling); the next gets what is left, and so on: work-conserving, one owner at a time,
    as the delay line's scheduler does.  ``order`` ranks flow owners ("r0", "r1", ..);
    unknown owners rank last, in arrival order."""

    name = "temporal"

    def __init__(self, order: list[str]):
        self.rank = {owner: i for i, owner in enumerate(order)}

    def allocate(self, flows: list[Flow], now: float) -> None:
        remaining = {id(link): link.bandwidth for f in flows for link in f.links}
        for f in sorted(flows, key=lambda f: (self.rank.get(f.owner, len(self.rank)), f.fid)):
            rate = min([f.ceiling] + [remaining[id(link)] for link in f.links])
            f.rate = max(0.0, rate)
            for link in f.links:
                remaining[id(link)] -= f.rate


class TurnPolicy(SharingPolicy):
    """Atlas's temporal sharing taken at the senders (``testbed/net/sendturns.py``): a link
    is handed a whole message at a time, not preempted, to as many pipelines as it takes to
    fill it (one, where one pipeline's ceiling is the link's rate or more).  When a holder's
    message ends, the highest-ranked pipeline with a message waiting for the link gets it
    (arrival order among equals); a sender whose next message starts in the same instant
    competes in its rank, as the server's ``more`` makes it.  Holders send at their
    ceilings, the higher-ranked first (the link idles where they cannot fill it); flows of
    no ranked pipeline (an all-reduce across DCs) share what the holders leave equally.  A
    path of several links takes them in name order, as the senders do (never holding one
    while waiting for an earlier one)."""

    name = "turns"

    def __init__(self, order: list[str]):
        self.rank = {owner: i for i, owner in enumerate(order)}
        self._holders: dict[int, dict[int, float]] = {}  # id(link) -> {fid: granted at}

    def allocate(self, flows: list[Flow], now: float) -> None:
        ranked = sorted((f for f in flows if f.owner in self.rank), key=lambda f: (self.rank[f.owner], f.fid))
        links = {id(link): link for f in flows for link in f.links}
        for key, link in links.items():  # holders whose message ended (or granted this instant) are re-chosen
            held = self._holders.get(key)
            if held:
                present = {g.fid for g in link.flows}
                for fid in [fid for fid, at in held.items() if at >= now or fid not in present]:
                    del held[fid]
        for f in ranked:
            for link in sorted(f.links, key=lambda link: link.name):  # in order; stop at the first not had
                held = self._holders.setdefault(id(link), {})
                if f.fid in held:
                    continue
                ceilings = {g.fid: g.ceiling for g in link.flows}
                if held and sum(ceilings.get(fid, 0.0) for fid in held) >= link.bandwidth * (1 - 1e-9):
                    break
                held[f.fid] = now
        group = {f.fid for f in flows}
        remaining = {key: link.bandwidth - sum(g.rate for g in link.flows if g.fid not in group)
                     for key, link in links.items()}
        for f in ranked:
            owns = all(f.fid in self._holders.get(id(link), ()) for link in f.links)
            f.rate = max(0.0, min([f.ceiling] + [remaining[id(link)] for link in f.links])) if owns else 0.0
            for link in f.links:
                remaining[id(link)] -= f.rate
        for f in flows:
            if f.owner not in self.rank:
                f.rate = max(0.0, min([f.ceiling] + [remaining[id(link)] / sum(1 for g in link.flows
                                                                                 if g.owner not in self.rank)
                                                     for link in f.links]))


class Simulator:
    def __init__(self, policy: SharingPolicy | None = None):
        self.now = 0.0
        self.policy = policy or SharingPolicy()
        self._events: list = []
        self._seq = itertools.count()
        self._fid = itertools.count()
        self.events_processed = 0

    # -- event queue ----------------------------------------------------------------
    def at(self, time: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time, next(self._seq), fn))

    def run(self, until: float = float("inf")) -> None:
        events = self._events
        while events and events[0][0] <= until:
            time, _, fn = heapq.heappop(events)
            self.now = time
            fn()
            self.events_processed += 1

    # -- network --------------------------------------------------------------------
    def transfer(self, links: list[Link], size: float, ceiling: float, on_arrival: Callable[[float], None],
                 owner: str = "", on_sent: Callable[[float], None] | None = None) -> Flow | None:
        """Send ``size`` bytes over ``links``; call ``on_arrival(time)`` when the last byte is in,
        and ``on_sent(time)`` when it has left (one propagation delay earlier).  Returns the
        flow (None when nothing crosses a link), whose ceiling ``set_ceiling`` may change."""
        delay = sum(link.delay for link in links)
        if not links or size <= 0:
            if on_sent is not None:
                on_sent(self.now)
            self.at(self.now + delay, lambda: on_arrival(self.now))
            return None
        flow = Flow(next(self._fid), links, float(size), ceiling, None, owner, updated=self.now)

        def done(t: float) -> None:
            if on_sent is not None:
                on_sent(t)
            self.at(t + delay, lambda: on_arrival(self.now))

        flow.on_done = done
        self._settle(links)
        for link in links:
            link.flows.append(flow)
        self._reallocate(links)
        return flow

    def settle(self, flow: Flow) -> None:
        """Bring ``flow.remaining`` (and its links' counters) up to now."""
        self._settle(flow.links)

    def set_ceiling(self, flow: Flow, ceiling: float) -> None:
        """A flow's own cap changed (its TCP window grew): share its links again from now."""
        if flow.remaining <= 0 or flow not in flow.links[0].flows or ceiling == flow.ceiling:
            return
        self._settle(flow.links)
        flow.ceiling = ceiling
        self._reallocate(flow.links)

    def _settle(self, links: list[Link]) -> None:
        """Advance every flow on these links (and the links they touch) to ``now``."""
        touched = {id(l): l for link in links for f in link.flows for l in f.links}
        touched.update({id(l): l for l in links})
        for link in touched.values():
            dt = self.now - link._last_update
            if dt > 0:
                carried = sum(f.rate for f in link.flows) * dt
                link.bytes_carried += carried
                if link.flows:
                    link.busy_time += dt
                link._last_update = self.now
        seen = set()
        for link in touched.values():
            for f in link.flows:
                if f.fid in seen:
                    continue
                seen.add(f.fid)
                f.remaining -= f.rate * (self.now - f.updated)
                f.updated = self.now

    def _reallocate(self, links: list[Link]) -> None:
        # every flow that shares a link with a changed link, transitively one hop
        flows = {f.fid: f for link in links for f in link.flows}
        for f in list(flows.values()):
            for link in f.links:
                for g in link.flows:
                    flows.setdefault(g.fid, g)
        group = list(flows.values())
        self._settle([l for f in group for l in f.links])
        self.policy.allocate(group, self.now)
        for f in group:
            f.version += 1
            if f.rate > 0:
                version = f.version
                self.at(self.now + max(0.0, f.remaining) / f.rate, lambda f=f, v=version: self._finish(f, v))

    def _finish(self, flow: Flow, version: int) -> None:
        if version != flow.version:
            return  # rescheduled since
        self._settle(flow.links)
        for link in flow.links:
            link.flows.remove(flow)
        flow.version += 1
        self._reallocate(flow.links)
        flow.on_done(self.now)


# -- workers ------------------------------------------------------------------------------
@dataclass
class StageTimes:
    """Seconds one worker of a stage spends per microbatch (forward, backward), per iteration
    (optimizer), and per message on its own CPU: ``send`` hands a tensor to the transport
    (the flow starts with it), ``recv`` takes an arrived tensor out of it.

    ``samples`` (optional, per kind: "forward", "backward", "optimizer") are durations
    observed on a real run; when present, each op draws one of them (``PipelineJob``'s
    seeded generator) instead of taking the fixed value.  Variable op times make a pipeline
    slower than its medians say (a stage waits for the slowest of its inputs) and keep DP
    replicas from moving in perfect lockstep, as real ones do not."""

    forward: float
    backward: float
    optimizer: float = 0.0
    send: float = 0.0
    recv: float = 0.0
    samples: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def draw(self, kind: str, rng: random.Random) -> float:
        pool = self.samples.get(kind)
        if pool:
            return pool[rng.randrange(len(pool))]
        return getattr(self, kind)


@dataclass
class Worker:
    name: str
    stage: int
    replica: int
    dc: str
    program: list[sch.Op]
    times: StageTimes
    events: list = field(default_factory=list)  # [kind, mb, start, end, iteration]
    transfers: list = field(default_factory=list)
    iteration_end: dict = field(default_factory=dict)
    pc: int = 0
    iteration: int = 0
    cursor: float = 0.0
    waiting: tuple | None = None
    offset_iteration: int = -1  # the iteration whose start offset was taken
    inbox: dict = field(default_factory=dict)  # (kind, iteration, mb) -> arrival time


class PipelineJob:
    """Runs every worker's program: compute takes its time, receives wait, sends are async."""

    def __init__(self, sim: Simulator, workers: list[Worker], iterations: int,
                 send: Callable[[Worker, str, int, int, Callable[[float], None]], None],
                 allreduce_time: Callable[[int], float], record: bool = True, dp_replicas: int | None = None,
                 start_offsets: dict[int, float] | None = None, seed: int = 0):
        self.sim = sim
        self._rng = random.Random(seed)  # draws op times where StageTimes carries samples
        self.workers = workers
        self.iterations = iterations
        self._send = send
        self._allreduce_time = allreduce_time
        self._by_key = {(w.stage, w.replica): w for w in workers}
        self._dp_waiting: dict[tuple[int, int], list[Worker]] = {}
        self._replicas = max(w.replica for w in workers) + 1  # simulated replicas (1 when folded)
        self._dp = dp_replicas or self._replicas  # replicas in the real job (all-reduce size)
        self.record = record
        # Atlas's stagger: the first stage of replica r starts each iteration this much later
        self._offsets = start_offsets or {}

    def start(self) -> None:
        for w in self.workers:
            self.sim.at(0.0, lambda w=w: self._step(w))

    def _event(self, w: Worker, kind: str, mb: int, start: float, end: float) -> None:
        if self.record and end > start:
            w.events.append([kind, mb, start, end, w.iteration])

    def _step(self, w: Worker) -> None:
        sim = self.sim
        offset = self._offsets.get(w.replica, 0.0) if w.stage == 0 else 0.0
        if w.pc == 0 and offset > 0 and w.offset_iteration != w.iteration:
            w.offset_iteration = w.iteration
            start = max(sim.now, w.cursor)
            self._event(w, "idle", -1, start, start + offset)
            w.cursor = start + offset
            sim.at(w.cursor, lambda w=w: self._step(w))
            return
        while w.pc < len(w.program):
            op = w.program[w.pc]
            kind, mb = op.kind, op.mb
            if kind in (sch.RECV_ACT, sch.RECV_GRAD):
                key = (kind, w.iteration, mb)
                arrival = w.inbox.pop(key, None)
                if arrival is None:
                    w.waiting = key
                    return
                w.pc += 1
                if w.times.recv > 0:  # the hand-off out of the transport: wait and cost are one "recv"
                    sim.at(sim.now + w.times.recv, lambda w=w: self._step(w))
                    return
                continue  # the wait is recorded when the next op starts
            if kind in (sch.SEND_ACT, sch.SEND_GRAD):
                peer = self._by_key[(w.stage + 1 if kind == sch.SEND_ACT else w.stage - 1, w.replica)]
                recv_kind = sch.RECV_ACT if kind == sch.SEND_ACT else sch.RECV_GRAD
                it = w.iteration
                w.pc += 1
                start = sim.now
                if start > w.cursor:
                    self._event(w, "recv", mb, w.cursor, start)
                end = start + w.times.send
                self._event(w, "send", mb, start, end)
                w.cursor = end

                # the flow starts as the hand-off begins: the transport's threads send while the
                # worker's own thread pays ``send`` (the emulator stamps a message there too)
                self._send(w, kind, mb, it, lambda t, p=peer, k=(recv_kind, it, mb): self._deliver(p, k, t))
                if w.times.send > 0:
                    sim.at(end, lambda w=w: self._step(w))
                    return
                continue
            duration = w.times.draw("forward" if kind == sch.FORWARD else "backward", self._rng)
            start = sim.now
            if start > w.cursor:
                self._event(w, "recv", mb, w.cursor, start)
            self._event(w, kind, mb, start, start + duration)
            w.cursor = start + duration
            w.pc += 1
            sim.at(w.cursor, lambda w=w: self._step(w))
            return
        self._iteration_end(w)

    def _deliver(self, w: Worker, key: tuple, time: float) -> None:
        w.inbox[key] = time
        if w.waiting == key:
            w.waiting = None
            self._step(w)

    def _iteration_end(self, w: Worker) -> None:
        """DP all-reduce inside the DC once every replica of the stage is here, then step."""
        key = (w.stage, w.iteration)
        group = self._dp_waiting.setdefault(key, [])
        group.append(w)
        if len(group) < self._replicas:
            return
        del self._dp_waiting[key]
        now = self.sim.now
        ar = self._allreduce_time(w.stage) if self._dp > 1 else 0.0
        for member in group:
            if now > member.cursor:
                self._event(member, "recv", -1, member.cursor, now)
            if ar:
                self._event(member, "allreduce", -1, now, now + ar)
            end = now + ar + member.times.draw("optimizer", self._rng)
            self._event(member, "optimizer", -1, now + ar, end)
            member.iteration_end[member.iteration] = end
            member.cursor = end
            member.iteration += 1
            member.pc = 0
            if member.iteration < self.iterations:
                self.sim.at(end, lambda m=member: self._step(m))
