"""Benchmark of emulated devices: how many GPU-like workers this machine holds (prints figures).

    .venv/bin/python experiments/bench_emulated.py [--cases 6x3,16x4,32x4,64x4,64x8] [--json OUT]
                                                   [--time-dilation K]

Each case ``NxK`` is N emulated devices over K DCs: one pipeline stage per DC (P = K) and
N / K data-parallel pipelines, 1F1B, 8 microbatches of one sequence, one TCP connection per
transfer, on a
chain of WAN links (DC i to DC i+1: 10 ms one-way, min(100, 100 / (K - 1)) Mbit/s: the
rates are scaled so that all the gateways' userspace delay lines together carry at most
200 Mbit/s, about half a core: with many flows the line costs ~0.25 cores per 100 Mbit/s,
and a saturated machine delays every emulated op).  Microbatches of one sequence (32 KiB
messages) keep iterations short.  Device times come from the simulator's FLOPs model of a
6-layer, 128-wide GPT at 0.0125 TFLOP/s (a forward of one microbatch: ~10 ms).  Per case it
prints: start-up (from the call to the go: network, WAN check, workers ready), the mean
iteration time, the per-op timing error (median of the worst worker, and its 99th
percentile), resident memory per worker (mean and max, sampled mid-run), the memory the
whole run holds (MemAvailable drop) and the cores the machine was busy for during training
(/proc/stat), and the simulator's iteration time for the same experiment (its default, fair
sharing, and with the TCP the window-sized messages meet: fifo-bursts and the window model).  Under
``--time-dilation K`` every figure is in emulated terms (the op error too: the wall clock's
divided by K).  Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed import messages as m  # noqa: E402
from testbed.spec.experiment import load_experiment  # noqa: E402
from testbed.run.runner import TrainingRun  # noqa: E402


def _topology(tmp: Path, dcs: int, hosts: int) -> Path:
    names = [f"dc{i + 1}" for i in range(dcs)]
    data = {"name": f"chain{dcs}x{hosts}", "dcs": [{"name": n, "hosts": hosts} for n in names],
            "wan": [{"a": a, "b": b, "delay_ms": 10, "rate_mbps": round(min(100.0, 100.0 / (dcs - 1)), 1)}
                    for a, b in zip(names, names[1:])]}
    path = tmp / f"chain{dcs}x{hosts}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _experiment(tmp: Path, devices: int, dcs: int, iterations: int, k: float = 1.0) -> Path:
    replicas = devices // dcs
    data = {"name": f"emulated-{devices}x{dcs}", "topology": str(_topology(tmp, dcs, replicas)), "time_dilation": k,
            "model": {"layers": max(6, dcs), "hidden": 128, "heads": 4, "seq_len": 64},
            "training": {"iterations": iterations, "microbatches": 8, "microbatch_size": 1, "seed": 1},
            "parallel": {"stages": dcs, "replicas": replicas, "schedule": "1f1b", "connections": 1},
            "device": "emulated", "sim": {"device_tflops": 0.0125, "efficiency": 0.5}}
    path = tmp / f"exp-{devices}x{dcs}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _busy_jiffies() -> tuple[int, int]:
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _mem_available_kb() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def _rss_kb(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_case(tmp: Path, devices: int, dcs: int, iterations: int, k: float = 1.0) -> dict:
    exp = load_experiment(_experiment(tmp, devices, dcs, iterations, k))
    out = tmp / f"out-{devices}x{dcs}"
    run = TrainingRun(exp, out)
    sample: dict = {}
    mem0 = _mem_available_kb()

    def watch(worker: str, msg: m.Message) -> None:
        if isinstance(msg, m.Events) and msg.iteration_done and msg.it == 2 and "rss" not in sample:
            pids = [p for n, p in run.pids().items() if n in run.workers]
            sample["rss"] = [_rss_kb(p) for p in pids]
            sample["mem"] = mem0 - _mem_available_kb()
            sample["cpu0"] = _busy_jiffies()
            sample["t0"] = time.monotonic()

    run.subscribe(watch)
    t0 = time.monotonic()
    result = run.run()
    t_end = time.monotonic()
    busy1, total1 = _busy_jiffies()
    busy0, total0 = sample["cpu0"]
    cores = (os.cpu_count() or 1) * (busy1 - busy0) / max(1, total1 - total0)
    s, timing = result["summary"], result["device"]["op_timing"]
    rss = sample["rss"]
    from testbed.results import metrics
    from testbed.sim.build import simulate
    from testbed.sim.device import stage_times

    times, latency = stage_times(exp)
    predicted = metrics.summarise(simulate(exp, stage_times=times, message_overhead_s=latency)).summary
    # and with the TCP the many window-sized messages meet (issue #30): a drop-tail FIFO serves
    # them in order (sim.sharing: fifo-bursts) and Linux's windows restart after an idle RTO
    tcp = exp.model_copy(deep=True)
    tcp._origin, tcp._topo, tcp._topo_file, tcp._slots = exp._origin, exp._topo, exp._topo_file, exp._slots
    tcp.sim.sharing, tcp.sim.tcp_window_model = "fifo-bursts", True
    predicted_tcp = metrics.summarise(simulate(tcp, stage_times=times, message_overhead_s=latency)).summary
    row = {"devices": devices, "dcs": dcs, "pipelines": devices // dcs, "time_dilation": k,
           "startup_s": round(run.go_time - t0, 2), "iteration_s": s["mean_iteration_time_s"],
           "simulated_iteration_s": predicted.mean_iteration_time_s,
           "simulated_fifo_window_s": predicted_tcp.mean_iteration_time_s,
           # in emulated microseconds: the wall clock's error / k
           "op_error_median_us": round(timing["median_us_worst_worker"] / k, 2),
           "op_error_p99_us": round(timing["p99_us_worst_worker"] / k, 2),
           "rss_mean_mb": round(sum(rss) / len(rss) / 1024, 1), "rss_max_mb": round(max(rss) / 1024, 1),
           "run_memory_mb": round(sample["mem"] / 1024), "cores_busy": round(cores, 2),
           "wall_s": round(t_end - t0, 1), "warnings": s["warnings"]}
    print(f"  {devices:>3} devices / {dcs} DCs ({devices // dcs} pipelines a link), k={k:g}: start-up "
          f"{row['startup_s']:.1f} s, {row['iteration_s']:.3f} s/iteration (simulated "
          f"{row['simulated_iteration_s']:.3f}; fifo-bursts + window model {row['simulated_fifo_window_s']:.3f}), op error median {row['op_error_median_us']} us "
          f"(p99 {row['op_error_p99_us']} us), RSS {row['rss_mean_mb']} MB/worker (max {row['rss_max_mb']}), "
          f"run {row['run_memory_mb']} MB, {row['cores_busy']} cores busy", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="6x3,16x4,32x4,64x4,64x8")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--time-dilation", type=float, default=1.0, help="k: figures in emulated terms")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for case in args.cases.split(","):
            n, k = (int(x) for x in case.split("x"))
            rows.append(run_case(Path(d), n, k, args.iterations, args.time_dilation))
    info = {"machine": {"cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}, "cases": rows}
    if args.json:
        args.json.write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
