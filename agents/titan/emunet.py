"""The dual-path network: Azure regions as testbed DCs on a WAN backbone, plus Internet paths.

How it fits: the WAN half is a testbed ``Lab`` (``testbed/run/lab.py``) of ``topology_data``:
every region of a ``World`` (user regions and media-server DCs) is a testbed DC with
participant hosts and, where it hosts a DC, one media-server host behind its gateway router
(``participant_hosts``, ``server_host``); the backbone's edges are WAN links with half the
edge's P95 RTT as one-way delay each way, a shaped rate, and counters
(``WanDirection.counters``) that give each WAN link's load.  The testbed routes DC to DC over
the direct link if there is one, else along the shortest-delay path: the rule
``regions.Backbone`` plans with, checked pair by pair before the Internet half is built.

The Internet half is ``InternetPaths``, built on that lab's network and registry (so the
lab's ``down()`` and ``testbed clean`` remove it); it owns no network and no process:

* a hub namespace ``gtbti`` ("the Internet", ``Lab.netns``), joined to every gateway router
  by a veth pair (``gtbti<i>`` on the hub, ``gtbtr<i>`` on router i, 10.254.i.0/30);
* a TUN delay line (``testbed.net.delayline``, started in the hub through the lab's
  launcher) with one lane per ordered (region, region) pair that has an Internet path: the
  pair's modelled one-way Internet delay, jitter and loss (``regions.AzureWan.internet_rtt``;
  the spec's overrides); policy routing in the hub sends packets from subnet a to subnet b
  through lane (a, b);
* marks and policy routing in every gateway: a packet from the router's own hosts with DSCP
  CS1 (``media.INTERNET_TOS``, set by the sender per call) is marked by an iptables mangle
  rule (chain ``GTB-TITAN``) and routed by an ``ip rule fwmark`` to the hub instead of onto
  the WAN; everything else takes the testbed's WAN routes.

So a call's route is chosen by its packets' DSCP and enforced by the routers; which links
its packets really left on is counted per stream by ``routecheck`` processes in every
router and in the hub.  Addresses exist only inside these namespaces; nothing routes out.
"""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from testbed import messages as m
from testbed.net.network import HostInfo, NetworkError
from testbed.procutil import DatagramClient
from testbed.run.lab import Lab

from agents.titan.media import INTERNET_TOS
from agents.titan.regions import World
from agents.titan.spec import EmulationSpec, TitanError

HUB_NS = "gtbti"
MARK = 0x7A
_TABLE_HUB = 3000
_TABLE_LANE0 = 4000


@dataclass
class InternetLane:
    name: str
    src: str  # region
    dst: str
    delay_ms: float
    jitter_ms: float
    loss: float


def topology_data(world: World, spec: EmulationSpec) -> dict[str, Any]:
    """The testbed topology (as YAML data) for a world: regions as DCs, backbone edges as links."""
    regions = world.backbone.nodes
    dcs = []
    for r in regions:
        hosts = (spec.hosts_per_region if r in world.users else 0) + (1 if r in world.dcs else 0)
        dcs.append({"name": r, "hosts": hosts})
    wan = [{"a": a, "b": b, "delay_ms": round(rtt / 2.0, 3), "rate_mbps": spec.wan_rate_mbps}
           for a, b, rtt in world.backbone.edges]
    return {"name": spec.name, "description": "Titan emulation: Azure regions on their P95-RTT backbone",
            "dcs": dcs, "wan": wan}


def participant_hosts(lab: Lab, world: World, spec: EmulationSpec, region: str) -> list[HostInfo]:
    """The participant hosts of a user region (none in a region without users)."""
    return lab.hosts(region)[: spec.hosts_per_region] if region in world.users else []


def server_host(lab: Lab, dc: str) -> HostInfo:
    """The media-server host of a DC: the last host of its region."""
    return lab.hosts(dc)[-1]


