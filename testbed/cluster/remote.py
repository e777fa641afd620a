"""The orchestrator's side of a run across machines: agents, clocks, and the network they make.

How it fits: ``Cluster.start`` installs the orchestrator's build on each machine through
Ansible (``plays.py``, ``build.py``), starts one machine agent per machine over SSH from that
build and speaks to it on the session's stdin/stdout (``AgentClient``: requests and
answers, events in one queue; nothing listens on a port), measures each machine's clock
against the orchestrator's (``measure_clock``), measures the underlay, and builds each
machine's DCs with a VXLAN per WAN link that crosses machines.  ``ClusterNetwork`` is the
``net.surface.NetworkSurface`` that ``runner.TrainingRun`` and ``fidelity`` use, as
``network.Network`` is on one machine:
hosts whose ``node.cmd`` and ``popen`` run on their machine, links (their counters read by
the sending gateway's agent), TCP counters, link state, ``check``.  ``ClusterSite`` is the
``run.site.Site`` across machines: it gives a run its hub (telemetry relayed by the agents,
every timestamp mapped onto the orchestrator's clock), its launcher and processes (an exit
is an agent's event) and its CPU containers; ``tests/test_site_conformance.py`` holds both
sides to the same protocols.

Clocks: a sample is a request/answer pair; offset = agent's time - the pair's midpoint,
uncertainty = half the round trip; the sample with the smallest round trip of ``samples``
is kept.  Measured at the start and at the end: the hub maps with the start offsets as
messages arrive; when training is over, ``correct_drift`` moves every timestamp by its
machine's drift, where the offset moved more than the two samples' uncertainties.  A
worker's timestamps are on its machine's clock and map by that machine's offset; a
transfer's start is the sender's clock (the transport carries it), so it maps by the
sender's machine.  The bound a run refuses to start beyond: uncertainty under 1 ms and
under a tenth of the smallest one-way delay of a WAN link that crosses machines (what the
one-way checks and the "received after sent" order need).

Underlay: each cross-machine link's emulated delay is cut by half the underlay's min round
trip between its machines, so the link measures as configured.  MTU: every emulated
interface on every machine gets the underlay's MTU less 50 (the VXLAN header): 1450 on a
1500 underlay; the hosts' TCP then never sends a packet a tunnel would fragment.
"""

from __future__ import annotations

import base64
import collections
import getpass
import itertools
import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from testbed.messages import (AgentGone, Answer, Call, Datagram, Done, Events, Exited, Message, NetworkFailed, Output,
                               Telemetry, Wait, Xfer)
from testbed.net.shaping import ClassCounters, Counters
from testbed.net.surface import HostIndex, HostInfo, NetworkError
from testbed.spec.topology import Topology, dilated
from testbed.cluster import wire
from testbed.cluster.build import version
from testbed.cluster.inventory import ClusterError, Machine

VXLAN_OVERHEAD = 50
_NETWORK_OPTIONS = {"scheduling", "time_dilation"}  # what a run may ask of each agent's network across machines
LOGS_PREFIX = "gtb-agent-logs-"  # + the orchestrator's PID: the agents' logs while it runs (tempfile's folder)
CLOCK_BOUND_MS = 1.0
_VNI_BASE = 4096


