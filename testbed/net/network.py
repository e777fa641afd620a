"""The emulated network: DCs of hosts behind gateway routers, joined by shaped WAN links.

How it fits: hosts and routers are Mininet hosts (unnamed network namespaces, one bash
each, their shells started all at once), each DC's hosts hang off a Linux bridge, and each
DC has one gateway router.  The bridges and veth pairs are made through netlink
(pyroute2) and the addresses by every shell at once, rather than by Mininet's ``Link``
and ``LinuxBridge``, which run a few commands per interface one after the other: the
network comes up faster than bare Mininet does for the same hosts.  WAN links are veth pairs between gateways with static routes
(shortest delay), so traffic between two DCs crosses exactly their link.  Each direction of
a WAN link is shaped at the sending gateway:

* delay and jitter: netem (``kernel.py`` finds it) or, without netem, the userspace TUN
  delay line (``delayline.py``) that policy routing puts in the path;
* rate and queue: HTB with a byte-limited leaf, through pyroute2 (``shaping.py``);
* loss: netem, or an iptables ``statistic`` rule in the gateway, or the delay line.  Each
  drops a whole packet as it sees it, and a host's TCP hands the gateway GSO packets of 2-45
  segments (veth keeps them whole), so a "0.05% of packets" link lost 0.05% of the segments
  in bursts of two or more, half the loss events a path losing 0.05% of its packets has
  (CUBIC's window goes as events^-0.75; measured: 1.05-1.97x the goodput, four directions of
  Sydney-London at 0.05%, one run each, docs/benchmarks.md).  So wherever a WAN direction
  has loss, at build or later, every host here sends single-segment packets
  (``gso_max_segs`` 1 on its interface, ``_segment_senders``), as a real path's NIC puts them
  on the wire.

``Network`` builds all of it, records every piece in the ``Registry`` as it appears, and
removes it on ``stop()`` (also on Ctrl-C through the context manager; after SIGKILL,
``testbed clean`` does it from the registry).  ``WanDirection`` is the handle callers use
at run time: change parameters in place (all or nothing: a step the kernel or the delay line
refuses rolls back the steps before it), sample counters, define traffic classes.
``Network`` is one machine's ``surface.NetworkSurface`` (what runs and ``fidelity`` use;
``surface`` also holds ``HostInfo``, ``HostIndex`` and ``NetworkError``, imported here).
Faults: ``set_link_up`` cuts a WAN link (both ends down, as a cut fibre) and restores it
with its routes, ``link_state`` says whether a direction is up, and ``check`` raises when a
delay line has died (its links would otherwise carry traffic without their delay, silently:
policy routing falls through to the direct route).

Addresses: DC ``i`` (1-based, in file order) is ``10.i.0.0/24``; host ``j`` is ``10.i.0.j``;
the gateway is ``10.i.0.254``; WAN link ``n`` uses ``10.255.x.y/30``.  These exist only inside
the testbed's namespaces; no route leads out of them.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from testbed import messages as m
from testbed.net.kernel import Backends, Capabilities, choose_backends, mininet_on_path, probe, require_runtime
from testbed.procutil import DatagramClient, Launcher, Process, ProcessError, stop_all
from testbed.registry import PREFIX, Registry
from testbed.net.shaping import Counters, EgressShaper, NetemParams
from testbed.net.surface import HostIndex, HostInfo, NetworkError
from testbed.spec.topology import Direction, Topology, default_queue_bytes, dilated, validation_error

DEFAULT_COMPENSATION_MS = 0.05  # measured per pass through the TUN delay line (docs/benchmarks.md)
_TCP_MEM = "4096 131072 67108864"
_DELAYLINE_START_TIMEOUT_S = 20.0
_RTO_MIN_MS = 200  # Linux's TCP_RTO_MIN


def _import_mininet():
    """Mininet's ``Host``, made to start its shell without waiting for the others'
    (``_start_together``)."""
    mininet_on_path()
    from mininet.log import setLogLevel
    from mininet.node import Host

    setLogLevel("error")
    return _start_together(Host)


def _start_together(cls):
    """``cls`` whose shells start without waiting for each other: Mininet's ``startShell``
    spawns the node's shell and then waits for its prompt and for one command, node after
    node, which is most of a large network's start-up.  Here it returns once the shell is
    spawned; ``_finish_shells`` then waits for every prompt at once and sends the same first
    command to all (what Mininet does for one, for every shell in parallel).  Mininet's own
    code runs unchanged: only its two waits are put off."""

    class Together(cls):
        _putting_off = False

        def startShell(self, mnopts=None):
            self._putting_off = True
            try:
                super().startShell(mnopts)
            finally:
                self._putting_off = False
            self._pending_prompt = True

        def read(self, *args, **kwargs):
            return chr(127) if self._putting_off else super().read(*args, **kwargs)

        def cmd(self, *args, **kwargs):
            return "" if self._putting_off else super().cmd(*args, **kwargs)

    Together.__name__ = Together.__qualname__ = f"Together{cls.__name__}"
    return Together


_DUMP_WARNING = "Dump was interrupted and may be inconsistent."


def _failure(out: str) -> str:
    """What a command's output says went wrong: the output less iproute2's dump warning.  tc
    (iproute2 6.1) dumps the namespace's links into a name cache before its first command, and
    the kernel marks that dump interrupted when an interface comes or goes meanwhile (a delay
    line's TUN device, made while the gateways shape their links: CI's fake cluster met it once
    in 300 tests).  tc warns, looks the name up on its own and succeeds (exit 0, the tree
    installed: ``tests/test_network.py`` churns interfaces to check both)."""
    return "\n".join(ln for ln in out.strip().splitlines() if ln.strip() != _DUMP_WARNING).strip()


def _in_every_shell(cmds: dict, what: str) -> None:
    """Run each node's command in its shell, all at once; a node whose command printed anything
    (every command used here is silent when it succeeds) fails ``what``, naming the node."""
    for node, cmd in cmds.items():
        node.sendCmd(cmd)
    failed = []
    for node in cmds:
        out = _failure(node.waitOutput())
        if out:
            failed.append(f"{node.name}: {out.splitlines()[0]}")
    if failed:
        raise NetworkError(f"{what} failed: {'; '.join(failed[:3])}")


def _finish_shells(nodes: list, timeout_s: float = 60.0) -> None:
    """Wait for the prompt of every shell ``_start_together`` left pending, then run Mininet's
    first command in all of them at once."""
    import select

    pending = {n.stdout.fileno(): n for n in nodes if getattr(n, "_pending_prompt", False)}
    poller = select.poll()
    for fd in pending:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    waiting = dict(pending)
    while waiting:
        if time.monotonic() > deadline:
            raise NetworkError(f"the shells of {', '.join(sorted(n.name for n in waiting.values()))} gave no "
                               f"prompt in {timeout_s:.0f} s")
        for fd, _ in poller.poll(1000):
            node = waiting.get(fd)
            if node is not None and node.read(1024).endswith(chr(127)):
                poller.unregister(fd)
                del waiting[fd]
    for node in pending.values():
        node._pending_prompt = False
        node.sendCmd("unset HISTFILE; stty -echo; set +m")
    for node in pending.values():
        node.waitOutput()


@dataclass
class Tunnel:
    """The VXLAN that carries one WAN link between two machines, seen from one end."""

    local_ip: str  # this machine's underlay address
    remote_ip: str  # the other machine's
    vni: int  # the same at both ends: one per WAN link
    mtu: int = 1450  # the underlay's MTU less 50 (outer IPv4, UDP, VXLAN, inner Ethernet)
    port: int = 4789


class _DelayLineClient:
    """Talks to one delay-line process over its Unix datagram socket."""

    def __init__(self, control_path: Path, client_path: Path):
        self._client = DatagramClient(client_path, timeout=2.0)
        self._control = str(control_path)

    @property
    def control_path(self) -> str:
        return self._control

    def request(self, msg: m.Message) -> m.Message:
        try:
            return self._client.request(self._control, msg)
        except RuntimeError as exc:
            raise NetworkError(f"delay line {self._control}: {exc}") from None
        except OSError as exc:  # gone (no socket), or no answer within the timeout
            raise NetworkError(f"delay line {self._control} does not answer: {exc.strerror or exc}") from None

    def close(self) -> None:
        self._client.close()


@dataclass
class WanDirection:
    """One shaped direction of a WAN link: ``src`` DC -> ``dst`` DC."""

    src: str
    dst: str
    params: Direction
    ifname: str
    router: Any
    shaper: EgressShaper
    backends: Backends
    lane: str | None = None
    delay_client: _DelayLineClient | None = None
    _loss_chain: str | None = None
    _loss_installed: bool = field(default=False, repr=False)
    on_loss: Callable[[], None] | None = field(default=None, repr=False)  # before loss is first set

    def set(self, **changes: float) -> Direction:
        """Change delay_ms, jitter_ms, loss, rate_mbps or queue_bytes in place, now.

        All or nothing: the change is applied step by step (rate, the delay line's rate,
        queue, delay, loss), and when a step fails the steps before it are undone, so
        ``params`` stays what the kernel and the delay line have.  A step that cannot be
        undone either is named in the error, and ``params`` then holds its new value."""
        merged = self.params.model_dump() | changes
        try:
            new = Direction(**merged)
        except ValidationError as exc:
            raise NetworkError(str(validation_error(exc, f"{self.src}->{self.dst}"))) from None
        old = self.params
        done: list[tuple[str, tuple[str, ...], Callable[[], None]]] = []
        for name, fields, apply, undo in self._steps(old, new):
            try:
                apply()
            except Exception as exc:
                stuck = []
                for done_name, done_fields, done_undo in reversed(done):
                    try:
                        done_undo()
                    except Exception:
                        stuck.append((done_name, done_fields))
                why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                if not stuck:
                    raise NetworkError(f"{self.src}->{self.dst}: setting {name} failed ({why}); nothing was "
                                       f"changed") from None
                kept = {f: getattr(new, f) for _, fs in stuck for f in fs}
                self.params = Direction(**(old.model_dump() | kept))
                raise NetworkError(f"{self.src}->{self.dst}: setting {name} failed ({why}), and "
                                   f"{', '.join(n for n, _ in stuck)} could not be undone: now {kept}") from None
            done.append((name, fields, undo))
        self.params = new
        return new

    def _steps(self, old: Direction, new: Direction) -> list[tuple[str, tuple[str, ...], Callable[[], None],
                                                                    Callable[[], None]]]:
        """(what, fields, apply, undo) for every part of the change, in the order applied."""
        steps = []
        sh = self.shaper
        if new.rate_mbps != old.rate_mbps:
            steps.append(("rate", ("rate_mbps",), lambda: sh.set_rate(new.rate_mbps), lambda: sh.set_rate(old.rate_mbps)))
            if self.delay_client is not None:  # the line knows its link's rate (Atlas's scheduler paces to it)
                def line_rate(rate: float) -> None:
                    self.delay_client.request(m.LaneSet(lane=self.lane, rate_mbps=rate))
                steps.append(("the delay line's rate", (), lambda: line_rate(new.rate_mbps),
                              lambda: line_rate(old.rate_mbps)))
        if new.queue_bytes != old.queue_bytes and new.queue_bytes is not None:
            prev_queue = sh.queue_bytes
            steps.append(("queue", ("queue_bytes",), lambda: sh.set_queue(new.queue_bytes),
                          lambda: sh.set_queue(prev_queue)))
            if self.delay_client is not None:
                def line_queue(queue: int) -> None:
                    self.delay_client.request(m.LaneSet(lane=self.lane, link_queue_bytes=queue))
                steps.append(("the delay line's queue", (), lambda: line_queue(new.queue_bytes),
                              lambda: line_queue(prev_queue)))
        delay_changed = (new.delay_ms, new.jitter_ms) != (old.delay_ms, old.jitter_ms)
        if self.backends.delay == "netem":
            if delay_changed or new.loss != old.loss:
                prev_netem = sh.netem
                steps.append(("delay and loss (netem)", ("delay_ms", "jitter_ms", "loss"),
                              lambda: sh.set_netem(NetemParams(new.delay_ms, new.jitter_ms, new.loss)),
                              lambda: sh.set_netem(prev_netem)))
        elif delay_changed and self.delay_client is not None:
            def delay(p: Direction) -> None:
                self.delay_client.request(m.LaneSet(lane=self.lane, delay_ms=p.delay_ms, jitter_ms=p.jitter_ms))
            steps.append(("delay", ("delay_ms", "jitter_ms"), lambda: delay(new), lambda: delay(old)))
        if new.loss != old.loss:
            if new.loss > 0 and self.on_loss is not None:
                self.on_loss()  # lost per segment, as on a real path (module docstring)
            if self.backends.loss == "delayline":
                def loss(value: float) -> None:
                    self.delay_client.request(m.LaneSet(lane=self.lane, loss=value))
                steps.append(("loss", ("loss",), lambda: loss(new.loss), lambda: loss(old.loss)))
            elif self.backends.loss == "iptables":
                steps.append(("loss", ("loss",), lambda: self._set_iptables_loss(new.loss),
                              lambda: self._set_iptables_loss(old.loss)))
        return steps

    def _set_iptables_loss(self, loss: float) -> None:
        chain = self._loss_chain
        cmds = []
        if not self._loss_installed:  # idempotent: a failed attempt may be repeated
            cmds.append(f"(iptables -w -N {chain} 2>/dev/null || true) && "
                        f"(iptables -w -C FORWARD -o {self.ifname} -j {chain} 2>/dev/null || "
                        f"iptables -w -A FORWARD -o {self.ifname} -j {chain})")
        cmds.append(f"iptables -w -F {chain}")
        if loss > 0:
            cmds.append(
                f"iptables -w -A {chain} -m statistic --mode random --probability {loss:.6f} -j DROP"
            )
        out = self.router.cmd(" && ".join(cmds) + " && echo gtb-ok")
        if "gtb-ok" not in out:
            raise NetworkError(f"{self.src}->{self.dst}: setting loss failed: {out.strip().splitlines()[-1:]}")
        self._loss_installed = True

    def counters(self) -> Counters:
        """Bytes and packets sent on the link so far, drops, backlog, per traffic class."""
        return self.shaper.counters()

    def add_class(self, name: str, matches: list[tuple[str | None, str | None]], share: float = 0.0) -> None:
        """Classify packets by (src, dst) host address into a class with a guaranteed share."""
        self.shaper.add_class(name, matches, share)

    def set_shares(self, shares: dict[str, float]) -> None:
        self.shaper.set_shares(shares)

    def delay_line_stats(self, turns_since: int | None = None) -> dict | None:
        if self.delay_client is None:
            return None
        return self.delay_client.request(m.LaneStats(lane=self.lane, turns_since=turns_since)).lanes[self.lane]

    # -- temporal sharing: the strict-priority scheduler inside the delay line --------------
    def schedule_classes(self, classes: dict[str, list[tuple[str | None, str | None]]],
                         queue_bytes: int | None = None) -> None:
        """Put per-class (per-pipeline) queues served owner-first in front of this link.
        ``classes``: name -> (src, dst) address pairs (None = any).  See ``delayline.py``."""
        self._sched({"classes": {n: [list(x) for x in ms] for n, ms in classes.items()},
                     "rate_mbps": self.params.rate_mbps, "queue_bytes": queue_bytes})  # None: the line sizes it

    def set_order(self, order: list[str]) -> None:
        """Strict priority: the first class with data owns the link."""
        self._sched({"order": list(order), "turns": None})

    def set_turns(self, t0: float, period_s: float, slots: list[tuple[str, float, float]]) -> None:
        """The owner from the clock: ``slots`` (class, start, end) repeat every ``period_s``
        from ``t0`` (CLOCK_MONOTONIC, which every namespace shares)."""
        self._sched({"turns": {"t0": t0, "period_s": period_s, "slots": [list(x) for x in slots]}})

    @property
    def control_path(self) -> str | None:
        """The delay line's control socket (agents talk to it directly), if it is in the path."""
        return self.delay_client.control_path if self.delay_client is not None else None

    def clear_schedule(self) -> None:
        """Back to one FIFO: fair sharing by TCP.  Nothing queued is lost."""
        if self.delay_client is not None:
            self._sched({"classes": None})

    def _sched(self, msg: dict) -> None:
        """``msg``: the fields of a ``LaneSet`` for this lane."""
        if self.delay_client is None:
            raise NetworkError(f"{self.src}->{self.dst}: temporal sharing needs the delay line in the path "
                               "(Network(..., scheduling=True) puts it there on a netem kernel)")
        self.delay_client.request(m.LaneSet(lane=self.lane, **msg))