class InternetPaths:
    """The Internet half, built on a lab that is up (``testbed.run.lab.Lab`` of
    ``topology_data``): the hub namespace, its veths, the hub's delay line, marks and policy
    routing.  It owns no network and no process: everything is recorded in the lab's
    registry and started through the lab's launcher, so the lab's ``down()`` removes it."""

    def __init__(self, lab: Lab, world: World, spec: EmulationSpec,
                 progress: Callable[[str], None] | None = None):
        self.lab = lab
        self.world = world
        self.spec = spec
        self._progress = progress or (lambda m: None)
        self.lanes: dict[tuple[str, str], InternetLane] = {}
        self._hub_ctl: ControlClient | None = None
        self.index = {r: int(lab.net.subnet(r).split(".")[1]) for r in world.backbone.nodes}

    def hub_ifname(self, region: str) -> str:
        return f"{HUB_NS}{self.index[region]}"

    def router_hub_ifname(self, region: str) -> str:
        return f"gtbtr{self.index[region]}"

    # -- building and closing ------------------------------------------------------------
    def build(self) -> "InternetPaths":
        self._check_routes()
        self._progress("building the Internet paths")
        try:
            self._build_internet()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Hang up on the hub's delay line (it, the hub and the rest go with the lab)."""
        if self._hub_ctl is not None:
            self._hub_ctl.close()
            self._hub_ctl = None

    def _check_routes(self) -> None:
        topo = self.lab.topo
        for u in self.world.users:
            for d in self.world.dcs:
                if u != d and self.world.backbone.path(u, d) != topo.path(u, d):
                    raise TitanError(f"emulation: the testbed routes {u}->{d} over {topo.path(u, d)}, "
                                     f"the plan over {self.world.backbone.path(u, d)}")

    def _run(self, cmd: list[str]) -> None:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise NetworkError(f"{' '.join(cmd[:6])}: {(res.stderr or res.stdout).strip().splitlines()[-1:]}")

    def _router(self, region: str, cmd: str) -> None:
        out = self.lab.net.router(region).cmd(cmd + " && echo gtb-ok")
        if "gtb-ok" not in out:
            raise NetworkError(f"router {region}: {cmd.split('&&')[0].strip()}: {out.strip().splitlines()[-1:]}")

    def _build_internet(self) -> None:
        net, reg = self.lab.net, self.lab.registry
        self.lab.netns(HUB_NS)
        hub = ["ip", "netns", "exec", HUB_NS]
        self._run(hub + ["sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
                         "net.ipv4.conf.default.rp_filter=0", "net.ipv6.conf.all.disable_ipv6=1",
                         "net.ipv6.conf.default.disable_ipv6=1"])
        for region, i in self.index.items():
            router = net.router(region)
            h_if, r_if = self.hub_ifname(region), self.router_hub_ifname(region)
            reg.link(h_if)
            reg.link(r_if)
            self._run(["ip", "link", "add", h_if, "netns", HUB_NS, "type", "veth", "peer", "name", r_if,
                       "netns", str(router.pid)])
            self._run(hub + ["ip", "addr", "add", f"10.254.{i}.1/30", "dev", h_if])
            self._run(hub + ["ip", "link", "set", h_if, "up"])
            self._run(hub + ["ip", "route", "add", net.subnet(region), "via", f"10.254.{i}.2"])
            subnet = net.subnet(region)
            self._router(region, " && ".join([
                f"sysctl -qw net.ipv4.conf.{r_if}.rp_filter=0",
                f"ip addr add 10.254.{i}.2/30 dev {r_if}",
                f"ip link set {r_if} up",
                f"ip route add default via 10.254.{i}.1 dev {r_if} table {_TABLE_HUB}",
                f"ip rule add from {subnet} fwmark {MARK:#x} lookup {_TABLE_HUB} priority 5",
                "iptables -w -t mangle -N GTB-TITAN",
                "iptables -w -t mangle -A PREROUTING -j GTB-TITAN",
                f"iptables -w -t mangle -A GTB-TITAN -s {subnet} -m dscp --dscp {INTERNET_TOS >> 2} "
                f"-j MARK --set-mark {MARK:#x}",
            ]))
        self._start_hub_lanes()

    def _lane_params(self, a: str, b: str) -> InternetLane:
        spec = self.spec
        one_way = self.world.wan.internet_rtt(a, b) / 2.0
        loss, jitter = spec.internet_loss, spec.internet_jitter_ms
        for o in spec.internet:
            if {self.world.wan.key(o.user), self.world.wan.key(o.dc)} == {a, b}:
                loss = o.loss if o.loss is not None else loss
                jitter = o.jitter_ms if o.jitter_ms is not None else jitter
                one_way += o.extra_delay_ms or 0.0
        name = f"gtbtl{self.index[a]}x{self.index[b]}"
        return InternetLane(name, a, b, one_way, min(jitter, one_way), loss)

    def _start_hub_lanes(self) -> None:
        net = self.lab.net
        pairs = sorted({(u, d) for u in self.world.users for d in self.world.dcs if u != d}
                       | {(d, u) for u in self.world.users for d in self.world.dcs if u != d})
        for a, b in pairs:
            self.lanes[(a, b)] = self._lane_params(a, b)
        control = self.lab.launcher.file(f"{HUB_NS}.sock")
        cfg = {"lanes": [{"name": ln.name, "delay_ms": ln.delay_ms, "jitter_ms": ln.jitter_ms, "loss": ln.loss}
                         for ln in self.lanes.values()],
               "control_path": str(control), "compensation_ms": net.compensation_ms, "seed": 254,
               "realtime": net.realtime}
        self.lab.start("titan-hub-delayline", "testbed.net.delayline", cfg, netns=HUB_NS, ready=True)
        batch = []
        for n, ln in enumerate(self.lanes.values()):
            table = _TABLE_LANE0 + n
            batch += [f"link set {ln.name} up txqlen 10000",
                      f"route add default dev {ln.name} table {table}",
                      f"rule add iif {ln.name} lookup main priority 100",
                      f"rule add from {net.subnet(ln.src)} to {net.subnet(ln.dst)} lookup {table} "
                      f"priority {200 + n}"]
        res = subprocess.run(["ip", "-n", HUB_NS, "-batch", "-"], input="\n".join(batch) + "\n",
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise NetworkError(f"hub routing: {res.stderr.strip().splitlines()[-1:]}")
        self._hub_ctl = self.control_client(control, f"{HUB_NS}-dl")

    def control_client(self, server: Path | str, tag: str, timeout: float = 5.0) -> "ControlClient":
        """A datagram client for an agent's control socket, its own path registered."""
        path = self.lab.registry.dir / f"{HUB_NS}-client-{os.getpid()}-{tag}.sock"
        self.lab.registry.file(path)
        return ControlClient(Path(server), path, timeout)

    # -- run time ---------------------------------------------------------------------
    def set_internet(self, a: str, b: str, **changes: float) -> None:
        """Change an Internet path (both directions) now: delay_ms (one-way), jitter_ms, loss."""
        for src, dst in ((a, b), (b, a)):
            lane = self.lanes.get((src, dst))
            if lane is None:
                raise TitanError(f"no Internet path {src} -> {dst}")
            self._hub_ctl.request(m.LaneSet(lane=lane.name, **changes))
            for k, v in changes.items():
                setattr(lane, k, v)


class ControlClient(DatagramClient):
    """``testbed.procutil.DatagramClient`` to one agent's control socket (the delay line's and
    the agents' protocol), with room for large replies (a window's per-stream statistics)
    and a refusal raised as ``NetworkError``."""

    MAX_REPLY = 4 << 20

    def __init__(self, server: Path, path: Path, timeout: float = 5.0):
        super().__init__(path, timeout)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.MAX_REPLY)
        self.server = str(server)

    def request(self, msg: m.Message) -> m.Message:  # type: ignore[override]
        try:
            return super().request(self.server, msg, self.MAX_REPLY)
        except RuntimeError as exc:  # refused
            raise NetworkError(f"{self.server}: {exc}") from None

