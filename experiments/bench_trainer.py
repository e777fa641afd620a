"""Benchmark of the trainer (prints figures; not a pass/fail test).

    .venv/bin/python experiments/bench_trainer.py [--json OUT.json]

1. Iteration time and bubble fraction versus WAN one-way delay (1, 10, 25, 50 ms):
   P=2 across two DCs, 1F1B, 8 microbatches.
2. The same versus TCP connections per transfer (1, 2, 4, 8) on a bandwidth-bound
   100 Mbit/s, 50 ms link with 1 MiB activations (TCP restarts slow start after idle, so
   each transfer ramps up again: N connections ramp N times faster).
3. The trainer's own overhead: P=1 on one unlimited host against the same model trained
   in one plain process (same microbatches, one thread).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from testbed.spec.experiment import parse_experiment  # noqa: E402
from testbed.run.runner import TrainingRun  # noqa: E402

TMP = Path(tempfile.mkdtemp(prefix="gtb-bench-"))


def _topology(delay_ms: float, rate_mbps: float, cpus: float, dcs: int = 2) -> str:
    names = [f"dc{i + 1}" for i in range(dcs)]
    data = {"name": f"bench-{delay_ms}-{rate_mbps}", "dcs": [{"name": n, "hosts": 1, "host": {"cpus": cpus}} for n in names],
            "wan": [{"a": a, "b": b, "delay_ms": delay_ms, "rate_mbps": rate_mbps}
                    for i, a in enumerate(names) for b in names[i + 1:]]}
    path = TMP / f"topo-{delay_ms}-{rate_mbps}-{cpus}-{dcs}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _run(topology: str, model: dict, stages: int, microbatches: int, mb_size: int, connections: int,
         iterations: int = 6) -> dict:
    exp = parse_experiment({
        "name": "bench", "topology": topology, "model": model,
        "training": {"iterations": iterations, "microbatches": microbatches, "microbatch_size": mb_size, "seed": 1},
        "parallel": {"stages": stages, "replicas": 1, "schedule": "1f1b", "connections": connections},
    }, "bench")
    result = TrainingRun(exp, TMP / f"run-{time.monotonic_ns()}").run()
    return result["summary"]


def versus_delay() -> list[dict]:
    model = {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 64}
    rows = []
    for delay in (1, 10, 25, 50):
        s = _run(_topology(delay, 200, 0.6), model, 2, 8, 4, 4)
        rows.append({"one_way_ms": delay, "iteration_s": s["mean_iteration_time_s"],
                     "bubble_fraction": s["bubble_fraction"]})
        print(f"  {delay:>3} ms: {s['mean_iteration_time_s']:.3f} s/iteration, bubbles {s['bubble_fraction']:.1%}",
              flush=True)
    return rows


def versus_connections() -> list[dict]:
    model = {"layers": 4, "hidden": 256, "heads": 4, "seq_len": 128}  # 8 x 128 x 256 x 4 B = 1 MiB per activation
    rows = []
    for n in (1, 2, 4, 8):
        s = _run(_topology(50, 100, 0.6), model, 2, 4, 8, n)
        rows.append({"connections": n, "iteration_s": s["mean_iteration_time_s"], "bubble_fraction": s["bubble_fraction"]})
        print(f"  N={n}: {s['mean_iteration_time_s']:.3f} s/iteration, bubbles {s['bubble_fraction']:.1%}", flush=True)
    return rows


def overhead() -> dict:
    import torch

    from testbed.train.data import Corpus
    from testbed.train.model import ModelConfig, build_model, loss_fn, stage_module

    model = {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 64}
    iterations, m, size = 6, 8, 4
    s = _run(_topology(0, 10_000, 0.0, dcs=1), model, 1, m, size, 1, iterations=iterations)
    torch.set_num_threads(1)
    net = stage_module(build_model(ModelConfig(**model), 1), 0, 1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    corpus = Corpus()
    times = []
    for it in range(iterations):
        t0 = time.perf_counter()
        for i in range(m):
            x, y = corpus.batch(1, it, 0, i, 1, m, size, model["seq_len"])
            (loss_fn(net(x), y) / m).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    plain = sum(times[2:]) / len(times[2:])
    out = {"worker_iteration_s": s["mean_iteration_time_s"], "plain_process_iteration_s": round(plain, 6),
           "overhead": round(s["mean_iteration_time_s"] / plain - 1, 4), "worker_busy_fraction": s["mean_busy_fraction"]}
    print(f"  one worker: {out['worker_iteration_s']:.4f} s/iteration (busy {s['mean_busy_fraction']:.1%}); "
          f"plain process: {plain:.4f} s; overhead {out['overhead']:+.1%}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = {}
    print("1. iteration time and bubbles vs WAN one-way delay (P=2, 1F1B, 8 microbatches, 200 Mbit/s, N=4)")
    results["delay"] = versus_delay()
    print("2. vs TCP connections per transfer (100 Mbit/s, 50 ms one-way, 1 MiB activations)")
    results["connections"] = versus_connections()
    print("3. trainer overhead against a plain single process")
    results["overhead"] = overhead()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
