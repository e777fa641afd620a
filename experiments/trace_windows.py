"""A traced emulator run's TCP windows against the simulator's, message by message.

    PYTHONPATH=. .venv/bin/python experiments/trace_windows.py EXPERIMENT RUN_DIR [--set KEY=VALUE ...] [--json OUT]

How it fits: ``testbed run EXPERIMENT --set parallel.tcp_trace=true --out RUN_DIR`` writes each
WAN connection's TCP state per message (``tcp-trace/WORKER.jsonl``: ``transport.Channel._traced``);
``build.simulate`` of the same experiment, profiled from the run (as ``testbed sim --profile``),
keeps each message's channel window as it started (``SimResult.windows``).  Per WAN direction
and microbatch, over the steady iterations (2 on), this prints the idle time the message found
and the window it started with, run against simulator (the run's: the smallest of its
connections', the slice that finishes last), and, for the run's messages that found their
channel idle, how their measured transfer compares with slow start from that window alone
(one-way delay + (rounds - 1) round trips + serialization): near 1 means the per-message
mechanics are right and any miss is in the windows' states (docs/benchmarks.md, "Random loss
on the long haul, measured long enough").  Linux-default hosts (the window model on).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed.net.tcpmodel import MSS, PAYLOAD_FRACTION  # noqa: E402
from testbed.sim.build import profiled_stage_times, simulate  # noqa: E402
from testbed.extension import simulator_options  # noqa: E402
from testbed.spec.experiment import load_experiment  # noqa: E402

STEADY_FROM = 2


def _peer(sender: str, kind: str) -> str:
    stage, replica = sender[1:].split("r")
    return f"s{int(stage) + (1 if 'act' in kind else -1)}r{replica}"


def measured(exp, run: Path) -> dict:
    """(direction, microbatch) -> list of (idle s, smallest start window, all idle, transfer s, segments)."""
    dc = {s.name: s.dc for s in exp.workers()}
    xfer = {}
    for e in json.loads((run / "timeline.json").read_text())["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("xfer_act", "xfer_grad"):
            a = e["args"]
            xfer[(e["tid"].split()[0], e["cat"][5:], a.get("iteration"), a.get("microbatch"))] = (e["dur"] / 1e6,
                                                                                                  a.get("bytes", 0))
    out: dict = {}
    for path in sorted((run / "tcp-trace").glob("*.jsonl")):
        msgs: dict = {}
        for line in path.open():
            row = json.loads(line)
            if row["it"] >= STEADY_FROM:
                msgs.setdefault((row["channel"], row["seq"]), {}).setdefault(row["phase"], []).append(row)
        for (channel, _seq), phases in msgs.items():
            kind, peer = channel.split(":")
            before, start = phases.get("before", []), phases.get("start", [])
            if not before or not start:
                continue
            it, mb = before[0]["it"], before[0]["mb"]
            dur, size = xfer.get((peer, kind, it, mb), (None, 0))
            key = (f"{dc[path.stem]}->{dc[peer]}", mb)
            out.setdefault(key, []).append((statistics.mean(r["idle_ms"] for r in before) / 1000,
                                            min(r["cwnd"] for r in start),
                                            all(r["unacked"] == 0 for r in before), dur,
                                            min((r["ssthresh"] or math.inf) for r in start), size / len(start)))
    return out


def simulated(exp, run: Path, iterations: int) -> dict:
    stage_times, overhead = profiled_stage_times(run / "timeline.json", exp)
    result = simulate(exp, iterations=iterations, stage_times=stage_times, message_overhead_s=overhead,
                      **simulator_options(exp))
    dc = {s.name: s.dc for s in exp.workers()}
    out: dict = {}
    for w in result.windows:
        if w["iteration"] >= STEADY_FROM:
            key = (f"{dc[w['sender']]}->{dc[_peer(w['sender'], w['kind'])]}", w["microbatch"])
            out.setdefault(key, []).append((w["idle_s"] or 0.0, w["cwnd"]))
    return out


def slow_start_check(exp, direction: str, rows: list) -> list[float]:
    """Measured / slow start alone from the smallest window, for messages that found the channel idle."""
    a, b = direction.split("->")
    topo = exp.topo
    owd = topo.one_way_delay_ms(a, b) / 1000
    rtt = topo.rtt_ms(a, b) / 1000
    hops = topo.path(a, b)
    rate = min(topo.direction(x, y).rate_mbps for x, y in zip(hops, hops[1:])) * 1e6 / 8 * PAYLOAD_FRACTION
    n = exp.parallel.connections
    ratios = []
    for _idle, window, idle, dur, ssthresh, slice_bytes in rows:
        if not idle or dur is None:
            continue
        need = math.ceil(slice_bytes / MSS) + 1  # the slice and its header segment
        left, rounds, cwnd = need, 0, window
        while left > 0:
            left, rounds = left - cwnd, rounds + 1
            cwnd = 2 * cwnd if cwnd < ssthresh else cwnd + 1
        ratios.append(dur / (owd + (rounds - 1) * rtt + n * need * MSS / rate))
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", type=Path)
    ap.add_argument("run", type=Path, help="a run of it with parallel.tcp_trace=true")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for the simulation")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--json", type=Path, help="write the table here")
    args = ap.parse_args()
    exp = load_experiment(args.experiment, args.set)
    if not (args.run / "tcp-trace").is_dir():
        sys.exit(f"error: {args.run}/tcp-trace: none (run it with --set parallel.tcp_trace=true)")
    real, sim = measured(exp, args.run), simulated(exp, args.run, args.iterations)
    table = []
    print(f"{'direction':16s} {'mb':>3s} {'idle ms run/sim':>16s} {'start segs run/sim':>19s} {'idle-start: measured / slow start':>34s}")
    for key in sorted(real):
        r, s = real[key], sim.get(key, [])
        check = slow_start_check(exp, key[0], r)
        row = {"direction": key[0], "microbatch": key[1], "messages": len(r),
               "idle_s_run": statistics.mean(x[0] for x in r), "start_run": statistics.mean(x[1] for x in r),
               "idle_s_sim": statistics.mean(x[0] for x in s) if s else None,
               "start_sim": statistics.mean(x[1] for x in s) if s else None,
               "idle_start_ratio_median": statistics.median(check) if check else None}
        table.append(row)
        sim_idle = "-" if row["idle_s_sim"] is None else f"{row['idle_s_sim'] * 1e3:.0f}"
        sim_start = "-" if row["start_sim"] is None else f"{row['start_sim']:.1f}"
        ratio = "-" if not check else f"{row['idle_start_ratio_median']:.2f} ({len(check)})"
        print(f"{key[0]:16s} {key[1]:3d} {row['idle_s_run'] * 1e3:7.0f} / {sim_idle:<7s} {row['start_run']:8.1f} / "
              f"{sim_start:<8s} {ratio:>20s}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
