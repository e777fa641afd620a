"""The written interface between a run and where it runs: one machine or several.

How it fits: ``runner.TrainingRun`` gets every part that differs between one machine and
several from a ``Site`` and uses it only through these protocols: the ``SiteLab`` it runs
on (one lifecycle: entered, its network is up and its launcher ready; left, every process
it started has ended and the network is gone), that lab's network
(``testbed.net.surface.NetworkSurface``, with its hosts and links), the ``Hub`` its
processes' telemetry arrives on, the ``Launcher`` that starts a process in a host and ends
it, the ``Process`` it hands back, and the ``Containers`` that make a CPU quota per device
stand-in.  Two sides satisfy them:

==============  ==============================  =======================================
protocol        one machine                     several (``cluster.remote``)
==============  ==============================  =======================================
``Site``        ``runner.LocalSite``            ``ClusterSite``
``SiteLab``     ``lab.Lab``                     ``ClusterLab``
network         ``net.network.Network``         ``ClusterNetwork``
``Hub``         ``hub.TelemetryHub``            ``ClusterHub`` (relayed by the agents)
``Launcher``    ``procs.Launcher``              ``ClusterLauncher``
``Process``     ``procs.Process``               ``_RemoteProcess`` (its exit an event)
``Containers``  ``procs.CpuContainers``         ``ClusterContainers``
==============  ==============================  =======================================

``tests/test_site_conformance.py`` runs one test body against both (the second on the fake
cluster).  An extension's processes run through the same launcher: beside the network on
the machine of a DC it names (``near``), talking over ``Launcher.socket`` paths (relayed
between machines by the agents), their files read back with ``Launcher.read``; a link's
delay line is reached by the process near the link's sending DC (``control_path``, ``lane``)
and its statistics by ``delay_line_stats()`` on either side.  What only one machine offers
(the network's registry, changing a link in place, cutting a link, an idle child container)
is not here: a caller that needs it (``testbed chaos``, BubbleTea on CPUs) names the
concrete class and runs on one machine.  The
protocols are ``runtime_checkable``: ``isinstance`` checks that the members exist (not
their signatures).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, TypeVar, runtime_checkable

from testbed.net.surface import HostInfo, NetworkSurface

if TYPE_CHECKING:
    from testbed.spec.experiment import Experiment
    from testbed.spec.topology import Topology

__all__ = ["Containers", "Hub", "Launcher", "NetworkSurface", "Process", "RunView", "Site", "SiteLab"]


@runtime_checkable
class Process(Protocol):
    """A process a launcher started: alive or its exit status, and its last words."""

    name: str

    @property
    def pid(self) -> int:
        """Its PID on the machine (in that machine's PID namespace) that runs it."""
        ...

    @property
    def returncode(self) -> int | None:
        """Its exit status once it has ended (negative: the signal), None while it runs (as
        far as this side has heard: across machines the agent reports the exit)."""
        ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status; ``subprocess.TimeoutExpired`` after ``timeout``."""
        ...

    def alive(self) -> bool: ...

    def last_log_line(self) -> str:
        """Its log's last line that says something (torch's C++ warnings left out)."""
        ...


@runtime_checkable
class Launcher(Protocol):
    """Starts a run's processes (``python -m MODULE CONFIG.json``) in hosts, ends them."""

    @property
    def processes(self) -> Mapping[str, Process]:
        """What it started, by name."""
        ...

    @property
    def dir(self) -> Path | None:
        """Configs, logs and per-process files (None: they are on other machines)."""
        ...

    def start(self, name: str, module: str, config: dict, host: HostInfo | None = None, cgroup: Any = None,
              cpu: int | None = None, sched_idle: bool = False, env: dict | None = None,
              near: str | None = None) -> Process:
        """Start ``module`` with ``config`` written as JSON, in ``host`` (None: beside the
        network, on the machine of DC ``near``; the first DC's without one), in the container
        ``cgroup`` (what ``Containers.make`` gave) before it starts a thread; its log is
        stdout and stderr together.  A ``config["telemetry"]`` is the hub's path where it
        runs (across machines each machine's agent sets its own)."""
        ...

    def pids(self) -> dict[str, int]: ...

    def stop(self, names: list[str] | None = None, timeout: float = 5.0) -> None:
        """SIGTERM these (default all), wait up to ``timeout``, SIGKILL what is left."""
        ...

    def copy_logs(self, dst: Path, names: list[str], rename: Callable[[str], str] = ...) -> None:
        """Their non-empty logs into ``dst`` as ``NAME.log``."""
        ...

    def file(self, name: str) -> Path:
        """A path beside the processes for a file they share (an emulated device, a
        board), recorded so ``testbed clean`` removes it."""
        ...

    def socket(self, name: str, near: str | None = None) -> Path:
        """A path for a Unix datagram socket bound by a process that runs beside DC ``near``
        (in one of its hosts, or beside its network): processes on every machine of the run
        send to it at this path (across machines, each other machine's agent binds the path
        and relays each datagram over the agents' SSH channels).  One way: a process that
        answers sends to another ``socket()``, not to the sender's address."""
        ...

    def read(self, path: Path, near: str | None = None) -> bytes | None:
        """The bytes of the file at ``path`` (a ``file()``) as a process beside DC ``near``
        left it (None: there is none)."""
        ...

    def clock_offset(self, near: str | None = None) -> float:
        """CLOCK_MONOTONIC on DC ``near``'s machine less the run's clock (the orchestrator's,
        which telemetry is mapped onto), in seconds: 0 on one machine.  A process that puts
        instants in messages to processes on other machines subtracts it (the run's clock),
        and adds it to the instants it is sent."""
        ...