def _main_thread_takes_signals() -> None:
    """Block Ctrl-C and SIGTERM in this helper thread: the kernel then delivers them to the
    main thread, whose waits they interrupt at once (delivered here, they would wait until the
    main thread's wait ended: up to a call's timeout)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


class AgentClient:
    """One machine agent, started over SSH (``plays.agent_command``) and spoken to on that
    session's stdin/stdout: ``call`` blocks for its answer; events go to ``events``; what the
    agent logs (its stderr) goes to ``log``."""

    def __init__(self, machine: Machine, argv: list[str], events: "queue.Queue", log: Path):
        self.machine = machine
        self.events = events
        self.log = log
        self._log_fh = open(log, "ab")
        try:  # its own session: a Ctrl-C at the orchestrator's terminal reaches the orchestrator only
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_fh,
                                         start_new_session=True)
        except OSError as exc:
            self._log_fh.close()
            raise ClusterError(f"machine {machine.name}: {argv[0]}: {exc.strerror or exc}") from None
        self.chan = wire.Channel(self.proc.stdout.fileno(), self.proc.stdin.fileno())
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[threading.Event, list]] = {}
        self.closed = False
        self.hello: dict = {}
        self.on_datagram: Callable[[Datagram], None] = lambda msg: None  # a relayed datagram: on at once
        threading.Thread(target=self._read, daemon=True).start()

    def greet(self, run: str, wait_s: float = 60.0) -> dict:
        """The first call: this orchestrator's build (the agent refuses another) and who it is."""
        try:
            self.hello = self.call("hello", wait_s=wait_s, build=version(), run=run,
                                   orchestrator=f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()}")
        except ClusterError as exc:
            if self.closed and "no answer" in str(exc):  # it never started: say why (ssh's or Python's last word)
                raise ClusterError(f"machine {self.machine.name}: its agent did not start: {self.last_log_line()}") \
                    from None
            raise
        return self.hello

    def last_log_line(self) -> str:
        try:
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return lines[-1].strip() if lines else "no output"

    def _read(self) -> None:
        _main_thread_takes_signals()
        reader = wire.LineReader(self.chan)
        while True:
            lines = reader.read()
            if lines is None:
                break
            for msg in lines:
                if isinstance(msg, Datagram):  # in this thread: it waits for no one
                    self.on_datagram(msg)
                    continue
                if not isinstance(msg, Answer):
                    self.events.put((self.machine.name, msg))
                    continue
                slot = self._waiting.pop(msg.id, None)
                if slot is not None:
                    slot[1].append(msg)
                    slot[0].set()
        self.closed = True
        for ev, box in list(self._waiting.values()):
            ev.set()
        self.events.put((self.machine.name, AgentGone()))

    def call(self, op: str, wait_s: float | None = 300.0, **args) -> Any:
        if self.closed:
            raise ClusterError(f"machine {self.machine.name}: its agent is gone")
        rid = next(self._ids)
        ev, box = threading.Event(), []
        self._waiting[rid] = (ev, box)
        with self._lock:
            try:
                self.chan.send(Call(id=rid, op=op, args=args))
            except OSError as exc:
                raise ClusterError(f"machine {self.machine.name}: its agent is unreachable ({exc})") from None
        if not ev.wait(wait_s) or not box:
            raise ClusterError(f"machine {self.machine.name}: no answer to {op}"
                               + (" (its agent is gone)" if self.closed else f" within {wait_s:g} s"))
        if box[0].error is not None:
            raise ClusterError(f"machine {self.machine.name}: {op}: {box[0].error}")
        return box[0].result

    def tell(self, msg: Message) -> None:
        """Send ``msg`` without waiting for anything (a relayed datagram); lost if the agent is gone."""
        if self.closed:
            return
        with self._lock:
            try:
                self.chan.send(msg)
            except OSError:
                pass

    def close(self, timeout: float = 30.0) -> None:
        """End the session: the agent reads end-of-file, removes what it made and exits."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._log_fh.close()


@dataclass
class ClockSample:
    offset_s: float  # machine clock - orchestrator clock
    uncertainty_s: float  # half the sample's round trip
    at: float  # orchestrator time of the sample


def measure_clock(agent: AgentClient, samples: int = 30) -> ClockSample:
    best = None
    for _ in range(samples):
        t0 = time.monotonic()
        t = agent.call("clock")["t"]
        t1 = time.monotonic()
        s = ClockSample(t - (t0 + t1) / 2, (t1 - t0) / 2, (t0 + t1) / 2)
        if best is None or s.uncertainty_s < best.uncertainty_s:
            best = s
    return best


class _RemoteStream:
    """A remote process's stdout (0) or stderr (1), read through its agent."""

    def __init__(self, proc: "RemotePopen", which: int):
        self._proc, self._which = proc, which

    def readline(self) -> str:
        return self._proc.agent.call("readline", pid=self._proc.pid)

    def read(self) -> str:
        return self._proc.communicate()[self._which]


