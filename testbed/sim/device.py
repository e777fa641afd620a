"""Device time for devices that are not there: how long each op of each stage takes, and
how big what it sends is (emulated devices replay it; the simulator and Atlas's planner
predict with it).

How it fits: with ``device: emulated`` the runner calls ``device_profile(exp)`` before it
builds anything (a bad profile is a one-line ``SpecError`` and nothing is created), and
passes each worker its stage's durations in its config (``testbed.train.config.Emulation``);
the worker (``testbed/train/emulated.py``) draws from them with the run's seed.  Durations
come from one of two places, as the experiment's ``emulation`` section says:

* ``profile``: an earlier real run's ``timeline.json`` (CPU containers, or a GPU): per stage
  every observed forward, backward and optimizer duration, the hand-offs to and from the
  transport, the all-reduce, and the hosts' own per-message transport latency, read by the
  simulator's ``profiled_stage_times`` (one implementation for both); a worker the profile
  has by name (a replay on the same parallelism) draws from its own durations;
* the experiment's ``sim.stage_times`` (fixed per stage), or the model's FLOPs at
  ``sim.device_tflops`` x ``sim.efficiency`` (the simulator's ``flops_stage_times``), with
  the all-reduce at ``sim.intra_dc_gbps``.

``speedup`` divides every device time (a device N times faster).  Message sizes are the
real tensors' (``testbed/train/codec.py``): microbatch x sequence x hidden float32 values
plus a 64-byte header; the all-reduce moves each stage's gradient bytes (capped inside a DC
at ``RING_CAP_BYTES``; its modelled time still counts them all).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from testbed.spec import modelshape
from testbed.spec.experiment import Experiment
from testbed.spec.topology import SpecError

RING_CAP_BYTES = 64 << 20
_HEADER = 64


@dataclass
class DeviceProfile:
    source: str  # in words, for metrics.json
    times: list[dict[str, list[float]]]  # per stage: op kind -> durations (s)
    message_bytes: int  # one activation or gradient on the wire
    grad_bytes: list[int]  # per stage: gradient bytes the ring moves
    message_latency_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    # per worker of the profiled run (by name): its own op durations, which a replay on the
    # same parallelism draws from instead of its stage's pool (workers differ: where they run)
    workers: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)  # (iteration, s)
    sequence: bool = False  # replay in order instead of drawing

    def times_for(self, stage: int, worker: str, slowdown: float = 1.0) -> dict[str, list[float]]:
        """The durations one worker draws from (its own where the profile has them, past the
        warm-up), or, replaying a sequence, all of its own in the order measured; device times
        ``slowdown`` times longer."""
        own = self.workers.get(worker, {})
        if self.sequence and own:
            out = dict(self.times[stage]) | {k: [d for _it, d in v] for k, v in own.items() if v}
        else:
            out = dict(self.times[stage]) | {k: [d for it, d in v if it >= 2] for k, v in own.items()
                                              if any(it >= 2 for it, _d in v)}
        if slowdown != 1.0:
            out = {k: [d * slowdown for d in v] for k, v in out.items()}
        return out

    def describe(self) -> dict:
        med = [{k: round(sorted(v)[len(v) // 2], 6) for k, v in t.items() if v} for t in self.times]
        return {"kind": "emulated", "source": self.source, "message_bytes": self.message_bytes,
                "grad_bytes": self.grad_bytes, "message_latency_s": round(self.message_latency_s, 6),
                "median_times_s": med, "notes": self.notes}


def message_bytes(exp: Experiment) -> int:
    m, t = exp.model, exp.training
    return _HEADER + t.microbatch_size * m.seq_len * m.hidden * 4


def _resolve(exp: Experiment, profile: str) -> Path:
    p = Path(profile)
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, Path(exp.origin).parent / p]
    for c in candidates:
        if c.is_file():
            return c
    raise SpecError(f"{exp.origin}: emulation.profile: no such file {profile!r}")


def _profiled(exp: Experiment, path: Path) -> tuple[list[dict[str, list[float]]], dict, float, list[str]]:
    """Per stage and per worker (where the profile has a worker of that name) the observed
    durations; the all-reduce as the collective's own cost: per stage and iteration the
    shortest rank's interval (the last to enter waited for nobody)."""
    from testbed.sim.build import profiled_stage_times

    notes = []
    try:
        trace = json.loads(path.read_text())["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SpecError(f"{exp.origin}: emulation.profile: {path} is not a timeline.json "
                        f"({type(exc).__name__})") from None
    ops = [e for e in trace if e.get("ph") == "X" and str(e.get("tid", "")).startswith("s")
           and " " not in str(e.get("tid"))]
    stages = {int(str(e["tid"])[1:].split("r")[0]) for e in ops}
    if len(stages) != exp.parallel.stages:
        raise SpecError(f"{exp.origin}: emulation.profile: {path} has {len(stages)} pipeline stage(s), the "
                        f"experiment {exp.parallel.stages}")
    try:
        times, latency = profiled_stage_times(path, exp)
    except ValueError as exc:
        raise SpecError(f"{exp.origin}: emulation.profile: {exc}") from None
    collective: dict[tuple[int, int], list[float]] = {}
    per_worker: dict[str, dict[str, list[float]]] = {}
    for e in sorted(ops, key=lambda e: e["ts"]):  # every iteration, in the order measured
        it = e["args"].get("iteration") or 0
        tid, kind = str(e["tid"]), e["cat"]
        if kind == "allreduce":
            collective.setdefault((int(tid[1:].split("r")[0]), it), []).append(e["dur"] / 1e6)
        elif kind in ("forward", "backward", "optimizer", "send"):
            per_worker.setdefault(tid, {}).setdefault(kind, []).append((it, e["dur"] / 1e6))
    allreduce: dict[int, list[tuple[int, float]]] = {}
    for (stage, it), durs in sorted(collective.items()):
        allreduce.setdefault(stage, []).append((it, min(durs)))
    for tid, kinds in per_worker.items():  # its stage's collective, in iteration order
        kinds["allreduce"] = list(allreduce.get(int(tid[1:].split("r")[0]), []))
    steady = {s: [d for it, d in v if it >= 2] for s, v in allreduce.items()}
    metrics = path.parent / "metrics.json"
    if metrics.exists():
        try:
            profiled = json.loads(metrics.read_text())
            if profiled.get("model", {}).get("hidden") != exp.model.hidden or \
                    profiled.get("training", {}).get("microbatch_size") != exp.training.microbatch_size:
                notes.append("the profiled run had another model or microbatch size: its times are replayed as they are")
        except (OSError, ValueError):
            pass
    out = []
    for s, st in enumerate(times):
        per = {k: list(st.samples.get(k) or [getattr(st, k)]) for k in ("forward", "backward", "optimizer")}
        per["send"] = [st.send]
        per["recv"] = [st.recv]
        per["allreduce"] = steady.get(s, [])
        out.append(per)
    return out, per_worker, latency, notes


