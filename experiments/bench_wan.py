"""Benchmark of the WAN emulator (prints figures; not a pass/fail test).

    .venv/bin/python experiments/bench_wan.py [--quick] [--json OUT.json]

1. TCP goodput through one link with no rate limit at 0, 10 and 50 ms one-way delay.
2. Delay-backend CPU cost per 100 Mbit/s (cores used by the delay line while a shaped
   100 Mbit/s link is full), and per Gbit/s unshaped.
3. Min-RTT error at 5, 25 and 50 ms one-way, probes 0.02, 0.2 and 1 s apart.
4. Start-up and stop time of 3 DCs x 8 hosts, 8 DCs x 8 hosts and 8 DCs x 32 hosts (full
   WAN mesh over the measured AWS matrix), next to bare Mininet (Linux bridges, no
   controller, the same hosts and bridges, no WAN machinery).
5. Shaping: one-way time of a 128 KiB TCP message after idle against delay + size / rate
   (a pipeline stage's activation; the shaper's bucket must not let it out at line speed),
   and shaped goodput against the rate from 100 Mbit/s to 8 Gbit/s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed.spec.awsmatrix import aws_topology, regions  # noqa: E402
from testbed.net.fidelity import iperf3, message_delays  # noqa: E402
from testbed.net.kernel import mininet_on_path, probe  # noqa: E402
from testbed.net.network import Network  # noqa: E402
from testbed.run.procs import cpu_seconds  # noqa: E402
from testbed.registry import PREFIX, Registry  # noqa: E402
from testbed.sim.build import PAYLOAD_FRACTION  # noqa: E402
from testbed.spec.topology import parse_topology  # noqa: E402



def _two(delay_ms: float, rate_mbps: float):
    return parse_topology({
        "name": "bench", "dcs": [{"name": "a", "hosts": 1}, {"name": "b", "hosts": 1}],
        "wan": [{"a": "a", "b": "b", "delay_ms": delay_ms, "rate_mbps": rate_mbps}],
    })


def goodput_unshaped(caps, delays=(0, 10, 50), seconds=5.0) -> list[dict]:
    rows = []
    for d in delays:
        with Network(_two(d, 40_000), caps=caps) as net:
            a, b = net.host("a"), net.host("b")
            procs = list(net.delay_line_pids().values())
            c0, t0 = sum(map(cpu_seconds, procs)), time.monotonic()
            perf = iperf3(net, a, b, seconds=seconds, omit_s=2 if d >= 25 else 1)
            cpu = (sum(map(cpu_seconds, procs)) - c0) / (time.monotonic() - t0)
        gbps = perf["goodput_mbps"] / 1000
        rows.append({"one_way_ms": d, "goodput_gbps": round(gbps, 2), "retransmits": perf["retransmits"],
                     "delayline_cores": round(cpu, 2),
                     "delayline_cores_per_gbps": round(cpu / gbps, 3) if gbps and procs else None})
        print(f"  unshaped, {d:>3} ms one-way: {gbps:6.2f} Gbit/s  (delay line {cpu:.2f} cores)", flush=True)
    return rows


def cpu_per_100mbit(caps, seconds=5.0) -> dict:
    with Network(_two(10, 100), caps=caps) as net:
        procs = list(net.delay_line_pids().values())
        c0, t0 = sum(map(cpu_seconds, procs)), time.monotonic()
        perf = iperf3(net, net.host("a"), net.host("b"), seconds=seconds, omit_s=1)
        cpu = (sum(map(cpu_seconds, procs)) - c0) / (time.monotonic() - t0)
    per100 = cpu / (perf["goodput_mbps"] / 100) if procs else 0.0
    print(f"  delay line at a full 100 Mbit/s link: {cpu:.3f} cores ({per100:.3f} cores per 100 Mbit/s)", flush=True)
    return {"goodput_mbps": round(perf["goodput_mbps"], 1), "cores": round(cpu, 3), "cores_per_100mbps": round(per100, 3)}


def rtt_error(caps, delays=(5, 25, 50), spacings=(0.02, 0.2, 1.0), repeats: int = 3) -> list[dict]:
    """Min and median RTT against twice the one-way delay, by how far apart the probes are:
    dense probes keep the delay line awake; sparse ones (1 s, ping's default) meet the host's
    wake-up latency, which the line's arrival stamps and its spin to each release take out.
    Each cell: ``repeats`` runs of 10 probes, each run's minimum and mean from ping's summary
    line (to the microsecond; its reply lines round to 0.1 ms, to 1 ms from 100 ms)."""
    rows = []
    for d in delays:
        with Network(_two(d, 100), caps=caps) as net:
            for gap in spacings:
                mins, means = [], []
                for _ in range(repeats):
                    out = net.host("a").node.cmd(f"ping -n -c 10 -i {gap} -W 2 {net.host('b').ip}")
                    lo, mean = (float(x) for x in re.search(r"= ([0-9.]+)/([0-9.]+)/", out).groups())
                    mins.append(lo - 2 * d)
                    means.append(mean - 2 * d)
                row = {"one_way_ms": d, "spacing_s": gap, "min_error_ms": [round(x, 3) for x in mins],
                       "mean_error_ms": [round(x, 3) for x in means]}
                rows.append(row)
                print(f"  {d:>3} ms one-way, probes {gap:>4} s apart: min RTT error "
                      f"{' '.join(f'{x:+.3f}' for x in mins)} ms, mean {' '.join(f'{x:+.3f}' for x in means)} ms",
                      flush=True)
    return rows


def shaping(caps, rates=(100, 200, 1000, 8000), seconds=4.0) -> dict:
    rows = []
    for rate, delay in ((200, 1), (50, 10)):
        with Network(_two(delay, rate), caps=caps) as net:
            times = message_delays(net, net.host("a"), net.host("b"), size=131072, count=30)[5:]
        expected = delay + 131072 / PAYLOAD_FRACTION * 8 / (rate * 1e6) * 1000
        median = sorted(times)[len(times) // 2]
        rows.append({"rate_mbps": rate, "one_way_ms": delay, "message_bytes": 131072,
                     "median_ms": round(median, 2), "expected_ms": round(expected, 2)})
        print(f"  128 KiB message at {rate} Mbit/s, {delay} ms: {median:.2f} ms one-way "
              f"(delay + size/rate {expected:.2f} ms, ratio {median / expected:.2f})", flush=True)
    goodput = []
    for rate in rates:
        with Network(_two(5, rate), caps=caps) as net:
            perf = iperf3(net, net.host("a"), net.host("b"), seconds=seconds, omit_s=1)
        ratio = perf["goodput_mbps"] / (rate * PAYLOAD_FRACTION)
        goodput.append({"rate_mbps": rate, "goodput_mbps": round(perf["goodput_mbps"], 1),
                        "of_payload_rate": round(ratio, 3)})
        print(f"  shaped {rate} Mbit/s: goodput {perf['goodput_mbps']:.1f} Mbit/s "
              f"({ratio:.3f} of the payload rate)", flush=True)
    return {"messages": rows, "goodput": goodput}


def _bare_mininet(n_dcs: int, hosts_per_dc: int) -> tuple[float, float]:
    mininet_on_path()
    from mininet.log import setLogLevel
    from mininet.net import Mininet
    from mininet.nodelib import LinuxBridge

    setLogLevel("error")
    reg = Registry()
    reg.acquire()
    try:
        t0 = time.monotonic()
        net = Mininet(topo=None, switch=LinuxBridge, controller=None, build=False, waitConnected=False)
        prev = None
        for i in range(1, n_dcs + 1):
            reg.link(f"{PREFIX}{i}s")
            sw = net.addSwitch(f"{PREFIX}{i}s", dpid=f"{i:016x}")
            for j in range(1, hosts_per_dc + 1):
                h = net.addHost(f"{PREFIX}{i}h{j}", ip=f"10.{i}.0.{j}/24")
                reg.process(h.pid, "bench")
                net.addLink(h, sw)
            if prev is not None:
                net.addLink(prev, sw)
            prev = sw
        net.build()
        net.start()
        start = time.monotonic() - t0
        t0 = time.monotonic()
        net.stop()
        stop = time.monotonic() - t0
    finally:
        from testbed.registry import clean

        clean(reg.dir, holding_lock=True)
        reg.release()
    return start, stop


def startup(caps, sizes, repeats: int = 3) -> list[dict]:
    """Each size built ``repeats`` times, alternating with bare Mininet; medians, and the
    ratio of each pair (the testbed's start over bare Mininet's, measured back to back)."""
    import statistics

    names = [r for r in ["Virginia", "Ohio", "Oregon", "London", "Frankfurt", "Ireland", "Tokyo", "Seoul",
                         "Singapore", "Sydney"] if r in regions()]
    rows = []
    for n_dcs, per_dc in sizes:
        topo = parse_topology(aws_topology(f"bench-{n_dcs}x{per_dc}", names[:n_dcs], 10, per_dc))
        starts, stops, bare_starts, bare_stops, ratios = [], [], [], [], []
        for _ in range(repeats):
            net = Network(topo, caps=caps)
            net.start()
            t0 = time.monotonic()
            net.stop()
            stops.append(time.monotonic() - t0)
            starts.append(net.startup_s)
            bare_start, bare_stop = _bare_mininet(n_dcs, per_dc)
            bare_starts.append(bare_start)
            bare_stops.append(bare_stop)
            ratios.append(net.startup_s / bare_start)
        med = statistics.median
        row = {"dcs": n_dcs, "hosts": n_dcs * per_dc, "wan_directions": len(topo.directions()), "repeats": repeats,
               "start_s": round(med(starts), 2), "stop_s": round(med(stops), 2),
               "bare_mininet_start_s": round(med(bare_starts), 2), "bare_mininet_stop_s": round(med(bare_stops), 2),
               "start_ratio": round(med(ratios), 2), "start_ratio_range": [round(min(ratios), 2), round(max(ratios), 2)]}
        rows.append(row)
        print(f"  {n_dcs} DCs x {per_dc} hosts ({row['hosts']} hosts, {row['wan_directions']} WAN directions): "
              f"start {row['start_s']} s, stop {row['stop_s']} s; bare Mininet start {row['bare_mininet_start_s']} s, "
              f"stop {row['bare_mininet_stop_s']} s; ratio {row['start_ratio']} "
              f"({row['start_ratio_range'][0]}-{row['start_ratio_range'][1]} over {repeats})", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller start-up sizes, shorter runs")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--only", choices=["goodput", "cpu", "rtt", "startup", "shaping"], help="one section")
    args = ap.parse_args()
    caps = probe()
    results = {"machine": {"cores": os.cpu_count(), "kernel": os.uname().release}}
    from testbed.net.kernel import choose_backends

    results["backends"] = vars(choose_backends(caps))
    print(f"backends: {results['backends']}", flush=True)
    print("1. TCP goodput through one link, no rate limit", flush=True)
    if args.only in (None, "goodput"):
        results["goodput_unshaped"] = goodput_unshaped(caps, seconds=3 if args.quick else 5)
    print("2. delay-backend CPU cost", flush=True)
    if args.only in (None, "cpu"):
        results["cpu"] = cpu_per_100mbit(caps, seconds=3 if args.quick else 5)
    print("3. RTT error", flush=True)
    if args.only in (None, "rtt"):
        results["rtt"] = rtt_error(caps)
    print("4. start-up and stop", flush=True)
    sizes = [(3, 8), (8, 8)] if args.quick else [(3, 8), (8, 8), (8, 32)]
    if args.only in (None, "startup"):
        results["startup"] = startup(caps, sizes)
    print("5. shaping", flush=True)
    if args.only in (None, "shaping"):
        results["shaping"] = shaping(caps, seconds=3 if args.quick else 4)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
