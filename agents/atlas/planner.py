"""Atlas's planner: which DCs, which stages where, and how deep and wide, scored by the simulator.

How it fits: ``assign_stages`` is the paper's Algorithm 1 as the brief gives it (as
re-implemented by the Sailor project): sort DCs by free devices, largest first, and give
each ``min(stages_left, floor(devices / (TP * DP)))`` consecutive stages; fail if stages
remain.  ``search`` is the what-if search around it: pipeline depth P, DP degree D (with the
global batch fixed: D x microbatches stays the experiment's), and every subset of DCs,
each candidate placed by Algorithm 1 and scored by simulating one iteration
(``testbed.sim``).  ``testbed plan`` prints the ranking and why the others lose;
``testbed plan --out FILE`` writes the best plan as an experiment ``testbed run`` takes.

A device here is what a worker occupies: one emulated host, or one TP group in the
simulator's paper-scale topologies (``hosts`` per DC counts them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from testbed.experiment import Experiment, parse_experiment
from testbed.spec import SpecError


class PlanError(ValueError):
    """No placement fits; the message names the shortfall."""


def assign_stages(free: dict[str, int], stages: int, replicas: int, tensor_parallel: int = 1) -> dict[str, list[int]]:
    """Algorithm 1: DCs by free devices (largest first, ties by name); consecutive stages."""
    per_stage = replicas * tensor_parallel
    out: dict[str, list[int]] = {}
    next_stage = 0
    for dc, devices in sorted(free.items(), key=lambda kv: (-kv[1], kv[0])):
        if next_stage == stages:
            break
        n = min(stages - next_stage, devices // per_stage)
        if n > 0:
            out[dc] = list(range(next_stage, next_stage + n))
            next_stage += n
    if next_stage < stages:
        have = sum(devices // per_stage for devices in free.values())
        raise PlanError(f"{stages} stages x {replicas} replicas x TP {tensor_parallel} do not fit: "
                        f"the DCs ({', '.join(f'{k}: {v}' for k, v in free.items())}) hold {have} stage(s)")
    return out


@dataclass
class Candidate:
    stages: int
    replicas: int
    microbatches: int
    dcs: tuple[str, ...]
    placement: dict[str, list[int]] | None = None
    iteration_time_s: float | None = None
    tokens_per_s: float | None = None
    bubble_fraction: float | None = None
    wan_utilization: float | None = None
    why_not: str = ""  # empty for a feasible candidate
    notes: list[str] = field(default_factory=list)

    def label(self) -> str:
        return f"P={self.stages} D={self.replicas} M={self.microbatches} over {'+'.join(self.dcs)}"

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "notes"} | {"label": self.label()}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _experiment(exp: Experiment, c: Candidate) -> Experiment:
    data = exp.model_dump()
    data["parallel"]["stages"], data["parallel"]["replicas"] = c.stages, c.replicas
    data["training"]["microbatches"] = c.microbatches
    data["placement"] = c.placement
    data["compare"] = None
    data["topology"] = exp.topology_file
    return parse_experiment(data, exp.origin)


def search(exp: Experiment, stages: list[int] | None = None, replicas: list[int] | None = None,
           max_dcs: int | None = None, iterations: int = 2,
           progress: Callable[[int, int], None] | None = None) -> list[Candidate]:
    """Every (P, D, DC subset) candidate, best first; infeasible ones last with the reason."""
    from testbed import metrics
    from testbed.sim.build import simulate

    topo = exp.topo
    tp = exp.sim.tensor_parallel
    batch = exp.parallel.replicas * exp.training.microbatches  # microbatches per iteration, all pipelines
    stages = stages or sorted({exp.parallel.stages} | {p for p in (1, 2, 3, 4, 6, 8, 12, 16)
                                                         if p <= exp.model.layers})
    replicas = replicas or [d for d in _divisors(batch) if batch // d >= 1]
    names = [dc.name for dc in topo.dcs]
    subsets = [s for k in range(1, min(len(names), max_dcs or len(names)) + 1)
               for s in itertools.combinations(names, k)]
    out: list[Candidate] = []
    combos = list(itertools.product(stages, replicas, subsets))
    for k, (p, d, dcs) in enumerate(combos):
        if progress:
            progress(k, len(combos))
        m = batch // d
        c = Candidate(p, d, m, dcs)
        free = {dc: topo.dc(dc).hosts for dc in dcs}
        try:
            c.placement = assign_stages(free, p, d)
        except PlanError as exc:
            c.why_not = str(exc)
            out.append(c)
            continue
        if len(c.placement) < len(dcs):
            c.why_not = f"Algorithm 1 needs only {len(c.placement)} of these DCs (a smaller subset covers it)"
            out.append(c)
            continue
        try:
            e = _experiment(exp, c)
        except SpecError as exc:
            c.why_not = str(exc).split(": ", 1)[-1]
            out.append(c)
            continue
        result = simulate(e, iterations=iterations, record=True)
        s = metrics.summarise(result)["summary"]
        from testbed.sim.build import wan_utilization

        c.iteration_time_s = s["mean_iteration_time_s"]
        c.tokens_per_s = s["tokens_per_s"]
        c.bubble_fraction = s["bubble_fraction"]
        c.wan_utilization = round(wan_utilization(result), 4)
        out.append(c)
    feasible = sorted((c for c in out if not c.why_not), key=lambda c: c.iteration_time_s)
    if feasible:
        best = feasible[0]
        for c in feasible[1:]:
            c.why_not = _why_slower(c, best)
    return feasible + [c for c in out if c.why_not and c.iteration_time_s is None]


def _why_slower(c: Candidate, best: Candidate) -> str:
    ratio = c.iteration_time_s / best.iteration_time_s
    reasons = []
    hops_c, hops_b = len(c.placement) - 1, len(best.placement) - 1
    if hops_c > hops_b:
        reasons.append(f"{hops_c} WAN boundaries vs {hops_b}")
    if c.bubble_fraction - best.bubble_fraction > 0.05:
        reasons.append(f"bubbles {c.bubble_fraction:.0%} vs {best.bubble_fraction:.0%}")
    if c.wan_utilization > 0.8:
        reasons.append(f"WAN-bound ({c.wan_utilization:.0%} of the links busy)")
    if c.replicas > best.replicas:
        reasons.append(f"{c.replicas} pipelines share each link")
    if c.stages > best.stages and not reasons:
        reasons.append("a deeper pipeline fills and drains longer")
    return f"{ratio:.2f}x slower" + (f": {', '.join(reasons)}" if reasons else "")