def _from_flops(exp: Experiment) -> list[dict[str, list[float]]]:
    from testbed.sim.build import flops_stage_times, stage_params

    params = stage_params(exp)
    d = exp.parallel.replicas
    out = []
    for st, p in zip(flops_stage_times(exp), params):
        ring = 2 * (d - 1) / d * p * exp.sim.dtype_bytes / (exp.sim.intra_dc_gbps * 1e9 / 8) if d > 1 else 0.0
        out.append({"forward": [st.forward], "backward": [st.backward], "optimizer": [st.optimizer],
                    "send": [0.0], "recv": [0.0], "allreduce": [ring + exp.sim.allreduce_latency_s] if d > 1 else []})
    return out


def device_profile(exp: Experiment) -> DeviceProfile:
    """The emulated devices' op times and message sizes for ``exp``; SpecError if the
    profile is missing or does not fit the experiment."""
    em = exp.emulation
    latency, notes, workers = 0.0, [], {}
    if em.profile:
        path = _resolve(exp, em.profile)
        times, workers, latency, notes = _profiled(exp, path)
        source = f"profile {path}"
        if not em.message_latency:
            latency = 0.0
    elif exp.sim.stage_times:
        if len(exp.sim.stage_times) != exp.parallel.stages:
            raise SpecError(f"{exp.origin}: sim.stage_times: {len(exp.sim.stage_times)} stage(s), the experiment "
                            f"{exp.parallel.stages}")
        times = [{"forward": [t.forward_s], "backward": [t.backward_s], "optimizer": [t.optimizer_s], "send": [0.0],
                  "recv": [0.0], "allreduce": []} for t in exp.sim.stage_times]
        source = "the experiment's sim.stage_times"
    else:
        times = _from_flops(exp)
        source = (f"FLOPs of the model at {exp.sim.device_tflops:g} TFLOP/s x {exp.sim.efficiency:g} efficiency "
                  f"(the simulator's model)")
    if em.speedup != 1.0:
        times = [{k: [v / em.speedup for v in vs] for k, vs in t.items()} for t in times]
        workers = {w: {k: [(it, v / em.speedup) for it, v in vs] for k, vs in t.items()} for w, t in workers.items()}
        latency /= em.speedup
        source += f", {em.speedup:g}x faster"
    params = modelshape.stage_params(exp.model.layers, exp.model.hidden, exp.model.seq_len, exp.parallel.stages)
    grads = [p * 4 for p in params]
    if not exp.parallel.dp_across_dcs:
        grads = [min(g, RING_CAP_BYTES) for g in grads]
    if em.replay == "sequence":
        source += "; each worker replays its own durations in order"
    return DeviceProfile(source, times, message_bytes(exp), grads, latency, notes, workers, em.replay == "sequence")


def stage_times(exp: Experiment):
    """The simulator's view of ``exp``'s emulated devices: per stage the medians (and every
    duration as ``samples``) and the per-message latency."""
    from testbed.sim.engine import StageTimes

    prof = device_profile(exp)
    out = []
    for t in prof.times:
        def med(kind):
            v = sorted(t.get(kind) or [0.0])
            return v[len(v) // 2]
        out.append(StageTimes(med("forward"), med("backward"), med("optimizer"), send=med("send"), recv=med("recv"),
                              samples={k: tuple(t[k]) for k in ("forward", "backward", "optimizer")
                                       if len(t.get(k) or ()) > 1}))
    return out, prof.message_latency_s
