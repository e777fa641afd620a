"""Processes of a run on one machine: CPU containers (``CpuContainers``), a process's CPU
time (``cpu_seconds``), and, re-exported from ``testbed.procutil`` where the network layer
shares them, the ``Launcher`` that starts a process in a host (or beside the network), its
``Process`` and ``python_env``.

How it fits: ``runner.TrainingRun`` owns one ``Launcher`` (the lab's); it starts the training
workers through it, and every run extension (``extension.py``: Atlas, BubbleTea, ...) starts
its own processes through the same launcher, so there is one way to start a process with a
JSON config and a log, one way to put it into a CPU container before it starts a thread,
and one way to end them all (terminate, wait, kill).  The network's own delay lines are
started by the same class (``network.Network`` holds one below the lab's).  Every process,
config, log and cgroup is recorded in the network's ``Registry`` as it is made, so
``testbed clean`` removes it after a crash.  ``Launcher``, ``Process`` and ``CpuContainers``
are this machine's side of ``site``'s protocols; ``cluster.remote`` has the side across
machines.

CPU containers: a cgroup CPU quota per device stand-in (v1 ``cpu`` controller or v2
``cpu.max``) with a 5 ms CFS period (the brief measured 92% of computes within 15% of the
ideal at 5 ms, 31% at the 100 ms default).  Mininet hosts remount /sys, so a process cannot
move itself into a cgroup from inside its host: the launcher starts ``sh -c "kill -STOP $$;
exec ..."``, waits for the shell to stop, moves it into its container from here, and lets
it continue into the real program, which so inherits the container before any thread.
"""

from __future__ import annotations

import os
from pathlib import Path

from testbed.procutil import (READY_TIMEOUT_S, Launcher, Process, ProcessError, enter_container, proc_state,
                              python_env)
from testbed.registry import PREFIX, Registry

__all__ = ["CFS_PERIOD_US", "READY_TIMEOUT_S", "CpuContainers", "Launcher", "Process", "ProcessError", "cpu_seconds",
           "enter_container", "proc_state", "python_env"]

CFS_PERIOD_US = 5000
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- reading a process's state ------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


# -- CPU containers -----------------------------------------------------------------------
def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


class CpuContainers:
    """One cgroup CPU quota per device stand-in, under ``<cgroup root>/gtb-<run>-<pid>``."""

    def __init__(self, registry: Registry, run_name: str):
        self.registry = registry
        if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            self.version, root = 2, Path("/sys/fs/cgroup")
        else:
            self.version, root = 1, Path("/sys/fs/cgroup/cpu")
            if not root.exists():
                root = Path("/sys/fs/cgroup/cpu,cpuacct")
        self.root = root
        machine = os.environ.get("GTB_MACHINE")  # fake machines share this cgroup tree (and PIDs repeat)
        self.base = root / f"{PREFIX}-{machine + '-' if machine else ''}{run_name.replace('/', '-')[:20]}-{os.getpid()}"
        self.available = root.exists() and os.access(root, os.W_OK)
        self._problem: str | None = None
        self._probed = False
        self._later: dict[Path, int] = {}  # containers made with ``limit_later``: path -> quota

    def problem(self) -> str | None:
        """Why CPU quotas cannot be had here (None when they can): no cpu controller, a tree
        that is not writable, or one that refuses a quota.  Probed once, by making the run's
        container and a quota in it; afterwards ``make`` gives no quota when there is a
        problem."""
        if self._probed:
            return self._problem
        self._probed = True
        if not self.root.exists():
            self._problem = f"there is no cgroup CPU controller at {self.root}"
        elif not os.access(self.root, os.W_OK):
            self._problem = f"the cgroup tree {self.root} is not writable" + (
                " (a read-only file system)" if _read_only(self.root) else "")
        else:
            try:
                probe = self.make("gtb-probe", 0.5)
                if probe is not None:
                    probe.rmdir()
            except OSError as exc:
                self._problem = f"the cgroup tree {self.root} refuses a CPU quota ({exc.strerror})"
        if self._problem:
            self.available = False
        return self._problem

    def make(self, name: str, cpus: float, limit_later: bool = False) -> Path | None:
        """A container with ``cpus`` cores of quota; None without cgroups or for ``cpus`` 0.

        ``limit_later``: no quota until ``enforce()`` (a worker's start-up, importing PyTorch
        and building its model, is not what the quota stands for, and at a quarter of a core
        it took 4 s longer per run of the default job)."""
        if not self.available or cpus <= 0:
            return None
        if not self.base.exists():
            self.base.mkdir()
            self.registry.cgroup(self.base)
            if self.version == 2:
                try:
                    (self.base / "cgroup.subtree_control").write_text("+cpu")
                except OSError:
                    pass
        path = self.base / name
        path.mkdir(exist_ok=True)
        self.registry.cgroup(path)
        quota = max(1000, int(cpus * CFS_PERIOD_US))
        if limit_later:
            self._later[path] = quota
            quota = -1
        self._limit(path, quota)
        return path

    def enforce(self) -> None:
        """Give the containers made with ``limit_later`` their quotas (the run does, just
        before training starts)."""
        for path, quota in self._later.items():
            self._limit(path, quota)
        self._later.clear()

    def _limit(self, path: Path, quota: int) -> None:
        """``quota`` microseconds per period; -1: none."""
        if self.version == 1:
            (path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
            burst = path / "cpu.cfs_burst_us"
            if burst.exists():
                burst.write_text("0")
        else:
            (path / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {CFS_PERIOD_US}")

    def idle_child(self, parent: Path, name: str) -> Path:
        """A child of ``parent`` at idle priority (``cpu.idle = 1``, else the lowest weight): it
        runs only when the parent's own processes leave the quota unused."""
        child = parent / name
        child.mkdir(exist_ok=True)
        self.registry.cgroup(child)
        idle = child / "cpu.idle"
        if idle.exists():
            idle.write_text("1")
        else:
            (child / ("cpu.shares" if self.version == 1 else "cpu.weight")).write_text("2" if self.version == 1 else "1")
        return child

    @staticmethod
    def lower_weight(cgroup: Path, fraction: float = 1 / 8) -> None:
        """Give a container ``fraction`` of a device's CPU weight when cores are contended."""
        for name, full in (("cpu.shares", 1024), ("cpu.weight", 100)):
            if (cgroup / name).exists():
                (cgroup / name).write_text(str(max(2 if name == "cpu.shares" else 1, int(full * fraction))))
                return