class Network(HostIndex):
    """Build, run and tear down one topology.  Use as a context manager."""

    def __init__(
        self,
        topo: Topology,
        delay_backend: str = "auto",
        loss_backend: str = "auto",
        compensation_ms: float = DEFAULT_COMPENSATION_MS,
        realtime: bool = True,
        caps: Capabilities | None = None,
        progress: Callable[[str], None] | None = None,
        scheduling: bool = False,
        dcs: list[str] | None = None,
        tunnels: dict[tuple[str, str], "Tunnel"] | None = None,
        mtu: int | None = None,
        time_dilation: float = 1.0,
        seed: int | None = None,
    ):
        """``seed``: the delay lines' random draws (loss, jitter); by default a fresh one per
        network (``self.seed`` says which), so a measurement taken again is a new sample.
        ``dcs``: the DCs built here (default all: one machine); a WAN link with one end
        elsewhere must have a ``tunnels[(local, remote)]``.  ``mtu``: every emulated
        interface's MTU (across machines: the underlay's less the VXLAN header).
        ``time_dilation``: k, the emulated world runs k times slower than the wall clock: the
        wire carries ``topology.dilated(topo, k)`` (``topo`` stays as ``emulated_topo``) and
        the hosts' TCP retransmission floor (``rto_min``, per route) is k times Linux's 200 ms."""
        if not 1.0 <= time_dilation <= 1000.0:
            raise NetworkError(f"time_dilation: {time_dilation:g} is not between 1 and 1000")
        self.time_dilation = float(time_dilation)
        self.seed = int(seed) if seed is not None else random.SystemRandom().randrange(2**31)
        self.emulated_topo = topo
        topo = dilated(topo, self.time_dilation)
        self.topo = topo
        names = [dc.name for dc in topo.dcs]
        self.local = [d for d in names if dcs is None or d in dcs]
        self.tunnels = dict(tunnels or {})
        for link in topo.wan:
            for a, b in ((link.a, link.b), (link.b, link.a)):
                if a in self.local and b not in self.local and (a, b) not in self.tunnels:
                    raise NetworkError(f"WAN link {a} - {b}: {b} is on another machine and no tunnel leads there")
        self.mtu = mtu
        self._senders_segmented = False
        self.caps = caps or probe()
        require_runtime(self.caps)
        self.backends = choose_backends(self.caps, delay_backend, loss_backend)
        self.compensation_ms = compensation_ms
        self.realtime = realtime
        # the delay line is in every WAN path when it emulates delay (no netem), or when asked
        # for its per-pipeline scheduler (temporal sharing) on a kernel that delays with netem
        self._lanes = self.backends.delay == "tun" or scheduling
        self.registry = Registry()
        self._progress = progress or (lambda msg: None)
        self._nodes: list[Any] = []  # every Mininet host made here (gateways too), in order
        self._hosts: dict[str, list[HostInfo]] = {}
        self._routers: dict[str, Any] = {}
        self._iprs: dict[str, Any] = {}
        self._links: dict[tuple[str, str], WanDirection] = {}
        self._delay_procs: dict[str, Process] = {}  # started by ``_lines``, the same launcher class as a lab's
        self._lines: Launcher | None = None
        self._clients: list[_DelayLineClient] = []
        self._popened: list[subprocess.Popen] = []
        self._index = {dc.name: i + 1 for i, dc in enumerate(topo.dcs)}  # global: every machine agrees
        self._wan_addr: dict[tuple[str, str], str] = {}
        self._tunnel_addr: dict[tuple[str, str], str] = {}  # (local, remote): the local end's address
        self.started = False
        self.startup_s = 0.0
        self._owner_pid: int | None = None

    # -- names and addresses ----------------------------------------------------------
    def _node_name(self, dc: str, kind: str, j: int | None = None) -> str:
        return f"{PREFIX}{self._index[dc]}{kind}{'' if j is None else j}"

    def _wan_ifname(self, src: str, dst: str) -> str:
        return f"{PREFIX}{self._index[src]}r-w{self._index[dst]}"

    def _lane_name(self, src: str, dst: str) -> str:
        return f"{PREFIX}{self._index[src]}t{self._index[dst]}"

    def subnet(self, dc: str) -> str:
        return f"10.{self._index[dc]}.0.0/24"

    def gateway_ip(self, dc: str) -> str:
        return f"10.{self._index[dc]}.0.254"

    # -- public queries -------------------------------------------------------------
    def router(self, dc: str) -> Any:
        return self._routers[dc]

    def link(self, src: str, dst: str) -> WanDirection:
        try:
            return self._links[(src, dst)]
        except KeyError:
            raise NetworkError(f"no WAN link {src} -> {dst}") from None

    def links(self) -> list[WanDirection]:
        return list(self._links.values())

    def delay_line_pids(self) -> dict[str, int]:
        """The delay-line process of each DC gateway that has one (its CPU can be measured)."""
        return {dc: p.pid for dc, p in self._delay_procs.items()}

    # -- faults -----------------------------------------------------------------------
    def check(self) -> None:
        """Raise NetworkError naming the links when a delay line has died: without it policy
        routing falls through to the direct route, and its links would carry traffic
        without their delay (and without Atlas's scheduler), silently."""
        for dc, proc in self._delay_procs.items():
            code = proc.poll()
            if code is None:
                continue
            links = [f"{dc} -> {nb}" for nb in self._neighbours(dc)]
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise NetworkError(f"WAN link{'s' if len(links) > 1 else ''} {', '.join(links)}: the delay line in "
                               f"{dc}'s gateway died ({how}); the link{'s' if len(links) > 1 else ''} would carry "
                               f"traffic without {'their' if len(links) > 1 else 'its'} delay")

    def _ip(self, dc: str, *args: str) -> subprocess.CompletedProcess:
        """``ip ARGS`` inside DC ``dc``'s gateway (safe from any thread: its own process)."""
        return subprocess.run(["nsenter", "-t", str(self._routers[dc].pid), "-n", "ip", *args],
                              capture_output=True, text=True, timeout=10)

    def link_state(self, src: str, dst: str) -> str:
        """"up", "down" (the interface, or its peer, is down) or "delay line dead" for the
        WAN direction src -> dst."""
        self.link(src, dst)
        proc = self._delay_procs.get(src)
        if proc is not None and proc.poll() is not None:
            return "delay line dead"
        out = self._ip(src, "-j", "link", "show", "dev", self._wan_ifname(src, dst))
        try:
            flags = json.loads(out.stdout)[0]["flags"]
        except (ValueError, IndexError, KeyError):
            return "down"
        return "up" if "UP" in flags and "LOWER_UP" in flags else "down"

    def set_link_up(self, a: str, b: str, up: bool) -> None:
        """Take the WAN link between ``a`` and ``b`` down, both directions (both gateways'
        interfaces: a cut fibre), or bring it back.  Going down, the kernel drops every route
        through the link; coming back, they are put back, so traffic flows again (TCP
        resumes at its next retransmission)."""
        self.link(a, b)
        for src, dst in ((a, b), (b, a)):
            res = self._ip(src, "link", "set", "dev", self._wan_ifname(src, dst), "up" if up else "down")
            if res.returncode:
                raise NetworkError(f"WAN link {src} -> {dst}: cannot set it {'up' if up else 'down'}: "
                                   f"{res.stderr.strip() or res.returncode}")
        if up:
            deadline = time.monotonic() + 5.0
            while any(self.link_state(x, y) == "down" for x, y in ((a, b), (b, a))) and time.monotonic() < deadline:
                time.sleep(0.01)  # the carrier follows both ends up
            for dc in (a, b):
                self._restore_routes(dc)

    def _restore_routes(self, dc: str) -> None:
        hops = self.topo.next_hops(dc)
        for other in self.topo.dcs:
            if other.name == dc:
                continue
            via = self._wan_addr[(dc, hops[other.name])]
            res = self._ip(dc, "route", "replace", self.subnet(other.name), "via", via)
            if res.returncode:
                raise NetworkError(f"{dc}: cannot restore the route to {other.name} via {via}: {res.stderr.strip()}")

    def popen(self, host: HostInfo | Any, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start a process inside a host; it is recorded and ended by stop()/clean."""
        node = host.node if isinstance(host, HostInfo) else host
        proc = node.popen(cmd, **kwargs)
        self.registry.process(proc.pid, f"popen:{node.name}", own_netns=False)
        self._popened.append(proc)
        return proc

    def tcp_counters(self) -> dict[str, dict[str, int]]:
        """Each host's TCP counters (its namespace's own ``/proc/net/snmp`` and ``netstat``):
        segments sent and retransmitted, retransmission timeouts, tail-loss probes and fast
        retransmits.  What a run's transfers cost in loss recovery, which no simulator models."""
        out = {}
        for h in self.hosts():
            res = subprocess.run(["nsenter", "-t", str(h.node.pid), "-n", "cat", "/proc/net/snmp",
                                  "/proc/net/netstat"], capture_output=True, text=True, timeout=10)
            if res.returncode == 0:
                out[h.name] = _tcp_counters(res.stdout)
        return out

    # -- lifecycle ------------------------------------------------------------------
    def __enter__(self) -> "Network":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Network":
        t0 = time.monotonic()
        self._owner_pid = os.getpid()
        self.registry.acquire()
        try:
            self._build()
        except BaseException:
            self.stop()
            raise
        self.started = True
        self.startup_s = time.monotonic() - t0
        return self

    def _host_tcp_problem(self) -> str | None:
        """Why the hosts cannot run cubic TCP (None when they can): a new namespace starts with
        the machine's default congestion control and may switch only to an allowed one."""
        try:
            allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
        except OSError:
            return None  # no such file: nothing to check
        if "cubic" in allowed:
            return None
        return (f"the emulated hosts' TCP must be cubic, and this machine lets a namespace choose only "
                f"{' '.join(allowed)} (net.ipv4.tcp_allowed_congestion_control; testbed provision adds cubic)")

    def _build(self) -> None:
        """Hosts and gateways are Mininet hosts (a shell in a network namespace of its own,
        started all at once); the DC bridges, the veth pairs and the addresses are made here
        through netlink and the shells in parallel, not by Mininet's ``Link``, which runs a few
        shell commands per interface one after the other (``_wire``)."""
        why = self._host_tcp_problem()
        if why:
            raise NetworkError(why)
        Host = _import_mininet()
        topo = self.topo
        self._progress("creating hosts")
        for dc in topo.dcs:
            if dc.name not in self.local:
                continue
            i = self._index[dc.name]
            router = Host(self._node_name(dc.name, "r"))
            self._nodes.append(router)
            self.registry.process(router.pid, f"router:{dc.name}")
            self._routers[dc.name] = router
            self._hosts[dc.name] = []
            for j in range(1, dc.hosts + 1):
                name = self._node_name(dc.name, "h", j)
                node = Host(name)
                self._nodes.append(node)
                self.registry.process(node.pid, f"host:{dc.name}")
                self._hosts[dc.name].append(HostInfo(dc.name, j - 1, name, f"10.{i}.0.{j}", node))
        _finish_shells(self._nodes)
        wan: list[tuple[str, str, str, str]] = []  # (dc a, dc b, a's address, b's address)
        for n, link in enumerate(topo.wan):
            base = ipaddress.ip_address("10.255.0.0") + 4 * n
            a_ip, b_ip = f"{base + 1}", f"{base + 2}"
            here = [d for d in (link.a, link.b) if d in self.local]
            if link.a in here:
                self._wan_addr[(link.a, link.b)] = b_ip  # next-hop address seen from a
            if link.b in here:
                self._wan_addr[(link.b, link.a)] = a_ip
            if len(here) < 2:  # one end elsewhere: a VXLAN, made once the gateway exists
                if here:
                    self._tunnel_addr[(here[0], link.b if here[0] == link.a else link.a)] = \
                        a_ip if here[0] == link.a else b_ip
                continue
            wan.append((link.a, link.b, a_ip, b_ip))
        self._progress("creating links")
        self._wire(wan, self._host_commands() | self._router_commands())
        self._quiet_root_side()
        self._progress("configuring gateways")
        self._configure_routers()
        # the delay lines start (each a Python process) while the WAN links are shaped here;
        # the routes into their lanes need the lanes, which exist once each line says ready
        self._lines = Launcher(self.registry, self)
        try:
            with self._lines.together():
                if self._lanes:
                    self._start_delay_lines()
                self._progress("shaping WAN links")
                self._shape_links()
        except ProcessError as exc:
            raise NetworkError(f"a delay line failed to start: {exc}") from None
        self._install_routes()
        self._connect_delay_lines()

    def _wire(self, wan: list[tuple[str, str, str, str]],
              then: dict[Any, tuple[dict[str, str], list[str], str]]) -> None:
        """Each DC's bridge with a veth to every host and to the gateway, a veth between the two
        gateways of each WAN link, every end up with its address (Mininet's names: a host's
        end ``NAME-eth0``, a bridge port ``BRIDGE-ethK``, a WAN end ``_wan_ifname``), then
        each node's ``then`` command, in the same round of every shell at once."""
        from pyroute2 import IPRoute

        def ns(node) -> str:
            return f"/proc/{node.pid}/ns/net"

        per_node: dict[Any, list[str]] = {node: ["link set lo up"] for node in self._nodes}  # ip -batch lines
        with IPRoute() as ipr:
            for dc in self.topo.dcs:
                if dc.name not in self.local:
                    continue
                i = self._index[dc.name]
                bridge = self._node_name(dc.name, "s")
                self.registry.link(bridge)
                ipr.link("add", ifname=bridge, kind="bridge")
                master = ipr.link_lookup(ifname=bridge)[0]
                members = [(self._routers[dc.name], f"10.{i}.0.254/24")] + \
                          [(h.node, f"{h.ip}/24") for h in self._hosts[dc.name]]
                for k, (node, cidr) in enumerate(members, start=1):
                    port, inside = f"{bridge}-eth{k}", f"{node.name}-eth0"
                    # one request: the pair made, its far end in the node, its near end on the bridge and up
                    ipr.link("add", ifname=port, kind="veth", master=master, state="up",
                             peer={"ifname": inside, "net_ns_fd": ns(node)})
                    per_node[node] += [f"addr add {cidr} dev {inside}", f"link set {inside} up"]
                ipr.link("set", index=master, state="up")
            for a, b, a_ip, b_ip in wan:
                ra, rb = self._routers[a], self._routers[b]
                end_a, end_b = self._wan_ifname(a, b), self._wan_ifname(b, a)
                ipr.link("add", ifname=end_a, kind="veth", net_ns_fd=ns(ra),  # both ends made in place
                         peer={"ifname": end_b, "net_ns_fd": ns(rb)})
                per_node[ra] += [f"addr add {a_ip}/30 dev {end_a}", f"link set {end_a} up"]
                per_node[rb] += [f"addr add {b_ip}/30 dev {end_b}", f"link set {end_b} up"]
        cmds = {}
        for node, lines in per_node.items():
            sysctls, more, shell = then.get(node, ({}, [], ""))
            # sysctls written by the shell itself and one ``ip`` for the rest: few processes per node
            writes = [f"echo '{v}' > /proc/sys/{k.replace('.', '/')}" for k, v in sysctls.items()]
            batch = " ".join(f"'{x}'" for x in lines + more)
            cmds[node] = "; ".join(writes + [f"ip -batch <(printf '%s\\n' {batch})"] + ([shell] if shell else []))
        _in_every_shell(cmds, "configuring interfaces")

    def _quiet_root_side(self) -> None:
        """Our interfaces in the root namespace carry no IP: switch off IPv6 there too."""
        for name in os.listdir("/sys/class/net"):
            if name.startswith(PREFIX):
                try:
                    with open(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6", "w") as fh:
                        fh.write("1")
                except OSError:
                    pass

    def _host_commands(self) -> dict[Any, tuple[dict[str, str], list[str], str]]:
        """Each host's settings: (sysctls, ``ip -batch`` lines, a shell command): IPv6 off, TCP
        cubic with WAN-sized buffers, its default route, its MTU and shaping."""
        cmds = {}
        for dc in self.topo.dcs:
            if dc.name not in self.local:
                continue
            gw = self.gateway_ip(dc.name)
            rate = self.topo.intra_dc.rate_mbps
            for h in self._hosts[dc.name]:
                sysctls = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1",
                           "net.ipv4.tcp_congestion_control": "cubic", "net.ipv4.tcp_no_metrics_save": "1",
                           "net.ipv4.tcp_rmem": _TCP_MEM, "net.ipv4.tcp_wmem": _TCP_MEM}
                rto = f" rto_min {_RTO_MIN_MS * self.time_dilation:.0f}ms" if self.time_dilation != 1 else ""
                ip = [f"route add default via {gw}{rto}"]
                if self.mtu:
                    ip.append(f"link set dev {h.name}-eth0 mtu {self.mtu}")
                shell = ""
                if rate > 0:
                    burst = max(32000, int(rate * 1e6 / 8 * 0.002))
                    shell = f"tc qdisc add dev {h.name}-eth0 root tbf rate {rate}mbit burst {burst} latency 20ms"
                cmds[h.node] = (sysctls, ip, shell)
        return cmds

    def _router_commands(self) -> dict[Any, tuple[dict[str, str], list[str], str]]:
        """Each gateway's settings: it forwards, with no reverse-path filter or redirects."""
        sysctls = {"net.ipv4.ip_forward": "1", "net.ipv4.conf.all.rp_filter": "0",
                   "net.ipv4.conf.default.rp_filter": "0", "net.ipv6.conf.all.disable_ipv6": "1",
                   "net.ipv6.conf.default.disable_ipv6": "1", "net.ipv4.conf.all.send_redirects": "0",
                   "net.ipv4.conf.default.send_redirects": "0"}
        return {router: (sysctls, [], "for f in /proc/sys/net/ipv4/conf/*/rp_filter; do echo 0 > $f; done")
                for router in self._routers.values()}

    def _configure_routers(self) -> None:
        from pyroute2 import IPRoute

        for dc, router in self._routers.items():
            self._iprs[dc] = IPRoute(netns=f"/proc/{router.pid}/ns/net", flags=0)
        self._make_tunnels()
        if self.mtu:
            for dc, ipr in self._iprs.items():
                for link in ipr.get_links():
                    if link.get_attr("IFLA_IFNAME") != "lo":
                        ipr.link("set", index=link["index"], mtu=self.mtu)

    def _segment_senders(self) -> None:
        """Every host here sends single-segment packets from now on (``gso_max_segs`` 1 on its
        interface: TCP sizes its packets by the route's device), so loss hits segments, not
        GSO bundles (module docstring).  Once per network; it costs the delay line a packet
        per segment on the lossy network only."""
        if self._senders_segmented:
            return
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        self._senders_segmented = True
        for dc in self.local:
            for h in self._hosts[dc]:
                with IPRoute(netns=f"/proc/{h.node.pid}/ns/net", flags=0) as ipr:
                    idx = ipr.link_lookup(ifname=f"{h.name}-eth0")
                    try:
                        if idx:
                            ipr.link("set", index=idx[0], gso_max_segs=1)
                    except NetlinkError as exc:  # a kernel that will not change it on a live link
                        self._progress(f"warning: this kernel keeps GSO on {h.name} ({exc.args[-1]}): "
                                       "loss will hit bundles of segments, not single ones")
                        return

    def _make_tunnels(self) -> None:
        """Each WAN link to a DC on another machine: a unicast VXLAN made in this machine's
        own namespace on its underlay (its UDP socket stays there), then moved into the
        gateway's namespace and named as the veth would have been: shaping, delay and loss
        stay at the sending gateway, as on one machine."""
        if not self.tunnels:
            return
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            for (dc, other), t in self.tunnels.items():
                if dc not in self.local:
                    continue
                found = ipr.get_addr(address=t.local_ip)
                if not found:
                    raise NetworkError(f"underlay address {t.local_ip} is on no interface of this machine")
                tmp = f"{PREFIX}{self._index[dc]}v{self._index[other]}"
                self.registry.link(tmp)
                ipr.link("add", ifname=tmp, kind="vxlan", vxlan_id=t.vni, vxlan_group=t.remote_ip,
                         vxlan_local=t.local_ip, vxlan_link=found[0]["index"], vxlan_port=t.port,
                         vxlan_learning=0)
                idx = ipr.link_lookup(ifname=tmp)[0]
                ipr.link("set", index=idx, net_ns_fd=f"/proc/{self._routers[dc].pid}/ns/net")
                rip = self._iprs[dc]
                idx = rip.link_lookup(ifname=tmp)[0]
                rip.link("set", index=idx, ifname=self._wan_ifname(dc, other), mtu=t.mtu)
                rip.addr("add", index=idx, address=self._tunnel_addr[(dc, other)], prefixlen=30)
                rip.link("set", index=idx, state="up")

    def _neighbours(self, dc: str) -> list[str]:
        return [d for (s, d) in self._wan_addr if s == dc]

    def _start_delay_lines(self) -> None:
        """One delay line per gateway with WAN links, in the gateway, started by the network's
        own ``Launcher`` (the class a lab starts its processes with) inside its ``together()``
        block: the caller's block waits for every line's ``ready``."""
        state = self.registry.dir
        for dc, router in self._routers.items():
            lanes = []
            for nb in self._neighbours(dc):
                p = self.topo.direction(dc, nb)
                delays = self.backends.delay == "tun"  # else netem delays and the line only schedules
                lanes.append({"name": self._lane_name(dc, nb), "delay_ms": p.delay_ms if delays else 0.0,
                              "jitter_ms": p.jitter_ms if delays else 0.0,
                              "loss": p.loss if self.backends.loss == "delayline" else 0.0,
                              "rate_mbps": p.rate_mbps,
                              "link_queue_bytes": default_queue_bytes(p, self.topo.rtt_ms(dc, nb))})
            if not lanes:
                continue
            control = state / f"{router.name}.sock"
            self.registry.file(control)
            cfg = {"lanes": lanes, "control_path": str(control), "compensation_ms": self.compensation_ms,
                   "seed": self.seed * 1009 + self._index[dc], "realtime": self.realtime}
            self._delay_procs[dc] = self._lines.start(f"delayline-{dc}", "testbed.net.delayline", cfg, router=dc,
                                                      ready=True, ready_timeout=_DELAYLINE_START_TIMEOUT_S)

    def _route_batch(self, dc: str) -> list[str]:
        """``dc``'s gateway routes, as ``ip -batch`` lines: to each other DC by the shortest-delay
        next hop; with delay-line lanes, policy routing sends what leaves for a WAN link into its
        lane first and what comes back out of the lane to the main table."""
        lines = []
        hops = self.topo.next_hops(dc)
        neighbours = self._neighbours(dc)
        if self._lanes:
            for n, nb in enumerate(neighbours):
                lane = self._lane_name(dc, nb)
                lines += [f"link set dev {lane} up txqueuelen 10000",
                          f"route add 0.0.0.0/0 dev {lane} table {1000 + n}",
                          f"rule add iif {lane} table 254 priority 100"]
        for other in self.topo.dcs:
            if other.name == dc:
                continue
            nh = hops[other.name]
            lines.append(f"route add {self.subnet(other.name)} via {self._wan_addr[(dc, nh)]}")
            if self._lanes:
                lines.append(f"rule add to {self.subnet(other.name)} table {1000 + neighbours.index(nh)} priority 200")
        return lines

    def _install_routes(self) -> None:
        """Every gateway's routes at once: one ``ip -batch`` file per gateway, run by all the
        gateways' shells in parallel (a netlink request from Python per route was a quarter of
        a large network's start-up)."""
        cmds = {}
        for dc, router in self._routers.items():
            path = self.registry.dir / f"{router.name}.routes"
            path.write_text("\n".join(self._route_batch(dc)) + "\n")
            self.registry.file(path)
            cmds[router] = f"ip -batch {path}"
        _in_every_shell(cmds, "installing routes")

    def _shape_links(self) -> None:
        """Each WAN direction's tc tree on its sending gateway: every gateway's trees as one
        ``tc -batch`` file, run by all the gateways' shells at once (netem trees through
        pyroute2, ``EgressShaper.install``)."""
        indices = {dc: {link.get_attr("IFLA_IFNAME"): link["index"] for link in ipr.get_links()}
                   for dc, ipr in self._iprs.items()}
        batches: dict[str, list[str]] = {}
        for src, dst, params in self.topo.directions():
            if src not in self.local:
                continue
            rtt = params.delay_ms + self.topo.direction(dst, src).delay_ms
            queue = default_queue_bytes(params, rtt)
            netem = (
                NetemParams(params.delay_ms, params.jitter_ms, params.loss) if self.backends.delay == "netem" else None
            )
            ifname = self._wan_ifname(src, dst)
            shaper = EgressShaper(self._iprs[src], ifname, params.rate_mbps, queue, netem, index=indices[src][ifname])
            lines = shaper.install_commands()
            if lines is None:
                shaper.install()
            else:
                batches.setdefault(src, []).extend(lines)
            wd = WanDirection(
                src, dst, params, self._wan_ifname(src, dst), self._routers[src], shaper, self.backends,
                _loss_chain=f"GTB-LOSS-{self._index[dst]}",
            )
            if self._lanes:
                wd.lane = self._lane_name(src, dst)
            wd.on_loss = self._segment_senders
            if params.loss > 0:
                self._segment_senders()
            if params.loss > 0 and self.backends.loss == "iptables":
                wd._set_iptables_loss(params.loss)
            self._links[(src, dst)] = wd
        cmds = {}
        for dc, lines in batches.items():
            path = self.registry.dir / f"{self._routers[dc].name}.tc"
            path.write_text("\n".join(lines) + "\n")
            self.registry.file(path)
            cmds[self._routers[dc]] = f"tc -batch {path}"
        _in_every_shell(cmds, "shaping WAN links")

    def _connect_delay_lines(self) -> None:
        """A control client per delay line (ready by now), given to its WAN directions."""
        if self._lanes:
            for dc in self._delay_procs:
                client_path = self.registry.dir / f"client-{os.getpid()}-{self._index[dc]}.sock"
                client = _DelayLineClient(self.registry.dir / f"{self._routers[dc].name}.sock", client_path)
                self.registry.file(client_path)
                self._clients.append(client)
                for nb in self._neighbours(dc):
                    self._links[(dc, nb)].delay_client = client

    def stop(self) -> None:
        """Remove everything this network made.  Safe to call twice.

        Ctrl-C and SIGTERM are held back while it runs: an interrupted clean-up is
        what leaves things behind.
        """
        if self._owner_pid not in (None, os.getpid()):
            return  # a forked helper (pyroute2 forks to enter namespaces) must not tear down
        with _signals_deferred():
            self._stop()

    def _stop(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()
        stop_all(self._popened)  # the delay lines among them (``Launcher`` starts them through ``popen``)
        self._popened.clear()
        self._delay_procs.clear()
        for ipr in self._iprs.values():
            try:
                ipr.close()
            except Exception:
                pass
        self._iprs.clear()
        # Ending the shells removes their namespaces and veth pairs; clean() removes the
        # bridges (and whatever a crash left).
        for node in self._nodes:
            try:
                node.terminate()
            except Exception:
                pass
        self._nodes.clear()
        from testbed.registry import clean

        clean(self.registry.dir, holding_lock=True)
        self.registry.release()
        self.started = False


class _signals_deferred:
    """Hold SIGINT/SIGTERM until the block ends (main thread only), then re-deliver."""

    def __enter__(self):
        import signal
        import threading

        self._saved = {}
        self._pending = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, lambda s, f: self._pending.append(s))
        return self

    def __exit__(self, *exc):
        import signal

        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        for sig in self._pending[:1]:
            signal.raise_signal(sig)


_TCP_COUNTERS = {("Tcp", "OutSegs"): "out_segments", ("Tcp", "RetransSegs"): "retransmitted_segments",
                 ("TcpExt", "TCPTimeouts"): "timeouts", ("TcpExt", "TCPLossProbes"): "loss_probes",
                 ("TcpExt", "TCPFastRetrans"): "fast_retransmits"}


def _tcp_counters(text: str) -> dict[str, int]:
    """The counters ``_TCP_COUNTERS`` names, from /proc/net/snmp + netstat text (header line, value line)."""
    lines = [ln.split() for ln in text.splitlines() if ln.strip()]
    out = {}
    for head, vals in zip(lines, lines[1:]):
        if not head or head[0] != vals[0] or head[1:] == vals[1:]:
            continue
        proto = head[0].rstrip(":")
        for key, value in zip(head[1:], vals[1:]):
            name = _TCP_COUNTERS.get((proto, key))
            if name:
                out[name] = int(value)
    return out
