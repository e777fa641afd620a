"""The simulator alone, under both sharing models, on the cases the emulator was measured on
(prints measured / fair / fifo-bursts / fifo-bursts with the window model per cell; starts no
emulator and builds no network).

    .venv/bin/python experiments/compare_sharing.py [--only bench,emulated,sim] [--json OUT]

* ``bench``: ``bench_emulated.py``'s cases 16x4, 64x4, 64x8 (6 iterations) and 256x4 (4
  iterations, k = 10), each built as that script builds it and simulated as it simulates it
  (the emulated devices' times, their per-message latency);
* ``emulated``: ``validate_emulated.py``'s earlier 12 cells (4.2 ms, 1/4/8 pipelines, 10x/100x
  BDP, default and tuned hosts, fair sharing), simulated as that script does (8 iterations);
* ``sim``: ``validate_sim.py``'s 24 cases.  Its simulator side needs each emulator run's
  ``timeline.json`` (the profiled op times and per-message latency), which is not kept; so
  this is a proxy: forward 30 ms / P, backward twice that, each op drawn from +-50%, a
  3 ms per-message latency (the profile's range: 0.5-6 ms), 42 iterations, the median
  steady iteration as the script takes it.  Its figures say how far the sharing model moves
  a prediction there, not the prediction itself.

Measured figures are docs/benchmarks.md's (the sections named beside each table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from testbed.results.metrics import summarise  # noqa: E402
from testbed.sim.build import simulate  # noqa: E402
from testbed.sim.device import stage_times as emulated_stage_times  # noqa: E402
from testbed.sim.engine import FifoBurstPolicy, SharingPolicy, StageTimes  # noqa: E402
from testbed.spec.experiment import load_experiment  # noqa: E402

# name -> (policy, sim.tcp_window_model): fifo_window sends each message a window at a time
# into drop-tail FIFOs (testbed/sim/rounds.py)
POLICIES = {"fair": (SharingPolicy, False), "fifo": (FifoBurstPolicy, False), "fifo_window": (FifoBurstPolicy, True)}

# docs/benchmarks.md: "The simulator on many pipelines a link and on the long haul" (12-06 reruns;
# 256x4: the mean of its three runs)
BENCH = {(16, 4): (6, 1.0, 0.573), (64, 4): (6, 1.0, 1.722), (64, 8): (6, 1.0, 2.465), (256, 4): (4, 10.0, 5.842)}
# docs/benchmarks.md: "Simulator against emulated devices": (pipelines, x BDP) -> (default, tuned) measured
EMULATED = {(1, 10): (0.406, 0.405), (4, 10): (1.066, 1.048), (8, 10): (1.980, 1.976),
            (1, 100): (4.079, 3.961), (4, 100): (10.110, 9.786), (8, 100): (18.429, 18.396)}
# docs/benchmarks.md: "Simulator against the emulator", full matrix 12-03: (P, D, ms, N) -> (measured, predicted)
SIM = {(2, 1, 1, 1): (0.3888, 0.359), (2, 1, 1, 4): (0.3205, 0.3319), (2, 1, 10, 1): (0.399, 0.3876),
       (2, 1, 10, 4): (0.4161, 0.4135), (2, 1, 50, 1): (0.6531, 0.6593), (2, 1, 50, 4): (0.6568, 0.6738),
       (2, 2, 1, 1): (0.3605, 0.346), (2, 2, 1, 4): (0.379, 0.3555), (2, 2, 10, 1): (0.4388, 0.4264),
       (2, 2, 10, 4): (0.4433, 0.4263), (2, 2, 50, 1): (0.6818, 0.6577), (2, 2, 50, 4): (0.687, 0.6801),
       (3, 1, 1, 1): (0.275, 0.2578), (3, 1, 1, 4): (0.2678, 0.2714), (3, 1, 10, 1): (0.3407, 0.3325),
       (3, 1, 10, 4): (0.3734, 0.3673), (3, 1, 50, 1): (0.8023, 0.7735), (3, 1, 50, 4): (0.8363, 0.8105),
       (3, 2, 1, 1): (0.3236, 0.3121), (3, 2, 1, 4): (0.328, 0.3307), (3, 2, 10, 1): (0.4135, 0.3887),
       (3, 2, 10, 4): (0.4508, 0.4455), (3, 2, 50, 1): (0.8108, 0.7955), (3, 2, 50, 4): (0.8836, 0.8574)}


def _both(exp, **kw) -> dict[str, tuple[float, str]]:
    out = {}
    for name, (policy, window) in POLICIES.items():
        t0 = time.perf_counter()
        result = simulate(exp, policy=policy(), tcp=window, **kw)
        out[name] = (result, time.perf_counter() - t0)
    return out


def bench(tmp: Path) -> list[dict]:
    import bench_emulated

    rows = []
    for (devices, dcs), (iterations, k, measured) in BENCH.items():
        exp = load_experiment(bench_emulated._experiment(tmp, devices, dcs, iterations, k))
        rows.append(_emulated_row(exp, f"{devices}x{dcs}", measured))
    return rows


def _emulated_row(exp, case: str, measured: float, **kw) -> dict:
    """One case on emulated devices, simulated under both policies with the devices' own times
    and per-message latency: its row (printed)."""
    times, latency = emulated_stage_times(exp)
    row = {"case": case, "measured": measured}
    for name, (result, wall) in _both(exp, stage_times=times, message_overhead_s=latency, **kw).items():
        row[name] = summarise(result).summary.mean_iteration_time_s
        row[f"{name}_wall_s"] = round(wall, 2)
        row[f"{name}_note"] = result.log_lines[0]
    _print(row)
    return row


def emulated(tmp: Path) -> list[dict]:
    import validation_matrix

    rows = []
    for (pipelines, x), measured in EMULATED.items():
        for tuned in (False, True):
            cell = validation_matrix.Cell(4.2, pipelines, float(x), "tuned" if tuned else "default", "fair")
            exp = load_experiment(validation_matrix.write_experiment(cell, tmp, 5))
            rows.append(_emulated_row(exp, f"{pipelines} pipelines {x}x BDP {'tuned' if tuned else 'default'}",
                                      measured[tuned], iterations=8))
    return rows


def sim(tmp: Path) -> list[dict]:
    import random

    import validate_sim

    rows = []
    rng = random.Random(7)
    spread = [rng.uniform(0.5, 1.5) for _ in range(200)]
    for (p, d, ms, n), (measured, predicted) in SIM.items():
        exp = validate_sim._experiment(tmp, p, d, ms, n, "1f1b", 10)
        f = 0.030 / p  # the 6 layers' forward, 30 ms, split over the stages
        pool = {"forward": tuple(f * x for x in spread), "backward": tuple(2 * f * x for x in spread[::-1])}
        times = [StageTimes(f, 2 * f, 0.002, samples=pool) for _ in range(p)]
        runs = _both(exp, iterations=42, stage_times=times, message_overhead_s=0.003)
        row = {"case": f"P={p} D={d} {ms} ms N={n}", "measured": measured, "recorded_prediction": predicted}
        for name, (result, _wall) in runs.items():
            s = summarise(result)
            row[name] = statistics.median(it["time_s"] for it in s["iterations"]
                                          if it["iteration"] in s["summary"]["steady_state_iterations"])
            row[f"{name}_note"] = result.log_lines[0]
        row["fifo_vs_fair"] = row["fifo"] / row["fair"] - 1
        rows.append(row)
        print(f"  {row['case']:<22} measured {measured:.4f} (recorded prediction {predicted:.4f}); proxy fair "
              f"{row['fair']:.4f}, fifo {row['fifo']:.4f} ({row['fifo_vs_fair']:+.2%}), fifo+window "
              f"{row['fifo_window']:.4f} ({row['fifo_window'] / row['fair'] - 1:+.2%})", flush=True)
    return rows


def _print(row: dict) -> None:
    m = row["measured"]
    print(f"  {row['case']:<32} measured {m:.3f}  fair {row['fair']:.3f} ({row['fair'] / m - 1:+.1%})  "
          f"fifo {row['fifo']:.3f} ({row['fifo'] / m - 1:+.1%})  "
          f"fifo+window {row['fifo_window']:.3f} ({row['fifo_window'] / m - 1:+.1%})", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="bench,emulated,sim")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for part in args.only.split(","):
            print(part, flush=True)
            out[part] = {"bench": bench, "emulated": emulated, "sim": sim}[part](Path(d))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
