"""Processes, below the network and the run: starting one (``Launcher``: ``python -m MODULE
CONFIG.json`` in a host, a DC's gateway, a named namespace or beside the network, with its
log, its CPU container and a wait for its line ``ready``), ending a set of them
(``stop_all``), and the JSON datagram client that talks to a process's control socket
(``DatagramClient``).

Why here, at the top of ``testbed`` beside ``registry``: both ``net`` (the delay lines that
``network.Network`` starts, through its own ``Launcher``, and drives) and ``run`` (the lab's
launcher, through which a run, its extensions and a user's job start theirs; ``run.procs``
adds CPU containers) need them, and the network layer must not import the run layer
(``run`` is built on ``net``, not the other way round).  They know no network type, no run
and no workload (a launcher reaches hosts through the network object it is given), and
import only the standard library, the typed messages and the registry.

``ready=True`` waits until the process has written a line ``ready`` (its log is stdout and
stderr together) and raises a ``ProcessError`` naming it and its last log line when it ends
first or stays silent past the timeout; inside ``with launcher.together():`` those waits are
made at the end of the block, for all the processes started in it at once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from testbed import messages as m
from testbed.registry import Registry

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 20.0  # how long ``Launcher.start(.., ready=True)`` waits for a process's "ready"
_TORCH_WARNING = re.compile(r"\[W\d{4} [\d:.]+ [^\]]*\]")  # a torch C++ warning line


class ProcessError(RuntimeError):
    """A process could not be started as asked; the message is one line."""


def proc_state(pid: int) -> str:
    """The one-letter state of a process (R, S, T, Z, ...), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def python_env(**extra: str) -> dict[str, str]:
    """The environment our Python processes run with: this checkout (or install) importable,
    one math thread (a worker stands for one device), few page faults per step.  A
    PYTHONPATH already set stays behind this checkout (packages installed beside it)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               GLIBC_TUNABLES="glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824")
    env.update(extra)
    return env


def enter_container(proc: subprocess.Popen, cgroup: Path, timeout: float = 10.0) -> None:
    """Move a process started stopped (``kill -STOP $$``) into ``cgroup``, then continue it."""
    deadline = time.monotonic() + timeout
    while proc_state(proc.pid) != "T":
        if proc.poll() is not None or time.monotonic() > deadline:
            raise ProcessError(f"process {proc.pid} did not reach its start point (state {proc_state(proc.pid)})")
        time.sleep(0.002)
    (cgroup / "cgroup.procs").write_text(str(proc.pid))
    os.kill(proc.pid, signal.SIGCONT)




def stop_all(procs: list[subprocess.Popen], timeout: float = 3.0) -> None:
    """SIGTERM all, wait up to ``timeout`` together, then SIGKILL what is left."""
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        try:
            proc.terminate()
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for proc in alive:
        try:
            proc.wait(max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


class DatagramClient:
    """Typed messages (``testbed/messages.py``) to processes' Unix datagram sockets (filesystem
    paths: reachable from every namespace), from a socket of our own at ``path`` (so they can
    answer)."""

    def __init__(self, path: str | Path | None = None, timeout: float = 2.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.path = str(path) if path is not None else None
        if self.path is not None:
            if os.path.exists(self.path):
                os.unlink(self.path)
            self.sock.bind(self.path)
        self.sock.settimeout(timeout)

    def send(self, to: str, msg: m.Message) -> bool:
        """Fire and forget; False when nobody listens there."""
        try:
            self.sock.sendto(m.encode(msg), to)
            return True
        except OSError:
            return False

    def request(self, to: str, msg: m.Message, max_reply: int = 65536) -> m.Message:
        """Send and wait for the answer; raises OSError (no answer) or RuntimeError (refused)."""
        self.sock.sendto(m.encode(msg), to)
        reply = m.decode(self.sock.recv(max_reply))
        if isinstance(reply, m.Refused):
            raise RuntimeError(reply.error)
        return reply

    def close(self) -> None:
        self.sock.close()
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass


# -- starting and stopping processes ----------------------------------------------------------------
@dataclass
class Process:
    """One process a run started: its name, Popen, config file and log."""

    name: str
    popen: subprocess.Popen
    config: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def last_log_line(self) -> str:
        """The log's last line that is not a warning of torch's C++ core (``[W...]``, such as
        c10d's "hostname of the client socket cannot be retrieved"): they say nothing of why a
        process ended, and would stand in for the cause in the error."""
        try:
            lines = [ln for ln in self.log.read_text().splitlines() if ln.strip() and not _TORCH_WARNING.match(ln)]
        except OSError:
            return ""
        return lines[-1] if lines else ""


def _said_ready(log: Path) -> bool:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return False
    return any(line.strip() == "ready" for line in text.splitlines())


class Launcher:
    """Starts a run's processes (``python -m MODULE CONFIG.json``), records them, ends them."""

    def __init__(self, registry: Registry, net: Any = None):
        self.registry = registry
        self.net = net  # a ``network.Network`` for processes inside hosts
        self.dir = registry.dir / "procs"  # configs, logs and per-process files (boards, devices)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, Process] = {}
        self._pending: list[tuple[Process, float, float]] | None = None  # ready-waits of a together() block

    def start(self, name: str, module: str, config: dict, host: Any = None, cgroup: Path | None = None,
              cpu: int | None = None, sched_idle: bool = False, env: dict | None = None, *,
              router: str | None = None, netns: str | None = None, ready: bool = False,
              ready_timeout: float = READY_TIMEOUT_S, near: str | None = None) -> Process:
        """Start ``python -m module CONFIG`` with ``config`` written as JSON.

        Where, at most one of: ``host``, a ``network.HostInfo`` to run inside (its network
        namespace); ``router``, a DC whose gateway router it runs in; ``netns``, a named
        network namespace (``ip netns``) that the lab made.  None of them runs it beside the
        network (the root namespace, in a session of its own).  ``cgroup``: a CPU container
        it enters before it starts.  ``cpu``: pin it to that core.  ``sched_idle``:
        SCHED_IDLE (any waking task preempts it).  ``ready``: wait up to ``ready_timeout``
        seconds for its line ``ready`` (deferred to the end of a ``together()`` block).  Its
        log is stdout and stderr together.  ``near``: the DC whose machine runs a process
        beside the network (across machines it matters; here every DC is on this one)."""
        if name in self.processes:
            raise ProcessError(f"a process named {name!r} was already started in this run")
        places = [k for k, v in (("host", host), ("router", router), ("netns", netns)) if v is not None]
        if len(places) > 1:
            raise ProcessError(f"{name}: one place to run it, not {' and '.join(places)}")
        node = None
        if host is not None or router is not None:
            if self.net is None:
                raise ProcessError(f"{name}: no network to run it in")
            if router is not None:
                if router not in self.net.local:
                    raise ProcessError(f"{name}: no DC {router!r} with a gateway router here "
                                       f"(DCs: {', '.join(self.net.local)})")
                node = self.net.router(router)
            else:
                node = host
        if netns is not None and not (Path("/run/netns") / netns).exists():
            raise ProcessError(f"{name}: no network namespace {netns!r}")
        cfg_path, log_path = self.dir / f"{name}.json", self.dir / f"{name}.log"
        cfg_path.write_text(json.dumps(config))
        self.registry.file(cfg_path)
        self.registry.file(log_path)
        env = env if env is not None else python_env()
        argv = [sys.executable, "-m", module, str(cfg_path)]
        launch = "exec " + " ".join(argv)
        if cgroup is not None:
            launch = f"kill -STOP $$; {launch}"  # moved into its container from here, then continued
        with open(log_path, "w") as log:
            if node is not None:
                popen = self.net.popen(node, ["sh", "-c", launch], env=env, stdout=log, stderr=subprocess.STDOUT)
            else:
                cmd = argv if cgroup is None or netns is None else ["sh", "-c", launch]
                if netns is not None:
                    cmd = ["ip", "netns", "exec", netns, *cmd]  # execs: the PID is the program's
                popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(self.dir),
                                         start_new_session=True)
                self.registry.process(popen.pid, name, own_netns=False)
        proc = Process(name, popen, cfg_path, log_path)
        self.processes[name] = proc
        try:
            if cpu is not None:
                os.sched_setaffinity(popen.pid, {cpu})
            if sched_idle:
                os.sched_setscheduler(popen.pid, os.SCHED_IDLE, os.sched_param(0))
            if cgroup is not None:
                if node is None and netns is None:
                    (cgroup / "cgroup.procs").write_text(str(popen.pid))
                else:
                    enter_container(popen, cgroup)
        except (OSError, ProcessError) as exc:
            raise ProcessError(f"{name}: could not be placed on its core or in its container: {exc}") from None
        if ready:
            if self._pending is not None:
                self._pending.append((proc, time.monotonic() + ready_timeout, ready_timeout))
            else:
                self._await_ready([(proc, time.monotonic() + ready_timeout, ready_timeout)])
        return proc

    @contextmanager
    def together(self) -> Iterator[None]:
        """Processes started with ``ready=True`` inside the block are waited for at its end,
        all at once (each against its own deadline), rather than one after another."""
        if self._pending is not None:  # nested: the outer block waits
            yield
            return
        self._pending = []
        try:
            yield
            pending = self._pending
        finally:
            self._pending = None
        self._await_ready(pending)

    def _await_ready(self, pending: list[tuple[Process, float, float]]) -> None:
        """Wait until every process has written its line ``ready``; the first that ends before
        it or passes its deadline is stopped and named in a ``ProcessError``."""
        pending = list(pending)
        while pending:
            for item in list(pending):
                proc, deadline, timeout = item
                if _said_ready(proc.log):
                    pending.remove(item)
                    continue
                code = proc.poll()
                if code is None and time.monotonic() < deadline:
                    continue
                if code is None:
                    stop_all([proc.popen], timeout=1.0)
                    why = f"did not say ready within {timeout:g} s"
                else:
                    why = f"ended (exit code {code}) before it was ready"
                raise ProcessError(f"{proc.name} {why}: {proc.last_log_line() or 'no output'}")
            if pending:
                time.sleep(0.005)

    def file(self, name: str) -> Path:
        """``name`` in the launcher's folder, recorded so ``testbed clean`` removes it (the
        caller makes the file)."""
        path = self.dir / name
        self.registry.file(path)
        return path

    def socket(self, name: str, near: str | None = None) -> Path:
        """A path for a Unix datagram socket that a process beside DC ``near`` binds (here:
        ``file(name)``; across machines the site relays what is sent to it from the others)."""
        return self.file(name)

    def read(self, path: str | Path, near: str | None = None) -> bytes | None:
        """The bytes of a file a process beside DC ``near`` wrote (None: there is none)."""
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return None

    def clock_offset(self, near: str | None = None) -> float:
        """0: one machine, one clock (the run's)."""
        return 0.0

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.processes.items()}

    def stop(self, names: list[str] | None = None, timeout: float = 5.0) -> None:
        """SIGTERM, wait up to ``timeout`` for all together, SIGKILL what is left."""
        stop_all([p.popen for n, p in self.processes.items() if names is None or n in names], timeout)

    def copy_logs(self, dst: Path, names: list[str], rename=lambda name: name) -> None:
        """Copy the non-empty logs of these processes into ``dst`` (results folder)."""
        for name in names:
            p = self.processes.get(name)
            if p is None or not p.log.exists() or not p.log.stat().st_size:
                continue
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p.log, dst / f"{rename(name)}.log")
