"""``testbed sim``: one simulation, or a sweep over parameters into a table, CSV and plot.

How it fits: loads the experiment like ``testbed run``; optionally takes compute times from
an emulator run's ``timeline.json``; applies each sweep point to a copy of the experiment
(link delay/rate on every WAN direction, connections, replicas, microbatches, stages,
schedule) and calls ``build.simulate``, with what the experiment's extensions add (their
``simulate`` hook: ``--set atlas.sharing=temporal`` simulates Atlas's turns).  Each row
carries ``model``: the parts of the model the run used, their validated ranges and one
warning per part the run lies outside (``validity.py``).
"""

from __future__ import annotations

import csv
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from testbed.extension import device_kind, simulator_options
from testbed.results.provenance import provenance
from testbed.spec.experiment import load_experiment, parse_experiment
from testbed.spec.topology import SpecError
from testbed.sim.build import profiled_stage_times, profiled_write_latency, simulate, wan_utilization

SWEEPABLE = {"delay_ms", "rate_mbps", "connections", "replicas", "microbatches", "stages", "schedule"}


def _with(exp, changes: dict, workdir: Path):
    """A copy of the experiment with sweep values applied (re-validated); the changed
    topology is written into ``workdir``."""
    data = exp.model_dump()
    topo = exp.topo.model_copy(deep=True)
    for link in topo.wan:
        if "delay_ms" in changes:
            link.delay_ms = float(changes["delay_ms"])
        if "rate_mbps" in changes:
            link.rate_mbps = float(changes["rate_mbps"])
    for key, section in (("connections", "parallel"), ("replicas", "parallel"), ("stages", "parallel"),
                         ("schedule", "parallel"), ("microbatches", "training")):
        if key in changes:
            data[section][key] = changes[key]
    if "stages" in changes or "replicas" in changes:
        data["placement"] = None
    path = workdir / "topology.yaml"
    path.write_text(yaml.safe_dump(topo.model_dump(mode="json")))
    data["topology"] = str(path)
    return parse_experiment(data, exp.origin)


def _parse_sweep(items: list[str]) -> list[dict]:
    axes = []
    for item in items:
        key, _, values = item.partition("=")
        if key not in SWEEPABLE or not values:
            raise SpecError(f"--sweep {item}: use KEY=V1,V2 with KEY one of {', '.join(sorted(SWEEPABLE))}")
        conv = str if key == "schedule" else (int if key in ("connections", "replicas", "microbatches", "stages")
                                               else float)
        try:
            axes.append([(key, conv(v)) for v in values.split(",")])
        except ValueError:
            raise SpecError(f"--sweep {item}: {key} takes numbers") from None
    return [dict(point) for point in itertools.product(*axes)] if axes else [{}]


def run_sim(path: Path, profile: Path | None = None, iterations: int = 3, sweep: list[str] | None = None,
            out_dir: Path | None = None, overrides: list[str] | tuple = (),
            write_latency: Path | None = None, seeds: int = 1) -> list[dict]:
    """One row per sweep point.  ``seeds`` > 1 simulates each point that many times, with the
    experiment's seed and the next ones: the row gives their mean and ``iteration_time_min_s`` /
    ``_max_s``.  The seeds differ only where something is drawn (a profile's op times, links'
    loss or jitter, a traced run's writer latency); several pipelines starting together on one
    link make the packet model chaotic, so small draws there give runs as different as a real
    cluster's.  ``--out`` keeps the first seed's run."""
    from testbed.results import metrics

    exp = load_experiment(path, overrides)
    if seeds < 1:
        raise SpecError(f"--seeds {seeds}: simulate at least once")
    points = _parse_sweep(sweep or [])
    rows = []
    # the profiled run is of ``exp`` itself: its message latency is measured against exp's links
    profiled = profiled_stage_times(profile, exp) if profile is not None else None
    # the packet model's writer threads: a traced run's (--write-latency, else the profile's own if traced)
    if write_latency is not None and exp.sim.sharing != "packets":
        raise SpecError(f"--write-latency {write_latency}: only the packet model writes slices "
                        f"(--set sim.sharing=packets)")
    source = write_latency or profile
    writes = profiled_write_latency(source) if source is not None and exp.sim.sharing == "packets" else None
    if write_latency is not None and not writes:
        raise SpecError(f"--write-latency {write_latency}: no traced slices there (run it with --set "
                        f"parallel.tcp_trace=true)")
    with tempfile.TemporaryDirectory(prefix="gtb-sim-") as workdir:
        for point in points:
            e = _with(exp, point, Path(workdir)) if point else exp
            stage_times, overhead = profiled if profile is not None else (None, None)
            if profile is None and device_kind(e.device).profiled:  # what the emulated devices will draw from
                from testbed.sim.device import stage_times as emulated_stage_times

                stage_times, overhead = emulated_stage_times(e)
            options = simulator_options(e)  # (their simulate hook: Atlas's temporal sharing, say)
            t0 = time.perf_counter()
            runs = [simulate(e, iterations=iterations, stage_times=stage_times, message_overhead_s=overhead,
                             write_latency=writes, seed=e.training.seed + k, **options)
                    for k in range(seeds)]
            wall = time.perf_counter() - t0
            result = runs[0]
            summaries = [metrics.summarise(r) for r in runs]
            summary = summaries[0]
            times = [x.summary.mean_iteration_time_s for x in summaries]
            row = dict(point)
            row.update({
                "iteration_time_s": statistics.fmean(times),
                "bubble_fraction": statistics.fmean(x.summary.bubble_fraction for x in summaries),
                "mean_busy_fraction": statistics.fmean(x.summary.mean_busy_fraction for x in summaries),
                "wan_utilization": round(statistics.fmean(wan_utilization(r) for r in runs), 6),
                "workers": len(result.workers),
                "events": sum(r.events_processed for r in runs),
                "sim_wall_s": round(wall, 3),
                "model": result.model,  # the parts used, their validated ranges, a warning per part outside
            })
            if seeds > 1:
                row.update({"seeds": seeds, "iteration_time_min_s": min(times), "iteration_time_max_s": max(times)})
            rows.append(row)
            if out_dir is not None and not sweep:
                result.out_dir = Path(out_dir)
                result.out_dir.mkdir(parents=True, exist_ok=True)
                summary.extra["simulated"] = row
                summary.extra["provenance"] = provenance(e)
                metrics.write_outputs(result, summary)
    if out_dir is not None and sweep:
        _write_sweep(rows, Path(out_dir), [k for k in points[0]])
    return rows


def _write_sweep(rows: list[dict], out: Path, axes: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.csv", "w", newline="") as fh:
        fields = [k for k in rows[0] if k != "model"]
        writer = csv.DictWriter(fh, fieldnames=fields + ["model_warnings"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows([r | {"model_warnings": " | ".join(r["model"]["warnings"])} for r in rows])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = axes[0]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    groups: dict = {}
    for r in rows:
        groups.setdefault(tuple((k, r[k]) for k in axes[1:]), []).append(r)
    for label, rs in groups.items():
        ax.plot([r[x] for r in rs], [r["iteration_time_s"] for r in rs], marker="o",
                label=", ".join(f"{k}={v}" for k, v in label) or None)
    ax.set_xlabel(x)
    ax.set_ylabel("iteration time (s)")
    ax.grid(alpha=0.3)
    if len(groups) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=110)
    plt.close(fig)
