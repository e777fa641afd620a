"""The netem backend's figures (prints them; not a pass/fail test), for a kernel with netem.

    .venv/bin/testbed vm run -- python experiments/bench_netem_vm.py [--json /mnt/gtbjob/netem.json]
    .venv/bin/python experiments/bench_netem_vm.py          # on a machine whose kernel has netem

On a kernel without netem run it in the netem VM (``testbed vm run``, ``testbed/tools/vm.py``);
every figure is labelled with how it ran (kernel, accelerator, CPUs).  Under TCG (software
emulation) the guest's CPU is 10-30x slower than the host's, so rates stay at what it
sustains (<= 40 Mbit/s; one TCP flow tops out near 70 Mbit/s there) and start-up times say
more about the emulation than about the testbed.

1. RTT error at 5, 25 and 50 ms one-way (ping, ``bench_wan.rtt_error``) and one-way delay
   error at 10 / 30 ms on an asymmetric link (``fidelity.one_way_delays``).
2. Jitter 20 +- 5 ms: one-way delay spread, and the order of 300 pings 2 ms apart.
3. Loss: 5% configured on one direction, 2,000 pings.
4. Shaping: a 128 KiB message after idle against delay + size / rate, and shaped goodput.
5. A run-time change (``WanDirection.set``): how long the call takes, and that it holds.
6. Atlas's temporal sharing on netem (``scheduling=True``: the delay line schedules, netem
   delays): owner share and utilization per turn length.
7. Start-up and stop of 3 DCs x 8 hosts (``bench_wan.startup``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_wan import rtt_error, startup  # noqa: E402
from testbed.net.fidelity import iperf3, message_delays, one_way_delays, ping, ping_loss  # noqa: E402
from testbed.net.kernel import choose_backends, probe  # noqa: E402
from testbed.net.network import Network  # noqa: E402
from testbed.sim.build import PAYLOAD_FRACTION  # noqa: E402
from testbed.spec.topology import parse_topology  # noqa: E402


def _two(delay_ms: float, rate_mbps: float, hosts: int = 1, **extra):
    return parse_topology({
        "name": "bench", "dcs": [{"name": "a", "hosts": hosts}, {"name": "b", "hosts": hosts}],
        "wan": [{"a": "a", "b": "b", "delay_ms": delay_ms, "rate_mbps": rate_mbps, **extra}],
    })


def how_it_ran() -> dict:
    accel = os.environ.get("GTB_VM_ACCEL")
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return {"kernel": os.uname().release, "vm": f"netem VM, QEMU {accel}" if accel else "no VM",
            "cpus": os.cpu_count(), "cpu": cpu, "date": time.strftime("%Y-%m-%d")}


def probe_floor(caps) -> dict:
    """What the probes read on a 0 ms link: the machine's own share of every delay figure."""
    with Network(_two(0, 20), caps=caps) as net:
        a, b = net.host("a"), net.host("b")
        owd = sorted(one_way_delays(net, a, b, count=200, interval_s=0.01))
        rtts = sorted(ping(a, b.ip, count=100, interval_s=0.01))
    row = {"owd_min_ms": round(owd[0], 3), "owd_median_ms": round(statistics.median(owd), 3),
           "owd_p95_ms": round(owd[int(0.95 * len(owd))], 3), "rtt_min_ms": round(rtts[0], 3),
           "rtt_median_ms": round(statistics.median(rtts), 3), "rtt_p95_ms": round(rtts[int(0.95 * len(rtts))], 3)}
    print(f"  0 ms link: one-way min {row['owd_min_ms']}, median {row['owd_median_ms']}, p95 {row['owd_p95_ms']} ms; "
          f"RTT min {row['rtt_min_ms']}, median {row['rtt_median_ms']}, p95 {row['rtt_p95_ms']} ms", flush=True)
    return row


