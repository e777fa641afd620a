"""Atlas at paper scale (simulator): speedup over the plain baseline, broken down by part.

    .venv/bin/python experiments/atlas_paper_scale.py [--out results/atlas-paper-scale] [--connections 64,256]
                                                      [--scenarios sim-1k-4dc,sim-10k]

For each large scenario (``experiments/sim-1k-4dc.yaml``: 7B on 1,024 GPUs over 4 AWS
regions; ``experiments/sim-10k.yaml``: 175B on 9,984 GPUs over 8) it simulates one
configuration per row, each adding one part of Atlas:

  d  data parallelism across DCs: every DC holds whole pipelines, gradients all-reduced over
     the WAN (ring over the DCs, each hop capped by the DC pair's capacity and by N x the
     measured single-connection bandwidth): what Atlas avoids by keeping DP inside DCs
  a  pipeline stages across DCs, one TCP connection per transfer, 1F1B, lockstep, fair sharing
  b  a + N connections per transfer (N = 16)
  c  b + temporal sharing (the controller's rank order, enforced; every pipeline simulated:
     strict priority cannot be folded).  The closed form is printed beside it: lockstep
     costs C + D*t per microbatch, temporal max(C + t, D*t), a gain of at most 1 + C/(D*t)
     when the link is the bottleneck (D*t >= C).
  s  b + a latency-aware schedule: the best of 1F1B, GPipe and 1F1B with a deeper warm-up (1F1B
     stalls a round trip per microbatch across a WAN boundary; see the brief)
  s* s with Algorithm 1's DC selection and stage order over the same devices
  s+ the full combination of the paper: s* with temporal sharing (every pipeline simulated)
  ct, s+t  c and s+ with the turns taken at the senders (``TurnPolicy``: a whole message at a
     time, to as many pipelines as it takes to fill the link); ``--connections 64,256`` adds
     b and ct at those connection counts (a pipeline's connections fill more of a link)

and writes ``table.csv``, ``table.md`` and ``speedup.png``: iteration time, speedup over
(a), and the factor each part contributes (b/a: connections, c/b: temporal sharing, s/b:
schedule, s*/s: DC selection, s+/s*: temporal sharing on top).  Note: the fold of identical
pipelines is exact only under fair sharing, so rows other than c and s+ fold them.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agents.atlas.plan import make_plan  # noqa: E402
from agents.atlas.planner import assign_stages  # noqa: E402
from testbed.spec.experiment import load_experiment, parse_experiment  # noqa: E402
from testbed.results.metrics import summarise  # noqa: E402
from testbed.sim.build import flops_stage_times, simulate, stage_params  # noqa: E402
from testbed.sim.engine import PriorityPolicy, TurnPolicy  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
N_CONNECTIONS = 16


def _variant(exp, **parallel):
    data = exp.model_dump()
    data["parallel"].update(parallel)
    data["topology"] = exp.topology_file
    data["compare"] = None
    return parse_experiment(data, exp.origin)


def _time(exp, **kw) -> float:
    result = simulate(exp, iterations=exp.training.iterations, **kw)
    return summarise(result)["summary"]["mean_iteration_time_s"]


def _dp_across_dcs(exp) -> float:
    """Whole pipelines inside each DC (no WAN in the pipeline) + a WAN ring all-reduce."""
    topo = exp.topo
    k = len(topo.dcs)
    data = exp.model_dump()
    data["topology"] = exp.topology_file
    data["compare"] = None
    data["placement"] = {topo.dcs[0].name: list(range(exp.parallel.stages))}
    data["parallel"]["replicas"] = 1  # every pipeline alike, inside one DC: no WAN in it
    one = parse_experiment(data, exp.origin)
    sim = one.sim
    one_pipeline = _time(one)
    grad_bytes = sum(stage_params(exp)) * sim.dtype_bytes
    # ring over the k DCs: each DC sends 2 (k-1)/k of the gradients over its slowest ring hop
    ring = [(topo.dcs[i].name, topo.dcs[(i + 1) % k].name) for i in range(k)]
    per_hop = min(min(sim.wan_link_gbps * 1e9 / 8, N_CONNECTIONS * topo.direction(*hop).rate_mbps * 1e6 / 8)
                  for hop in ring if topo.path(*hop))
    return one_pipeline + 2 * (k - 1) / k * grad_bytes / per_hop


def temporal_plan(b) -> tuple:
    """The controller's plan for ``b`` (its turn order, enforced) from the compute time its
    FLOPs give and one activation's time on a WAN link; and that compute time (C)."""
    compute = max(t.forward + t.backward for t in flops_stage_times(b))
    act = b.training.microbatch_size * b.model.seq_len * b.model.hidden * b.sim.dtype_bytes
    return make_plan(b.parallel.replicas, compute, act, b.sim.wan_link_gbps * 1e9 / 8, enforced=True), compute


