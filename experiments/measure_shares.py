"""How N TCP flows through one shaped WAN link divide it over a message (issue #30, item 2).

    .venv/bin/python experiments/measure_shares.py [--flows 2 4 8] [--rtt-ms 10 50]
        [--bdp 1 10] [--rounds 8] [--json OUT.json]

N host pairs across one link (50 Mbit/s, the round trip given, a BDP queue) each send one
message of ``bdp`` x the path's BDP at the same instant of the shared clock (``testbed.net.owd
msg-send ... START_AT``), then again every interval, over one persistent connection each, as a
pipeline stage's channel does.  Per round the receivers' completion times (first byte handed
to the socket to last byte read) are set against the fluid model's: every flow ends together
at one-way delay + N x size / payload rate.  Printed per cell: the first and the last
finisher against that, and the spread (last / first); the fluid model says 1.0, 1.0 and 1.0.
Default hosts (Linux's slow start after idle) and tuned ones
(``net.ipv4.tcp_slow_start_after_idle=0``).  Prints progress; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed.net.kernel import probe  # noqa: E402
from testbed.net.network import Network  # noqa: E402
from testbed.sim.build import PAYLOAD_FRACTION  # noqa: E402
from testbed.spec.topology import parse_topology  # noqa: E402

RATE_MBPS = 50.0
PORT = 5400


def _cell(caps, flows: int, rtt_ms: float, bdp: float, rounds: int, tuned: bool) -> dict:
    topo = parse_topology({"name": "shares", "dcs": [{"name": "a", "hosts": flows}, {"name": "b", "hosts": flows}],
                           "wan": [{"a": "a", "b": "b", "delay_ms": rtt_ms / 2, "rate_mbps": RATE_MBPS}]})
    size = int(bdp * RATE_MBPS * 1e6 / 8 * rtt_ms / 1000)
    payload = RATE_MBPS * 1e6 / 8 * PAYLOAD_FRACTION
    fluid_s = rtt_ms / 2000 + flows * size / payload
    interval = max(1.0, 2.5 * fluid_s + 4 * rtt_ms / 1000)
    with Network(topo, caps=caps) as net:
        senders, receivers = net.hosts("a"), net.hosts("b")
        if tuned:
            for h in senders + receivers:
                h.node.cmd("sysctl -qw net.ipv4.tcp_slow_start_after_idle=0")
        recv = []
        for i, dst in enumerate(receivers):
            p = net.popen(dst, [sys.executable, "-m", "testbed.net.owd", "msg-recv", str(PORT + i), str(rounds + 1),
                                str(size), str(interval * (rounds + 3) + 10)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "listening", p.stderr.read()
            recv.append(p)
        start_at = time.monotonic() + 1.0
        send = [net.popen(src, [sys.executable, "-m", "testbed.net.owd", "msg-send", dst.ip, str(PORT + i),
                                str(rounds + 1), str(size), str(interval), f"{start_at:.6f}"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for i, (src, dst) in enumerate(zip(senders, receivers))]
        for p in send:
            p.wait(timeout=interval * (rounds + 3) + 20)
        times = [[float(x) / 1000 for x in p.communicate(timeout=30)[0].split()] for p in recv]
    by_flow = [[t[k] for t in times] for k in range(1, rounds + 1)]  # round 0: connections new
    per_round = [sorted(r) for r in by_flow]
    # does one flow stay ahead?  how often a round's first finisher was the last round's too
    firsts = [r.index(min(r)) for r in by_flow]
    same_first = sum(a == b for a, b in zip(firsts, firsts[1:])) / max(1, len(firsts) - 1)
    first = [r[0] / fluid_s for r in per_round]
    last = [r[-1] / fluid_s for r in per_round]
    spread = [r[-1] / r[0] for r in per_round]
    return {"flows": flows, "rtt_ms": rtt_ms, "bdp": bdp, "hosts": "tuned" if tuned else "default",
            "message_bytes": size, "fluid_s": round(fluid_s, 4), "rounds": rounds,
            "first_over_fluid": round(statistics.median(first), 3), "last_over_fluid": round(statistics.median(last), 3),
            "spread_median": round(statistics.median(spread), 3), "spread_max": round(max(spread), 3),
            "same_first_as_last_round": round(same_first, 2),
            "times_s": [[round(x, 4) for x in r] for r in by_flow]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flows", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[10.0, 50.0])
    ap.add_argument("--bdp", type=float, nargs="+", default=[1.0, 10.0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    caps = probe()
    rows = []
    print(f"{'flows':>5} {'rtt':>5} {'bdp':>4} {'hosts':>7}  first/fluid  last/fluid  spread (median, max)", flush=True)
    for tuned in (False, True):
        for rtt in args.rtt_ms:
            for bdp in args.bdp:
                for n in args.flows:
                    r = _cell(caps, n, rtt, bdp, args.rounds, tuned)
                    rows.append(r)
                    print(f"{n:>5} {rtt:>5g} {bdp:>4g} {r['hosts']:>7}  {r['first_over_fluid']:>11.3f} "
                          f"{r['last_over_fluid']:>11.3f}  {r['spread_median']:.2f}, {r['spread_max']:.2f}", flush=True)
    out = {"machine": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, "rate_mbps": RATE_MBPS, "cells": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
