"""The simulator's re-rating: the indexed engine against the plain one it replaced.

How it fits: ``testbed/sim/engine.py`` re-rates flows through per-link indexes (the links a
link's flows cross, its flows with a rate, its flows in a strict-priority policy's order) so
that strict priority visits only the flows that get a rate.  ``_PlainSimulator`` below is the
engine as it was before them, verbatim: every flow on the changed links and one hop on,
settled, re-rated and rescheduled at every start and end.  The indexed engine must give the
same finish times bit for bit, over random multi-hop workloads with full links, idle links,
ties and ceiling changes, under both policies; and the counter ``flows_rated`` must show that
a strict-priority link does not visit its waiting flows (the speed-up, which no wall-clock
figure would pin).
"""

from __future__ import annotations

import random

import pytest

from testbed.sim.engine import FifoBurstPolicy, Link, PriorityPolicy, SharingPolicy, Simulator


class _PlainSimulator(Simulator):
    """The engine before its indexes: ``_settle`` and ``_reallocate`` as they were."""

    def _settle(self, links):
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

    def _reallocate(self, links):
        flows = {f.fid: f for link in links for f in link.flows}
        for f in list(flows.values()):
            for link in f.links:
                for g in link.flows:
                    flows.setdefault(g.fid, g)
        group = list(flows.values())
        self._settle([l for f in group for l in f.links])
        self.policy.allocate(group, self.now)
        self.reallocations += 1
        self.flows_rated += len(group)
        for f in group:
            f.version += 1
            if f.rate > 0:
                version = f.version
                self.at(self.now + max(0.0, f.remaining) / f.rate, lambda f=f, v=version: self._finish(f, v))


def _plain(policy: SharingPolicy) -> SharingPolicy:
    """The same policy for the plain engine: it rates whole groups (``allocate``)."""
    plain = PriorityPolicy.__new__(PriorityPolicy) if isinstance(policy, PriorityPolicy) else type(policy)()
    plain.__dict__.update(policy.__dict__)
    plain.ordered = False
    return plain


def _workload(engine: type[Simulator], policy: SharingPolicy, seed: int, reused: bool = False):
    """Random transfers over a small multi-hop network; every finish time and link counter.
    ``reused``: the links carried one earlier run first (of another simulator, whose clock
    went further than this one's will at first)."""
    rng = random.Random(seed)
    bursts = random.Random(seed + 1000)  # which messages are sent whole (FifoBurstPolicy), drawn apart
    links = [Link(f"l{i}", bandwidth=rng.choice([1e6, 2e6, 5e6]), delay=rng.choice([0.0, 0.01])) for i in range(5)]
    if reused:
        earlier = engine(policy)
        for link in links:
            earlier.transfer([link], 2e6, float("inf"), lambda t: None)
        earlier.run()
    sim = engine(policy)
    paths = [[links[0]], [links[1]], [links[0], links[2]], [links[1], links[2], links[3]], [links[3]],
             [links[4]], [links[2], links[4]]]
    done: list[tuple[int, float]] = []
    for n in range(60):
        start = rng.choice([0.0, 0.1, 0.25]) if n % 3 else round(rng.uniform(0, 1), 3)
        path = rng.choice(paths)
        size = rng.choice([50_000, 100_000, 100_000, 300_000])
        ceiling = rng.choice([float("inf"), float("inf"), 4e5, 1.5e6])
        owner = rng.choice(["r0", "r1", "r2", "r3", ""])
        grow = rng.random() < 0.3
        burst = size <= 100_000 and bursts.random() < 0.8

        def go(n=n, path=path, size=size, ceiling=ceiling, owner=owner, grow=grow, burst=burst):
            flow = sim.transfer(path, size, ceiling, lambda t, n=n: done.append((n, t)), owner=owner, burst=burst)
            if grow:  # a window that grows while the message is under way
                sim.at(sim.now + 0.05, lambda: sim.set_ceiling(flow, flow.ceiling * 2 + 1e5))

        sim.at(start, go)
        if n % 5 == 0:  # a twin: the same transfer at the same time (lockstep pipelines tie)
            sim.at(start, lambda path=path, size=size, ceiling=ceiling, n=n: sim.transfer(
                path, size, ceiling, lambda t, n=n: done.append((1000 + n, t)), owner="r1"))
    sim.run()
    return done, [(l.bytes_carried, l.busy_time) for l in links], sim


@pytest.mark.parametrize(("seed", "reused"), [(seed, False) for seed in range(12)] + [(12, True), (13, True)])
@pytest.mark.parametrize("policy", [lambda: SharingPolicy(), lambda: PriorityPolicy(["r2", "r0", "r3", "r1"]),
                                    lambda: FifoBurstPolicy()], ids=["fair", "priority", "fifo-bursts"])
def test_the_indexed_engine_gives_the_plain_engines_results_bit_for_bit(policy, seed, reused):
    done, counters, sim = _workload(Simulator, policy(), seed, reused)
    want, want_counters, plain = _workload(_PlainSimulator, _plain(policy()), seed, reused)
    assert len(done) == 72  # 60 transfers and 12 twins, every one finished
    assert done == want  # the same finish times in the same order, exactly
    assert counters == want_counters
    # the void finish entries it no longer pushes, one per flow re-rated, are all it skips
    assert sim.events_processed < plain.events_processed


def test_the_workload_has_full_links_waiting_flows_and_ties():
    """What the comparison above covers: flows held at 0 behind a full link, multi-hop flows,
    and equal finish times."""
    done, _, sim = _workload(Simulator, PriorityPolicy(["r2", "r0", "r3", "r1"]), 3)
    times = [t for _, t in done]
    assert len(set(times)) < len(times)
    assert sim.flows_rated < _workload(_PlainSimulator, _plain(PriorityPolicy(["r2", "r0", "r3", "r1"])), 3)[2].flows_rated


def _one_link(policy: SharingPolicy, pipelines: int) -> tuple[Simulator, dict[str, float]]:
    """``pipelines`` equal transfers on one link, each of its own pipeline, the lowest-ranked first."""
    sim = Simulator(policy)
    link = Link("a->b", bandwidth=1e6, delay=0.0)
    done: dict[str, float] = {}
    for r in reversed(range(pipelines)):
        sim.transfer([link], 100_000, float("inf"), lambda t, r=r: done.setdefault(f"r{r}", t), owner=f"r{r}")
    sim.run()
    return sim, done


def test_strict_priority_rerates_only_the_flows_that_get_a_rate():
    """48 pipelines on one link: the owner takes it whole, the other 47 wait at 0.  Each start
    and end re-rates the flows that get a rate (here the owner) plus the one it found behind
    the full link, not the 47: work per re-rating stays flat as pipelines are added."""
    order = [f"r{i}" for i in range(48)]
    sim, done = _one_link(PriorityPolicy(order), 48)
    assert done == {f"r{i}": pytest.approx(0.1 * (i + 1)) for i in range(48)}  # one turn after another
    assert sim.flows_rated <= 2 * sim.reallocations, (sim.flows_rated, sim.reallocations)
    # fair sharing has every flow rated (and the plain engine rated every flow under both)
    fair, _ = _one_link(SharingPolicy(), 48)
    assert fair.flows_rated >= 20 * fair.reallocations