def scenario(path: Path, connections_sweep: tuple[int, ...] = ()) -> list[dict]:
    exp = load_experiment(path)
    rows = []
    t0 = time.perf_counter()

    def row(name, what, seconds):
        rows.append({"scenario": exp.name, "variant": name, "what": what, "iteration_s": round(seconds, 3)})
        print(f"  {exp.name} {name:>2}: {seconds:8.2f} s  {what}  ({time.perf_counter() - t0:.0f} s so far)",
              flush=True)

    row("d", "DP across DCs (gradients over the WAN)", _dp_across_dcs(exp))
    a = _variant(exp, connections=1)
    row("a", "stages across DCs, 1 connection, fair", _time(a))
    b = _variant(exp, connections=N_CONNECTIONS)
    row("b", f"+ {N_CONNECTIONS} connections", _time(b))
    plan, compute = temporal_plan(b)
    bound = min(1 + compute / (b.parallel.replicas * plan.transfer_s), plan.lockstep_s / plan.temporal_s)
    print(f"  {exp.name}  closed form: C = {compute * 1e3:.1f} ms, D*t = {b.parallel.replicas * plan.transfer_s * 1e3:.1f} "
          f"ms: temporal sharing gains at most {bound:.3f}x", flush=True)
    row("c", "+ temporal sharing (rank order, enforced; every pipeline simulated)",
        _time(b, policy=PriorityPolicy(plan.order), fold_replicas=False))
    row("ct", "+ temporal sharing, turns at the senders (a message at a time, as many pipelines as fill the link)",
        _time(b, policy=TurnPolicy(plan.order), fold_replicas=False))
    m = b.training.microbatches
    best = None
    for schedule, extra in [("1f1b", 0), ("gpipe", 0)] + [("1f1b", w) for w in
                                                           sorted({m // 4, m // 2, m - b.parallel.stages}) if w > 0]:
        cand = _variant(b, schedule=schedule, extra_warmup=extra)
        t = _time(cand)
        if best is None or t < best[0]:
            best = (t, cand, f"{schedule}" + (f" + {extra} extra warm-up microbatches" if extra else ""))
    s_time, sched, label = best
    row("s", f"b + schedule: {label}", s_time)
    free = {dc.name: dc.hosts for dc in sched.topo.dcs}
    placement = assign_stages(free, sched.parallel.stages, sched.parallel.replicas)
    data = sched.model_dump()
    data["topology"], data["placement"], data["compare"] = sched.topology_file, placement, None
    chosen = parse_experiment(data, exp.origin)
    row("s*", f"s + Algorithm 1 DC selection and stage order ({len(placement)} of {len(free)} DCs)", _time(chosen))
    row("s+", "the full combination: s* + temporal sharing (every pipeline simulated)",
        _time(chosen, policy=PriorityPolicy(plan.order), fold_replicas=False))
    row("s+t", "s* + temporal sharing, turns at the senders",
        _time(chosen, policy=TurnPolicy(plan.order), fold_replicas=False))
    for n in connections_sweep:  # where one pipeline's connections fill more of a link
        bn = _variant(exp, connections=n)
        row(f"b{n}", f"b with {n} connections", _time(bn))
        row(f"ct{n}", f"ct with {n} connections", _time(bn, policy=TurnPolicy(plan.order), fold_replicas=False))
    base = rows[1]["iteration_s"]
    for r in rows:
        r["speedup_over_a"] = round(base / r["iteration_s"], 3)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("results/atlas-paper-scale"))
    ap.add_argument("--connections", default="", help="also b and ct at these connection counts (e.g. 64,256)")
    ap.add_argument("--scenarios", default="sim-1k-4dc,sim-10k")
    args = ap.parse_args()
    sweep = tuple(int(n) for n in args.connections.split(",") if n)
    rows = []
    for name in args.scenarios.split(","):
        print(f"{name}:", flush=True)
        rows += scenario(REPO / "experiments" / f"{name}.yaml", sweep)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "table.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = ["| scenario | variant | what | iteration s | speedup over a |", "|---|---|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['variant']} | {r['what']} | {r['iteration_s']} | {r['speedup_over_a']}x |"
              for r in rows]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    _plot(rows, args.out / "speedup.png")
    print("\n".join(lines))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 3.6))
    for ax, sc in zip(axes if len(scenarios) > 1 else [axes], scenarios):
        mine = [r for r in rows if r["scenario"] == sc]
        ax.bar([r["variant"] for r in mine], [r["speedup_over_a"] for r in mine], color="#4C72B0")
        ax.axhline(1.0, color="#999999", linewidth=0.8)
        ax.set_title(sc)
        ax.set_ylabel("speedup over (a)")
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
