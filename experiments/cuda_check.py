"""The CUDA path, once, on a machine with an NVIDIA GPU (prints figures; not a pass/fail test).

    python3 experiments/cuda_check.py OUT_DIR [--quick]

Each step runs with its own time limit and the next runs whatever the last did, so one
short session on a borrowed GPU machine says as much as it can:

1. what the machine is: ``nvidia-smi``, torch's CUDA, ``testbed doctor``;
2. BubbleTea's serving profile on the GPU (``agents.bubbletea.profile --device cuda``):
   prefill chunk and decode step times and the training stages' device times;
3. the main job (experiments/default.yaml) with ``device: cpu`` and with ``device: cuda``
   (GPU passthrough: each worker in its namespace, ``CUDA_VISIBLE_DEVICES`` its GPU): the
   iteration time, the bubble fraction and whether the losses agree;
4. BubbleTea on the GPU (experiments/bubbletea.yaml, ``device: cuda``): prefills on the
   worker's own GPU in its bubbles, the training slowdown and the utilization;
5. NCCL inside a DC: two ranks (a DC's two DP replicas) all-reduce over NCCL on the GPUs
   there are (on one GPU NCCL refuses two ranks; the runner then uses gloo: said here).

Writes OUT_DIR/summary.json (the figures), one metrics file per run and the serving profile
(the runs' folders stay in $TMPDIR/gtb-cuda-check); the log is on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


_SUMMARY: Path | None = None


def _save(summary: dict) -> None:
    """After every step: a check cut short still leaves what it measured."""
    if _SUMMARY is not None:
        _SUMMARY.write_text(json.dumps(summary, indent=1, default=str) + "\n")


def _step(name: str, argv: list[str], timeout: float, summary: dict, **kw) -> subprocess.CompletedProcess | None:
    _save(summary)
    print(f"\n=== {name}: {' '.join(argv)} (limit {timeout:.0f} s)", flush=True)
    t0 = time.monotonic()
    try:
        r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        print(out[-3000:])
        summary["steps"][name] = {"rc": "timeout", "s": round(time.monotonic() - t0, 1)}
        return None
    except OSError as exc:  # the program is not there
        print(exc)
        summary["steps"][name] = {"rc": "missing", "error": str(exc)}
        return None
    print(r.stdout[-4000:], r.stderr[-4000:], sep="\n", flush=True)
    summary["steps"][name] = {"rc": r.returncode, "s": round(time.monotonic() - t0, 1)}
    if r.returncode != 0:
        summary["steps"][name]["error"] = (r.stderr.strip().splitlines() or [""])[-1][-300:]
    return r


def _experiment(src: str, device: str, work: Path, iterations: int | None) -> Path:
    data = yaml.safe_load((REPO / src).read_text())
    data["device"] = device
    data["name"] = f"{data['name']}-{device}"
    if iterations:
        data["training"]["iterations"] = iterations
    path = work / f"{Path(src).stem}-{device}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(name: str, src: str, device: str, out: Path, summary: dict, timeout: float, iterations: int | None) -> dict:
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "gtb-cuda-check"
    work.mkdir(exist_ok=True)
    exp = _experiment(src, device, work, iterations)
    folder = work / f"run-{name}"
    _step(name, [PY, "-m", "testbed.cli", "run", str(exp), "--out", str(folder)], timeout, summary)
    metrics = folder / "metrics.json"
    if not metrics.exists():
        return {}
    shutil.copy(metrics, out / f"metrics-{name}.json")
    m = json.loads(metrics.read_text())
    s = m["summary"]
    fig = {k: s.get(k) for k in ("mean_iteration_time_s", "bubble_fraction", "final_loss", "tokens_per_s",
                                 "warnings", "training_slowdown_interleaved", "iteration_time_served_s",
                                 "iteration_time_unserved_s", "utilization_with_prefill",
                                 "utilization_without_prefill", "prefill_share_of_device_time",
                                 "bubble_time_filled", "requests_arrived", "requests_completed", "ttft_p50_s",
                                 "ttft_p99_s") if k in s}
    fig["losses"] = [it["loss"] for it in m["iterations"]]
    fig["device"] = m.get("device")
    fig["workers_devices"] = sorted({w.get("device") for w in m["workers"].values()})
    summary["runs"][name] = fig
    _save(summary)
    return fig


_NCCL = r"""
import os, sys, torch, torch.distributed as dist
rank, world = int(sys.argv[1]), int(sys.argv[2])
gpus = torch.cuda.device_count()
torch.cuda.set_device(rank % gpus)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=world)
x = torch.full((1 << 20,), float(rank + 1), device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
print(f"rank {rank} on cuda:{rank % gpus}: all_reduce sum {x[0].item()} (expected {world * (world + 1) / 2})")
dist.destroy_process_group()
"""


def _nccl(summary: dict) -> None:
    print("\n=== nccl: two ranks, one per DP replica, on the GPUs there are", flush=True)
    procs = [subprocess.Popen([PY, "-c", _NCCL, str(r), "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(timed out)")
    text = "\n".join(outs)
    print(text[-3000:])
    errs = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln or "Duplicate" in ln]
    summary["nccl"] = {"rc": [p.returncode for p in procs], "said": (errs[-1][-300:] if errs else
                       [ln for ln in text.splitlines() if ln.startswith("rank")])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer profile repeats and iterations")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    global _SUMMARY
    _SUMMARY = out / "summary.json"
    summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "steps": {}, "runs": {}}
    r = _step("nvidia-smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
              30, summary)
    summary["gpu"] = r.stdout.strip() if r and r.returncode == 0 else None
    r = _step("torch", [PY, "-c", "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(),"
                        " torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"],
              60, summary)
    summary["torch"] = r.stdout.strip() if r else None
    r = _step("doctor", [PY, "-m", "testbed.cli", "doctor"], 60, summary)
    summary["doctor"] = r.stdout.strip().splitlines()[-40:] if r else None
    _step("profile-cuda", [PY, "-m", "agents.bubbletea.profile", "experiments/bubbletea.yaml", "--device", "cuda",
                           "--repeats", "3" if args.quick else "5", "--out", str(out / "serving-profile-cuda.json")],
          150, summary)
    prof = out / "serving-profile-cuda.json"
    if prof.exists():
        p = json.loads(prof.read_text())
        summary["profile"] = {k: p.get(k) for k in ("device", "took_s", "training")}
    its = 8 if args.quick else None
    gpu = _run("default-cuda", "experiments/default.yaml", "cuda", out, summary, 180, its)
    _run("bubbletea-cuda", "experiments/bubbletea.yaml", "cuda", out, summary, 240, None)
    cpu = _run("default-cpu", "experiments/default.yaml", "cpu", out, summary, 120, its)
    if cpu.get("losses") and gpu.get("losses"):
        diff = max(abs(a - b) / max(abs(a), 1e-9) for a, b in zip(cpu["losses"], gpu["losses"]))
        summary["losses_cpu_vs_cuda_max_rel_diff"] = diff
        if cpu.get("mean_iteration_time_s") and gpu.get("mean_iteration_time_s"):
            summary["iteration_time_cuda_over_cpu"] = gpu["mean_iteration_time_s"] / cpu["mean_iteration_time_s"]
    _nccl(summary)
    _save(summary)
    print("\n=== summary\n" + json.dumps(summary, indent=1, default=str)[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
