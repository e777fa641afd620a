"""Run extensions: what plugs into a training run (Atlas, BubbleTea, what comes next).

How it fits: ``runner.TrainingRun`` knows none of them by name.  ``extensions_for(exp)``
looks in ``REGISTRY`` (name -> "module:Class", in the spirit of pyroute2's plugin table and
torchtitan's ``TrainSpec``) and asks each class whether the experiment uses it; the run then
drives every extension through the same hooks, in this order:

1. ``network_options()`` before the network is built (Atlas asks for the delay line's
   scheduler), ``worker_options(ctx, slot)`` and ``pins_workers`` while the workers are
   launched;
2. ``start(ctx)`` once the workers are started: the extension starts its own processes
   through ``ctx.launcher`` (they connect to the run's telemetry hub under one of its
   ``peers`` names);
3. during the run: ``on_worker_message`` for every telemetry message of every worker,
   ``on_peer_message`` / ``on_peer_gone`` for its own processes, ``check()`` twice a
   second (a dead process is logged, training goes on), ``ready()`` (training starts when
   every extension is ready, e.g. BubbleTea's servers have profiled their model);
4. after training: ``stop(out_dir)`` (end its processes, keep their logs and files),
   ``steady_state_from()`` (the first iteration the summary may count), ``summarise``
   (figures merged into metrics.json's summary) and ``write_outputs`` (its own plots).

A third-party extension registers under the ``testbed.extensions`` entry-point group.
``TOOLS`` names what extensions offer the command besides a run (``testbed plan`` is
Atlas's planner), loaded the same way; ``COMMANDS`` names whole command groups an agent
adds (``testbed titan ...``: Titan / Titan-Next, which is no training run).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol

if TYPE_CHECKING:
    from testbed.spec.experiment import Experiment, WorkerSlot
    from testbed.net.network import HostInfo, Network
    from testbed.run.procs import CpuContainers, Launcher
    from testbed.run.records import RunRecord, WorkerRecord

REGISTRY: dict[str, str] = {
    "atlas": "agents.atlas.extension:AtlasExtension",
    "bubbletea": "agents.bubbletea.extension:BubbleTeaExtension",
}
# what an extension offers the ``testbed`` command besides a run (name -> module)
TOOLS: dict[str, str] = {
    "plan": "agents.atlas.planner",  # Atlas's DC selection and stage assignment: ``testbed plan``
}
# command groups agents add to ``testbed`` (name -> "module:typer app"); their modules may
# import only light things at the top (typer, rich): the command loads them at start
COMMANDS: dict[str, str] = {
    "titan": "agents.titan.cli:app",  # Titan / Titan-Next: ``testbed titan study|emulate|backbone``
}


class ExtensionError(RuntimeError):
    """An extension cannot run as the experiment asks; the message is one line."""


class WorkerView(Protocol):
    """What an extension may read of a live worker."""

    slot: "WorkerSlot"
    host: "HostInfo"
    record: "WorkerRecord"
    cgroup: Path | None
    cpu: int | None
    device_file: Path | None  # device: emulated: its stream, which a co-tenant's ops may queue on
    iterations_done: int


class RunContext(Protocol):
    """What the run gives its extensions."""

    exp: "Experiment"
    net: "Network"
    launcher: "Launcher"
    containers: "CpuContainers"
    telemetry_path: Path
    workers: dict[str, WorkerView]

    def log(self, msg: str) -> None: ...
    def warn(self, msg: str) -> None: ...
    def send_to_worker(self, name: str, msg: dict) -> bool: ...
    def send_to_peer(self, name: str, msg: dict) -> bool: ...
    def iterations_done(self) -> int: ...


class RunExtension:
    """Base class: every hook does nothing until an extension overrides it."""

    name: ClassVar[str] = ""
    peers: ClassVar[tuple[str, ...]] = ()  # hello names its processes use on the telemetry hub
    pins_workers: ClassVar[bool] = False  # each worker on one core (a co-tenant must share it)

    @classmethod
    def for_experiment(cls, exp: "Experiment") -> "RunExtension | None":
        """An instance when ``exp`` uses this extension, else None."""
        raise NotImplementedError

    def network_options(self) -> dict[str, Any]:
        return {}

    def worker_options(self, ctx: RunContext, slot: "WorkerSlot") -> dict[str, Any]:
        """Fields of the worker's ``testbed.train.config.WorkerConfig`` to set."""
        return {}

    def start(self, ctx: RunContext) -> None:
        pass

    def on_worker_message(self, worker: str, msg: dict) -> None:
        pass

    def on_peer_message(self, peer: str, msg: dict) -> None:
        pass

    def on_peer_gone(self, peer: str) -> None:
        pass

    def ready(self) -> bool:
        return True

    def waiting_for(self) -> str:
        """What ``ready()`` waits for, in words (for the not-ready error)."""
        return self.name

    def check(self) -> None:
        pass

    def steady_state_from(self) -> int:
        return 0

    def training_done(self) -> None:
        """Training has ended; the run is about to stop the extension."""

    def stop(self, out_dir: Path) -> None:
        pass

    def summarise(self, record: "RunRecord", result: dict, out_dir: Path) -> dict:
        return {}

    def write_outputs(self, record: "RunRecord", result: dict, out_dir: Path) -> None:
        pass


def _load(target: str) -> type[RunExtension]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def tool(name: str):
    """The module behind one of the extensions' command-line tools (``TOOLS``)."""
    return importlib.import_module(TOOLS[name])


def command_groups() -> dict[str, Any]:
    """The typer apps behind ``COMMANDS``, by group name."""
    out = {}
    for name, target in COMMANDS.items():
        module, _, attr = target.partition(":")
        out[name] = getattr(importlib.import_module(module), attr)
    return out


def registered() -> dict[str, Callable[[], type[RunExtension]]]:
    """Every known extension: the built-in table, then the ``testbed.extensions`` entry points."""
    out: dict[str, Callable[[], type[RunExtension]]] = {n: (lambda t=t: _load(t)) for n, t in REGISTRY.items()}
    for ep in entry_points(group="testbed.extensions"):
        out.setdefault(ep.name, ep.load)
    return out


def extensions_for(exp: "Experiment") -> list[RunExtension]:
    """The extensions ``exp`` uses, in registry order."""
    out = []
    for loader in registered().values():
        ext = loader().for_experiment(exp)
        if ext is not None:
            out.append(ext)
    return out