def one_way(caps) -> dict:
    with Network(_two(10, 20, reverse={"delay_ms": 30}), caps=caps) as net:
        a, b = net.host("a"), net.host("b")
        fwd, back = one_way_delays(net, a, b, count=50), one_way_delays(net, b, a, count=50)
    row = {"fwd_min_ms": round(min(fwd), 3), "fwd_median_ms": round(statistics.median(fwd), 3),
           "back_min_ms": round(min(back), 3), "back_median_ms": round(statistics.median(back), 3)}
    print(f"  10 ms one-way: min {row['fwd_min_ms']:.3f} ms (error {row['fwd_min_ms'] - 10:+.3f}), "
          f"median {row['fwd_median_ms']:.3f}; 30 ms back: min {row['back_min_ms']:.3f} ms "
          f"(error {row['back_min_ms'] - 30:+.3f}), median {row['back_median_ms']:.3f}", flush=True)
    return row


def jitter(caps) -> dict:
    with Network(_two(20, 20, jitter_ms=5), caps=caps) as net:
        a, b = net.host("a"), net.host("b")
        owd = one_way_delays(net, a, b, count=300, interval_s=0.01)
        out = a.node.cmd(f"ping -n -c 300 -i 0.002 -W 2 {b.ip}")
    seqs = [int(x) for x in re.findall(r"icmp_seq=(\d+)", out)]
    inversions = sum(y < x for x, y in zip(seqs, seqs[1:]))
    owd.sort()
    row = {"min_ms": round(owd[0], 3), "p5_ms": round(owd[int(0.05 * len(owd))], 3),
           "median_ms": round(statistics.median(owd), 3), "p95_ms": round(owd[int(0.95 * len(owd))], 3),
           "stdev_ms": round(statistics.pstdev(owd), 3), "pings": len(seqs), "reordered": inversions}
    print(f"  20 +- 5 ms: min {row['min_ms']}, p5 {row['p5_ms']}, median {row['median_ms']}, p95 {row['p95_ms']}, "
          f"stdev {row['stdev_ms']} ms (uniform: 2.887); {inversions} of {len(seqs)} pings 2 ms apart out of order",
          flush=True)
    return row


def loss(caps) -> dict:
    with Network(_two(5, 20, loss=0.05, reverse={"loss": 0.0}), caps=caps) as net:
        lost = ping_loss(net.host("a"), net.host("b").ip, count=2000, interval_s=0.002)
    print(f"  5% configured (one direction): {lost * 100:.2f}% of 2000 pings lost", flush=True)
    return {"configured": 0.05, "measured": round(lost, 4), "pings": 2000}


def shaping(caps, rates: list[int], seconds: float = 4.0) -> dict:
    messages = []
    for rate, delay in ((40, 1), (40, 10)):  # slower, a message would queue behind the last (50 ms idle)
        with Network(_two(delay, rate), caps=caps) as net:
            times = message_delays(net, net.host("a"), net.host("b"), size=131072, count=30)[5:]
        expected = delay + 131072 / PAYLOAD_FRACTION * 8 / (rate * 1e6) * 1000
        median = statistics.median(times)
        messages.append({"rate_mbps": rate, "one_way_ms": delay, "median_ms": round(median, 2),
                         "expected_ms": round(expected, 2)})
        print(f"  128 KiB message at {rate} Mbit/s, {delay} ms: {median:.2f} ms one-way "
              f"(delay + size/rate {expected:.2f} ms, ratio {median / expected:.2f})", flush=True)
    goodput = []
    for rate in rates:
        with Network(_two(5, rate), caps=caps) as net:
            perf = iperf3(net, net.host("a"), net.host("b"), seconds=seconds, omit_s=1)
        ratio = perf["goodput_mbps"] / (rate * PAYLOAD_FRACTION)
        goodput.append({"rate_mbps": rate, "goodput_mbps": round(perf["goodput_mbps"], 2),
                        "of_payload_rate": round(ratio, 3), "retransmits": perf["retransmits"]})
        print(f"  shaped {rate} Mbit/s: goodput {perf['goodput_mbps']:.2f} Mbit/s ({ratio:.3f} of the payload rate, "
              f"{perf['retransmits']} retransmits)", flush=True)
    return {"messages": messages, "goodput": goodput}


