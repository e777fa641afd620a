"""Time dilation, measured: what k buys on this machine, and what it leaves wrong.

Three sections (``--only`` picks one), each printed as it goes and written to
``results/bench_dilation.json``:

* ``run``: the same emulated-device experiment (tests/test_time_dilation.py's) at k = 1, 4
  and 10: mean and median steady iteration time, bubble fraction and the bytes on the WAN in
  emulated terms; the host's share, as CPU seconds the whole machine spent (``/proc/stat``,
  busy jiffies over both cores) per emulated second of training; the emulated devices' op
  error (median and p99 of the worst worker, in emulated microseconds).
* ``tcp``: one TCP flow over the same emulated link at k = 1 and 10: a 1 MiB message after
  idle (slow start from the initial window), the steady goodput of an unclamped CUBIC flow
  through a one-BDP queue (losses, then CUBIC's regrowth), and the goodput of the same flow
  with 1% random loss (loss recovery, RTO floors).  In emulated terms: where they differ,
  Linux's TCP has a clock of its own that dilation does not stretch.
* ``fidelity``: ``testbed fidelity aws-us3-real --time-dilation 10`` (the AWS matrix at its
  real rates, 790-1120 Mbit/s, which this machine's delay lines cannot carry at k = 1).

Run as root: ``python experiments/bench_dilation.py [--only run|tcp|fidelity] [--ks 1,4,10]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from testbed.net.fidelity import iperf3, message_delays  # noqa: E402
from testbed.net.network import Network  # noqa: E402
from testbed.spec.topology import parse_topology  # noqa: E402


def _busy_seconds() -> float:
    """CPU seconds the machine has spent busy (all cores), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / 100.0


def run_section(ks: list[float], repeats: int) -> list[dict]:
    from test_time_dilation import _experiment

    from testbed.run.runner import TrainingRun
    from testbed.spec.experiment import parse_experiment

    rows = []
    with tempfile.TemporaryDirectory(prefix="gtb-dil-") as tmp_name:  # the runs' outputs: read here, then removed
        tmp = Path(tmp_name)
        for rep in range(repeats):
            for k in ks:
                exp = parse_experiment(_experiment(tmp, k, training={"iterations": 9, "warmup_iterations": 2,
                                                                     "microbatches": 4, "microbatch_size": 4,
                                                                     "seed": 3}), "bench")
                out = tmp / f"k{k:g}-{rep}"
                c0, t0 = _busy_seconds(), time.monotonic()
                s = TrainingRun(exp, out).run()
                wall, cpu = time.monotonic() - t0, _busy_seconds() - c0
                steady = set(s["summary"]["steady_state_iterations"])
                its = [it["time_s"] for it in s["iterations"] if it["iteration"] in steady]
                trained = sum(it["time_s"] for it in s["iterations"])  # emulated seconds of training
                trace = json.loads((out / "timeline.json").read_text())["traceEvents"]
                wan = sum(x["args"]["bytes"] for x in trace if x.get("cat") in ("xfer_act", "xfer_grad"))
                timing = s["device"]["op_timing"]
                row = {"k": k, "repeat": rep, "mean_iteration_s": s["summary"]["mean_iteration_time_s"],
                       "median_iteration_s": round(statistics.median(its), 6),
                       "bubble_fraction": s["summary"]["bubble_fraction"], "wan_bytes": wan,
                       "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                       "cpu_s_per_emulated_s_whole_run": round(cpu / (wall / k), 3),
                       "emulated_training_s": round(trained, 3),
                       "op_error_median_us": round(timing["median_us_worst_worker"] / k, 2),
                       "op_error_p99_us": round(timing["p99_us_worst_worker"] / k, 2),
                       "tcp_timeouts": s["summary"].get("tcp_timeouts")}
                rows.append(row)
                print(f"  k={k:g} #{rep}: iteration mean {row['mean_iteration_s']:.4f} s, median "
                      f"{row['median_iteration_s']:.4f} s, bubbles {row['bubble_fraction']:.3f}, WAN {wan} B, "
                      f"{row['cpu_s_per_emulated_s_whole_run']:.2f} CPU-s per emulated s, op error median "
                      f"{row['op_error_median_us']} us p99 {row['op_error_p99_us']} us (emulated)", flush=True)
    return rows


def _link(k: float, loss: float = 0.0):
    topo = parse_topology({"name": "dil-tcp", "dcs": [{"name": "a", "hosts": 1}, {"name": "b", "hosts": 1}],
                           "wan": [{"a": "a", "b": "b", "delay_ms": 25, "rate_mbps": 40, "loss": loss}]})
    return Network(topo, time_dilation=k)


def tcp_section(ks: list[float]) -> list[dict]:
    rows = []
    for k in ks:
        with _link(k) as net:
            a, b = net.host("a"), net.host("b")
            msg = message_delays(net, a, b, size=1 << 20, count=5, interval_s=1.0 * k)
            bulk = iperf3(net, a, b, seconds=10 * k, omit_s=2 * k)
        with _link(k, loss=0.01) as net:
            lossy = iperf3(net, net.host("a"), net.host("b"), seconds=10 * k, omit_s=2 * k)
        row = {"k": k, "message_1mib_after_idle_ms": round(statistics.median(msg) / k, 2),
               "bulk_goodput_mbps": round(bulk["goodput_mbps"] * k, 2), "bulk_retransmits": bulk["retransmits"],
               "lossy_goodput_mbps": round(lossy["goodput_mbps"] * k, 2), "lossy_retransmits": lossy["retransmits"]}
        rows.append(row)
        print(f"  k={k:g}: 1 MiB after idle {row['message_1mib_after_idle_ms']} ms; bulk CUBIC "
              f"{row['bulk_goodput_mbps']} Mbit/s ({bulk['retransmits']} retransmits); 1% loss "
              f"{row['lossy_goodput_mbps']} Mbit/s (emulated terms)", flush=True)
    return rows


def fidelity_section(k: float) -> list[dict]:
    res = subprocess.run([sys.executable, "-m", "testbed.cli", "fidelity", "aws-us3-real", "--time-dilation", f"{k:g}",
                          "--json"], capture_output=True, text=True, cwd=REPO)
    rows = json.loads(res.stdout[res.stdout.index("["):])
    for r in rows:
        print(f"  {r['src']} -> {r['dst']}: RTT {r['rtt_ms_configured']} / {r['rtt_ms_measured']} ms, goodput "
              f"{r['goodput_mbps_measured']} of {r['rate_mbps_configured']} Mbit/s ({r['goodput_ratio']}), "
              f"ok {r['ok']}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["run", "tcp", "fidelity"])
    ap.add_argument("--ks", default="1,4,10", help="time dilations for the run section")
    ap.add_argument("--repeats", type=int, default=2, help="runs per k in the run section")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench_dilation.json")
    args = ap.parse_args()
    ks = [float(x) for x in args.ks.split(",")]
    results: dict = {"machine": subprocess.run(["uname", "-n"], capture_output=True, text=True).stdout.strip(),
                     "date": time.strftime("%Y-%m-%d %H:%M")}
    if args.only in (None, "run"):
        print("1. the same emulated-device run at each k", flush=True)
        results["run"] = run_section(ks, args.repeats)
    if args.only in (None, "tcp"):
        print("2. one TCP flow at k = 1 and 10", flush=True)
        results["tcp"] = tcp_section([1.0, 10.0])
    if args.only in (None, "fidelity"):
        print("3. testbed fidelity aws-us3-real --time-dilation 10", flush=True)
        results["fidelity"] = fidelity_section(10.0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