class RemotePopen:
    """A process in a host on another machine, as much of ``subprocess.Popen`` as callers use."""

    def __init__(self, agent: AgentClient, pid: int):
        self.agent, self.pid = agent, pid
        self.returncode: int | None = None
        self.stdout, self.stderr = _RemoteStream(self, 0), _RemoteStream(self, 1)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.agent.call("poll", pid=self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        rc = self.agent.call("wait", wait_s=None if timeout is None else timeout + 10, pid=self.pid,
                             timeout=timeout)
        if rc is None:
            raise subprocess.TimeoutExpired("remote", timeout)
        self.returncode = rc
        return rc

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        r = self.agent.call("communicate", wait_s=None if timeout is None else timeout + 10, pid=self.pid,
                            timeout=timeout)
        self.returncode = r["rc"]
        return r["stdout"], r["stderr"]

    def terminate(self) -> None:
        self.agent.call("signal", pid=self.pid)

    def kill(self) -> None:
        self.agent.call("signal", pid=self.pid, kill=True)


class RemoteNode:
    """A host or gateway on another machine: what callers do with a Mininet node."""

    def __init__(self, agent: AgentClient, name: str):
        self.agent, self.name = agent, name

    def cmd(self, command: str) -> str:
        return self.agent.call("cmd", host=self.name, command=command)

    def popen(self, argv: list[str], stdout=None, stderr=None, text=None, **_ignored) -> RemotePopen:
        pipe = stdout == subprocess.PIPE
        return RemotePopen(self.agent, self.agent.call("popen", host=self.name, argv=list(argv), pipe=pipe)["pid"])


class _ClusterLink:
    """One WAN direction across machines: its parameters, and its counters as the sending
    gateway's agent reads them (``time`` mapped onto the orchestrator's clock)."""

    def __init__(self, cluster: "Cluster", src: str, dst: str, params: Any):
        self._cluster = cluster
        self.src, self.dst, self.params = src, dst, params

    def _agent(self) -> AgentClient:
        return self._cluster.agents[self._cluster.placement[self.src]]

    def counters(self) -> Counters:
        machine = self._cluster.placement[self.src]
        c = self._cluster.agents[machine].call("link_counters", wait_s=30.0, src=self.src, dst=self.dst)
        classes = {name: ClassCounters(**v) for name, v in c.pop("classes").items()}
        c["time"] -= self._cluster.offsets.get(machine, 0.0)
        return Counters(**c, classes=classes)

    def _info(self) -> dict:
        key = (self.src, self.dst)
        if key not in self._cluster.link_info:
            self._cluster.link_info[key] = self._agent().call("link_info", src=self.src, dst=self.dst)
        return self._cluster.link_info[key]

    @property
    def control_path(self) -> str | None:
        """The delay line's control socket on the sending DC's machine (for a process started
        there: ``Launcher.start(..., near=src)``), if the line is in the path."""
        return self._info()["control_path"]

    @property
    def lane(self) -> str:
        return self._info()["lane"]

    def delay_line_stats(self, turns_since: int | None = None) -> dict | None:
        return self._agent().call("delay_line_stats", wait_s=30.0, src=self.src, dst=self.dst,
                                  turns_since=turns_since)

    def _sched(self, msg: dict) -> None:
        self._agent().call("link_sched", wait_s=30.0, src=self.src, dst=self.dst, msg=msg)

    def schedule_classes(self, classes: dict, queue_bytes: int | None = None) -> None:
        self._sched({"classes": {n: [list(x) for x in ms] for n, ms in classes.items()},
                     "rate_mbps": self.params.rate_mbps, "queue_bytes": queue_bytes})

    def set_order(self, order: list[str]) -> None:
        self._sched({"order": list(order), "turns": None})

    def clear_schedule(self) -> None:
        self._sched({"classes": None})


class _Backends:
    def __init__(self, d: dict):
        self.delay, self.loss, self.rate = d["delay"], d["loss"], d["rate"]


class ClusterNetwork(HostIndex):
    """The topology built across machines, used as ``network.Network`` is."""

    def __init__(self, cluster: "Cluster", topo: Topology, time_dilation: float = 1.0):
        self.cluster = cluster
        # as on one machine (``Network``): ``topo`` is what the wire carries, k times slower
        # under time dilation, and ``emulated_topo`` the topology as given
        self.time_dilation = float(time_dilation)
        self.emulated_topo = topo
        self.topo = dilated(topo, self.time_dilation)
        self._hosts: dict[str, list[HostInfo]] = {}
        self.backends = None
        self.startup_s = 0.0
        self.started = False
        self.errors: list[str] = []

    def start(self) -> "ClusterNetwork":
        t0 = time.monotonic()
        self.cluster.build(self, getattr(self, "delay_backend", "auto"), options=getattr(self, "options", None))
        self.startup_s = time.monotonic() - t0
        self.started = True
        return self

    def __enter__(self) -> "ClusterNetwork":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.cluster.teardown_networks()
        self.started = False

    def machine_of(self, dc: str) -> str:
        return self.cluster.placement[dc]

    def links(self) -> list[_ClusterLink]:
        return [_ClusterLink(self.cluster, s, d, p) for s, d, p in self.topo.directions()]

    def link(self, src: str, dst: str) -> _ClusterLink:
        for s, d, p in self.topo.directions():
            if (s, d) == (src, dst):
                return _ClusterLink(self.cluster, s, d, p)
        raise NetworkError(f"no WAN link {src} -> {dst}")

    def popen(self, host: HostInfo, cmd: list[str], **kwargs) -> RemotePopen:
        return host.node.popen(cmd, **kwargs)

    def owd_correction_ms(self, src: HostInfo, dst: HostInfo) -> float:
        """What a one-way probe src -> dst reads too much by: the receiver's clock offset less
        the sender's (the probe stamps with the sender's clock, reads with the receiver's)."""
        off = self.cluster.offsets
        return (off[self.machine_of(dst.dc)] - off[self.machine_of(src.dc)]) * 1000.0

    def tcp_counters(self) -> dict[str, dict[str, int]]:
        out = {}
        for agent in self.cluster.agents.values():
            out.update(agent.call("tcp_counters"))
        return out

    def link_state(self, src: str, dst: str) -> str:
        return self.cluster.agent_of(src).call("link_state", src=src, dst=dst)

    def check(self) -> None:
        self.cluster.drain()
        if self.errors:
            raise NetworkError(self.errors[0])


class _RemoteCgroup:
    def __init__(self, cpus: float, limit_later: bool = False):
        self.cpus, self.limit_later = cpus, limit_later


class ClusterContainers:
    """``run.site.Containers`` across machines: each agent makes its processes' containers."""

    def __init__(self, cluster: "Cluster"):
        self.cluster = cluster

    def problem(self) -> str | None:
        for name, agent in self.cluster.agents.items():
            p = agent.call("containers_problem")
            if p:
                return f"on machine {name}: {p}"
        return None

    def make(self, name: str, cpus: float, limit_later: bool = False) -> _RemoteCgroup | None:
        return _RemoteCgroup(cpus, limit_later) if cpus > 0 else None

    def enforce(self) -> None:
        for agent in self.cluster.agents.values():
            agent.call("containers_enforce")


class _RemoteProcess:
    """A process an agent launched (``run.site.Process``): alive, exit status, the log's last
    line; its exit arrives as the agent's event (``Cluster.drain``)."""

    def __init__(self, name: str, machine: str, pid: int, cluster: "Cluster"):
        self.name, self.machine, self.pid = name, machine, pid
        self._cluster = cluster
        self.returncode: int | None = None
        self.tail = ""

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.name, timeout)
            self._cluster.drain(0.05)
        return self.returncode

    def alive(self) -> bool:
        return self.returncode is None

    def last_log_line(self) -> str:
        return self.tail