def runtime_change(caps) -> dict:
    with Network(_two(10, 20), caps=caps) as net:
        a, b = net.host("a"), net.host("b")
        link = net.link("a", "b")
        t0 = time.perf_counter()
        link.set(delay_ms=30, rate_mbps=10)
        set_ms = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        link.set(delay_ms=31)
        delay_ms = (time.perf_counter() - t0) * 1000
        after = min(one_way_delays(net, a, b, count=30))
        rate = iperf3(net, a, b, seconds=3, omit_s=1)["goodput_mbps"]
    row = {"set_delay_and_rate_ms": round(set_ms, 2), "set_delay_ms": round(delay_ms, 2),
           "owd_after_ms": round(after, 3), "goodput_after_mbps": round(rate, 2)}
    print(f"  set(delay 30 ms, rate 10 Mbit/s): {set_ms:.1f} ms; set(delay 31 ms): {delay_ms:.1f} ms; "
          f"then one-way min {after:.3f} ms, goodput {rate:.2f} Mbit/s", flush=True)
    return row


def temporal(caps, rate_mbps: float, turns: list[float]) -> list[dict]:
    from agents.atlas.precision import measure_turns

    rows = []
    with Network(_two(10, rate_mbps, hosts=2), caps=caps, scheduling=True) as net:
        for turn in turns:
            r = measure_turns(net, "a", "b", turn_s=turn, seconds=3.0)
            rows.append({"rate_mbps": rate_mbps, "turn_ms": turn * 1e3, "turns": r.turns,
                         "owner_share_mean": r.owner_share_mean, "owner_share_p10": r.owner_share_p10,
                         "link_utilization": r.link_utilization, "line_utilization": r.line_utilization,
                         "goodput_mbps": r.goodput_mbps})
            print(f"  {turn * 1e3:.0f} ms turns at {rate_mbps:g} Mbit/s: {r.turns} turns, owner share mean "
                  f"{r.owner_share_mean:.3f} / p10 {r.owner_share_p10:.3f}; utilization {r.link_utilization:.3f} (HTB) "
                  f"/ {r.line_utilization:.3f} (scheduler); goodput {r.goodput_mbps}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--rates", default="5,10,20,40", help="shaped goodput at these rates (Mbit/s)")
    ap.add_argument("--sched-rates", default="10,20", help="link rates for the temporal-sharing rows (Mbit/s)")
    ap.add_argument("--turns", default="10,20,50,100", help="turn lengths for the temporal-sharing rows (ms)")
    ap.add_argument("--only", default="", help="comma-separated step keys to run (default: all)")
    args = ap.parse_args()
    caps = probe()
    backends = vars(choose_backends(caps))
    results = {"how": how_it_ran(), "backends": backends}
    print(f"how: {results['how']}\nbackends: {backends}", flush=True)
    if backends["delay"] != "netem":
        sys.exit("this kernel has no netem: run it in the netem VM (testbed vm run -- python experiments/bench_netem_vm.py)")
    steps = [
        ("0. the probes' floor (0 ms link, 20 Mbit/s)", "floor", lambda: probe_floor(caps)),
        ("1. RTT error (ping)", "rtt", lambda: rtt_error(caps)),
        ("1b. one-way delay error (asymmetric link, 20 Mbit/s)", "one_way", lambda: one_way(caps)),
        ("2. jitter", "jitter", lambda: jitter(caps)),
        ("3. loss", "loss", lambda: loss(caps)),
        ("4. shaping", "shaping", lambda: shaping(caps, rates=[int(r) for r in args.rates.split(",")], seconds=4.0)),
        ("5. run-time change", "runtime_change", lambda: runtime_change(caps)),
        ("6. temporal sharing (scheduling=True)", "temporal",
         lambda: [row for r in args.sched_rates.split(",")
                  for row in temporal(caps, float(r), [int(t) / 1000 for t in args.turns.split(",")])]),
        ("7. start-up and stop", "startup", lambda: startup(caps, [(3, 8)])),
    ]
    only = set(filter(None, args.only.split(",")))
    for title, key, step in steps:
        if only and key not in only:
            continue
        print(title, flush=True)
        t0 = time.monotonic()
        results[key] = step()
        print(f"  ({time.monotonic() - t0:.0f} s)", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
