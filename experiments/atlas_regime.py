"""Atlas in the paper's regime, on the emulator with emulated devices (prints figures).

    .venv/bin/python experiments/atlas_regime.py [--out results/atlas-regime] [--quick] [--schedule gpipe]
                                                 [--variants b,c] [--time-dilation K] [--enforce senders]
                                                 [--connections 32] [--queues 2] [--paced] [--sweep gpipe,1f1b]

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
``--enforce senders`` has (c) take its turns at the senders (``testbed/net/sendturns.py``; the
link keeps its FIFO, the same for every variant) instead of the gateway's per-pipeline
queues; ``--connections`` and ``--queues`` (in BDPs) change (b)'s and (c)'s connection count
and the queue depths run; ``--sweep SCHEDULES`` runs (b) and (c) over C/t in 1, 1.67, 3 and D
in 2, 4, 8 instead, measured, simulated and the closed form side by side
(``OUT/atlas_sweep.csv``; experiments/atlas-regime.yaml is its C/t 1.67, D 4 point as
``testbed run`` runs it).
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
from testbed.sim.engine import PriorityPolicy, TurnPolicy  # noqa: E402

RATE = 100.0
ONE_WAY = 24.5  # Ohio-Oregon: 49 ms round trip
D, M = 4, 4
SEQ, HIDDEN = 2048, 512  # one microbatch of one sequence: 2048 x 512 x 4 B = 4 MiB
WINDOW = 32768
CONNECTIONS = 16
_DILATION = 1.0  # --time-dilation
_ENFORCE = "gateway"  # --enforce
_CONNECTIONS = CONNECTIONS  # --connections
_PACED = False  # --paced


def _t() -> float:
    return SEQ * HIDDEN * 4 / (RATE * 1e6 / 8 * PAYLOAD_FRACTION)


def _write(tmp: Path, name: str, queue: int, time_dilation: float = 1.0, d: int = D, c_over_t: float = 1.67,
           **over) -> Path:
    bdp = RATE * 1e6 / 8 * 2 * ONE_WAY / 1000
    topo = tmp / f"topo-{queue}-d{d}.yaml"
    topo.write_text(yaml.safe_dump({
        "name": "ohio-oregon-scale", "source": "AWS matrix round trip Ohio-Oregon 49 ms (Yuan et al.); 100 Mbit/s",
        "dcs": [{"name": "ohio", "hosts": d}, {"name": "oregon", "hosts": d}],
        "wan": [{"a": "ohio", "b": "oregon", "delay_ms": ONE_WAY, "source_rtt_ms": 2 * ONE_WAY, "rate_mbps": RATE,
                 "queue_bytes": int(queue * bdp)}]}))
    t = _t()
    data = {
        "name": name, "topology": str(topo), "device": "emulated", "time_dilation": time_dilation,
        "model": {"layers": 2, "hidden": HIDDEN, "heads": 8, "seq_len": SEQ},
        "training": {"iterations": 5, "microbatches": M, "microbatch_size": 1, "seed": 2, "warmup_iterations": 2},
        "parallel": {"stages": 2, "replicas": d, "schedule": "1f1b", "connections": _CONNECTIONS, "paced": _PACED,
                     "tcp_window_bytes": WINDOW},
        "sim": {"stage_times": [{"forward_s": round(c_over_t * t / 3, 4),
                                 "backward_s": round(2 * c_over_t * t / 3, 4)}] * 2,
                "tcp_window_model": True, "tail_loss": True},  # as experiments/atlas-regime.yaml
        "atlas": {"sharing": "fair", "class_queue": "share", "enforce": _ENFORCE},
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


def _steady_link_figures(out: Path, summary: dict) -> dict:
    """Over the iterations the summary counts (the plan in force): drops at the WAN links'
    queues (both directions) and, where the senders took turns, each turn's hold against the
    message's time alone on the link (``hold_excess``: median held / ideal - 1, the hand-over
    and whatever slowed the owner) and the gaps where the link had no holder."""
    its = [json.loads(line) for line in (out / "iterations.jsonl").read_text().splitlines() if line.strip()]
    first = summary["steady_state_iterations"][0]
    start = next((i["end_s"] for i in its if i["iteration"] == first - 1), 0.0)
    drops = {}
    with open(out / "links.csv") as fh:
        for row in csv.DictReader(fh):
            d = drops.setdefault(row["link"], [None, 0])
            if d[0] is None and float(row["time_s"]) >= start:
                d[0] = int(row["drops"])
            d[1] = int(row["drops"])
    fig = {"link_drops": sum(b - (a or b) for a, b in drops.values())}
    turns_file = out / "atlas-turns.json"
    if turns_file.exists():
        ideal = SEQ * HIDDEN * 4 / (RATE * 1e6 / 8 * PAYLOAD_FRACTION)
        held, idle = [], 0.0
        for data in json.loads(turns_file.read_text()).values():
            turns = sorted((t for t in data["turns"] if t[5] and t[2] >= start and t[3] is not None), key=lambda t: t[2])
            held += [(t[3] - t[2]) / ideal - 1 for t in turns]
            idle += sum(max(0.0, b[2] - a[3]) for a, b in zip(turns, turns[1:]) if b[1] <= a[3])  # someone waited
        held.sort()
        fig["hold_excess"] = round(held[len(held) // 2], 3) if held else None
        fig["handover_idle_s"] = round(idle, 4)
    return fig


def run(tmp: Path, name: str, queue: int, **over) -> dict:
    exp = load_experiment(_write(tmp, name, queue, _DILATION, **over))
    over.pop("d", None), over.pop("c_over_t", None)
    out = tmp / name
    if not (out / "metrics.json").exists():
        TrainingRun(exp, out).run()
    measured = json.loads((out / "metrics.json").read_text())["summary"]["mean_iteration_time_s"]
    policy = None
    plans = out / "atlas-plans.json"
    order = None
    if exp.atlas.sharing == "temporal" and plans.exists() and json.loads(plans.read_text()):
        order = json.loads(plans.read_text())[-1]["order"]
        policy = TurnPolicy(order) if exp.atlas.enforce == "senders" else PriorityPolicy(order)
    data = exp.model_dump()  # the simulator's window is the cap: the transport clamps it exactly
    data["topology"] = exp.topology_file
    from testbed.spec.experiment import parse_experiment

    sim_exp = parse_experiment(data, exp.origin)
    times, latency = emulated_stage_times(exp)
    predicted = summarise(simulate(sim_exp, policy=policy, iterations=8, fold_replicas=False, stage_times=times,
                                   message_overhead_s=latency))["summary"]["mean_iteration_time_s"]
    metrics = json.loads((out / "metrics.json").read_text())
    tcp = _tcp_by_pipeline(metrics)
    gateway = (metrics["summary"].get("atlas") or {}).get("gateway_drops") or {}
    steady = _steady_link_figures(out, json.loads((out / "metrics.json").read_text())["summary"])
    row = {"variant": name, "queue_bdp": queue, "measured_s": round(measured, 3), "predicted_s": round(predicted, 3),
           "error": round(predicted / measured - 1, 4), "order": " ".join(order) if order else "",
           "rto": sum(v["timeouts"] for v in tcp.values()), "loss_probes": sum(v["loss_probes"] for v in tcp.values()),
           "rto_by_pipeline": " ".join(f"{r}:{v['timeouts']}" for r, v in sorted(tcp.items())),
           "enforce": exp.atlas.enforce if exp.atlas.sharing == "temporal" else "", **steady,
           "gateway_drops": " ".join(f"{r}:{sum(d.get(r, 0) for d in gateway.values())}"
                                     for r in sorted({r for d in gateway.values() for r in d}))}
    print(f"  {name:<24} queue {queue:>2} BDP: measured {measured:.3f} s, predicted {predicted:.3f} s "
          f"({row['error']:+.1%}) {row['order']}; retransmission timeouts {row['rto']} ({row['rto_by_pipeline']}), "
          f"loss probes {row['loss_probes']}; steady state: {steady['link_drops']} drops at the link queues"
          + (f"; the gateway's per-pipeline queues dropped {row['gateway_drops']}" if gateway else "")
          + (f", turns held {steady['hold_excess']:+.1%} over a message's time alone (median), "
             f"{steady['handover_idle_s']:.3f} s idle between turns" if steady.get("hold_excess") is not None
             else ""), flush=True)
    return row


def closed_form(c_over_t: float, d: int) -> float:
    """Perfect turns over lockstep fair sharing on one link: (C + D t) / max(C + t, D t)."""
    return (c_over_t + d) / max(c_over_t + 1, d)


def sweep(out: Path, queue: int, schedules: list[str]) -> list[dict]:
    """(b) and (c) at C/t in 1, 1.67, 3 and D in 2, 4, 8: measured, simulated and the closed
    form side by side (``OUT/atlas_sweep.csv``)."""
    rows = []
    for schedule in schedules:
        for c_over_t in (1.0, 1.67, 3.0):
            for d in (2, 4, 8):
                tag = f"{schedule}-c{c_over_t:g}-d{d}-q{queue}"
                b = run(out, f"b-{tag}", queue, d=d, c_over_t=c_over_t, parallel__schedule=schedule)
                c = run(out, f"c-{tag}", queue, d=d, c_over_t=c_over_t, parallel__schedule=schedule,
                        atlas__sharing="temporal")
                row = {"schedule": schedule, "c_over_t": c_over_t, "d": d, "queue_bdp": queue,
                       "b_measured_s": b["measured_s"], "c_measured_s": c["measured_s"],
                       "b_predicted_s": b["predicted_s"], "c_predicted_s": c["predicted_s"],
                       "gain_measured": round(b["measured_s"] / c["measured_s"], 3),
                       "gain_simulated": round(b["predicted_s"] / c["predicted_s"], 3),
                       "gain_closed_form": round(closed_form(c_over_t, d), 3),
                       "c_hold_excess": c.get("hold_excess"), "b_rto": b["rto"], "c_rto": c["rto"],
                       "b_drops": b["link_drops"], "c_drops": c["link_drops"]}
                rows.append(row)
                print(f"{schedule} C/t {c_over_t:<4g} D {d}: (c)/(b) measured {row['gain_measured']:.2f}x, "
                      f"simulated {row['gain_simulated']:.2f}x, closed form {row['gain_closed_form']:.2f}x; "
                      f"turns held {row['c_hold_excess']:+.0%} over alone", flush=True)
                with open(out / "atlas_sweep.csv", "w", newline="") as fh:
                    w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                    w.writeheader()
                    w.writerows(rows)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("results/atlas-regime"))
    ap.add_argument("--quick", action="store_true", help="router buffers only, no schedule search, no ablation")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"],
                    help="the schedule of (a), (b) and (c) (GPipe sends a stage's microbatches back to back: "
                         "more transfers overlap on the link, where turns help most)")
    ap.add_argument("--enforce", default="gateway", choices=["gateway", "senders"],
                    help="where (c) takes its turns: the gateway's per-pipeline queues, or the senders")
    ap.add_argument("--connections", type=int, default=CONNECTIONS, help="connections per transfer of (b) and (c)")
    ap.add_argument("--paced", action="store_true", help="every WAN connection paced (parallel.paced), every variant")
    ap.add_argument("--queues", default=None,
                    help="the WAN queue depths to run at, in BDPs, comma-separated (default 1 and 16; --quick: 1)")
    ap.add_argument("--sweep", default=None, metavar="SCHEDULES",
                    help="instead: (b) and (c) over C/t in 1, 1.67, 3 and D in 2, 4, 8 for these schedules "
                         "(e.g. gpipe,1f1b) at the first of --queues, against the closed form")
    ap.add_argument("--variants", default="a,b,c", help="which of a, b and c to run (default all three)")
    ap.add_argument("--time-dilation", type=float, default=1.0,
                    help="k: every run k times slower than the wall clock, figures in emulated seconds")
    args = ap.parse_args()
    global _DILATION, _ENFORCE, _CONNECTIONS, _PACED
    _DILATION, _ENFORCE, _CONNECTIONS, _PACED = args.time_dilation, args.enforce, args.connections, args.paced
    variants = set(args.variants.split(","))
    schedule = {"parallel__schedule": args.schedule}  # of (a), (b), (c) and the ablation
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print(f"one connection's window: {WINDOW / 1024:.0f} KiB, {WINDOW / (2 * ONE_WAY / 1000) * 8 / 1e6:.1f} Mbit/s "
          f"on the {2 * ONE_WAY:g} ms round trip; a pipeline's fair share is {RATE / D * PAYLOAD_FRACTION:.1f}",
          flush=True)
    rows = []
    queues = tuple(int(q) for q in args.queues.split(",")) if args.queues else (1,) if args.quick else (1, 16)
    if args.sweep:
        sweep(args.out, queues[0], args.sweep.split(","))
        print(f"({time.monotonic() - t0:.0f} s)")
        return 0
    for queue in queues:
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
        w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    by = {r["variant"]: r for r in rows}
    for q in queues:
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
