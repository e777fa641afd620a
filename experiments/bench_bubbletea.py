"""BubbleTea benchmark: utilization, slowdown and goodput against WAN delay, request rate and
pipelines, Atlas off and on (prints figures; not a pass/fail test).

    .venv/bin/python experiments/bench_bubbletea.py [--device emulated|cpu] [--sweeps delay,rate,pipelines]
                                                    [--pairs 1] [--out results/bench-bubbletea] [--replot]

Every cell is measured back to back (``agents/bubbletea/backtoback.py``): the job with
BubbleTea off, then on (every steady iteration served), ``--pairs`` times; the slowdown is
the on runs' mean iteration time over the off runs'.  The base job is
``experiments/bubbletea-emulated.yaml`` (``--device emulated``: device times from the
shipped profile) or ``experiments/bubbletea.yaml`` (``--device cpu``: CPU containers).
Sweeps, each around the default (1x delay, rate x20, 2 pipelines):

* ``delay``: every WAN delay of aws-us3 scaled by 0.5, 1, 2 (bubbles grow with delay), Atlas
  off (fair sharing) and on (temporal sharing);
* ``rate``: the trace's arrivals x1, x5, x20, x80, x400 (Atlas off): its own rate to saturation;
* ``pipelines``: 1, 2, 4 data-parallel pipelines (each DC gets a host per pipeline and one
  for its decode worker), Atlas off and on.

Per cell it prints utilization without and with BubbleTea, the slowdown, goodput under the
TTFT SLO (over all arrivals), TTFT and TBT percentiles over completed requests and the
accounting; writes ``results.json``, ``results.csv`` and ``bubbletea-sweeps.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from agents.bubbletea.backtoback import back_to_back  # noqa: E402
from testbed.spec.experiment import parse_experiment  # noqa: E402
from testbed.spec.topology import read_yaml  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT = {"delay": 1.0, "rate": 20.0, "pipelines": 2}
# rate: from the trace's own arrivals (x1) to saturation (x400: most of the load is rejected)
SWEEPS = {"delay": [0.5, 1.0, 2.0], "rate": [1.0, 5.0, 20.0, 80.0, 400.0], "pipelines": [1, 2, 4]}
ATLAS = {"delay": ("fair", "temporal"), "rate": ("fair",), "pipelines": ("fair", "temporal")}
COLUMNS = ("sweep", "value", "atlas", "iteration_off_s", "iteration_on_s", "slowdown", "utilization_off",
           "utilization_on", "goodput_within_slo", "goodput_rps", "offered_rps", "ttft_p50_s", "ttft_p99_s",
           "tbt_p50_s", "tbt_p99_s", "bubble_time_filled", "arrived", "admitted", "completed", "rejected",
           "accounting_exact")


def _topology(tmp: Path, name: str, delay: float, hosts: int) -> Path:
    topo = read_yaml(REPO / "topologies" / f"{name}.yaml")
    topo["name"] = f"{name}-d{delay:g}-h{hosts}"
    for dc in topo["dcs"]:
        dc["hosts"] = max(dc["hosts"], hosts)
    for link in topo["wan"]:
        link["delay_ms"] = round(link["delay_ms"] * delay, 3)
    path = tmp / f"{topo['name']}.yaml"
    path.write_text(yaml.safe_dump(topo))
    return path


def cells(sweeps: list[str]) -> list[dict]:
    """The distinct (delay, rate, pipelines, atlas) points the sweeps ask for, each once."""
    out, seen = [], set()
    for sweep in sweeps:
        for value in SWEEPS[sweep]:
            for atlas in ATLAS[sweep]:
                point = dict(DEFAULT, **{sweep: value}, atlas=atlas)
                key = tuple(sorted(point.items()))
                if key not in seen:
                    seen.add(key)
                    out.append(point)
    return out


def run(device: str, sweeps: list[str], out: Path, pairs: int = 1) -> list[dict]:
    base = read_yaml(REPO / "experiments" / ("bubbletea-emulated.yaml" if device == "emulated" else "bubbletea.yaml"))
    measured = []
    with tempfile.TemporaryDirectory(prefix="gtb-bench-bt-") as tmp:
        for point in cells(sweeps):
            data = json.loads(json.dumps(base))
            tag = f"d{point['delay']:g}-r{point['rate']:g}-p{point['pipelines']}-{point['atlas']}"
            data["name"] = f"{base['name']}-{tag}"
            data["topology"] = str(_topology(Path(tmp), base["topology"], point["delay"], point["pipelines"] + 1))
            data["parallel"]["replicas"] = point["pipelines"]
            data["atlas"] = {"sharing": point["atlas"]}
            data["bubbletea"]["rate_scale"] = point["rate"]
            exp = parse_experiment(data, f"bench: {tag}")
            print(f"{tag}: running {pairs} pair(s) ...", flush=True)
            r = back_to_back(exp, out / tag, pairs)
            on = [x for x in r["runs"] if x["bubbletea"]]
            last = on[-1]
            measured.append({"point": point, "result": r})
            print(f"  slowdown {100 * r['training_slowdown']:+.2f}%, utilization {r['utilization_off']:.3f} -> "
                  f"{r['utilization_on']:.3f}, goodput {last['goodput_within_slo']}, TTFT p50/p99 "
                  f"{last['ttft_p50_s']}/{last['ttft_p99_s']} s, completed/rejected/arrived "
                  f"{last['requests_completed']}/{last['requests_rejected']}/"
                  f"{last['requests_arrived']}", flush=True)
    return measured


def rows(measured: list[dict], sweeps: list[str]) -> list[dict]:
    """One row per sweep and value (a cell shared by sweeps appears in each)."""
    out = []
    for sweep in sweeps:
        for m in measured:
            p, r = m["point"], m["result"]
            if any(p[k] != DEFAULT[k] for k in DEFAULT if k != sweep) or p["atlas"] not in ATLAS[sweep]:
                continue
            on = [x for x in r["runs"] if x["bubbletea"]]
            mean = lambda key: (sum(x[key] for x in on) / len(on)) if all(x.get(key) is not None for x in on) else None  # noqa: E731
            out.append({
                "sweep": sweep, "value": p[sweep], "atlas": p["atlas"] == "temporal",
                "iteration_off_s": r["mean_iteration_off_s"], "iteration_on_s": r["mean_iteration_on_s"],
                "slowdown": r["training_slowdown"], "utilization_off": r["utilization_off"],
                "utilization_on": r["utilization_on"],
                **{k: (round(mean(k), 4) if mean(k) is not None else None)
                   for k in ("goodput_within_slo", "goodput_rps", "offered_rps", "ttft_p50_s", "ttft_p99_s",
                             "tbt_p50_s", "tbt_p99_s", "bubble_time_filled")},
                "arrived": sum(x["requests_arrived"] for x in on), "admitted": sum(x["requests_admitted"] for x in on),
                "completed": sum(x["requests_completed"] for x in on),
                "rejected": sum(x["requests_rejected"] for x in on),
                "accounting_exact": all(x["accounting_exact"] for x in on),
            })
    return out


def _plot(table: list[dict], sweeps: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, len(sweeps), figsize=(4.2 * len(sweeps), 12), squeeze=False)
    for col, sweep in enumerate(sweeps):
        for atlas, style in ((False, "-o"), (True, "--s")):
            sel = sorted((r for r in table if r["sweep"] == sweep and r["atlas"] == atlas), key=lambda r: r["value"])
            if not sel:
                continue
            x = [r["value"] for r in sel]
            tag = "Atlas on" if atlas else "Atlas off"
            axes[0][col].plot(x, [r["utilization_off"] for r in sel], style, color="#999999", label=f"off, {tag}")
            axes[0][col].plot(x, [r["utilization_on"] for r in sel], style, color="#C44E52", label=f"on, {tag}")
            axes[1][col].plot(x, [100 * r["slowdown"] for r in sel], style, label=tag)
            axes[2][col].plot(x, [r["goodput_within_slo"] for r in sel], style, label=tag)
            axes[3][col].plot(x, [r["ttft_p50_s"] for r in sel], style, color="#4C72B0", label=f"P50, {tag}")
            axes[3][col].plot(x, [r["ttft_p99_s"] for r in sel], style, color="#DD8452", label=f"P99, {tag}")
        if sweep == "rate":
            for row in axes:
                row[col].set_xscale("log")
        axes[3][col].set_yscale("log")
        axes[0][col].set_ylim(0, 1)
        axes[0][col].axhline(0.9, color="#999999", linestyle=":")
        axes[1][col].axhline(1, color="#999999", linestyle=":")
        axes[1][col].axhline(-1, color="#999999", linestyle=":")
        axes[2][col].set_ylim(0, 1)
        axes[3][col].set_xlabel({"delay": "WAN delay x", "rate": "arrival rate x (trace)",
                                 "pipelines": "DP pipelines"}[sweep])
        for row in axes:
            row[col].legend(fontsize=7)
    axes[0][0].set_ylabel("device utilization")
    axes[1][0].set_ylabel("training slowdown, back to back (%)")
    axes[2][0].set_ylabel("goodput (fraction of arrivals in SLO)")
    axes[3][0].set_ylabel("TTFT of completed requests (s)")
    fig.suptitle("BubbleTea on the default job")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="emulated", choices=("emulated", "cpu"))
    ap.add_argument("--sweeps", default="delay,rate,pipelines")
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "results" / "bench-bubbletea"))
    ap.add_argument("--replot", action="store_true", help="measure nothing: the table and plot again from OUT/results.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sweeps = args.sweeps.split(",")
    if args.replot:
        measured = json.loads((out / "results.json").read_text())["cells"]
    else:
        measured = run(args.device, sweeps, out, args.pairs)
    table = rows(measured, sweeps)
    (out / "results.json").write_text(json.dumps({"cells": measured, "rows": table}, indent=1))
    with open(out / "results.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(COLUMNS))
        w.writeheader()
        w.writerows(table)
    _plot(table, sweeps, out / "bubbletea-sweeps.png")
    print(f"{'sweep':>9} {'value':>6} {'atlas':>5} {'it off':>7} {'it on':>7} {'slowdown':>8} {'util':>11} "
          f"{'goodput':>7} {'TTFT p50/p99':>13} {'TBT p50/p99 ms':>15} {'done/rej/arr':>14}")
    for r in table:
        print(f"{r['sweep']:>9} {r['value']:>6g} {'on' if r['atlas'] else 'off':>5} {r['iteration_off_s']:>7.4f} "
              f"{r['iteration_on_s']:>7.4f} {100 * r['slowdown']:>+7.2f}% "
              f"{r['utilization_off']:>5.3f}->{r['utilization_on']:<5.3f} {r['goodput_within_slo'] or 0:>7.3f} "
              f"{r['ttft_p50_s'] or 0:>6.3f}/{r['ttft_p99_s'] or 0:<6.3f} "
              f"{1000 * (r['tbt_p50_s'] or 0):>7.1f}/{1000 * (r['tbt_p99_s'] or 0):<7.1f} "
              f"{r['completed']:>4}/{r['rejected']}/{r['arrived']}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
