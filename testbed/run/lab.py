"""A lab: one emulated WAN with one lifecycle for the network, the processes started in it
and what is recorded about it.

How it fits: ``Lab(topology, name=..)`` wraps a ``net.network.Network``.  ``up()`` builds
it (every piece recorded in the ``Registry`` as it appears, so ``testbed clean`` removes it
after a crash) and runs the per-run WAN self-check that ``testbed run`` makes
(``net.fidelity.check_wan``: a ping and a one-way probe per direction; a direction outside
tolerance is a warning, kept in ``warnings``).  ``exec`` runs a command in a host and waits,
``popen`` starts one and returns (both enter the host's namespaces with ``mnexec -a PID``,
as Mininet does, and record the process).  A workload on the lab (an extension's emulation,
what comes next) starts the testbed's own processes through the lab's one
``procs.Launcher``: ``start(name, module, config, host=|router=DC|netns=NAME, ready=True)``
writes the JSON config and the log, records both and the process, and waits for its
``ready`` line (``launcher.together()`` waits for several at once); ``netns(name)`` makes a
named network namespace recorded in the registry, for the parts a workload adds to the
network.  ``link(src, dst).set(..)`` changes a WAN direction in place, ``counters()``
samples every direction's counters, ``down()`` ends every process started here (popen'd or
launched) and removes the network with everything recorded in its registry.  A context
manager: ``with Lab(..) as lab:``.

The same questions answered about a lab another process holds up (``testbed up``, see
``labserver``) go through ``labserver.LabClient``; both answer ``host_table()``,
``link_table()``, ``counter_table()`` and ``popen(dc, index, argv)`` in the same JSON-ready
shapes, which is all ``torchrun`` needs of a lab.  One network at a time per machine (the
registry's lock; names and addresses would collide), so one lab at a time.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from testbed.net.kernel import Capabilities
from testbed.net.network import HostInfo, Network, NetworkError, WanDirection
from testbed.net.shaping import Counters
from testbed.registry import PREFIX, Registry
from testbed.procutil import stop_all
from testbed.run.procs import Launcher, Process
from testbed.spec.topology import Topology, load_topology, resolve_topology

_LAB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")


class LabError(RuntimeError):
    """A lab could not be used as asked; the message is one line naming the cause."""


def check_lab_name(name: str) -> str:
    if not _LAB_NAME.match(name):
        raise LabError(f"lab name {name!r}: letters, digits, '_', '.' or '-', at most 32 characters")
    return name


def enter_argv(pid: int, argv: list[str]) -> list[str]:
    """``argv`` run inside the network and mount namespaces of process ``pid`` (a host's shell)."""
    return ["mnexec", "-a", str(pid), *argv]


def link_key(src: str, dst: str) -> str:
    return f"{src}->{dst}"


def counters_dict(c: Counters) -> dict:
    return {"time": c.time, "tx_bytes": c.tx_bytes, "tx_packets": c.tx_packets, "drops": c.drops,
            "backlog_bytes": c.backlog_bytes}


def pick_host(hosts: list[dict], dc: str, index: int, lab: str) -> dict:
    """The host ``index`` of ``dc`` in a host table; a LabError naming what exists otherwise."""
    in_dc = [h for h in hosts if h["dc"] == dc]
    if not in_dc:
        dcs = ", ".join(dict.fromkeys(h["dc"] for h in hosts))
        raise LabError(f"lab {lab} has no DC {dc!r} (DCs: {dcs})")
    for h in in_dc:
        if h["index"] == index:
            return h
    raise LabError(f"DC {dc} of lab {lab} has no host {index} (hosts 0-{len(in_dc) - 1})")


def pick_link(links: list[dict], src: str, dst: str, lab: str) -> dict:
    for link in links:
        if (link["src"], link["dst"]) == (src, dst):
            return link
    dcs = list(dict.fromkeys([x["src"] for x in links] + [x["dst"] for x in links]))
    for dc in (src, dst):
        if dc not in dcs:
            raise LabError(f"lab {lab} has no DC {dc!r} (DCs: {', '.join(dcs)})")
    raise LabError(f"lab {lab} has no WAN link {src} -> {dst}")


class LabHandle(Protocol):
    """What ``torchrun`` and the CLI need of a lab, held here (``Lab``) or elsewhere
    (``labserver.LabClient``)."""

    name: str

    def host_table(self) -> list[dict]: ...

    def link_table(self) -> list[dict]: ...

    def counter_table(self) -> dict[str, dict]: ...

    def popen(self, dc: str, index: int, argv: list[str], **kwargs) -> subprocess.Popen: ...


class Lab:
    """One topology built, checked, driven and removed.  ``topology``: a ``Topology``, a file
    or a shipped topology's name.  ``check``: run the WAN self-check in ``up()``.  ``caps``:
    what ``net.kernel.probe`` found, where the caller has it (else ``up()`` probes).
    ``time_dilation``: k, the network's emulated world k times slower than the wall clock
    (``net.network.Network``); the WAN check reads emulated terms."""

    def __init__(self, topology: Topology | str | Path, name: str | None = None, delay_backend: str = "auto",
                 loss_backend: str = "auto", check: bool = True, progress: Callable[[str], None] | None = None,
                 caps: Capabilities | None = None, network_options: dict | None = None, time_dilation: float = 1.0):
        if isinstance(topology, Topology):
            self.topo, self.topology_file = topology, None
        else:
            self.topology_file = resolve_topology(topology)
            self.topo = load_topology(self.topology_file)
        self.name = check_lab_name(name or self.topo.name)
        self.delay_backend, self.loss_backend = delay_backend, loss_backend
        self.check = check
        self._caps = caps  # what this machine offers, when already probed
        self._network_options = dict(network_options or {})  # a run's extensions' asks (Network's keywords)
        if time_dilation != 1.0:  # the emulated world k times slower than the wall clock (Network's docstring)
            self._network_options["time_dilation"] = time_dilation
        self._progress = progress or (lambda msg: None)
        self.net: Network | None = None
        self.wan_check: list[dict] = []
        self.warnings: list[str] = []
        self.started_at: float | None = None  # time.time() when up
        self._procs: list[subprocess.Popen] = []
        self._launcher: Launcher | None = None

    # -- lifecycle --------------------------------------------------------------------
    def up(self) -> "Lab":
        if self.net is not None:
            return self
        options = {"loss_backend": self.loss_backend, "caps": self._caps, "progress": self._progress}
        self.net = Network(self.topo, delay_backend=self.delay_backend, **(options | self._network_options))
        try:
            self.net.start()
        except BaseException:
            self.net = None
            raise
        try:
            self._launcher = Launcher(self.net.registry, self.net)
            if self.check:
                from testbed.net.fidelity import check_wan

                self._progress("checking the WAN")
                checks = check_wan(self.net)
                self.wan_check = [c.to_dict() for c in checks]
                self.warnings += [f"WAN {c.src} -> {c.dst} is not as configured: {c.problem}"
                                  for c in checks if not c.ok]
        except BaseException:
            self.down()
            raise
        self.started_at = time.time()
        return self

    def down(self) -> None:
        """End every process started here and remove the network.  Safe to call twice."""
        if self._launcher is not None:
            launcher, self._launcher = self._launcher, None
            launcher.stop()
        stop_all(self._procs)
        self._procs.clear()
        if self.net is not None:
            net, self.net = self.net, None
            net.stop()

    def __enter__(self) -> "Lab":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    @property
    def registry(self) -> Registry:
        return self._net().registry

    @property
    def network(self) -> Network:
        """The network, while the lab is up (``site.SiteLab``)."""
        return self._net()

    def _net(self) -> Network:
        if self.net is None:
            raise LabError(f"lab {self.name} is not up")
        return self.net

    # -- hosts and processes --------------------------------------------------------------
    def hosts(self, dc: str | None = None) -> list[HostInfo]:
        net = self._net()
        if dc is not None and dc not in net.local:
            raise LabError(f"lab {self.name} has no DC {dc!r} (DCs: {', '.join(net.local)})")
        return net.hosts(dc)

    def host(self, dc: str, index: int = 0) -> HostInfo:
        pick_host(self.host_table(), dc, index, self.name)  # the error names what exists
        return self._net().host(dc, index)

    def host_table(self) -> list[dict]:
        """Every host: ``dc``, ``index`` (0-based in its DC), ``name``, ``ip``, ``ifname`` (its
        emulated interface) and ``pid`` (its shell: the namespace to enter)."""
        return [{"dc": h.dc, "index": h.index, "name": h.name, "ip": h.ip, "ifname": f"{h.name}-eth0",
                 "pid": h.node.pid} for h in self._net().hosts()]

    def popen(self, dc: str, index: int, argv: list[str] | str, **kwargs) -> subprocess.Popen:
        """Start ``argv`` (a string: through ``sh -c``) in host ``index`` of ``dc``; it is ended by
        ``down()``, or by ``testbed clean`` after a crash.  Its own session unless told
        otherwise (``start_new_session=False``)."""
        h = self.host(dc, index)
        proc = _start(h.node.pid, argv, kwargs)
        self.registry.process(proc.pid, f"lab:{self.name}:{h.name}", own_netns=False)
        self._procs.append(proc)
        return proc

    @property
    def launcher(self) -> Launcher:
        """The one way to start the testbed's processes in this lab (``procs.Launcher``)."""
        self._net()
        assert self._launcher is not None
        return self._launcher

    def start(self, name: str, module: str, config: dict, **where: Any) -> Process:
        """``launcher.start``: ``python -m module CONFIG.json`` in ``host=`` (a ``HostInfo``),
        ``router=DC`` or ``netns=NAME`` (or beside the network), ``ready=True`` to wait for its
        ``ready`` line; ended by ``down()``."""
        return self.launcher.start(name, module, config, **where)

    def netns(self, name: str) -> str:
        """Make the named network namespace ``name`` (``ip netns``; it must start with the
        testbed's prefix), recorded in the registry so ``down()`` and ``testbed clean``
        remove it and end what runs in it; its loopback is up."""
        net = self._net()
        if not name.startswith(PREFIX):
            raise LabError(f"network namespace {name!r}: the name must start with {PREFIX!r}")
        res = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if res.returncode != 0:
            raise LabError(f"network namespace {name}: {(res.stderr or res.stdout).strip()}")
        net.registry.netns(name)
        res = subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], capture_output=True, text=True)
        if res.returncode != 0:
            raise LabError(f"network namespace {name}: loopback: {res.stderr.strip()}")
        return name

    def exec(self, dc: str, index: int, argv: list[str] | str, input: str | None = None,
             timeout: float | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` in host ``index`` of ``dc`` and wait: its exit code, stdout and stderr (text)."""
        proc = self.popen(dc, index, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_all([proc])
            raise LabError(f"{argv!r} in {dc}:{index} did not end within {timeout} s") from None
        finally:
            if proc in self._procs:
                self._procs.remove(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # -- links ------------------------------------------------------------------------
    def link(self, src: str, dst: str) -> WanDirection:
        """The WAN direction ``src -> dst``: ``.set(delay_ms=.., rate_mbps=.., loss=.., jitter_ms=..,
        queue_bytes=..)`` changes it in place, ``.counters()`` samples it."""
        net = self._net()
        try:
            return net.link(src, dst)
        except NetworkError:
            pick_link(self.link_table(), src, dst, self.name)
            raise

    def link_table(self) -> list[dict]:
        """Every WAN direction with its settings now (``queue_bytes``: the queue in force) and
        ``delay_line``: its delay line's control socket and lane (``{"control", "lane"}``, None
        where netem delays it), through which extensions schedule its traffic."""
        return [{"src": wd.src, "dst": wd.dst, **wd.params.model_dump(), "queue_bytes": wd.shaper.queue_bytes,
                 "delay_line": {"control": wd.control_path, "lane": wd.lane} if wd.control_path else None}
                for wd in self._net().links()]

    def counters(self) -> dict[tuple[str, str], Counters]:
        """One sample of every WAN direction's counters (bytes and packets sent, drops, queue)."""
        return {(wd.src, wd.dst): wd.counters() for wd in self._net().links()}

    def counter_table(self) -> dict[str, dict]:
        return {link_key(*k): counters_dict(c) for k, c in self.counters().items()}

    def status(self) -> dict:
        """What ``testbed status --json`` shows of a lab."""
        net = self._net()
        return {"name": self.name, "topology": self.topo.name,
                "topology_file": str(self.topology_file) if self.topology_file else None,
                "backends": {"delay": net.backends.delay, "loss": net.backends.loss},
                "up_since": self.started_at, "startup_s": round(net.startup_s, 3),
                "hosts": self.host_table(), "links": self.link_table(),
                "wan_check": self.wan_check, "warnings": self.warnings}


def _start(pid: int, argv: list[str] | str, kwargs: dict[str, Any]) -> subprocess.Popen:
    if isinstance(argv, str):
        argv = ["sh", "-c", argv]
    kwargs.setdefault("start_new_session", True)
    return subprocess.Popen(enter_argv(pid, list(argv)), **kwargs)


def start_in(registry: Registry, host: dict, argv: list[str] | str, role: str, **kwargs) -> subprocess.Popen:
    """Start ``argv`` in a host of a host table (a lab held elsewhere), recorded for ``clean``."""
    proc = _start(host["pid"], argv, kwargs)
    registry.process(proc.pid, role, own_netns=False)
    return proc

