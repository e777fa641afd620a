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

Device time (``DeviceTimes``) comes from where the run will get it: an emulated experiment's
own device profile (``testbed.sim.device``: a timeline, ``sim.stage_times`` or the FLOPs
model, with its ``speedup``), or ``--profile``, the ``timeline.json`` of an earlier run of
the experiment on its real devices (CPU containers, a GPU), or the experiment's own
``sim.stage_times``.  Those are per stage of the
experiment's depth; a candidate of another depth gets the FLOPs model's per-stage split
scaled, op kind by op kind, to match the measured total (a calibrated FLOPs model, so the
ranking across depths is as good as that split).  Without either, the FLOPs model at
``sim.device_tflops`` is all there is, and the plan says it does not describe this machine.
An emulated candidate's stage times go into the plan ``--out`` writes (``sim.stage_times``),
so the run draws what the prediction assumed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from testbed.spec.experiment import Experiment, parse_experiment
from testbed.spec.topology import SpecError


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
    stage_times: list | None = None  # what the prediction assumed (StageTimes per stage), when measured
    why_not: str = ""  # empty for a feasible candidate
    notes: list[str] = field(default_factory=list)

    def label(self) -> str:
        return f"P={self.stages} D={self.replicas} M={self.microbatches} over {'+'.join(self.dcs)}"

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("notes", "stage_times")} | {"label": self.label()}

    def stage_times_spec(self, speedup: float = 1.0) -> list[dict] | None:
        """The stage times as an experiment's ``sim.stage_times`` (before an emulated ``speedup``)."""
        if self.stage_times is None:
            return None
        return [{"forward_s": round(t.forward * speedup, 7), "backward_s": round(t.backward * speedup, 7),
                 "optimizer_s": round(t.optimizer * speedup, 7)} for t in self.stage_times]


@dataclass
class DeviceTimes:
    """Per-candidate stage times (``None``: the simulator's FLOPs model) and where they come from."""

    source: str
    measured: list | None = None  # StageTimes per stage of the experiment's own depth
    depth: int = 0
    overhead: float | None = None  # per-message latency on the hosts, from the same measurement
    scale: dict[str, float] = field(default_factory=dict)  # measured / FLOPs model, per op kind
    speedup: float = 1.0  # an emulated device's: the plan file stores times before it
    machine: bool = False  # do the times describe the devices the run will use?

    @classmethod
    def of(cls, exp: Experiment, profile=None) -> "DeviceTimes":
        from testbed.sim.build import flops_stage_times, profiled_stage_times

        if profile is not None:
            measured, overhead = profiled_stage_times(profile, exp)
            src = f"the profiled run {profile}"
            speedup = exp.emulation.speedup if exp.device == "emulated" else 1.0  # its durations are after it
        elif exp.device == "emulated":
            from testbed.sim.device import device_profile, stage_times

            measured, overhead = stage_times(exp)
            src, speedup = f"the emulated devices ({device_profile(exp).source})", exp.emulation.speedup
        elif exp.sim.stage_times:
            from testbed.sim.engine import StageTimes

            measured = [StageTimes(t.forward_s, t.backward_s, t.optimizer_s) for t in exp.sim.stage_times]
            src, overhead, speedup = "the experiment's sim.stage_times", exp.sim.message_overhead_s, 1.0
        else:
            return cls(f"the FLOPs model at {exp.sim.device_tflops:g} TFLOP/s x {exp.sim.efficiency:g} (not this "
                       f"machine's {exp.device} devices: pass --profile with a run's timeline.json)")
        model = flops_stage_times(exp)
        scale = {}
        for kind in ("forward", "backward", "optimizer"):
            want, have = sum(getattr(t, kind) for t in measured), sum(getattr(t, kind) for t in model)
            scale[kind] = want / have if have > 0 else 0.0
        return cls(src, measured, exp.parallel.stages, overhead, scale, speedup, True)

    def for_candidate(self, e: Experiment) -> tuple[list | None, float | None]:
        if self.measured is None:
            return None, None
        if e.parallel.stages == self.depth:
            return self.measured, self.overhead
        from testbed.sim.build import flops_stage_times
        from testbed.sim.engine import StageTimes

        return [StageTimes(t.forward * self.scale["forward"], t.backward * self.scale["backward"],
                           t.optimizer * self.scale["optimizer"]) for t in flops_stage_times(e)], self.overhead


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
           progress: Callable[[int, int], None] | None = None,
           device: DeviceTimes | None = None) -> list[Candidate]:
    """Every (P, D, DC subset) candidate, best first; infeasible ones last with the reason.
    ``device``: where device time comes from (default ``DeviceTimes.of(exp)``)."""
    from testbed.results import metrics
    from testbed.sim.build import simulate

    device = device or DeviceTimes.of(exp)
    topo = exp.topo
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
        c.stage_times, overhead = device.for_candidate(e)
        result = simulate(e, iterations=iterations, record=True, stage_times=c.stage_times,
                          message_overhead_s=overhead)
        s = metrics.summarise(result).summary
        from testbed.sim.build import wan_utilization

        c.iteration_time_s = s.mean_iteration_time_s
        c.tokens_per_s = s.tokens_per_s
        c.bubble_fraction = s.bubble_fraction
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
