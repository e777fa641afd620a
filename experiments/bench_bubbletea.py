"""BubbleTea benchmark (prints figures; not a pass/fail test).

    .venv/bin/python experiments/bench_bubbletea.py [--scales 0.5,1,2] [--out results/bench-bubbletea]

Runs ``experiments/bubbletea.yaml`` on the emulator with every WAN delay of its topology
scaled by each factor (bubbles grow with delay), once with Atlas off (fair sharing) and once
with Atlas's temporal sharing, and prints, per run: device utilization without and with
prefills, the training slowdown (served against unserved iterations of the same run), the
bubble time filled, prefill TTFT P50/P90/P99 and the request accounting.  Writes
``results.json``, ``results.csv`` and ``bubbletea-vs-delay.png`` to ``--out``.
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

from testbed.experiment import parse_experiment  # noqa: E402
from testbed.spec import read_yaml  # noqa: E402
from testbed.runner import TrainingRun  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIELDS = ("utilization_without_prefill", "utilization_with_prefill", "training_slowdown", "bubble_time_filled",
          "iteration_time_unserved_s", "iteration_time_served_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
          "goodput_within_slo", "requests_admitted", "requests_completed", "requests_rejected")


def _topology(tmp: Path, name: str, scale: float) -> Path:
    topo = read_yaml(REPO / "topologies" / f"{name}.yaml")
    topo["name"] = f"{name}-delay-x{scale:g}"
    for link in topo["wan"]:
        link["delay_ms"] = round(link["delay_ms"] * scale, 3)
    path = tmp / f"{topo['name']}.yaml"
    path.write_text(yaml.safe_dump(topo))
    return path


def run(scales: list[float], out: Path, atlas_modes: tuple[str, ...] = ("fair", "temporal")) -> list[dict]:
    base = read_yaml(REPO / "experiments" / "bubbletea.yaml")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gtb-bench-bt-") as tmp:
        for scale in scales:
            topo = _topology(Path(tmp), base["topology"], scale)
            for atlas in atlas_modes:
                data = json.loads(json.dumps(base))
                data["name"] = f"bubbletea-x{scale:g}-{atlas}"
                data["topology"] = str(topo)
                data["atlas"] = {"sharing": atlas}
                exp = parse_experiment(data, f"bench: delay x{scale:g}, atlas {atlas}")
                print(f"delay x{scale:g}, atlas {'on' if atlas == 'temporal' else 'off'}: running ...", flush=True)
                s = TrainingRun(exp, out / data["name"]).run()["summary"]
                row = {"delay_scale": scale, "atlas": atlas == "temporal", **{k: s.get(k) for k in FIELDS}}
                rows.append(row)
                print("  " + ", ".join(f"{k} {row[k]}" for k in FIELDS), flush=True)
    return rows


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for atlas, style in ((False, "-o"), (True, "--s")):
        sel = [r for r in rows if r["atlas"] == atlas]
        x = [r["delay_scale"] for r in sel]
        tag = "Atlas on" if atlas else "Atlas off"
        axes[0].plot(x, [r["utilization_without_prefill"] for r in sel], style, color="#999999",
                     label=f"training only, {tag}")
        axes[0].plot(x, [r["utilization_with_prefill"] for r in sel], style, color="#C44E52",
                     label=f"with prefills, {tag}")
        axes[1].plot(x, [100 * (r["training_slowdown"] or 0) for r in sel], style, label=tag)
        axes[2].plot(x, [r["ttft_p50_s"] for r in sel], style, label=f"P50, {tag}")
        axes[2].plot(x, [r["ttft_p99_s"] for r in sel], style, label=f"P99, {tag}")
    axes[0].set_ylabel("device utilization")
    axes[0].set_ylim(0, 1)
    axes[1].set_ylabel("training slowdown (%)")
    axes[1].axhline(2, color="#999999", linestyle=":")
    axes[2].set_ylabel("prefill TTFT (s)")
    for ax in axes:
        ax.set_xlabel("WAN delay x")
        ax.legend(fontsize=7)
    fig.suptitle("BubbleTea on the default training job versus WAN delay")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="0.5,1,2", help="WAN delay factors, comma-separated")
    ap.add_argument("--atlas", default="off,on", help="Atlas off (fair sharing), on (temporal), or both")
    ap.add_argument("--out", default=str(REPO / "results" / "bench-bubbletea"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = tuple({"off": "fair", "on": "temporal"}[m] for m in args.atlas.split(","))
    rows = run([float(x) for x in args.scales.split(",")], out, modes)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    with open(out / "results.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _plot(rows, out / "bubbletea-vs-delay.png")
    print(f"{'delay':>6} {'atlas':>5} {'util off':>8} {'util on':>8} {'slowdown':>8} {'filled':>6} "
          f"{'TTFT p50':>8} {'p90':>6} {'p99':>6} {'done/adm':>9}")
    for r in rows:
        print(f"{r['delay_scale']:>5g}x {'on' if r['atlas'] else 'off':>5} {r['utilization_without_prefill']:>8.3f} "
              f"{r['utilization_with_prefill']:>8.3f} {100 * (r['training_slowdown'] or 0):>7.1f}% "
              f"{r['bubble_time_filled']:>6.2f} {r['ttft_p50_s']:>8.3f} {r['ttft_p90_s']:>6.3f} "
              f"{r['ttft_p99_s']:>6.3f} {r['requests_completed']:>4}/{r['requests_admitted']}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