@runtime_checkable
class Hub(Protocol):
    """The run's telemetry: messages from named processes, and messages to them."""

    @property
    def path(self) -> Path | None:
        """Where processes connect (None: each machine's agent tells its own)."""
        ...

    def expect_peers(self, names: set[str]) -> None: ...

    def connected(self, name: str) -> bool: ...

    def poll(self, timeout: float) -> list[tuple[str, dict | None]]:
        """What arrived within ``timeout`` as (name, msg); (name, None) when it hung up."""
        ...

    def send(self, name: str, msg: dict) -> bool: ...

    def close(self) -> None: ...


@runtime_checkable
class Containers(Protocol):
    """CPU quotas, one per device stand-in."""

    def problem(self) -> str | None:
        """Why quotas cannot be had (None when they can)."""
        ...

    def make(self, name: str, cpus: float, limit_later: bool = False) -> Any:
        """A container with ``cpus`` cores of quota, to pass to ``Launcher.start``; None
        without quotas or for ``cpus`` 0.  ``limit_later``: no quota until ``enforce``."""
        ...

    def enforce(self) -> None:
        """Give the containers made with ``limit_later`` their quotas."""
        ...


class RunView(Protocol):
    """What a site reads of the run it serves (``runner.TrainingRun`` satisfies it)."""

    @property
    def exp(self) -> "Experiment": ...

    @property
    def workers(self) -> Mapping[str, Any]:
        """Name -> a live worker (its ``record``)."""
        ...


NetT = TypeVar("NetT", bound=NetworkSurface)
NetT_co = TypeVar("NetT_co", bound=NetworkSurface, covariant=True)


@runtime_checkable
class SiteLab(Protocol[NetT_co]):
    """The lab a run happens on: ``with lab:`` brings its network up and its launcher with it;
    leaving ends every process the launcher started and removes the network."""

    @property
    def network(self) -> NetT_co:
        """Its network (up while the lab is entered)."""
        ...

    @property
    def launcher(self) -> Launcher:
        """The one way to start processes in it."""
        ...

    def __enter__(self) -> "SiteLab[NetT_co]": ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class Site(Protocol[NetT]):
    """Where a run's parts come from.  ``NetT``: the network its lab builds, which its other
    parts take (``LocalSite`` is a ``Site[Network]``, ``ClusterSite`` a ``Site[ClusterNetwork]``)."""

    def lab(self, topo: "Topology", delay_backend: str, options: dict) -> SiteLab[NetT]:
        """The lab for ``topo``, not yet up (the run enters it); ``options``: what the run's
        extensions ask of the network (``RunExtension.network_options``)."""
        ...

    def hub(self, run: RunView, net: NetT) -> tuple[Hub, Path | None]:
        """The telemetry hub and the path workers connect to (None: the agents say)."""
        ...

    def containers(self, net: NetT, run_name: str) -> Containers: ...

    def gpus(self) -> int: ...

    def finish(self, run: RunView) -> None:
        """Training is over, the parts still up (across machines: the end clock sample, and
        every timestamp corrected for the drift it measured)."""
        ...

    def summary(self) -> dict:
        """What the site adds to metrics.json (across machines: machines, clocks, underlay)."""
        ...
