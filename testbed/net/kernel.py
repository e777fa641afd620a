"""What this kernel offers, probed at run time, and which backend each feature uses.

How it fits: ``probe()`` tries each feature for real inside a throwaway network namespace
(``gtb-probe-PID``, removed before it returns): it creates a veth pair and attaches each
qdisc kind, opens a TUN device, adds an iptables ``statistic`` rule.  ``network.py`` asks
``choose_backends()`` which delay and loss mechanism to use; ``testbed doctor`` prints the
same table.  Nothing is assumed from the kernel version or config files: a module that is
present but fails to load counts as missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from testbed.registry import PREFIX

DELAY_BACKENDS = ("netem", "tun")
LOSS_BACKENDS = ("netem", "iptables", "delayline")


@dataclass
class Capabilities:
    root: bool
    qdiscs: dict[str, bool] = field(default_factory=dict)
    tun: bool = False
    iptables_statistic: bool = False
    veth: bool = False
    bridge_utils: bool = False
    mininet: bool = False
    iperf3: bool = False
    ping: bool = False
    cgroup_cpu: str | None = None
    errors: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Backends:
    delay: str
    loss: str
    rate: str = "htb"


class BackendUnavailable(RuntimeError):
    pass


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def _cgroup_cpu() -> str | None:
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        try:
            if "cpu" in open("/sys/fs/cgroup/cgroup.controllers").read().split():
                return "v2"
        except OSError:
            pass
    if os.path.exists("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") or os.path.exists(
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us"
    ):
        return "v1"
    return None


_DEBIAN_DIST_PACKAGES = "/usr/lib/python3/dist-packages"


def mininet_on_path() -> bool:
    """Debian's mininet is installed for the system interpreter; a venv needs its path."""
    try:
        import mininet.net  # noqa: F401

        return True
    except ImportError:
        if _DEBIAN_DIST_PACKAGES in sys.path or not os.path.isdir(f"{_DEBIAN_DIST_PACKAGES}/mininet"):
            return False
        sys.path.append(_DEBIAN_DIST_PACKAGES)
        return mininet_on_path()


def _mininet_importable() -> bool:
    return mininet_on_path() and shutil.which("mnexec") is not None


def probe() -> Capabilities:
    """Try every feature the testbed may use; needs root for most of them."""
    caps = Capabilities(root=os.geteuid() == 0)
    caps.bridge_utils = shutil.which("brctl") is not None
    caps.iperf3 = shutil.which("iperf3") is not None
    caps.ping = shutil.which("ping") is not None
    caps.mininet = _mininet_importable()
    caps.cgroup_cpu = _cgroup_cpu()
    if not caps.root:
        caps.errors["root"] = "not root: network namespaces and tc need root"
        return caps
    ns = f"{PREFIX}-probe-{os.getpid()}"
    r = _run(["ip", "netns", "add", ns])
    if r.returncode != 0:
        caps.errors["netns"] = r.stderr.strip()
        return caps
    try:
        _probe_in(ns, caps)
    finally:
        _run(["ip", "netns", "delete", ns])
    return caps


def _probe_in(ns: str, caps: Capabilities) -> None:
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    from testbed.net import shaping  # noqa: F401  (registers bfifo with pyroute2)

    with IPRoute(netns=f"/run/netns/{ns}", flags=0) as ipr:
        try:
            ipr.link("add", ifname="gtbp0", kind="veth", peer="gtbp1")
            caps.veth = True
        except NetlinkError as exc:
            caps.errors["veth"] = str(exc)
            return
        idx = ipr.link_lookup(ifname="gtbp0")[0]
        ipr.link("set", index=idx, state="up")
        trials = {
            "htb": {"default": 0x10},
            "tbf": {"rate": 125000, "burst": 10000, "latency": "50ms"},
            "netem": {"delay": 10000},
            "bfifo": {"limit": 100000},
            "pfifo": {"limit": 1000},
            "ingress": {},
        }
        for kind, kwargs in trials.items():
            handle = 0xFFFF0000 if kind == "ingress" else 0x10000
            try:
                ipr.tc("add", kind, idx, handle, **kwargs)
                caps.qdiscs[kind] = True
                ipr.tc("del", kind, idx, handle, **kwargs)
            except NetlinkError as exc:
                caps.qdiscs[kind] = False
                caps.errors[f"qdisc:{kind}"] = exc.args[1] if len(exc.args) > 1 else str(exc)
    caps.tun = _probe_tun(ns)
    r = _run(
        ["ip", "netns", "exec", ns, "iptables", "-w", "-A", "FORWARD", "-m", "statistic",
         "--mode", "random", "--probability", "0.5", "-j", "DROP"]
    )
    caps.iptables_statistic = r.returncode == 0
    if r.returncode != 0:
        caps.errors["iptables"] = (r.stderr.strip() or "iptables failed").splitlines()[-1]


def _probe_tun(ns: str) -> bool:
    code = (
        "import fcntl,os,struct;fd=os.open('/dev/net/tun',os.O_RDWR);"
        "fcntl.ioctl(fd,0x400454CA,struct.pack('16sH22x',b'gtbptun',0x5001));"
        "fcntl.ioctl(fd,0x400454D0,7)"
    )
    return _run(["ip", "netns", "exec", ns, sys.executable, "-c", code]).returncode == 0


def choose_backends(caps: Capabilities, delay: str = "auto", loss: str = "auto") -> Backends:
    """netem where the kernel has it, else the TUN delay line; raise if neither works."""
    if delay == "auto":
        delay = "netem" if caps.qdiscs.get("netem") else "tun"
    if delay not in DELAY_BACKENDS:
        raise BackendUnavailable(f"delay backend {delay!r} is unknown (choose from auto, {', '.join(DELAY_BACKENDS)})")
    if delay == "netem" and not caps.qdiscs.get("netem"):
        raise BackendUnavailable("delay backend 'netem' forced, but this kernel has no netem qdisc")
    if delay == "tun" and not caps.tun:
        raise BackendUnavailable("delay backend 'tun' needs /dev/net/tun with IFF_VNET_HDR, which failed here")
    if not caps.qdiscs.get("htb"):
        raise BackendUnavailable("this kernel has no htb qdisc: WAN rates cannot be shaped")
    if loss == "auto":
        loss = "netem" if delay == "netem" else ("iptables" if caps.iptables_statistic else "delayline")
    if loss not in LOSS_BACKENDS:
        raise BackendUnavailable(f"loss backend {loss!r} is unknown (choose from auto, {', '.join(LOSS_BACKENDS)})")
    if loss == "netem" and delay != "netem":
        raise BackendUnavailable("loss backend 'netem' needs the netem delay backend")
    if loss == "delayline" and delay != "tun":
        raise BackendUnavailable("loss backend 'delayline' needs the tun delay backend")
    if loss == "iptables" and not caps.iptables_statistic:
        raise BackendUnavailable("loss backend 'iptables' needs the iptables statistic match, which failed here")
    return Backends(delay=delay, loss=loss)


def require_runtime(caps: Capabilities) -> None:
    """Raise with one line naming the first missing piece the network needs."""
    if not caps.root:
        raise BackendUnavailable("the testbed must run as root (network namespaces, tc)")
    for ok, what in (
        (caps.mininet, "Mininet is not importable (apt-get install mininet; see README)"),
        (caps.bridge_utils, "brctl is missing (apt-get install bridge-utils)"),
        (caps.veth, "this kernel cannot create veth pairs"),
    ):
        if not ok:
            raise BackendUnavailable(what)
