"""Comparisons: several variants of one experiment, run back to back, measured and predicted.

How it fits: an experiment with a ``compare:`` section (e.g. ``experiments/atlas-vs-baseline.yaml``:
(a) one connection and fair sharing, (b) N connections, (c) Atlas) is run once per variant
by ``TrainingRun`` (each in ``OUT/<variant>/`` with its own metrics, trace and plots); the
simulator then predicts each variant from the compute times profiled in that variant's own
run; an extension the variant uses may pass the simulator more (its ``predict`` hook in
``testbed.extension``: a sharing policy and start offsets from what its run recorded).
``OUT/comparison.json`` holds, per variant, what it sets, ``measured_s`` and
``predicted_s`` (mean steady-state iteration time), the drops at the WAN queues and the TCP
timeouts its senders took (``wan_drops``, ``tcp_timeouts``, ``tcp_loss_probes``), and the
speedups over the first variant;
``OUT/comparison.png`` draws them.
"""

from __future__ import annotations

import contextlib
import csv
import json
from pathlib import Path
from typing import Any, Callable, ContextManager

from testbed.extension import simulator_options
from testbed.messages import UNSET
from testbed.spec.experiment import Experiment


def predict(exp: Experiment, run_dir: Path) -> float:
    """The simulator's mean steady-state iteration time for the run of ``exp`` kept in
    ``run_dir``, profiled from it, at the experiment's seed (``predict_seeds``)."""
    return predict_seeds(exp, run_dir)[0]


def predict_seeds(exp: Experiment, run_dir: Path, iterations: int | None = None, seeds: int = 1,
                  profile: bool = True) -> list[float]:
    """The simulator's mean steady-state iteration time for the run of ``exp`` kept in
    ``run_dir``, once per seed (the experiment's own first), over the same iterations the run's
    own figure counted: as many as it ran (its metrics.json; else ``iterations``, else the
    experiment's) and from the first it counted (its ``steady_state_iterations``: a run whose
    extension planned after the warm-up counts from the iteration after the plan came into
    force, not from the warm-up's end).  Windows keep growing from one iteration to the next,
    so a mean over a longer run, or over other iterations of it, is not the same figure (the
    validation matrix's Atlas runs read -0.8% apart on average, -4.8% to +3.5%).  ``profile``:
    the devices' times and the per-message latency are the run's own
    (``build.profiled_stage_times`` of its timeline, each op a draw from what the run measured,
    so seeds differ); else the experiment's exact device times.  The extensions the experiment
    uses pass what the run recorded (``extension.simulator_options``).  The run is read once
    for all the seeds."""
    from testbed.results import metrics
    from testbed.sim.build import profiled_stage_times, simulate
    from testbed.sim.device import stage_times

    steady_from = 0
    kept = run_dir / "metrics.json"
    if kept.exists():
        summary = json.loads(kept.read_text())["summary"]
        iterations = summary.get("iterations", iterations)
        steady_from = (summary.get("steady_state_iterations") or [0])[0]
    times, overhead = profiled_stage_times(run_dir / "timeline.json", exp) if profile else stage_times(exp)
    options = simulator_options(exp, run_dir)

    def mean_over_the_runs_steady_state(seed: int) -> float:
        result = simulate(exp, iterations=iterations or exp.training.iterations, stage_times=times,
                          message_overhead_s=overhead, seed=seed, **options)
        result.steady_from = steady_from
        return metrics.summarise(result).summary.mean_iteration_time_s

    return [mean_over_the_runs_steady_state(exp.training.seed + k) for k in range(seeds)]


def _network_counters(s, run_dir: Path) -> dict:
    """What the variant's packets went through, over the whole run: drops at the WAN links'
    queues (links.csv's last sample, every direction) and the senders' retransmission
    timeouts and tail-loss probes (where the hosts' TCP counters were read)."""
    out: dict = {}
    links = run_dir / "links.csv"
    if links.exists():
        last: dict[str, int] = {}
        with open(links) as fh:
            for row in csv.DictReader(fh):
                last[row["link"]] = int(row["drops"])
        out["wan_drops"] = sum(last.values())
    for key in ("tcp_timeouts", "tcp_loss_probes"):
        value = getattr(s, key)
        if value is not UNSET:
            out[key] = value
    return out


def _settings(exp: Experiment, name: str) -> str:
    """What a variant sets, in words (``connections=4, sharing=temporal``)."""
    arm = exp.compare[name].model_dump(exclude={"description"}, exclude_none=True)
    return ", ".join(f"{k}={v}" for k, v in arm.items()) or "as the experiment"


def run_comparison(exp: Experiment, out: Path, delay_backend: str = "auto",
                   progress: Callable[[str, int, int], None] | None = None,
                   log: Callable[[str], None] | None = None,
                   open_site: Callable[[Experiment], ContextManager[Any]] | None = None) -> dict:
    """The variants back to back; ``open_site(variant)`` gives each its site (a cluster's,
    opened for the variant and closed after it; default: this machine)."""
    from testbed.run.runner import TrainingRun

    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    for name in exp.compare or {}:
        v = exp.variant(name)
        run_dir = out / name
        if log:
            log(f"variant {name}: {exp.compare[name].description or ''} ({_settings(exp, name)})")
        with open_site(v) if open_site else contextlib.nullcontext(None) as site:
            runner = TrainingRun(v, run_dir, delay_backend=delay_backend, site=site,
                                 progress=(lambda d, t, n=name: progress(n, d, t)) if progress else None, log=log)
            summary = runner.run()
        s = summary.summary
        rows[name] = {
            "description": exp.compare[name].description,
            "connections": v.parallel.connections, "settings": _settings(exp, name),
            "measured_s": s.mean_iteration_time_s, "predicted_s": round(predict(v, run_dir), 6),
            "steady_state_iterations": s.steady_state_iterations,
            "mean_busy_fraction": s.mean_busy_fraction,
            "losses": summary.losses,
            **_network_counters(s, run_dir),
        }
    names = list(rows)
    result: dict = dict(rows)
    if names:
        base = rows[names[0]]
        result["speedup_over_" + names[0]] = {
            n: {"measured": round(base["measured_s"] / r["measured_s"], 4),
                "predicted": round(base["predicted_s"] / r["predicted_s"], 4)} for n, r in rows.items()}
        result["same_losses"] = all(r["losses"] == base["losses"] for r in rows.values())
    (out / "comparison.json").write_text(json.dumps(result, indent=1))
    _plot(rows, out / "comparison.png", exp.name)
    return result


def _plot(rows: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 3.6))
    x = range(len(names))
    ax.bar([i - 0.18 for i in x], [rows[n]["measured_s"] for n in names], 0.36, label="measured (emulator)",
           color="#4C72B0")
    ax.bar([i + 0.18 for i in x], [rows[n]["predicted_s"] for n in names], 0.36, label="predicted (simulator)",
           color="#DD8452")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{n}\n{rows[n]['settings']}".replace(", ", "\n") for n in names])
    ax.set_ylabel("mean iteration time (s)")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