class ClusterLauncher:
    """``run.site.Launcher`` across machines: each process is launched by its host's agent."""

    def __init__(self, cluster: "Cluster"):
        self.cluster = cluster
        self.processes: dict[str, _RemoteProcess] = {}
        self.dir = None

    def start(self, name: str, module: str, config: dict, host: HostInfo | None = None, cgroup=None,
              cpu: int | None = None, sched_idle: bool = False, env: dict | None = None,
              near: str | None = None) -> _RemoteProcess:
        """In ``host``, or (None) beside the network on the machine of DC ``near`` (default:
        the topology's first DC's).  ``cpu`` and ``sched_idle`` are the agent's to honour
        there: pinning and SCHED_IDLE apply on that machine."""
        machine = self.machine_of(host.dc if host is not None else near, name)
        agent = self.cluster.agents[machine]
        base = os.environ
        extra = {k: v for k, v in (env or {}).items() if base.get(k) != v and k != "PYTHONPATH"}
        pid = agent.call("launch", name=name, module=module, config=config,
                         host=host.name if host is not None else None,
                         cpus=cgroup.cpus if cgroup is not None else 0.0,
                         limit_later=cgroup is not None and cgroup.limit_later, env=extra, cpu=cpu,
                         sched_idle=sched_idle)["pid"]
        proc = _RemoteProcess(name, machine, pid, self.cluster)
        self.processes[name] = proc
        self.cluster.processes[name] = proc
        return proc

    def machine_of(self, dc: str | None, what: str) -> str:
        """The machine of DC ``dc`` (None: the topology's first DC's)."""
        placement = self.cluster.placement
        if dc is None:
            dc = next(iter(placement))
        if dc not in placement:
            raise ClusterError(f"{what}: no DC {dc!r} in this run (DCs: {', '.join(placement)})")
        return placement[dc]

    def socket(self, name: str, near: str | None = None) -> Path:
        """``file(name)``, for a datagram socket that a process on DC ``near``'s machine binds;
        every other machine's agent binds the same path at once and relays what is sent to it
        there (``Datagram``) to that machine."""
        path = self.file(name)
        owner = self.machine_of(near, name)
        self.cluster.sockets[str(path)] = owner
        for machine, agent in self.cluster.agents.items():
            if machine != owner:
                agent.call("relay", path=str(path))
        return path

    def read(self, path: Path, near: str | None = None) -> bytes | None:
        """The file at ``path`` on DC ``near``'s machine (up to 64 MiB), through its agent."""
        data = self.cluster.agents[self.machine_of(near, str(path))].call("read_file", path=str(path))
        return None if data is None else base64.b64decode(data)

    def clock_offset(self, near: str | None = None) -> float:
        """DC ``near``'s machine's CLOCK_MONOTONIC less the orchestrator's, as measured when
        the cluster started (what ``ClusterHub.map_times`` subtracts from its telemetry)."""
        return self.cluster.offsets.get(self.machine_of(near, "clock_offset"), 0.0)

    def file(self, name: str) -> Path:
        """``name`` in the agents' process folder, the same path on every machine: a process
        that shares it makes it on its own machine (an emulated device does), and the agent's
        teardown (or ``testbed clean`` there) removes it with the folder."""
        where = set(self.cluster.files.values())
        if len(where) != 1:
            raise ClusterError(f"{name}: the machines keep their processes' files in different folders "
                               f"({', '.join(sorted(where)) or 'none yet'}): one testbed build and state folder "
                               f"everywhere")
        return Path(where.pop()) / name

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.processes.items()}

    def stop(self, names: list[str] | None = None, timeout: float = 5.0) -> None:
        by_machine: dict[str, list[str]] = {}
        for n, p in self.processes.items():
            if names is None or n in names:
                by_machine.setdefault(p.machine, []).append(n)
        for machine, ns in by_machine.items():
            try:
                self.cluster.agents[machine].call("stop", names=ns, wait_s=timeout + 10)
            except ClusterError:
                pass

    def copy_logs(self, dst: Path, names: list[str], rename=lambda name: name) -> None:
        by_machine: dict[str, list[str]] = {}
        for n in names:
            if n in self.processes:
                by_machine.setdefault(self.processes[n].machine, []).append(n)
        for machine, ns in by_machine.items():
            try:
                logs = self.cluster.agents[machine].call("logs", names=ns)
            except ClusterError:
                continue
            for n, text in logs.items():
                dst.mkdir(parents=True, exist_ok=True)
                (dst / f"{rename(n)}.log").write_text(text)
        for machine, agent in self.cluster.agents.items():  # with them, what each machine's agent said
            if agent.log.exists() and agent.log.stat().st_size:
                dst.mkdir(parents=True, exist_ok=True)
                (dst / agent.log.name).write_bytes(agent.log.read_bytes())


