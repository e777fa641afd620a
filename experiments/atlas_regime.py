"""Atlas in the paper's regime, on the emulator with emulated devices (prints figures).

    .venv/bin/python experiments/atlas_regime.py [--out results/atlas-regime] [--quick] [--schedule gpipe]
                                                 [--variants b,c] [--time-dilation K]

The scale model.  At paper scale (experiments/sim-10k.yaml: 175B, 78 pipelines, 50 MB
activations, 400 Gbit/s DC pairs, 6 MiB windows over 49-67 ms round trips) the ratios that
decide temporal sharing's outcome are: several pipelines on each WAN link; one connection
window-bound (6 MiB / RTT is ~0.15 of a pipeline's fair share of the link); the link, shared,
slower than compute (D x t / C ~ 2.4 per microbatch); transfers long against the round trip.
Here, on two DCs with the matrix's Ohio-Oregon round trip (49 ms, scaled to 100 Mbit/s):

* D = 4 pipelines share the link; P = 2 (one stage per DC), 4 microbatches;
* a boundary message is 4 MiB (6.8 x the link's BDP of 612 KB, 27 x a pipeline's fair share
  of it), t = S / B = 0.35 s alone on the link;
* every connection's window is capped at 32 KiB (``parallel.tcp_window_bytes``): one
  connection gets ~0.2 of a pipeline's fair share, as at paper scale; 16 connections lift it;
* compute per microbatch C = 1.67 t (forward a third, backward two thirds), so D t / C = 2.4;
* emulated devices (exact times), hosts with Linux's defaults.

Variants: (a) 1 connection, fair sharing; (b) 16 connections, fair; (c) Atlas: 16 connections
+ temporal sharing enforced at the gateway; (s) the full combination: (c) with the best
schedule of 1F1B, GPipe and 1F1B with a deeper warm-up (DC selection has nothing to choose
between two DCs; say so).  Each at equal buffer depth on the link: ``router`` (a FIFO of one
BDP, the pipelines' queues at the enforcing gateway splitting that same BDP) and ``deep``
(16 BDP, 4 BDP a pipeline).  The ablation: one pipeline's devices 1.5 x slower, the plan's
order from telemetry (the slow pipeline first) against the fixed r0, r1, ... with the slow
pipeline last.  Every run is predicted by the simulator (the devices' times, the
window, the controller's order), and carries its TCP counters per pipeline (retransmission
timeouts, tail-loss probes: where a waiting pipeline's dropped tail cost it).  Writes
``OUT/atlas_regime.csv`` and prints a table.
``--time-dilation K`` runs every variant K times slower than the wall clock (the figures in
emulated seconds; the simulator's prediction is the same as at K = 1), to tell how much of a
figure was this machine; ``--variants`` picks among a, b and c.
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
from testbed.sim.engine import PriorityPolicy  # noqa: E402

RATE = 100.0
ONE_WAY = 24.5  # Ohio-Oregon: 49 ms round trip
D, M = 4, 4
SEQ, HIDDEN = 2048, 512  # one microbatch of one sequence: 2048 x 512 x 4 B = 4 MiB
WINDOW = 32768
CONNECTIONS = 16
_DILATION = 1.0  # --time-dilation


def _t() -> float:
    return SEQ * HIDDEN * 4 / (RATE * 1e6 / 8 * PAYLOAD_FRACTION)


def _write(tmp: Path, name: str, queue: int, time_dilation: float = 1.0, **over) -> Path:
    bdp = RATE * 1e6 / 8 * 2 * ONE_WAY / 1000
    topo = tmp / f"topo-{queue}.yaml"
    topo.write_text(yaml.safe_dump({
        "name": "ohio-oregon-scale", "source": "AWS matrix round trip Ohio-Oregon 49 ms (Yuan et al.); 100 Mbit/s",
        "dcs": [{"name": "ohio", "hosts": D}, {"name": "oregon", "hosts": D}],
        "wan": [{"a": "ohio", "b": "oregon", "delay_ms": ONE_WAY, "source_rtt_ms": 2 * ONE_WAY, "rate_mbps": RATE,
                 "queue_bytes": int(queue * bdp)}]}))
    t = _t()
    data = {
        "name": name, "topology": str(topo), "device": "emulated", "time_dilation": time_dilation,
        "model": {"layers": 2, "hidden": HIDDEN, "heads": 8, "seq_len": SEQ},
        "training": {"iterations": 5, "microbatches": M, "microbatch_size": 1, "seed": 2, "warmup_iterations": 2},
        "parallel": {"stages": 2, "replicas": D, "schedule": "1f1b", "connections": CONNECTIONS,
                     "tcp_window_bytes": WINDOW},
        "sim": {"stage_times": [{"forward_s": round(1.67 * t / 3, 4), "backward_s": round(2 * 1.67 * t / 3, 4)}] * 2},
        "atlas": {"sharing": "fair", "class_queue": "share"},
    }
    for key, value in over.items():
        section, _, field = key.partition("__")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _tcp_by_pipeline(metrics: dict) -> dict[str, dict[str, int]]:
    """The run's TCP counters (``tcp_per_host``: every host's sender side) summed per pipeline
    (r0, r1, ...): where the retransmission timeouts and tail-loss probes fell."""
    host_of = {w["host"]: w for w in (metrics["workers"].values() if isinstance(metrics["workers"], dict)
                                      else metrics["workers"])}
    out: dict[str, dict[str, int]] = {}
    for host, counters in (metrics.get("tcp_per_host") or {}).items():
        w = host_of.get(host)
        if w is None:
            continue
        pipe = out.setdefault(f"r{w['replica']}", {"timeouts": 0, "loss_probes": 0, "retransmitted_segments": 0})
        for key in pipe:
            pipe[key] += counters.get(key, 0)
    return out


def run(tmp: Path, name: str, queue: int, **over) -> dict:
    exp = load_experiment(_write(tmp, name, queue, _DILATION, **over))
    out = tmp / name
    if not (out / "metrics.json").exists():
        TrainingRun(exp, out).run()
    measured = json.loads((out / "metrics.json").read_text())["summary"]["mean_iteration_time_s"]
    policy = None
    plans = out / "atlas-plans.json"
    order = None
    if exp.atlas.sharing == "temporal" and plans.exists() and json.loads(plans.read_text()):
        order = json.loads(plans.read_text())[-1]["order"]
        policy = PriorityPolicy(order)
    data = exp.model_dump()  # the simulator's window is the cap: the transport clamps it exactly
    data["topology"] = exp.topology_file
    from testbed.spec.experiment import parse_experiment

    sim_exp = parse_experiment(data, exp.origin)
    times, latency = emulated_stage_times(exp)
    predicted = summarise(simulate(sim_exp, policy=policy, iterations=8, fold_replicas=False, stage_times=times,
                                   message_overhead_s=latency))["summary"]["mean_iteration_time_s"]
    tcp = _tcp_by_pipeline(json.loads((out / "metrics.json").read_text()))
    row = {"variant": name, "queue_bdp": queue, "measured_s": round(measured, 3), "predicted_s": round(predicted, 3),
           "error": round(predicted / measured - 1, 4), "order": " ".join(order) if order else "",
           "rto": sum(v["timeouts"] for v in tcp.values()), "loss_probes": sum(v["loss_probes"] for v in tcp.values()),
           "rto_by_pipeline": " ".join(f"{r}:{v['timeouts']}" for r, v in sorted(tcp.items()))}
    print(f"  {name:<24} queue {queue:>2} BDP: measured {measured:.3f} s, predicted {predicted:.3f} s "
          f"({row['error']:+.1%}) {row['order']}; retransmission timeouts {row['rto']} ({row['rto_by_pipeline']}), "
          f"loss probes {row['loss_probes']}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("results/atlas-regime"))
    ap.add_argument("--quick", action="store_true", help="router buffers only, no schedule search, no ablation")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"],
                    help="the schedule of (a), (b) and (c) (GPipe sends a stage's microbatches back to back: "
                         "more transfers overlap on the link, where turns help most)")
    ap.add_argument("--variants", default="a,b,c", help="which of a, b and c to run (default all three)")
    ap.add_argument("--time-dilation", type=float, default=1.0,
                    help="k: every run k times slower than the wall clock, figures in emulated seconds")
    args = ap.parse_args()
    global _DILATION
    _DILATION = args.time_dilation
    variants = set(args.variants.split(","))
    schedule = {"parallel__schedule": args.schedule}  # of (a), (b), (c) and the ablation
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print(f"one connection's window: {WINDOW / 1024:.0f} KiB, {WINDOW / (2 * ONE_WAY / 1000) * 8 / 1e6:.1f} Mbit/s "
          f"on the {2 * ONE_WAY:g} ms round trip; a pipeline's fair share is {RATE / D * PAYLOAD_FRACTION:.1f}",
          flush=True)
    rows = []
    for queue in ((1,) if args.quick else (1, 16)):
        if "a" in variants:
            rows.append(run(args.out, f"a-q{queue}", queue, parallel__connections=1, **schedule))
        if "b" in variants:
            rows.append(run(args.out, f"b-q{queue}", queue, **schedule))
        if "c" in variants:
            rows.append(run(args.out, f"c-q{queue}", queue, atlas__sharing="temporal", **schedule))
    if not args.quick:
        for schedule, extra in (("gpipe", 0), ("1f1b", 2)):
            rows.append(run(args.out, f"s-{schedule}-w{extra}-q1", 1, atlas__sharing="temporal",
                            parallel__schedule=schedule, parallel__extra_warmup=extra))
        for plan in ("fixed", "telemetry"):  # the slow pipeline is r3: last in the fixed order
            rows.append(run(args.out, f"slow-{plan}-q1", 1, atlas__sharing="temporal", atlas__plan=plan,
                            emulation__slowdown={3: 1.5}, **schedule))
    with open(args.out / "atlas_regime.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    by = {r["variant"]: r for r in rows}
    for q in ((1,) if args.quick else (1, 16)):
        b, c = by.get(f"b-q{q}"), by.get(f"c-q{q}")
        if b and c:
            print(f"queue {q} BDP: (c)/(b) measured {b['measured_s'] / c['measured_s']:.2f}x, predicted "
                  f"{b['predicted_s'] / c['predicted_s']:.2f}x", end="")
        a = by.get(f"a-q{q}")
        print(f"; (c)/(a) measured {a['measured_s'] / c['measured_s']:.2f}x" if a and c else "")
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
