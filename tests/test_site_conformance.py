"""One machine and several, held to one written interface (``testbed/run/site.py``,
``testbed/net/surface.py``): the same test body runs against ``runner.LocalSite`` and against
``cluster.remote.ClusterSite`` on the fake cluster (``tests/test_cluster.py``'s fixture:
machines of namespaces with sshd, the real machine agents, VXLAN, clocks 5 s ahead and 3 s
behind; the machines run this checkout, ``gtb_testbed_root``, since the probe is a module of
``tests/``).  The orchestrator's side runs in this process: opening the cluster (the agents
started over SSH) happens with this thread in the fake cluster's head network namespace,
where the underlay is; everything after goes over the SSH sessions made there.

For each site: every part satisfies its protocol; the host index (names, addresses, each
address on its host); one WAN direction's counters move with the traffic sent across it,
on this process's clock; ``fidelity.check_wan`` measures through the surface; a process
started in a host through the launcher, in a CPU container, says hello to the hub, gets an
answer, exits with its status and last words, and its log comes back; a second one is
ended by the launcher and is gone from its host.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed import messages as m

from test_cluster import _missing, _nothing_left_soon, cluster  # noqa: F401  (cluster: the fake cluster fixture)
from testbed.net.fidelity import check_wan
from testbed.net.surface import HostProcess, Link, NetworkError, NetworkSurface, Node
from testbed.run.runner import LocalSite, TrainingRun
from testbed.run.site import Containers, Hub, Launcher, Process, Site, SiteLab
from testbed.spec.experiment import parse_experiment

pytestmark = pytest.mark.network

REPO = Path(__file__).resolve().parent.parent
DELAY_MS = 10.0  # one-way, each direction
_TOPOLOGY = f"""name: conform
dcs:
  - {{name: east, hosts: 2, host: {{cpus: 0.5}}}}
  - {{name: west, hosts: 1, host: {{cpus: 0.5}}}}
wan:
  - {{a: east, b: west, delay_ms: {DELAY_MS}, rate_mbps: 50}}