class ClusterHub:
    """The run's telemetry, relayed by the agents, on the orchestrator's clock."""

    def __init__(self, cluster: "Cluster", sender_of: Callable[[str, str], str | None]):
        self.cluster = cluster
        self.sender_of = sender_of  # (receiver worker, transfer kind) -> sending worker
        self.worker_machine: dict[str, str] = {}  # a worker's or a connected peer's machine
        self.peers: set[str] = set()
        self.path = None

    def expect_peers(self, names: set[str]) -> None:
        self.peers |= set(names)
        for agent in self.cluster.agents.values():
            agent.call("expect_peers", names=sorted(names))

    def connected(self, name: str) -> bool:
        return self._machine(name) is not None

    def _machine(self, name: str) -> str | None:
        """Where ``name`` is connected: a worker's machine is known; a peer (an extension's
        process) is found by asking the agents, once it has said hello to one of them."""
        machine = self.worker_machine.get(name)
        if machine is None and name in self.peers:
            for m, agent in self.cluster.agents.items():
                try:
                    if agent.call("connected", name=name):
                        self.worker_machine[name] = machine = m
                        break
                except ClusterError:
                    continue
        return machine

    def poll(self, timeout: float) -> list[tuple[str, Message | None]]:
        return self.cluster.take_telemetry(timeout)

    def send(self, name: str, msg: Message) -> bool:
        machine = self._machine(name)
        if machine is None:
            return False
        try:
            return bool(self.cluster.agents[machine].call("send", name=name, msg=msg))
        except ClusterError:
            return False

    def close(self) -> None:
        self.cluster.clock_report()  # the end clock sample, while the agents are still there

    def map_times(self, name: str, machine: str, msg: Message) -> Message:
        off = self.cluster.offsets
        mine = off[machine]

        def moved(transfers: list[Xfer]) -> list[Xfer]:
            out = []
            for x in transfers:
                sender = self.sender_of(name, x.kind)
                theirs = off[self.worker_machine.get(sender, machine)] if sender else mine
                out.append(replace(x, start=x.start - theirs, end=x.end - mine))
            return out

        if isinstance(msg, Events):
            return replace(msg, events=[replace(e, start=e.start - mine, end=e.end - mine) for e in msg.events],
                           transfers=moved(msg.transfers), end=None if msg.end is None else msg.end - mine)
        if isinstance(msg, Wait):
            return replace(msg, t=msg.t - mine)
        if isinstance(msg, Done):
            return replace(msg, transfers=moved(msg.transfers))
        return msg


