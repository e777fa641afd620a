"""The device kinds the core ships: ``cpu``, ``cuda``, ``emulated`` and ``auto``.

How it fits: a device kind is a plug-in of the extension registry like any other
(``testbed.extension.DeviceKind``; this module's ``EXTENSION`` is declared under the
``testbed.extensions`` entry points as ``devices``, and a third party's package may add a
kind the same way).  An experiment's ``device: NAME`` names one; ``TrainingRun`` makes one
per run (``kind(exp)``) and asks it, in order:

* ``check()`` before anything is built (an emulated device's profile is read here, so a bad
  one fails with nothing made);
* ``plan(site, count, warn)``: one device label per worker (``cpu``, ``cuda:1``, ``emulated``);
* ``configure(run, worker, cfg, env)`` per worker: its CPU quota, environment and what its
  config says of its device (``cfg.compute``: the worker's compute, loaded by the worker);
* ``dp_backend(labels)``: how a stage's replicas all-reduce;
* ``describe(run)``: the ``device`` section of the run's record (metrics.json).

``auto`` picks ``cuda`` where torch can use a GPU and ``cpu`` otherwise, and says so, loudly,
where an NVIDIA GPU is present that torch cannot use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from testbed.extension import DeviceKind, Extension, ExtensionError

_TORCH = "testbed.train.torch_compute:TorchCompute"


def detect_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def cuda_problem() -> str | None:
    """Why torch cannot use a GPU here, in words (None when it can)."""
    try:
        import torch
    except Exception as exc:
        return f"torch cannot be imported ({type(exc).__name__}: {exc})"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    try:
        torch.cuda.init()
    except Exception as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        return f"CUDA does not initialise: {lines[0] if lines else type(exc).__name__}"
    if torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return "torch sees no CUDA device" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
    return None


def nvidia_pci_devices(root: str | Path = "/sys/bus/pci/devices") -> list[str]:
    """PCI addresses of NVIDIA display or 3D controllers on this machine (vendor 0x10de,
    class 0x03xxxx), whether or not a driver is bound."""
    found = []
    try:
        entries = sorted(Path(root).iterdir())
    except OSError:
        return []
    for dev in entries:
        try:
            vendor = (dev / "vendor").read_text().strip().lower()
            cls = (dev / "class").read_text().strip().lower()
        except OSError:
            continue
        if vendor == "0x10de" and cls.startswith("0x03"):
            found.append(dev.name)
    return found


class CpuDevice(DeviceKind):
    """The stand-in for one device per worker: a CPU container (the host's ``cpus`` quota)."""

    name = "cpu"

    def plan(self, site: Any, count: int, warn: Callable[[str], None]) -> list[str]:
        return ["cpu"] * count

    def configure(self, run: Any, worker: Any, cfg: Any, env: dict[str, str]) -> float:
        cfg.compute, cfg.device = _TORCH, "cpu"
        return run.exp.topo.dc(worker.slot.dc).host.cpus


class CudaDevice(DeviceKind):
    """A GPU per worker, shared round-robin when there are fewer GPUs than workers."""

    name = "cuda"

    def plan(self, site: Any, count: int, warn: Callable[[str], None]) -> list[str]:
        gpus = site.gpus()
        if gpus == 0:
            raise ExtensionError(f"device: cuda asked for, but torch cannot use a GPU here: {cuda_problem() or 'no GPU'}")
        if gpus < count:
            warn(f"{gpus} GPU(s) for {count} workers: GPUs are shared round-robin")
        return [f"cuda:{i % gpus}" for i in range(count)]

    def configure(self, run: Any, worker: Any, cfg: Any, env: dict[str, str]) -> float:
        env["CUDA_VISIBLE_DEVICES"] = worker.record.device.split(":")[1]
        cfg.compute, cfg.device = _TORCH, "cuda:0"
        return 0.0

    def dp_backend(self, labels: list[str]) -> str:
        return "nccl" if len(set(labels)) == len(labels) else "gloo"  # NCCL wants a GPU per rank


class AutoDevice(DeviceKind):
    """``cuda`` where torch can use a GPU, ``cpu`` otherwise."""

    name = "auto"

    def __init__(self, exp: Any):
        super().__init__(exp)
        self._chosen: DeviceKind = CpuDevice(exp)

    def plan(self, site: Any, count: int, warn: Callable[[str], None]) -> list[str]:
        if site.gpus() > 0:
            self._chosen = CudaDevice(self.exp)
        else:
            nvidia = nvidia_pci_devices()
            if nvidia:  # a GPU is there and will not be used: say so, loudly, in metrics.json too
                warn(f"device: auto: an NVIDIA GPU is present (PCI {', '.join(nvidia)}) but torch cannot use it "
                     f"({cuda_problem() or 'no CUDA device'}): the workers run in CPU containers")
        return self._chosen.plan(site, count, warn)

    def configure(self, run: Any, worker: Any, cfg: Any, env: dict[str, str]) -> float:
        return self._chosen.configure(run, worker, cfg, env)

    def dp_backend(self, labels: list[str]) -> str:
        return self._chosen.dp_backend(labels)


class EmulatedDevice(DeviceKind):
    """Device time from a profile (``testbed.sim.device``), the network real: each worker gets a
    device stream (a file its co-tenants share, ``testbed.train.device``) and its stage's op
    times; no model is computed."""

    name = "emulated"
    computes_model = False
    profiled = True
    dilates = True  # under time dilation k every op time and the message latency are k times longer

    def check(self) -> None:
        from testbed.sim.device import device_profile

        self.profile = device_profile(self.exp)  # SpecError (one line) on a bad profile

    def plan(self, site: Any, count: int, warn: Callable[[str], None]) -> list[str]:
        return ["emulated"] * count

    def configure(self, run: Any, worker: Any, cfg: Any, env: dict[str, str]) -> float:
        from testbed.train.config import Emulation

        prof, exp = self.profile, self.exp
        worker.device_file = run.launcher.file(f"{worker.name}.device")  # the worker makes it, where it runs
        stage = worker.slot.stage
        slow = exp.emulation.slowdown.get(worker.slot.replica, 1.0)
        cfg.compute, cfg.device = "testbed.train.emulated:EmulatedCompute", "emulated"
        k = exp.time_dilation  # the device runs on the wall clock: its times k times longer
        times = prof.times_for(stage, worker.name, slow * k)
        cfg.emulation = Emulation(str(worker.device_file), exp.training.seed, times, prof.message_bytes,
                                  prof.grad_bytes[stage], prof.message_latency_s * k,
                                  sequence=prof.sequence and worker.name in prof.workers)
        return 0.0

    def dp_backend(self, labels: list[str]) -> str:
        return "ring"  # the transport's own ring: its all-reduce time is the profile's

    def describe(self, run: Any) -> dict:
        device = self.profile.describe() | {"computes_model": False}
        reports = {n: (w.report or {}).get("op_timing", {}) for n, w in run.workers.items()}
        device["op_timing_per_worker"] = reports
        medians = [r["median_us"] for r in reports.values() if r.get("ops")]
        worst = [r["p99_us"] for r in reports.values() if r.get("ops")]
        k = self.exp.time_dilation  # an op's error on the wall clock is k times smaller in emulated time
        device["op_timing"] = {"workers": len(medians), "median_us_worst_worker": max(medians, default=None),
                               "p99_us_worst_worker": max(worst, default=None)}
        if k != 1.0:
            device["op_timing"] |= {"time_dilation": k, "emulated_median_us_worst_worker":
                                    None if not medians else round(max(medians) / k, 3),
                                    "emulated_p99_us_worst_worker": None if not worst else round(max(worst) / k, 3)}
        return device


EXTENSION = Extension(
    name="devices",
    devices={"auto": "testbed.run.devices:AutoDevice", "cpu": "testbed.run.devices:CpuDevice",
             "cuda": "testbed.run.devices:CudaDevice", "emulated": "testbed.run.devices:EmulatedDevice"},
)
