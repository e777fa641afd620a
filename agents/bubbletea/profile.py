"""Profile BubbleTea's device times on this machine: the numbers an emulated device replays.

How it fits: with ``device: emulated`` a prefill server and a decode worker compute nothing;
they occupy their emulated device (``testbed/train/device.py``) for the time the real model
takes, which this script measures once and writes as JSON to ``agents/bubbletea/data/``
(``timing.py`` reads it, without torch).  It runs the real inference model of
``inference.py`` (the experiment's ``bubbletea.model``) and the training job's own stages
(``testbed/train/model.py``) on one device, here one CPU core with one torch thread (or a
GPU with ``--device cuda``), so that training and serving times come from the same device:

* ``prefill``: one chunk of ``n`` prompt tokens after ``start`` tokens already in the cache
  (``prefill_chunk``), on a grid of ``n`` and ``start``; the median of ``--repeats``;
* ``decode``: one step of ``decode_batch`` for a batch of ``b`` caches of context ``c``
  ((time of 9 steps - time of none) / 8), and the batch's set-up (the padded copy);
* ``kv_bytes``: what ``pack`` puts on the wire for a prompt of ``T`` tokens (fitted a + b T);
* ``training``: forward, backward and optimizer step of each pipeline stage for one
  microbatch of the experiment (the emulated experiment's ``sim.stage_times`` quote them).

The file records when, where and how it was measured (CPU model, torch version, threads,
the machine's load before and after).  Run it on a quiet machine:

    python -m agents.bubbletea.profile experiments/bubbletea.yaml [--device cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
PREFILL_N = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PREFILL_START = (0, 16, 32, 64, 128, 192, 256, 320, 384, 448, 496)
DECODE_BATCH = (1, 2, 4, 8, 16)
DECODE_CONTEXT = (16, 64, 128, 256, 384, 496)
KV_TOKENS = (1, 16, 64, 128, 256, 512)


def default_path(device: str = "cpu") -> Path:
    return DATA / f"serving-profile-{device}.json"


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _median_time(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(exp_path: str, device: str = "cpu", repeats: int = 9) -> dict:
    import torch

    from agents.bubbletea.inference import (PrefillState, decode_batch, load_model, pack, prefill_chunk,
                                           prompt_tokens, unpack)
    from testbed.train.model import ModelConfig, build_model, loss_fn, stage_module
    from testbed.spec.experiment import load_experiment

    exp = load_experiment(exp_path)
    torch.set_num_threads(1)
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    m = exp.bubbletea.model
    model = load_model(m.layers, m.hidden, m.heads, m.max_context).to(dev)
    load_before = os.getloadavg()
    t_start = time.time()

    # prefill: n tokens after `start` cached
    prefill = []
    for start in PREFILL_START:
        for n in PREFILL_N:
            if start + n > m.max_context:
                continue
            tokens = prompt_tokens(start, start + n).to(dev)
            base = PrefillState(tokens)
            if start:
                prefill_chunk(model, base, start)

            def one(base=base, tokens=tokens, n=n, start=start):
                st = PrefillState(tokens, start, list(base.keys), list(base.values))
                prefill_chunk(model, st, n)

            one()  # warm
            prefill.append([n, start, _median_time(one, repeats, sync)])

    # decode: per step and batch, at a context
    decode, setup = [], []
    for b in DECODE_BATCH:
        for c in DECODE_CONTEXT:
            if c + 9 > m.max_context:
                continue
            caches = []
            for j in range(b):
                st = PrefillState(prompt_tokens(10_000 + j, c).to(dev))
                prefill_chunk(model, st, c)
                caches.append({"keys": st.keys, "values": st.values, "logits": st.logits})
            t1 = _median_time(lambda: decode_batch(model, caches, [1] * b), repeats, sync)
            t9 = _median_time(lambda: decode_batch(model, caches, [9] * b), repeats, sync)
            decode.append([b, c + 4, max(0.0, (t9 - t1) / 8)])  # the 8 steps' mean context
            setup.append([b, c, t1])

    # KV caches on the wire, and the time to pack / unpack them (host side)
    kv, pack_s, unpack_s = [], [], []
    for n in KV_TOKENS:
        st = PrefillState(prompt_tokens(20_000 + n, n).to(dev))
        prefill_chunk(model, st, n)
        blob = pack(st)
        kv.append([n, len(blob)])
        pack_s.append([n, _median_time(lambda: pack(st), repeats, sync)])
        unpack_s.append([n, _median_time(lambda: unpack(blob), repeats, sync)])
    a, b = _line(kv)

    # the training job's stages, one microbatch, on the same device
    mcfg = ModelConfig(**exp.model.model_dump())
    full = build_model(mcfg, exp.training.seed)
    mb, seq = exp.training.microbatch_size, exp.model.seq_len
    training = []
    for s in range(exp.parallel.stages):
        stage = stage_module(full, s, exp.parallel.stages).to(dev)
        opt = torch.optim.AdamW(stage.parameters(), lr=exp.training.lr, weight_decay=0.0)
        first, last = s == 0, s == exp.parallel.stages - 1
        targets = torch.randint(0, 256, (mb, seq), device=dev)
        held = {}

        def forward():
            x = torch.randint(0, 256, (mb, seq), device=dev) if first else \
                torch.randn(mb, seq, mcfg.hidden, device=dev, requires_grad=True)
            out = stage(x)
            held["out"] = loss_fn(out, targets) if last else out

        def backward():
            out = held["out"]
            out.backward() if last else out.backward(torch.randn_like(out))

        def fwd_bwd():
            forward()
            backward()

        fwd_bwd()
        f = _median_time(forward, repeats, sync)
        fb = _median_time(fwd_bwd, repeats, sync)
        o = _median_time(lambda: (opt.step(), opt.zero_grad(set_to_none=False)), repeats, sync)
        training.append({"stage": s, "forward_s": round(f, 7), "backward_s": round(max(0.0, fb - f), 7),
                         "optimizer_s": round(o, 7)})

    return {
        "what": "BubbleTea's device times on one device: prefill chunks, decode steps, KV cache bytes, and the "
                "training job's stages (agents/bubbletea/profile.py)",
        "measured": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t_start)),
        "took_s": round(time.time() - t_start, 1),
        "command": "python -m agents.bubbletea.profile " + " ".join(sys.argv[1:]),
        "device": {"kind": dev.type, "name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_model(),
                   "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                   "cpus_online": os.cpu_count(), "load_before": [round(x, 2) for x in load_before],
                   "load_after": [round(x, 2) for x in os.getloadavg()]},
        "method": f"median of {repeats} runs per point after one warm-up; decode step = (9 steps - none) / 8 at "
                  "the steps' mean context",
        "experiment": exp_path,
        "model": m.model_dump(),
        "training_model": exp.model.model_dump() | {"microbatch_size": mb, "stages": exp.parallel.stages},
        "prefill": {"columns": ["tokens", "start", "seconds"], "points": [[n, s, round(t, 7)] for n, s, t in prefill]},
        "decode_step": {"columns": ["batch", "context", "seconds"],
                        "points": [[b_, c, round(t, 7)] for b_, c, t in decode]},
        "decode_setup": {"columns": ["batch", "context", "seconds"],
                         "points": [[b_, c, round(t, 7)] for b_, c, t in setup]},
        "kv_bytes": {"columns": ["tokens", "bytes"], "points": kv, "fit": [round(a, 1), round(b, 3)],
                     "raw_bytes_per_token": 2 * m.layers * m.hidden * 4},
        "pack_s": [[n, round(t, 7)] for n, t in pack_s],
        "unpack_s": [[n, round(t, 7)] for n, t in unpack_s],
        "training": training,
    }


def _line(points: list) -> tuple[float, float]:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", nargs="?", default="experiments/bubbletea.yaml")
    ap.add_argument("--device", default="cpu", help="cpu (one core, one thread) or cuda")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None, help="default agents/bubbletea/data/serving-profile-DEVICE.json")
    args = ap.parse_args()
    result = measure(args.experiment, args.device, args.repeats)
    out = Path(args.out) if args.out else default_path(args.device.split(":")[0])
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} ({len(result['prefill']['points'])} prefill points, "
          f"{len(result['decode_step']['points'])} decode points, {result['took_s']} s); "
          f"load {result['device']['load_before'][0]} -> {result['device']['load_after'][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