@dataclass
class Cluster:
    """The machines of one run and their agents."""

    machines: list[Machine]
    placement: dict[str, str]  # DC -> machine
    inventory: Path
    lease_s: float = 15.0
    progress: Callable[[str], None] = lambda msg: None
    agents: dict[str, AgentClient] = field(default_factory=dict)
    offsets: dict[str, float] = field(default_factory=dict)
    clock: dict = field(default_factory=dict)
    underlay: dict = field(default_factory=dict)
    processes: dict[str, _RemoteProcess] = field(default_factory=dict)
    ranks: dict[str, Any] = field(default_factory=dict)  # a torchrun job's ranks (``jobs.RankProcess``), by name
    hub: ClusterHub | None = None
    net: ClusterNetwork | None = None
    events: "queue.Queue" = field(default_factory=queue.Queue)
    telemetry: "collections.deque" = field(default_factory=collections.deque)  # drained, for the hub
    _renewer: threading.Thread | None = None
    _report: dict | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    logs: Path | None = None  # each agent's log (its stderr over SSH): agent-<machine>.log
    files: dict[str, str] = field(default_factory=dict)  # machine -> its agent's folder for processes' files
    sockets: dict[str, str] = field(default_factory=dict)  # Launcher.socket path -> the machine whose process binds it
    link_info: dict[tuple[str, str], dict] = field(default_factory=dict)  # (src, dst) -> control_path, lane

    # -- start and end ----------------------------------------------------------------
    def start(self, run: str = "") -> "Cluster":
        from testbed.cluster.plays import agent_command, install_build

        used = sorted(set(self.placement.values()), key=[m.name for m in self.machines].index)
        by_name = {m.name: m for m in self.machines}
        installing = [n for n in used if by_name[n].testbed_root is None]
        self.progress(f"installing build {version()} on {', '.join(installing) or 'no machine'} (Ansible)")
        build_dir = install_build(self.inventory, installing, progress=self.progress)
        self.progress(f"starting machine agents on {', '.join(used)} (SSH)")
        self.logs = Path(tempfile.mkdtemp(prefix=f"{LOGS_PREFIX}{os.getpid()}-"))
        try:
            for name in used:  # all started first: their Pythons import side by side
                self.agents[name] = AgentClient(by_name[name], agent_command(by_name[name], self.lease_s, build_dir),
                                                self.events, self.logs / f"agent-{name}.log")
                self.agents[name].on_datagram = self._route
            for agent in self.agents.values():
                agent.greet(run)
            self._renewer = threading.Thread(target=self._renew, daemon=True)
            self._renewer.start()
            self.measure_clocks("start")
        except BaseException:
            self.close()
            raise
        return self

    def _route(self, msg: Datagram) -> None:
        """A datagram one agent relayed: on to the agent of the machine whose process binds
        its path (the agents' reader threads call this; nothing here waits)."""
        owner = self.sockets.get(msg.path)
        agent = self.agents.get(owner) if owner is not None else None
        if agent is not None:
            agent.tell(msg)

    def _renew(self) -> None:
        _main_thread_takes_signals()
        while not self._stopping.wait(self.lease_s / 4):
            for agent in list(self.agents.values()):
                try:
                    agent.call("renew", wait_s=self.lease_s)
                except ClusterError:
                    pass

    def close(self) -> None:
        self._stopping.set()
        for agent in self.agents.values():
            try:
                agent.call("teardown", wait_s=60)
            except ClusterError:
                pass
            agent.close()
        self.agents.clear()
        if self.logs is not None:
            shutil.rmtree(self.logs, ignore_errors=True)

    # -- clocks -----------------------------------------------------------------------
    def measure_clocks(self, when: str) -> dict:
        got = {name: measure_clock(agent) for name, agent in self.agents.items()}
        self.clock[when] = {n: {"offset_s": round(s.offset_s, 6), "uncertainty_ms": round(s.uncertainty_s * 1e3, 4),
                                "at": s.at} for n, s in got.items()}
        if when == "start":
            self.offsets = {n: s.offset_s for n, s in got.items()}
        return self.clock[when]

    def clock_bound_ms(self, topo: Topology) -> float:
        crossing = [p.delay_ms for s, d, p in topo.directions() if self.placement[s] != self.placement[d]]
        return min([CLOCK_BOUND_MS] + [0.1 * d for d in crossing])

    def check_clocks(self, topo: Topology) -> None:
        bound = self.clock_bound_ms(topo)
        worst = max(((v["uncertainty_ms"], n) for n, v in self.clock["start"].items()), default=(0.0, ""))
        if worst[0] > bound:
            raise ClusterError(f"machine {worst[1]}: its clock is known to {worst[0]:.3f} ms, more than the "
                               f"{bound:.3f} ms this run needs (1 ms, and a tenth of the smallest one-way delay "
                               f"between machines)")

    def clock_report(self) -> dict:
        """The clocks over the run, for metrics.json; the end sample is taken on the first call
        (while the agents are still there), later calls return the same report."""
        if self._report is not None:
            return self._report
        end = self.measure_clocks("end") if self.agents else {}
        out = {"bound_ms": None, "drift_corrected": False, "machines": {}}
        for n, s in self.clock.get("start", {}).items():
            e = end.get(n)
            row = {"offset_s": s["offset_s"], "uncertainty_ms": s["uncertainty_ms"]}
            if e:
                span = e["at"] - s["at"]
                row["offset_end_s"] = e["offset_s"]
                row["drift_ppm"] = round((e["offset_s"] - s["offset_s"]) / span * 1e6, 3) if span > 0 else None
                row["mapping_error_ms"] = round(abs(e["offset_s"] - s["offset_s"]) * 1e3 + s["uncertainty_ms"]
                                                + e["uncertainty_ms"], 4)
            out["machines"][n] = row
        self._report = out
        return out

    # -- the network --------------------------------------------------------------------
    def agent_of(self, dc: str) -> AgentClient:
        return self.agents[self.placement[dc]]

    def build(self, net: ClusterNetwork, delay_backend: str = "auto", loss_backend: str = "auto",
              run_name: str = "run", options: dict | None = None) -> None:
        topo = net.topo
        self.net = net
        by_name = {m.name: m for m in self.machines}
        crossing = [(n, link) for n, link in enumerate(topo.wan) if self.placement[link.a] != self.placement[link.b]]
        self.progress("measuring the underlay")
        pairs = {frozenset((self.placement[l.a], self.placement[l.b])) for _, l in crossing}
        for pair in pairs:
            a, b = sorted(pair)
            rtt = self.agents[a].call("underlay_rtt", peers=[by_name[b].underlay])[by_name[b].underlay]
            if rtt is None:
                raise ClusterError(f"machines {a} and {b}: no ping over the underlay ({by_name[a].underlay} -> "
                                   f"{by_name[b].underlay})")
            self.underlay[f"{a}-{b}"] = {"rtt_ms": rtt}
        mtus = {m: self.agents[m].call("underlay_mtu", address=by_name[m].underlay) for m in self.agents}
        mtu = min(1500, min(mtus.values())) - VXLAN_OVERHEAD
        self.underlay["mtu"] = mtus
        # each crossing link's delay less half the underlay's round trip, per direction; the
        # agents get the topology as given and dilate it themselves (``time_dilation`` in
        # ``options``), so the underlay's real delay is taken off in emulated terms: owd / k
        k = net.time_dilation
        data = net.emulated_topo.model_dump()
        for n, link in crossing:
            a, b = sorted((self.placement[link.a], self.placement[link.b]))
            owd = self.underlay[f"{a}-{b}"]["rtt_ms"] / 2 / k
            given = data["wan"][n]
            given["delay_ms"] = max(0.0, given["delay_ms"] - owd)
            if given.get("reverse"):
                given["reverse"]["delay_ms"] = max(0.0, given["reverse"]["delay_ms"] - owd)
        self.progress(f"building {len(topo.dcs)} DCs on {len(self.agents)} machines "
                      f"({len(crossing)} WAN link(s) over VXLAN, MTU {mtu})")
        results = {}
        errors: list[str] = []

        def build_on(machine: str) -> None:
            tunnels = []
            for n, link in crossing:
                for local, remote in ((link.a, link.b), (link.b, link.a)):
                    if self.placement[local] == machine:
                        tunnels.append({"local": local, "remote": remote, "local_ip": by_name[machine].underlay,
                                        "remote_ip": by_name[self.placement[remote]].underlay,
                                        "vni": _VNI_BASE + n, "mtu": mtu})
            dcs = [dc for dc, m in self.placement.items() if m == machine]
            try:
                results[machine] = self.agents[machine].call(
                    "build", topology=data, dcs=dcs, tunnels=tunnels, mtu=mtu, delay_backend=delay_backend,
                    loss_backend=loss_backend, run_name=run_name, options=options or {})
            except ClusterError as exc:
                errors.append(str(exc))

        threads = [threading.Thread(target=build_on, args=(m,)) for m in self.agents]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise NetworkError(errors[0])
        for machine, r in results.items():
            self.files[machine] = r["files"]
            for dc, hosts in r["hosts"].items():
                net._hosts[dc] = [HostInfo(dc, j, name, ip, RemoteNode(self.agents[machine], name))
                                  for j, (name, ip) in enumerate(hosts)]
            net.backends = _Backends(r["backends"])
        net._hosts = {dc.name: net._hosts[dc.name] for dc in topo.dcs}  # the topology's order, as on one machine
        net.mtu = mtu

    def teardown_networks(self) -> None:
        self.sockets.clear()
        self.link_info.clear()
        for agent in self.agents.values():
            try:
                agent.call("teardown", wait_s=60)
            except ClusterError:
                pass

    # -- events -----------------------------------------------------------------------
    def take_telemetry(self, timeout: float) -> list[tuple[str, Message | None]]:
        """The telemetry drained so far and what arrives within ``timeout`` (none waited for
        when some is already kept), as the hub's (name, msg), in order."""
        self.drain(0.0 if self.telemetry else timeout)
        out = list(self.telemetry)
        self.telemetry.clear()
        return out

    def drain(self, timeout: float = 0.0) -> None:
        """Handle the agents' events that arrived (waiting up to ``timeout`` for the first).
        Telemetry is kept for the hub (``take_telemetry``), whoever drains: a network check or
        a wait for a process's exit drains too, and once dropped what it found (a worker's
        iteration end, lost: the run then failed in its summary)."""
        deadline = time.monotonic() + timeout
        first = True
        while True:
            left = deadline - time.monotonic()
            try:
                machine, ev = self.events.get(timeout=left) if left > 0 and first else self.events.get_nowait()
            except queue.Empty:
                return
            first = False
            if isinstance(ev, Telemetry):
                name, msg = ev.name, ev.msg
                if self.hub is not None and msg is not None:
                    self.hub.worker_machine.setdefault(name, machine)
                    msg = self.hub.map_times(name, machine, msg)
                self.telemetry.append((name, msg))
            elif isinstance(ev, Output) and ev.name in self.ranks:
                self.ranks[ev.name].output(ev.text)
            elif isinstance(ev, Exited) and ev.name in self.ranks:
                self.ranks[ev.name].ended(ev.rc)
            elif isinstance(ev, Exited):
                p = self.processes.get(ev.name)
                if p is not None:
                    p.returncode, p.tail = ev.rc, ev.tail
            elif isinstance(ev, NetworkFailed) and self.net is not None:
                self.net.errors.append(f"machine {machine}: {ev.error}")
            elif isinstance(ev, AgentGone) and self.net is not None and not self._stopping.is_set():
                self.net.errors.append(f"machine {machine}: its agent is gone (the machine or its management "
                                       f"network failed)")


