"""The hooks a training run drives its extensions through (``RunExtension``).

How it fits: ``testbed.extension`` finds the extensions an experiment uses (its section says
so) and names each one's ``RunExtension`` class; ``extensions_for(exp)`` makes them, and
``runner.TrainingRun`` drives every one through the same hooks, in this order:

1. ``network_options()`` before the network is built (a delay line's per-class scheduler,
   say), ``worker_options(ctx, slot)`` and ``pins_workers`` while the workers are launched;
2. ``start(ctx)`` once the workers are started: the extension starts its own processes
   through ``ctx.launcher`` (they connect to the run's telemetry hub under one of its
   ``peers`` names); every message is typed (``testbed/messages.py``; an extension's own
   kinds live in its own package, on the same base);
3. during the run: ``on_worker_message`` for every telemetry message of every worker,
   ``on_peer_message`` / ``on_peer_gone`` for its own processes, ``check()`` twice a
   second (a dead process is logged, training goes on), ``ready()`` (training starts when
   every extension is ready, e.g. servers that must first profile a model);
4. after training: ``stop(out_dir)`` (end its processes, keep their logs and files),
   ``steady_state_from()`` (the first iteration the summary may count), ``summarise``
   (figures merged into metrics.json's summary) and ``write_outputs`` (its own plots).

A ``testbed torchrun`` job (a user's own script on a lab) drives a ``JobExtension`` instead,
made from ``--with NAME=VALUE`` by ``job_extensions``: ``apply(lab, ranks)`` before the
ranks start, ``remove()`` after they have ended (whatever the outcome), its figures going
into the job's metrics.json under the extension's name.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from testbed import messages as m
from testbed.extension import ExtensionError, in_use, job_extension

if TYPE_CHECKING:
    from testbed.net.network import HostInfo, Network
    from testbed.run.procs import CpuContainers, Launcher
    from testbed.results.metrics import RunSummary
    from testbed.results.records import RunRecord, WorkerRecord
    from testbed.run.lab import LabHandle
    from testbed.spec.experiment import Experiment, WorkerSlot

__all__ = ["ExtensionError", "JobExtension", "RunContext", "RunExtension", "WorkerView", "extensions_for",
           "job_extensions"]


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
    go_time: float  # monotonic instant the workers were told to go (0.0 before); under time
    # dilation k an instant t of the wall clock is ``go_time + (t - go_time) / k`` in emulated time

    def log(self, msg: str) -> None: ...
    def warn(self, msg: str) -> None: ...
    def send_to_worker(self, name: str, msg: m.Message) -> bool: ...
    def send_to_peer(self, name: str, msg: m.Message) -> bool: ...
    def iterations_done(self) -> int: ...


class RunExtension:
    """Base class: every hook does nothing until an extension overrides it."""

    name: ClassVar[str] = ""
    peers: ClassVar[tuple[str, ...]] = ()  # hello names its processes use on the telemetry hub
    pins_workers: ClassVar[bool] = False  # each worker on one core (a co-tenant must share it)

    def __init__(self, exp: "Experiment"):
        self.exp = exp

    def network_options(self) -> dict[str, Any]:
        return {}

    def worker_options(self, ctx: RunContext, slot: "WorkerSlot") -> dict[str, Any]:
        """Fields of the worker's ``testbed.train.config.WorkerConfig`` to set."""
        return {}

    def start(self, ctx: RunContext) -> None:
        pass

    def on_worker_message(self, worker: str, msg: m.Message) -> None:
        pass

    def on_peer_message(self, peer: str, msg: m.Message) -> None:
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

    def summarise(self, record: "RunRecord", result: "RunSummary", out_dir: Path) -> dict:
        """Figures for the summary (``result.summary.extra``), under the extension's own key."""
        return {}

    def write_outputs(self, record: "RunRecord", result: "RunSummary", out_dir: Path) -> None:
        pass


def extensions_for(exp: "Experiment") -> list[RunExtension]:
    """The run extensions ``exp`` uses, made for it, in registry order."""
    out = []
    for ext in in_use(exp):
        if ext.run is not None:
            cls = ext.load(ext.run)
            if not (isinstance(cls, type) and issubclass(cls, RunExtension)):
                raise ExtensionError(f"extension {ext.name}: {ext.run} is not a RunExtension")
            out.append(cls(exp))
    return out


class JobExtension:
    """Base class of an extension acting on a ``testbed torchrun`` job's network.

    ``value`` is what the user passed (``--with NAME=VALUE``: a file of options, say); a bad
    one raises ``ExtensionError`` with one line, before anything is built.  ``apply`` gets the
    lab (``testbed.run.lab.LabHandle``: its hosts, and its links with each one's delay-line
    control socket) and the ranks' placement (one dict per rank: ``rank``, ``dc``, ``index``,
    ``name``, ``ip``, ``ifname``), and must leave the lab as it found it if it fails; ``remove``
    undoes it (called once, after the ranks have ended, also after a failed job) and returns
    its figures."""

    name: ClassVar[str] = ""

    def __init__(self, value: str):
        self.value = value

    def apply(self, lab: "LabHandle", ranks: list[dict]) -> None:
        pass

    def remove(self) -> dict:
        return {}


def job_extensions(specs: list[str]) -> list[JobExtension]:
    """``["NAME=VALUE", ...]`` (torchrun's ``--with``) -> the extensions made from them, in
    the order given; a one-line ExtensionError for a malformed or unknown one."""
    out: list[JobExtension] = []
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name.strip():
            raise ExtensionError(f"--with {spec!r}: NAME=VALUE, NAME an installed extension "
                                 "(e.g. --with NAME=options.yaml)")
        name = name.strip()
        if any(e.name == name for e in out):
            raise ExtensionError(f"--with {name}: given twice")
        ext = job_extension(name)
        cls = ext.load(ext.lab)
        if not (isinstance(cls, type) and issubclass(cls, JobExtension)):
            raise ExtensionError(f"extension {name}: {ext.lab} is not a JobExtension")
        obj = cls(value)
        obj.name = name
        out.append(obj)
    return out
