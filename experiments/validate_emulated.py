"""The simulator against emulated-device runs, where TCP's fair sharing should hold.

    .venv/bin/python experiments/validate_emulated.py [--quick] [--out DIR] [--reuse DIR]

The matrix (each case one run of ``device: emulated`` on the emulator, then ``simulate`` of
the same experiment; the devices' times are exact, so what differs is the network's model):

* one WAN link between two DCs, 100 Mbit/s; P = 2 (one stage per DC), 1F1B, 4 microbatches;
* pipelines on the link: 1, 4, 8;
* a boundary message of ~10 or ~100 times the link's bandwidth-delay product (0.5 MiB at a
  4.2 ms round trip; 5 MiB at the same round trip), compute per microbatch about one
  message's transfer time (forward one third, backward two thirds);
* hosts with Linux's defaults (``tcp_slow_start_after_idle = 1``, as the main job runs) and
  WAN-tuned hosts (``= 0``).

It prints measured and predicted mean iteration times and the error per case, and writes
``DIR/validate_emulated.csv``.  ``--reuse DIR`` predicts again from the runs kept in DIR.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed.sim.device import stage_times as emulated_stage_times  # noqa: E402
from testbed.spec.experiment import load_experiment  # noqa: E402
from testbed.results.metrics import summarise  # noqa: E402
from testbed.run.runner import TrainingRun  # noqa: E402
from testbed.sim.build import PAYLOAD_FRACTION, simulate  # noqa: E402

RATE_MBPS = 100.0
ONE_WAY_MS = 2.1  # a 4.2 ms round trip: BDP 52.5 KB at 100 Mbit/s
MESSAGES = {10: (1024, 1), 100: (2048, 5)}  # x BDP -> (seq_len, microbatch_size) at hidden 128


def _files(tmp: Path, pipelines: int, times_bdp: int, tuned: bool, iterations: int) -> Path:
    topo = tmp / f"topo-{pipelines}.yaml"
    topo.write_text(yaml.safe_dump({
        "name": f"v2dc-{pipelines}", "dcs": [{"name": "a", "hosts": pipelines}, {"name": "b", "hosts": pipelines}],
        "wan": [{"a": "a", "b": "b", "delay_ms": ONE_WAY_MS, "rate_mbps": RATE_MBPS}]}))
    seq, mb = MESSAGES[times_bdp]
    message = mb * seq * 128 * 4
    t = message / (RATE_MBPS * 1e6 / 8 * PAYLOAD_FRACTION)  # one message alone on the link
    name = f"d{pipelines}-x{times_bdp}-{'tuned' if tuned else 'default'}"
    exp = tmp / f"{name}.yaml"
    exp.write_text(yaml.safe_dump({
        "name": name, "topology": str(topo), "device": "emulated",
        "model": {"layers": 2, "hidden": 128, "heads": 4, "seq_len": seq},
        "training": {"iterations": iterations, "microbatches": 4, "microbatch_size": mb, "seed": 3},
        "parallel": {"stages": 2, "replicas": pipelines, "schedule": "1f1b", "connections": 1,
                     "slow_start_after_idle": not tuned},
        "sim": {"stage_times": [{"forward_s": round(t / 3, 5), "backward_s": round(2 * t / 3, 5)}] * 2}}))
    return exp


def case(tmp: Path, pipelines: int, times_bdp: int, tuned: bool, iterations: int, reuse: bool) -> dict:
    path = _files(tmp, pipelines, times_bdp, tuned, iterations)
    exp = load_experiment(path)
    run_dir = tmp / exp.name
    if not (reuse and (run_dir / "metrics.json").exists()):
        TrainingRun(exp, run_dir).run()
    measured = json.loads((run_dir / "metrics.json").read_text())["summary"]["mean_iteration_time_s"]
    times, latency = emulated_stage_times(exp)
    predicted = summarise(simulate(exp, iterations=max(iterations, 8), stage_times=times,
                                   message_overhead_s=latency))["summary"]["mean_iteration_time_s"]
    row = {"pipelines": pipelines, "message_x_bdp": times_bdp, "hosts": "tuned" if tuned else "default",
           "measured_s": round(measured, 4), "predicted_s": round(predicted, 4),
           "error": round(predicted / measured - 1, 4)}
    print(f"  {pipelines} pipeline(s), {times_bdp:>3}x BDP, {row['hosts']:>7} hosts: measured {measured:.3f} s, "
          f"predicted {predicted:.3f} s ({row['error']:+.1%})", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 and 4 pipelines, 10x BDP only")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("results/validate_emulated"))
    ap.add_argument("--reuse", action="store_true", help="predict again from the runs already in --out")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pipelines = (1, 4) if args.quick else (1, 4, 8)
    sizes = (10,) if args.quick else (10, 100)
    t0 = time.monotonic()
    rows = [case(args.out, d, x, tuned, args.iterations, args.reuse)
            for x in sizes for d in pipelines for tuned in (False, True)]
    with open(args.out / "validate_emulated.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst {worst:.1%}, mean {sum(abs(r['error']) for r in rows) / len(rows):.1%}, "
          f"within 5%: {sum(abs(r['error']) <= 0.05 for r in rows)}/{len(rows)} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