class ClusterLab:
    """The lab of a run across machines (``site.SiteLab``; ``lab.Lab`` on one): entering builds
    every machine's part of the network, leaving ends what its launcher started and removes
    the network everywhere."""

    def __init__(self, cluster: Cluster, net: ClusterNetwork):
        self.cluster = cluster
        self._net = net
        self._launcher: ClusterLauncher | None = None

    @property
    def network(self) -> ClusterNetwork:
        return self._net

    @property
    def launcher(self) -> ClusterLauncher:
        if self._launcher is None:
            raise ClusterError("the lab across machines is not up")
        return self._launcher

    def __enter__(self) -> "ClusterLab":
        self._net.__enter__()
        self._launcher = ClusterLauncher(self.cluster)
        return self

    def __exit__(self, *exc: object) -> None:
        launcher, self._launcher = self._launcher, None
        try:
            if launcher is not None:
                launcher.stop()
        finally:
            self._net.__exit__(*exc)


class ClusterSite:
    """``runner.TrainingRun``'s parts across machines (``runner.LocalSite`` on one)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.net: ClusterNetwork | None = None

    def lab(self, topo: Topology, delay_backend: str, options: dict) -> ClusterLab:
        unknown = sorted(set(options) - _NETWORK_OPTIONS)
        if unknown:
            raise ClusterError(f"a run across machines does not take {', '.join(unknown)} yet (on one machine only, "
                               "for now)")
        net = ClusterNetwork(self.cluster, topo, options.get("time_dilation", 1.0))
        self.cluster.check_clocks(net.topo)  # the wire's delays (k times the topology's)
        self.net = net
        self.net.delay_backend = delay_backend
        self.net.options = dict(options)
        return ClusterLab(self.cluster, self.net)

    def hub(self, run, net: ClusterNetwork) -> tuple[ClusterHub, None]:
        slots = {(s.stage, s.replica): s.name for s in run.exp.workers()}
        stage_of = {s.name: (s.stage, s.replica) for s in run.exp.workers()}

        def sender_of(receiver: str, kind: str) -> str | None:
            stage, replica = stage_of.get(receiver, (None, None))
            if stage is None:
                return None
            return slots.get((stage - 1 if kind == "xfer_act" else stage + 1, replica))

        hub = ClusterHub(self.cluster, sender_of)
        for s in run.exp.workers():
            hub.worker_machine[s.name] = self.cluster.placement[s.dc]
        self.cluster.hub = hub
        return hub, None

    def finish(self, run) -> None:
        """The end clock sample, then every timestamp moved by its machine's drift."""
        report = self.cluster.clock_report()
        hub = self.cluster.hub
        report["drift_corrected"] = correct_drift(
            {n: w.record for n, w in run.workers.items()}, hub.worker_machine, hub.sender_of,
            self.cluster.clock.get("start", {}), self.cluster.clock.get("end", {}))

    def containers(self, net: ClusterNetwork, run_name: str) -> ClusterContainers:
        return ClusterContainers(self.cluster)

    def gpus(self) -> int:
        used = set(self.cluster.placement.values())
        return min((m.gpus for m in self.cluster.machines if m.name in used), default=0)

    def summary(self) -> dict:
        clock = self.cluster.clock_report()
        clock["bound_ms"] = round(self.cluster.clock_bound_ms(self.net.topo), 4) if self.net else None
        return {"machines": sorted(set(self.cluster.placement.values())), "placement": self.cluster.placement,
                "clock": clock, "underlay": self.cluster.underlay,
                "mtu": getattr(self.net, "mtu", None)}


