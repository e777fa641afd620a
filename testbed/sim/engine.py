"""Discrete-event simulator of pipeline + data-parallel training over a WAN.

How it fits: ``build.py`` turns an experiment (the same YAML ``testbed run`` takes) into
``Worker`` programs (the op lists of ``testbed/spec/schedules.py``, the very lists the trainer
executes) and ``Link`` objects (bandwidth, one-way delay, per-connection TCP ceiling);
``Simulator.run`` plays them out; ``build.py`` returns the run's ``records.RunRecord`` and
``testbed/results/metrics.py`` writes the same ``metrics.json`` and Chrome trace as the emulator.

The network is a fluid model.  A transfer is a flow of ``size`` bytes on every link of its
path; while flows share a link, a ``SharingPolicy`` (below) sets their rates, at
most each flow's own ceiling (N connections x window / RTT).  The default policy is
max-min fair sharing (TCP's long-run behaviour); ``FifoBurstPolicy`` serves a message sent
whole in one window first-in first-out, ahead of the others, as a drop-tail FIFO serves a
burst.  Atlas's temporal sharing plugs in as another policy without touching the engine
(``PriorityPolicy``: the gateway's strict priority; ``TurnPolicy``: turns taken at the
senders, a whole message at a time).  A flow's last byte reaches the receiver one
propagation delay after it leaves.  Rates are recomputed only when a flow starts or ends
(or its ceiling changes), for the flows on the changed links and one hop on.  Each link
indexes its flows (the links they cross, those with a rate, and for an ordered policy such
as strict priority their order), so a re-rating costs what those flows cost rather than the
square of a link's flows, and strict priority visits only the flows that get a rate (and
the first one behind each full link): a flow without a rate has nothing to settle.  Every
rated flow a re-rating touches is rescheduled (so finish times round exactly as they always
did), under one heap entry per re-rating (``_schedule_finishes``); ``events_processed``
counts heap entries, void ones included.  ``tests/test_sim_rerating.py`` keeps the plain
engine and holds this one to its results bit for bit.

Exactness the tests hold it to: with no communication, GPipe and 1F1B bubbles are
(p-1)/(m+p-1); one transfer takes delay + size/bandwidth; k equal transfers started
together on one link each take k times as long.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Callable

from testbed.spec import schedules as sch


@dataclass
class Link:
    name: str
    bandwidth: float  # bytes/s
    delay: float  # s, one way
    flows: list["Flow"] = field(default_factory=list)  # in arrival order, which is fid order
    bytes_carried: float = 0.0
    busy_time: float = 0.0
    _last_update: float = 0.0
    # the engine's indexes of ``flows``, kept as flows come and go so that a re-rating visits
    # only what it must (``Simulator._add``/``_remove``):
    _near: dict = field(default_factory=dict, repr=False)  # id(link) -> [link, flows]: the links its flows cross
    _multi: dict = field(default_factory=dict, repr=False)  # fid -> its flows that cross other links too, fid order
    _rated: dict = field(default_factory=dict, repr=False)  # fid -> its flows whose rate is > 0
    _queue: list = field(default_factory=list, repr=False)  # (policy.key(flow), flow), sorted: for an ordered policy


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
    updated: float = 0.0  # when `remaining` was last brought up to date (while it has a rate)
    burst: bool = False  # its sender puts it in flight whole (size <= the channel's window): FifoBurstPolicy
    on_start: Callable[[float], None] | None = None  # called once, when it first gets a rate (its first byte leaves)


class SharingPolicy:
    """Sets the rate of every flow on the links that changed (max-min fair by default).

    ``allocate`` gets the whole group of flows to re-rate.  An ``ordered`` policy instead rates
    flows one after another in ``key`` order: the engine keeps each link's flows sorted by that
    key (``Link._queue``) and calls ``allocate_queues`` with the group's links, so that the
    policy can stop at a full link instead of visiting every flow behind it."""

    name = "fair"
    ordered = False

    def allocate(self, flows: list[Flow], now: float) -> None:
        remaining = {id(link): link.bandwidth for f in flows for link in f.links}
        rate = self._max_min(flows, remaining)
        for f in flows:
            f.rate = rate[f.fid]

    def forget(self, flow: Flow) -> None:
        """``flow`` has left its links (done): whatever the policy keeps for it can go."""

    @staticmethod
    def _max_min(flows: list[Flow], remaining: dict[int, float],
                 weights: dict[int, float] | None = None) -> dict[int, float]:
        """Progressive filling of ``flows`` over what ``remaining`` (id(link) -> bytes/s) says
        their links have left, each flow capped by its ceiling; the rates by fid (``remaining``
        is used up).  ``weights`` (fid -> weight): weighted max-min, each flow's share in
        proportion to its weight (``SpreadPolicy``); without, the unweighted filling as it was."""
        unfixed = set(f.fid for f in flows)
        rate = {f.fid: 0.0 for f in flows}
        by_id = {f.fid: f for f in flows}
        while unfixed:
            # the smallest share per unit of weight any link can give its unfixed flows
            share = float("inf")
            counts: dict[int, float] = {}
            for fid in unfixed:
                w = 1 if weights is None else weights[fid]
                for link in by_id[fid].links:
                    counts[id(link)] = counts.get(id(link), 0) + w
            for key, n in counts.items():
                share = min(share, remaining[key] / n)
            fixed_now = []
            for fid in unfixed:
                f = by_id[fid]
                cap = f.ceiling - rate[fid]
                if (cap if weights is None else cap / weights[fid]) <= share + 1e-12:
                    fixed_now.append((fid, cap))
            if not fixed_now:
                # the bottleneck links saturate: fix every flow crossing one of them
                bottlenecks = {key for key, n in counts.items() if remaining[key] / n <= share + 1e-9}
                fixed_now = [(fid, share if weights is None else share * weights[fid]) for fid in unfixed
                             if any(id(link) in bottlenecks for link in by_id[fid].links)]
            for fid, inc in fixed_now:
                rate[fid] += inc
                for link in by_id[fid].links:
                    remaining[id(link)] -= inc
                unfixed.discard(fid)
        return rate


class FifoBurstPolicy(SharingPolicy):
    """Max-min fair sharing, except for bursts: a message its sender puts in flight whole (its
    size at most its channel's connections x window, ``Flow.burst``, set by ``build.py``) is
    served first-in first-out at its links, as a drop-tail FIFO queue serves bursts that
    arrive whole.

    The rule: on every link, the bursts in arrival (fid) order each take what they can (their
    ceiling, at most what the earlier bursts left on each of their links); the flows that are
    not bursts (messages larger than the channel's window, ACK-clocked) share what the bursts
    leave, max-min fairly, as ``SharingPolicy`` does.  So N window-sized messages started
    together on one link finish one after another (size/bw, 2 size/bw, ..) instead of all
    together at N size/bw; where no message fits its window, this is fair sharing exactly.

    Why bursts go ahead of bulk flows: a FIFO queue serves bytes in the order they arrived.
    A burst arrives whole, at the senders' access rate (far above the WAN's), so it lands in
    the queue in one piece and everything arriving while it drains waits behind it: a long
    flow's packets come ACK-clocked at about its share, a few at a time, and those that arrive
    during the burst's drain queue behind it, so while the burst drains the bulk flows' data
    leaves the link at (nearly) nothing, and their share resumes after it.  What this leaves
    out: the bulk flows' packets already queued ahead of the burst when it arrives (at most
    the queue, a fraction of a round trip's delay), and overflow of the queue by the burst
    (``sim.tail_loss`` models a late message where windows overflow it).  With
    ``sim.tcp_window_model`` there are no bulk flows: ``rounds.RoundsChannel`` sends every
    message a window at a time, each round a burst, and drops what overflows the queue."""

    name = "fifo-bursts"

    def allocate(self, flows: list[Flow], now: float) -> None:
        remaining = {id(link): link.bandwidth for f in flows for link in f.links}
        bulk = [f for f in flows if not f.burst]  # (in the group's order: with no burst, fair sharing to the bit)
        for f in sorted((f for f in flows if f.burst), key=lambda f: f.fid):
            rate = f.ceiling
            for link in f.links:
                left = remaining[id(link)]
                if left < rate:
                    rate = left
            f.rate = rate if rate > 0.0 else 0.0
            for link in f.links:
                remaining[id(link)] -= f.rate
        if bulk:
            for key in remaining:  # (what the bursts left; never below nothing)
                if remaining[key] < 0.0:
                    remaining[key] = 0.0
            rate = self._max_min(bulk, remaining)
            for f in bulk:
                f.rate = rate[f.fid]


class SpreadPolicy(SharingPolicy):
    """Fair in the long run, unequal over a message: each flow draws a weight when it starts
    (lognormal: exp(sigma x N(0, 1)), from a seeded generator) and its links divide among their
    flows in proportion to the weights (weighted max-min).  TCP flows that start together on a
    shaped link do not finish together: ``experiments/measure_shares.py`` measures how far
    apart, and sigma is fitted to it.  With sigma 0 this is fair sharing.  What it is for:
    under fair sharing DP replicas move in lockstep; in the emulator they drift apart and the
    all-reduce waits for the slowest (docs/benchmarks.md)."""

    name = "spread"

    def __init__(self, sigma: float, seed: int = 0):
        self.sigma = sigma
        self._rng = random.Random(seed)
        self._weights: dict[int, float] = {}

    def allocate(self, flows: list[Flow], now: float) -> None:
        weights = self._weights
        for f in flows:
            if f.fid not in weights:
                weights[f.fid] = math.exp(self.sigma * self._rng.gauss(0.0, 1.0))
        remaining = {id(link): link.bandwidth for f in flows for link in f.links}
        rate = self._max_min(flows, remaining, weights)
        for f in flows:
            f.rate = rate[f.fid]

    def forget(self, flow: Flow) -> None:
        self._weights.pop(flow.fid, None)


class PriorityPolicy(SharingPolicy):
    """Atlas's temporal sharing in the fluid model: strict priority between pipelines.

    The highest-ranked pipeline with a flow on a link gets all it can use (up to its
    ceiling); the next gets what is left, and so on: work-conserving, one owner at a time,
    as the delay line's scheduler does.  ``order`` ranks flow owners ("r0", "r1", ..);
    unknown owners rank last, in arrival order.  ``rate_factor``: the share of each link's rate
    the scheduler gives out (the emulator's delay line paces at ``delayline.RATE_FACTOR``, 0.97,
    so that the HTB behind it never queues; a real gateway at full rate: 1).

    ``allocate`` is the definition (every flow of the group, in key order); the engine calls
    ``allocate_queues``, which gives the same rates while visiting only the flows that get a
    rate (and at most one behind each full link): on a full link the pipelines behind the
    owner wait at 0 and cost nothing.  (At paper scale a link seldom fills: 400 Gbit/s per
    DC pair, each flow held to its connections' ceiling, so nearly every flow has a rate and
    a re-rating costs what they do.)"""

    name = "temporal"
    ordered = True

    def __init__(self, order: list[str], rate_factor: float = 1.0, class_queue: str = "deep"):
        self.rank = {owner: i for i, owner in enumerate(order)}
        self.rate_factor = rate_factor  # the scheduler paces at this share of each link's rate
        # each pipeline's queue at the scheduler (``sim.sharing: packets`` only; the fluid model has
        # no queues): "deep" = the delay line's own (4 x the path's BDP), "share" = the link's, split
        self.class_queue = class_queue

    def key(self, flow: Flow) -> tuple[int, int]:
        return (self.rank.get(flow.owner, len(self.rank)), flow.fid)

    def allocate(self, flows: list[Flow], now: float) -> None:
        remaining = {id(link): link.bandwidth * self.rate_factor for f in flows for link in f.links}
        for f in sorted(flows, key=self.key):
            rate = min([f.ceiling] + [remaining[id(link)] for link in f.links])
            f.rate = max(0.0, rate)
            for link in f.links:
                remaining[id(link)] -= f.rate

    def allocate_queues(self, links: list[Link]) -> list[Flow]:
        """``allocate`` over every flow on ``links``, walking their queues merged in key order;
        a link's queue is left once the link has nothing left to give, since every flow behind
        it would get 0.  Sets and returns the flows visited; the others on ``links`` get 0."""
        if len(links) == 1:  # (then each of its flows crosses it alone)
            return self._allocate_queue(links[0], self.rate_factor)
        remaining: dict[int, float] = {}
        heads = [(link._queue[0][0], i, 0) for i, link in enumerate(links) if link._queue]
        heapq.heapify(heads)
        visited: dict[int, Flow] = {}
        while heads:
            _, i, pos = heapq.heappop(heads)
            link = links[i]
            queue = link._queue
            f = queue[pos][1]
            if f.fid not in visited:  # a flow on several of the links comes up once per link
                visited[f.fid] = f
                rate = f.ceiling
                for hop in f.links:
                    left = remaining.get(id(hop), hop.bandwidth * self.rate_factor)
                    if left < rate:
                        rate = left
                f.rate = max(0.0, rate)
                for hop in f.links:
                    remaining[id(hop)] = remaining.get(id(hop), hop.bandwidth * self.rate_factor) - f.rate
            pos += 1
            if pos < len(queue) and remaining.get(id(link), link.bandwidth * self.rate_factor) > 0:
                heapq.heappush(heads, (queue[pos][0], i, pos))
        return list(visited.values())

    @staticmethod
    def _allocate_queue(link: Link, rate_factor: float = 1.0) -> list[Flow]:
        """``allocate_queues`` for one link, whose flows cross it alone (no merge to make)."""
        left = link.bandwidth * rate_factor
        visited = []
        for _, f in link._queue:
            rate = f.ceiling if f.ceiling <= left else left
            f.rate = rate if rate > 0.0 else 0.0  # max(0.0, rate)
            left -= f.rate
            visited.append(f)
            if not left > 0:
                break
        return visited


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
        used: dict[int, float] = {}  # per link: its holders' ceilings, summed
        for key, link in links.items():
            held = self._holders.get(key)
            if held:
                used[key] = sum(g.ceiling for g in link.flows if g.fid in held)
        for f in ranked:
            for link in (f.links if len(f.links) == 1 else sorted(f.links, key=lambda link: link.name)):
                key = id(link)  # in order; stop at the first not had
                held = self._holders.setdefault(key, {})
                if f.fid in held:
                    continue
                if held and used.get(key, 0.0) >= link.bandwidth * (1 - 1e-9):
                    break
                held[f.fid] = now
                used[key] = used.get(key, 0.0) + f.ceiling
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
        self._seq = 0  # every event's tie-breaker, in the order they were scheduled
        self._fid = itertools.count()
        self.events_processed = 0
        # the network's work: how many re-ratings, and how many flows their policy rated in
        # all (under strict priority, flows_rated / reallocations stays near the number of
        # flows that get a rate, however many wait behind them)
        self.reallocations = 0
        self.flows_rated = 0

    # -- event queue ----------------------------------------------------------------
    def at(self, time: float, fn: Callable[[], None]) -> None:
        seq = self._seq
        self._seq = seq + 1
        heapq.heappush(self._events, (time, seq, fn))

    def run(self, until: float = float("inf")) -> None:
        events = self._events
        while events and events[0][0] <= until:
            time, _, fn = heapq.heappop(events)
            self.now = time
            fn()
            self.events_processed += 1

    # -- network --------------------------------------------------------------------
    def transfer(self, links: list[Link], size: float, ceiling: float, on_arrival: Callable[[float], None],
                 owner: str = "", on_sent: Callable[[float], None] | None = None,
                 burst: bool = False, on_start: Callable[[float], None] | None = None) -> Flow | None:
        """Send ``size`` bytes over ``links``; call ``on_arrival(time)`` when the last byte is in,
        and ``on_sent(time)`` when it has left (one propagation delay earlier).  ``burst``: the
        sender puts all of it in flight at once (a policy such as ``FifoBurstPolicy`` serves
        it so).  ``on_start(time)``: called once, when the flow first gets a rate (its first
        byte leaves; behind a FIFO's earlier bursts, when they are through), at the latest
        with ``on_sent``.  Returns the flow (None when nothing crosses a link), whose ceiling
        ``set_ceiling`` may change."""
        delay = sum(link.delay for link in links)
        if not links or size <= 0:
            if on_start is not None:
                on_start(self.now)
            if on_sent is not None:
                on_sent(self.now)
            self.at(self.now + delay, lambda: on_arrival(self.now))
            return None
        flow = Flow(next(self._fid), links, float(size), ceiling, None, owner, updated=self.now, burst=burst,
                    on_start=on_start)

        def done(t: float) -> None:
            if on_sent is not None:
                on_sent(t)
            self.at(t + delay, lambda: on_arrival(self.now))

        flow.on_done = done
        self._settle(links)
        self._add(flow)
        self._reallocate(links)
        return flow

    def settle(self, flow: Flow) -> None:
        """Bring ``flow.remaining`` (and its links' counters) up to now."""
        self._settle(flow.links)

    def backlog(self, link: Link) -> float:
        """Bytes the flows on ``link`` have still to send through it, now: what a FIFO at the
        link holds where every flow put its bytes in flight at once (``FifoBurstPolicy``'s bursts)."""
        self._settle([link])
        return sum(f.remaining for f in link.flows)

    def set_ceiling(self, flow: Flow, ceiling: float) -> None:
        """A flow's own cap changed (its TCP window grew): share its links again from now."""
        if flow.remaining <= 0 or flow not in flow.links[0].flows or ceiling == flow.ceiling:
            return
        self._settle(flow.links)
        flow.ceiling = ceiling
        self._reallocate(flow.links)

    def _add(self, flow: Flow) -> None:
        """Put ``flow`` on its links and into their indexes."""
        for link in flow.links:
            link.flows.append(flow)
            for hop in flow.links:
                link._near.setdefault(id(hop), [hop, 0])[1] += 1
            if len(flow.links) > 1:
                link._multi[flow.fid] = flow
            if self.policy.ordered:
                bisect.insort(link._queue, (self.policy.key(flow), flow))

    def _remove(self, flow: Flow) -> None:
        key = self.policy.key(flow) if self.policy.ordered else None
        for link in flow.links:
            link.flows.remove(flow)
            for hop in flow.links:
                entry = link._near[id(hop)]
                entry[1] -= 1
                if not entry[1]:
                    del link._near[id(hop)]
            link._multi.pop(flow.fid, None)
            link._rated.pop(flow.fid, None)
            if key is not None:
                del link._queue[bisect.bisect_left(link._queue, (key,))]
        self.policy.forget(flow)

    @staticmethod
    def _reach(links) -> dict[int, Link]:
        """The links that the flows on ``links`` cross (each of ``links`` that carries a flow among them)."""
        out: dict[int, Link] = {}
        for link in links:
            for key, (hop, _) in link._near.items():
                out[key] = hop
        return out

    def _settle(self, links) -> None:
        """Advance every flow on these links (and the links they touch) to ``now``.  A flow
        without a rate has nothing to advance, so only the links' ``_rated`` flows are walked."""
        now = self.now
        if any(link._multi for link in links):
            touched = self._reach(links)
            touched.update((id(link), link) for link in links)
            links = touched.values()
        # else their flows cross them alone: they are all it touches
        for link in links:
            rated = link._rated
            dt = now - link._last_update
            if dt > 0:
                # summed in fid order, as the flows sit on the link (floating point is not associative)
                link.bytes_carried += sum(rated[fid].rate for fid in sorted(rated)) * dt
                if link.flows:
                    link.busy_time += dt
                link._last_update = now
            for f in rated.values():
                if f.updated != now:  # not settled at this instant yet (by another of its links, say)
                    f.remaining -= f.rate * (now - f.updated)
                    f.updated = now

    @staticmethod
    def _group(links, rated_only: bool) -> list[Flow]:
        """The flows re-rated when ``links`` changed: every flow on them, then (one hop on)
        every flow on a link those flows cross, in the order their finish events are scheduled
        (which breaks ties between equal finish times).  ``rated_only``: those with a rate > 0,
        in the same order, without visiting the others."""
        def on(link: Link):
            return [link._rated[fid] for fid in sorted(link._rated)] if rated_only else link.flows

        if len(links) == 1 and not links[0]._multi:  # one link, whose flows cross it alone
            return list(on(links[0]))
        group: dict[int, Flow] = {}
        for link in links:
            for f in on(link):
                group.setdefault(f.fid, f)
        # one hop on: only flows that cross several links lead off ``links``; the links they
        # cross are taken in the order those flows come in the group
        done = {id(link) for link in links}
        leads: dict[int, Flow] = {}
        for link in links:
            for fid, f in link._multi.items():
                leads.setdefault(fid, f)
        for f in leads.values():
            for link in f.links:
                if id(link) not in done:
                    done.add(id(link))
                    for g in on(link):
                        group.setdefault(g.fid, g)
        return list(group.values())

    def _reallocate(self, links: list[Link]) -> None:
        # every flow that shares a link with a changed link, transitively one hop: the flows on
        # ``near``, the links the changed links' flows cross
        if any(link._multi for link in links):
            near = list(self._reach(links).values())
            self._settle(list(self._reach(near).values()))  # every link the group crosses
        else:  # their flows cross them alone: the group is theirs
            near = [link for link in links if link.flows]
            self._settle(near)
        before: dict[int, Flow] = {}
        for link in near:
            before.update(link._rated)
        group = None
        if self.policy.ordered:
            rated = self.policy.allocate_queues(near)
        else:
            rated = group = self._group(links, rated_only=False)
            self.policy.allocate(group, self.now)
        self.reallocations += 1
        self.flows_rated += len(rated)
        now = self.now
        for f in rated:
            if before.pop(f.fid, None) is None:  # had no rate
                if f.rate > 0:
                    f.updated = now  # nothing has moved since it last had one
                    for link in f.links:
                        link._rated[f.fid] = f
                    if f.on_start is not None:  # its first byte leaves now
                        f.on_start, started = None, f.on_start
                        started(now)
            elif not f.rate > 0:
                for link in f.links:
                    del link._rated[f.fid]
            f.version += 1  # its pending finish (if any) is void
        for f in before.values():  # had a rate, was not reached: behind a full link
            f.rate = 0.0
            for link in f.links:
                del link._rated[f.fid]
            f.version += 1
        self._schedule_finishes(self._group(links, rated_only=True) if group is None
                                else [f for f in group if f.rate > 0])

    def _schedule_finishes(self, flows: list[Flow]) -> None:
        """Each flow's finish, at now + remaining / rate, ordered among all events as if each
        had an entry of its own (a sequence number each, in this order).  The heap gets one
        entry for the lot, the earliest, which hands on to the next one still current when it
        comes up: most are voided first, since the next start or end on their link re-rates
        them, and a void entry is one heap operation wasted, not one per flow."""
        if len(flows) == 1:  # (the common case when few flows share a link: no batch to keep)
            f = flows[0]
            self.at(self.now + max(0.0, f.remaining) / f.rate, lambda v=f.version: self._finish(f, v))
        elif flows:
            now, seq = self.now, self._seq
            self._seq = seq + len(flows)
            self._next_finish(sorted((now + max(0.0, f.remaining) / f.rate, seq + i, f, f.version)
                                     for i, f in enumerate(flows)), 0)

    def _next_finish(self, batch: list[tuple], i: int) -> None:
        for j in range(i, len(batch)):
            time, seq, flow, version = batch[j]
            if flow.version == version:
                heapq.heappush(self._events, (time, seq, lambda j=j: self._finish_from(batch, j)))
                return

    def _finish_from(self, batch: list[tuple], j: int) -> None:
        _, _, flow, version = batch[j]
        self._finish(flow, version)
        self._next_finish(batch, j + 1)

    def _finish(self, flow: Flow, version: int) -> None:
        if version != flow.version:
            return  # rescheduled since
        self._settle(flow.links)
        self._remove(flow)
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
    # a profiled run's warm-up iterations, op by op ((worker, iteration, kind, microbatch) -> s): the
    # same op of a simulated run takes what it took there, so the run starts as slowly as the
    # profiled one did; the TCP state that start leaves (ssthresh, windows) carries on
    warmup: dict[tuple[str, int, str, int], float] = field(default_factory=dict)

    def draw(self, kind: str, rng: random.Random, op: tuple[str, int, int] | None = None) -> float:
        """One ``kind`` op's duration: ``op`` (worker, iteration, microbatch)'s own in the warm-up
        of a profiled run, else a draw from ``samples``, else the fixed value."""
        if self.warmup and op is not None:
            own = self.warmup.get((op[0], op[1], kind, op[2]))
            if own is not None:
                return own
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
                 start_offsets: dict[int, float] | None = None, seed: int = 0,
                 iterations_ended: Callable[[int], None] | None = None):
        self.sim = sim
        # called with n when every worker has ended n iterations, at the last one's end (as a
        # controller that plans from every worker's telemetry sees it)
        self._iterations_ended = iterations_ended
        self._ended: dict[int, int] = {}  # iteration -> how many workers have ended it
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
            duration = w.times.draw("forward" if kind == sch.FORWARD else "backward", self._rng,
                                    (w.name, w.iteration, mb))
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
            end = now + ar + member.times.draw("optimizer", self._rng, (member.name, member.iteration, -1))
            self._event(member, "optimizer", -1, now + ar, end)
            member.iteration_end[member.iteration] = end
            if self._iterations_ended is not None:
                it = member.iteration
                self._ended[it] = self._ended.get(it, 0) + 1
                if self._ended[it] == len(self.workers):
                    last = max(w.iteration_end[it] for w in self.workers)
                    self.sim.at(last, lambda n=it + 1: self._iterations_ended(n))
            member.cursor = end
            member.iteration += 1
            member.pc = 0
            if member.iteration < self.iterations:
                self.sim.at(end, lambda m=member: self._step(m))
