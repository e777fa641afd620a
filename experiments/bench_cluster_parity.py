"""Benchmark: the same experiment on one machine and across three (fake) machines, repeated,
with the difference's 95% interval from the spread between runs (prints figures, writes JSON).

    .venv/bin/python experiments/bench_cluster_parity.py [--pairs 4] [--cases emulated,bubbletea,atlas]
                                                         [--json OUT]

Each case runs ``--pairs`` times here and across machines, alternating (here, there, here,
...), so slow drifts of the machine fall on both sides alike.  Across machines is the fake
cluster of ``testbed/cluster/fake.py`` (3 machines at CLOCK_MONOTONIC offsets +5, 0 and -3 s,
each DC on its own, the WAN links VXLANs between them), made for the benchmark and removed
after.  One figure per run:

* ``emulated``: the steady-state mean iteration time of an emulated-device run on aws-us3
  (3 stages x 2 replicas, one connection per transfer: ``tests/test_cluster.py``'s experiment).
* ``bubbletea``: the bubble time BubbleTea filled, ``experiments/bubbletea-emulated.yaml``
  interleaved, 9 iterations (``tests/test_cluster_extensions.py``'s).
* ``atlas``: the temporal / fair ratio of steady-state iteration times, Atlas's ``compare:``
  on ``tests/data/atlas2.yaml`` (``tests/test_cluster_extensions.py``'s).

Per case it prints each side's mean and standard deviation over the runs and the difference
(across machines less here) with its Welch 95% interval: "within noise" where the interval
holds 0.  Run it on an otherwise idle machine (it takes the network lock the tests take).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from test_cluster import _EMULATED  # noqa: E402  (the tests' experiments, run as they run them)
from test_cluster_extensions import _ATLAS, _steady_mean  # noqa: E402
from testbed.cluster import fake  # noqa: E402

TESTBED = [sys.executable, "-m", "testbed.cli"]
OFFSETS = [5.0, 0.0, -3.0]


def _emulated(folder: Path) -> tuple[Path, callable]:
    data = yaml.safe_load(_EMULATED)
    data.pop("compare")
    exp = folder / "emulated.yaml"
    exp.write_text(yaml.safe_dump(data))
    return exp, lambda out: _steady_mean(json.loads((out / "metrics.json").read_text()))


def _bubbletea(folder: Path) -> tuple[Path, callable]:
    data = yaml.safe_load((REPO / "experiments" / "bubbletea-emulated.yaml").read_text())
    data["training"]["iterations"] = 9
    data["bubbletea"]["interleave"] = True
    exp = folder / "bubbletea.yaml"
    exp.write_text(yaml.safe_dump(data))
    return exp, lambda out: json.loads((out / "metrics.json").read_text())["summary"]["bubble_time_filled"]


def _atlas(folder: Path) -> tuple[Path, callable]:
    exp = folder / "atlas.yaml"
    exp.write_text(_ATLAS)

    def ratio(out: Path) -> float:
        m = {v: json.loads((out / v / "metrics.json").read_text()) for v in ("fair", "temporal")}
        return _steady_mean(m["temporal"]) / _steady_mean(m["fair"])

    return exp, ratio


_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086]  # Student's t, 97.5th percentile, 1..20 degrees of freedom
CASES = {"emulated": (_emulated, "steady iteration time, s"), "bubbletea": (_bubbletea, "bubble time filled"),
         "atlas": (_atlas, "temporal / fair iteration time")}


def welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """mean(b) - mean(a) and its Welch 95% interval (Student's t at the floor of Welch's degrees
    of freedom: conservative)."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if se > 0 else 1.0
    t = _T975[min(len(_T975), max(1, int(dof))) - 1]
    d = statistics.mean(b) - statistics.mean(a)
    return d, d - t * se, d + t * se


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--cases", default="emulated,bubbletea,atlas")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown or args.pairs < 2:
        print(f"error: --cases: unknown {unknown} (known: {', '.join(CASES)}); --pairs at least 2", file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cluster = fake.create(3, OFFSETS)
    failed: list[dict] = []
    results: dict = {"date": started, "machine": _machine(), "pairs": args.pairs, "cases": {}, "failed": failed}
    try:
        with tempfile.TemporaryDirectory(prefix="gtb-parity-") as tmp:
            folder = Path(tmp)
            inventory = folder / "inventory.ini"
            inventory.write_text(cluster.inventory_text())
            for case in cases:
                make, what = CASES[case]
                exp, figure = make(folder)
                runs: dict[str, list[float]] = {"here": [], "there": []}
                for i in range(args.pairs):
                    for where in ("here", "there"):
                        out = folder / f"{case}-{where}-{i}"
                        argv = [*TESTBED, "run", str(exp), "--out", str(out)]
                        if where == "there":
                            argv = cluster.head_argv(argv + ["--inventory", str(inventory)])
                        r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=900)
                        if r.returncode != 0:  # kept, said, and left out of the figures
                            kept = Path(tempfile.mkdtemp(prefix=f"gtb-parity-failed-{case}-{where}-"))
                            if out.exists():
                                shutil.copytree(out, kept / "out", dirs_exist_ok=True)
                            (kept / "stderr.txt").write_text(r.stderr)
                            failed.append({"case": case, "where": where, "run": i, "kept": str(kept),
                                           "error": (r.stderr.strip().splitlines() or ["?"])[-1]})
                            print(f"{case} {where} {i + 1}/{args.pairs}: FAILED ({failed[-1]['error']}); kept in {kept}",
                                  flush=True)
                            continue
                        runs[where].append(figure(out))
                        print(f"{case} {where} {i + 1}/{args.pairs}: {runs[where][-1]:.4f}", flush=True)
                if min(len(v) for v in runs.values()) < 2:
                    print(f"== {case}: fewer than two runs on a side finished", flush=True)
                    continue
                d, lo, hi = welch(runs["here"], runs["there"])
                row = {"figure": what, "here": runs["here"], "there": runs["there"],
                       "difference": d, "ci95": [lo, hi], "within_noise": lo <= 0 <= hi}
                results["cases"][case] = row
                print(f"== {case} ({what}): here {statistics.mean(runs['here']):.4f} "
                      f"(sd {statistics.stdev(runs['here']):.4f}), across machines {statistics.mean(runs['there']):.4f} "
                      f"(sd {statistics.stdev(runs['there']):.4f}); difference {d:+.4f}, 95% [{lo:+.4f}, {hi:+.4f}]"
                      f"{' (within noise)' if lo <= 0 <= hi else ''}", flush=True)
    finally:
        fake.destroy()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def _machine() -> str:
    import os
    import platform

    return f"{platform.node()} {os.cpu_count()} cores {platform.processor() or platform.machine()}"


if __name__ == "__main__":
    sys.exit(main())