def remove_stale_logs() -> int:
    """Remove the agents' log folders of orchestrators that are gone (killed before their
    ``close``); how many."""
    removed = 0
    for d in Path(tempfile.gettempdir()).glob(f"{LOGS_PREFIX}*"):
        pid = d.name[len(LOGS_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
    return removed


def open_cluster(topo: Topology, inventory: Path, machines_flag: str | None = None,
                 progress: Callable[[str], None] = lambda msg: None, lease_s: float = 15.0, run: str = "") -> Cluster:
    """Read the inventory, place the DCs, start and reach the agents, sample the clocks.
    The caller ends it with ``close()`` (the agents' leases end it too)."""
    from testbed.cluster.inventory import load_inventory, parse_machines_flag, place

    machines = load_inventory(inventory)
    placement = place(topo, machines, parse_machines_flag(machines_flag))
    return Cluster(machines, placement, Path(inventory), lease_s=lease_s, progress=progress).start(run)


def correct_drift(records: dict, where: dict[str, str], sender_of: Callable[[str, str], str | None],
                  start: dict, end: dict) -> bool:
    """Move every timestamp of ``records`` (already mapped with the start offsets) by its
    machine's drift: a machine whose offset moved by ``d`` between the start and the end
    sample had its timestamps off by ``d`` times the fraction of that span elapsed.  A drift
    within what the two samples can tell (their uncertainties added) is noise and left
    alone.  True when something moved."""
    from testbed.results.records import Interval, Transfer

    rate: dict[str, tuple[float, float]] = {}
    for m, s0 in start.items():
        e = end.get(m)
        if not e or e["at"] <= s0["at"]:
            continue
        moved = e["offset_s"] - s0["offset_s"]
        known = (s0["uncertainty_ms"] + e["uncertainty_ms"]) / 1e3
        if abs(moved) > known:
            rate[m] = (moved / (e["at"] - s0["at"]), s0["at"])
    if not rate:
        return False

    def fix(t: float, machine: str) -> float:
        r, at = rate.get(machine, (0.0, 0.0))
        return t - r * (t - at)

    for name, rec in records.items():
        m = where[name]
        rec.events = [Interval(i.kind, i.mb, fix(i.start, m), fix(i.end, m), i.iteration) for i in rec.events]
        rec.iteration_end = {k: fix(t, m) for k, t in rec.iteration_end.items()}
        rec.transfers = [Transfer(x.kind, x.mb, fix(x.start, where.get(sender_of(name, x.kind) or "", m)),
                                  fix(x.end, m), x.nbytes, x.iteration) for x in rec.transfers]
    return True