"""
_CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def _in_netns(pid: int):
    """This thread in the network namespace of ``pid`` for the block (sockets made and
    processes started there stay there), then back."""
    libc = ctypes.CDLL(None, use_errno=True)
    mine = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    theirs = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if libc.setns(theirs, _CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), "setns into the head's network namespace")
        try:
            yield
        finally:
            if libc.setns(mine, _CLONE_NEWNET):
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(mine)
        os.close(theirs)


@pytest.fixture
def experiment(tmp_path):
    (tmp_path / "conform.yaml").write_text(_TOPOLOGY)
    return parse_experiment({"name": "conform", "topology": "conform.yaml", "parallel": {"stages": 2}},
                            "conform", base_dir=tmp_path)


@pytest.fixture(params=["local", "cluster"])
def site(request, experiment):
    """A site, and the fake cluster behind it (None for one machine)."""
    if request.param == "local":
        yield LocalSite(), None
        return
    why = _missing()
    if why:
        pytest.skip(why)
    from testbed.cluster.remote import ClusterSite, open_cluster

    fake = request.getfixturevalue("cluster")
    # the machines run this checkout (they share its disk), not an installed build: the probe
    # process is a module of tests/, which a build (testbed and agents only) does not carry;
    # the agents still check that it is the orchestrator's build (it is: the same files)
    inventory = request.getfixturevalue("tmp_path") / "checkout.ini"
    inventory.write_text("\n".join(ln + f" gtb_testbed_root={REPO}" if "gtb_underlay=" in ln else ln
                                   for ln in fake.inventory_text().splitlines()) + "\n")
    # reading the inventory imports Ansible, which patches sys.intern for the whole process;
    # torch's dynamo (torch.optim imports it) then refuses to load in later tests of this
    # session (tests/test_cluster.py's reference losses): this process gets its own back
    intern = sys.intern
    try:
        with _in_netns(fake.head_pid):
            opened = open_cluster(experiment.topo, inventory)
    finally:
        sys.intern = intern
    try:
        yield ClusterSite(opened), fake
    finally:
        opened.close()
        _nothing_left_soon(fake, timeout=10)


def test_site_conforms(site, experiment, tmp_path):
    site, _fake = site
    assert isinstance(site, Site)
    with site.lab(experiment.topo, "auto", {}) as lab:
        assert isinstance(lab, SiteLab)  # inside: its network and launcher exist while it is up
        net = lab.network
        assert isinstance(net, NetworkSurface)
        assert net.started and net.backends.delay in ("tun", "netem")
        _host_index(net)
        _link_counters(net)
        _fidelity(net)
        run = TrainingRun(experiment, tmp_path / "out", site=site)  # what a site reads of its run
        hub, path = site.hub(run, net)
        launcher = lab.launcher
        containers = site.containers(net, experiment.name)
        assert isinstance(hub, Hub) and isinstance(launcher, Launcher) and isinstance(containers, Containers)
        try:
            _processes(net, hub, path, launcher, containers, tmp_path)
        finally:
            hub.close()
        assert net.link_state("east", "west") == "up"
        net.check()  # nothing broke
    assert not net.started


def _host_index(net: NetworkSurface) -> None:
    hosts = net.hosts()
    assert [(h.dc, h.index, h.ip) for h in hosts] == [("east", 0, "10.1.0.1"), ("east", 1, "10.1.0.2"),
                                                      ("west", 0, "10.2.0.1")]
    assert len({h.name for h in hosts}) == 3
    assert [h.ip for h in net.hosts("east")] == ["10.1.0.1", "10.1.0.2"]
    assert net.host("west").name == hosts[2].name and net.host("east", 1).name == hosts[1].name
    with pytest.raises(NetworkError, match="no host 5 in DC 'west'"):
        net.host("west", 5)
    for h in hosts:  # each address is on its host
        assert isinstance(h.node, Node)
        assert f"inet {h.ip}/24" in h.node.cmd("ip -4 -o addr show"), h.name
    assert set(net.tcp_counters()) == {h.name for h in hosts}
    assert all("out_segments" in c for c in net.tcp_counters().values())
    proc = net.popen(hosts[0], ["sh", "-c", "echo out; echo err >&2; exit 4"], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    assert isinstance(proc, HostProcess)
    assert proc.communicate(timeout=20) == ("out\n", "err\n") and proc.returncode == 4


def _link_counters(net: NetworkSurface) -> None:
    there, back = net.link("east", "west"), net.link("west", "east")
    assert isinstance(there, Link) and (there.src, there.dst, there.params.delay_ms) == ("east", "west", DELAY_MS)
    assert sorted((d.src, d.dst) for d in net.links()) == [("east", "west"), ("west", "east")]
    before, before_back = there.counters(), back.counters()
    count, size = 30, 1000
    out = net.host("east").node.cmd(f"ping -n -q -c {count} -i 0.01 -s {size} {net.host('west').ip}")
    assert f"{count} received" in out, out
    after, after_back = there.counters(), back.counters()
    for b, a in ((before, after), (before_back, after_back)):  # the requests there, the replies back
        assert a.tx_packets - b.tx_packets >= count
        assert a.tx_bytes - b.tx_bytes >= count * size
    # on this process's clock (across machines: mapped by the sending machine's offset)
    assert before.time < after.time <= time.monotonic() + 0.05 and time.monotonic() - after.time < 5.0


def _fidelity(net: NetworkSurface) -> None:
    checks = check_wan(net)
    assert sorted((c.src, c.dst) for c in checks) == [("east", "west"), ("west", "east")]
    for c in checks:  # the round trip and, across machines, the one-way delay on two clocks
        assert c.rtt_ms_measured is not None and abs(c.rtt_ms_measured - 2 * DELAY_MS) <= 2.0, c
        assert c.owd_ms_measured is not None and abs(c.owd_ms_measured - DELAY_MS) <= 2.0, c


def _quota(cgroups: str, name: str) -> tuple[int, int]:
    """(quota, period) in us of the CPU container a process's /proc/self/cgroup names (-1: none)."""
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        rel = next(ln.split(":", 2)[2] for ln in cgroups.splitlines() if ln.startswith("0::"))
        quota, period = (Path("/sys/fs/cgroup") / rel.lstrip("/") / "cpu.max").read_text().split()
        assert rel.endswith(f"/{name}"), rel
        return -1 if quota == "max" else int(quota), int(period)
    rel = next(ln.split(":", 2)[2] for ln in cgroups.splitlines() if "cpu" in ln.split(":")[1].split(","))
    assert rel.endswith(f"/{name}"), rel
    root = next(r for r in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct")) if r.is_dir())
    return (int((root / rel.lstrip("/") / "cpu.cfs_quota_us").read_text()),
            int((root / rel.lstrip("/") / "cpu.cfs_period_us").read_text()))


def _messages_from(hub, name: str, timeout_s: float = 60) -> list:
    """The first batch of messages ``name`` sends through the hub (empty after ``timeout_s``)."""
    got, deadline = [], time.monotonic() + timeout_s
    while not got and time.monotonic() < deadline:
        got = [msg for n, msg in hub.poll(0.2) if n == name and msg is not None]
    return got


def _processes(net, hub, path, launcher, containers, tmp_path) -> None:
    problem = containers.problem()
    assert problem is None, f"CPU containers: {problem}"  # this machine has them (and the fake one shares them)
    east, west = net.host("east"), net.host("west")
    proc = launcher.start("probe", "tests.site_probe",
                          {"mode": "echo", "name": "probe", "telemetry": str(path), "rc": 3},
                          host=east, cgroup=containers.make("probe", 0.5))
    assert isinstance(proc, Process) and proc.name == "probe"
    got = _messages_from(hub, "probe")
    assert got and isinstance(got[0], m.Log), "no message from the probe through the hub"
    assert hub.connected("probe")
    assert _quota(got[0].msg, "probe") == (2500, 5000)  # 0.5 CPU of a 5 ms period, from before its start
    assert hub.send("probe", m.Log(msg="7"))
    assert proc.wait(30) == 3 and proc.returncode == 3 and proc.poll() == 3 and not proc.alive()
    assert proc.last_log_line() == "got 7"
    launcher.copy_logs(tmp_path / "logs", ["probe"], rename=lambda n: f"copied-{n}")
    assert (tmp_path / "logs" / "copied-probe.log").read_text().splitlines()[-1] == "got 7"

    sleeper = launcher.start("sleeper", "tests.site_probe", {"mode": "sleep"}, host=west)
    assert launcher.pids() == {"probe": proc.pid, "sleeper": sleeper.pid}
    assert sleeper.alive() and sleeper.poll() is None and sleeper.returncode is None
    alive = f"kill -0 {sleeper.pid} 2>/dev/null && echo alive || echo gone"
    assert west.node.cmd(alive).strip() == "alive"  # its PID on the machine that runs it
    launcher.stop(["sleeper"], timeout=5.0)
    assert sleeper.wait(20) == -signal.SIGTERM and not sleeper.alive()
    assert west.node.cmd(alive).strip() == "gone"
    assert set(launcher.processes) == {"probe", "sleeper"}

    # a container made to be limited later (a worker's: its start-up runs free) has no quota
    # until enforce(), then its own
    later = launcher.start("later", "tests.site_probe",
                           {"mode": "echo", "name": "later", "telemetry": str(path), "rc": 0},
                           host=west, cgroup=containers.make("later", 0.5, limit_later=True))
    got = _messages_from(hub, "later")
    assert got and _quota(got[0].msg, "later") == (-1, 5000)
    containers.enforce()
    assert _quota(got[0].msg, "later") == (2500, 5000)
    assert hub.send("later", m.Log(msg="0")) and later.wait(30) == 0
