"""Benchmark of the simulator's speed (prints figures; not a pass/fail test).

    .venv/bin/python experiments/bench_sim.py

One iteration of ``experiments/sim-10k.yaml`` (9,984 GPUs: 16 stages x 78 pipelines x TP 8
over 8 DCs, 64 microbatches): wall time, events per second and peak memory, with the DP
replicas folded (the default at this scale: identical pipelines under fair sharing) and
unfolded (every pipeline and every flow simulated); then its row c of
``atlas_paper_scale.py`` as that script runs it (16 connections, temporal sharing: strict
priority in the controller's order, every pipeline simulated, two iterations); and the
1,024-GPU scenario folded and unfolded.  A start or end re-rates the flows with a rate on the
links it changed (``testbed/sim/engine.py``), so unfolding costs the pipelines times what
one costs, not their square, and strict priority never visits the flows it holds at 0.
"""

from __future__ import annotations

import resource
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atlas_paper_scale import N_CONNECTIONS, temporal_plan  # noqa: E402
from testbed.spec.experiment import load_experiment, parse_experiment  # noqa: E402
from testbed.results.metrics import summarise  # noqa: E402
from testbed.sim.build import simulate  # noqa: E402
from testbed.sim.engine import PriorityPolicy  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    run("sim-10k", (True, False))
    temporal("sim-10k")
    run("sim-1k-4dc", (True, False))
    print(f"  process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


def run(name: str, folds: tuple[bool, ...]) -> None:
    exp = load_experiment(REPO / "experiments" / f"{name}.yaml")
    gpus = exp.parallel.stages * exp.parallel.replicas * exp.sim.tensor_parallel
    print(f"{name}: {gpus} GPUs, {len(exp.topo.dcs)} DCs, {exp.parallel.replicas} pipelines, "
          f"{exp.training.microbatches} microbatches, 1 iteration")
    for fold in folds:
        tracemalloc.start()
        t0 = time.perf_counter()
        result = simulate(exp, iterations=1, fold_replicas=fold)
        wall = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        exp.training.iterations, exp.training.warmup_iterations = 1, 0
        s = summarise(result)["summary"]
        print(f"  {'folded' if fold else 'unfolded'}: {wall:.2f} s wall, {result.events_processed} events "
              f"({result.events_processed / wall:,.0f}/s), peak traced memory {peak / 2**20:.0f} MiB; "
              f"iteration {s['mean_iteration_time_s']:.1f} s simulated, bubbles {s['bubble_fraction']:.1%}",
              flush=True)


def temporal(name: str) -> None:
    exp = load_experiment(REPO / "experiments" / f"{name}.yaml")
    data = exp.model_dump()
    data["parallel"]["connections"], data["topology"], data["compare"] = N_CONNECTIONS, exp.topology_file, None
    b = parse_experiment(data, exp.origin)
    plan, _ = temporal_plan(b)
    t0 = time.perf_counter()
    result = simulate(b, iterations=b.training.iterations, policy=PriorityPolicy(plan.order), fold_replicas=False)
    wall = time.perf_counter() - t0
    s = summarise(result)["summary"]
    print(f"  {N_CONNECTIONS} connections, temporal sharing, {b.training.iterations} iterations: {wall:.2f} s wall, "
          f"{result.events_processed} events; iteration {s['mean_iteration_time_s']:.2f} s simulated", flush=True)


if __name__ == "__main__":
    main()
