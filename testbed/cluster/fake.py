"""A fake cluster: several "machines" on this one, for the tests and for trying ``--inventory``.

Each machine is what a server looks like to the testbed: its own network, mount, PID, UTS
and time namespaces (``unshare``), a private ``/run`` (so its testbed state, its named
namespaces and its sshd's files are its own), ``/sys`` remounted for its network (the
cgroup tree stays the host's), its own sshd with its own host key, and an injected
CLOCK_MONOTONIC offset (``--monotonic``), so the orchestrator's clock mapping has
something to map.  The machines hang off one Linux bridge, the underlay
(``172.30.0.0/24``), which lives in a "head" network namespace of its own: the head is
where the orchestrator runs (``head_argv``), as it would on a lab's head node, and nothing
of the fake cluster touches this machine's own network.  Ansible reaches the machines over
SSH with the cluster's key, exactly as it reaches real servers; ``inventory_text`` writes
the inventory.

Everything lives under ``FAKE_DIR`` (the state, keys and sshd configs: it must be a path
the machines see, and their ``/run`` is private) and in processes whose PIDs, with their
start times, are in its ``state.json``; ``destroy`` (also ``testbed clean``) ends them,
and with them go their namespaces, the underlay and every interface in them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from testbed.registry import PREFIX, _proc_start_time

FAKE_DIR = Path(os.environ.get("GTB_FAKE_CLUSTER_DIR", "/tmp/gtb-fakecluster"))
UNDERLAY_PREFIX = "172.30.0"
HEAD_ADDRESS = f"{UNDERLAY_PREFIX}.254"
_BRIDGE = f"{PREFIX}fc-br"

_INIT = r"""
set -e
mount --make-rprivate /
mount -t tmpfs -o mode=755 {prefix}-run /run
mkdir -p /run/.cg /run/sshd /run/netns
mount --rbind /sys/fs/cgroup /run/.cg
mount -t sysfs sysfs /sys
mount --move /run/.cg /sys/fs/cgroup
hostname {name}
ip link set lo up
for i in $(seq 200); do ip link show eth0 >/dev/null 2>&1 && break; sleep 0.05; done
ip addr add {address}/24 dev eth0
ip link set eth0 up
/usr/sbin/sshd -f {dir}/sshd_config -E {dir}/sshd.log
echo up > {dir}/ready
exec sleep infinity
"""

_SSHD = """ListenAddress {address}
Port 22
HostKey {dir}/host_key
AuthorizedKeysFile {root}/id_ed25519.pub
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile {dir}/sshd.pid
SetEnv GTB_MACHINE={name}
MaxStartups 50
"""


class FakeClusterError(RuntimeError):
    """The fake cluster could not be made; the message is one line."""


@dataclass
class FakeMachine:
    name: str
    address: str  # on the underlay: SSH, the agent and VXLAN all use it
    pid: int  # the machine's init (PID 1 inside): its namespaces are /proc/PID/ns/*
    clock_offset_s: float  # its CLOCK_MONOTONIC minus this machine's


@dataclass
class FakeCluster:
    head_pid: int  # holds the underlay's network namespace
    machines: list[FakeMachine]
    key: str  # the SSH private key Ansible uses

    def head_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run in the head's network namespace (where the underlay is reachable)."""
        return ["nsenter", f"--net=/proc/{self.head_pid}/ns/net", *argv]

    def machine_argv(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run inside machine ``name`` (all its namespaces), as a shell of its own."""
        pid = next(m.pid for m in self.machines if m.name == name)
        return ["nsenter", "-t", str(pid), "-n", "-m", "-p", "-u", "-T", "--", *argv]

    def inventory_text(self, gpus: int = 0) -> str:
        """An Ansible INI inventory of the machines, with what ``--inventory`` needs."""
        lines = ["[machines]"]
        for m in self.machines:
            lines.append(f"{m.name} ansible_host={m.address} gtb_underlay={m.address} gtb_gpus={gpus}")
        lines += ["", "[machines:vars]", "ansible_user=root", f"ansible_ssh_private_key_file={self.key}",
                  "ansible_python_interpreter=/usr/bin/python3",
                  "ansible_ssh_common_args='-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                  "-o LogLevel=ERROR'", ""]
        return "\n".join(lines)


def _state_path() -> Path:
    return FAKE_DIR / "state.json"


def create(n: int = 3, clock_offsets_s: list[float] | None = None) -> FakeCluster:
    """``n`` machines ``m1..mn`` at 172.30.0.1..n, each with its clock offset (default 0)."""
    if not shutil.which("sshd") and not os.path.exists("/usr/sbin/sshd"):
        raise FakeClusterError("the fake cluster needs sshd (apt-get install openssh-server)")
    if not 1 <= n <= 250:
        raise FakeClusterError(f"machines: {n}: between 1 and 250")
    if _state_path().exists():
        destroy()
    offsets = list(clock_offsets_s or []) + [0.0] * n
    FAKE_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(FAKE_DIR, 0o700)
    state: dict = {"head": None, "machines": []}
    try:
        key = FAKE_DIR / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True,
                       capture_output=True)
        head = subprocess.Popen(["unshare", "--net", "sleep", "infinity"], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # holds no caller's pipe
        state["head"] = {"pid": head.pid, "start": _wait_start(head.pid)}
        _write_state(state)
        _wait_own_netns(head.pid)  # until unshare has run, nsenter would enter this machine's network
        _in_head(head.pid, f"ip link set lo up; ip link add {_BRIDGE} type bridge; "
                           f"ip addr add {HEAD_ADDRESS}/24 dev {_BRIDGE}; ip link set {_BRIDGE} up")
        machines = []
        for i in range(1, n + 1):
            name, address = f"m{i}", f"{UNDERLAY_PREFIX}.{i}"
            mdir = FAKE_DIR / name
            mdir.mkdir(exist_ok=True)
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(mdir / "host_key")],
                           check=True, capture_output=True)
            (mdir / "sshd_config").write_text(_SSHD.format(address=address, dir=mdir, root=FAKE_DIR, name=name))
            (mdir / "init.sh").write_text(_INIT.format(prefix=PREFIX, name=name, address=address, dir=mdir))
            argv = ["unshare", "--net", "--mount", "--pid", "--uts", "--fork", "--mount-proc"]
            if offsets[i - 1]:
                argv += ["--time", "--monotonic", str(int(round(offsets[i - 1])))]  # unshare takes whole seconds
            proc = subprocess.Popen([*argv, "bash", str(mdir / "init.sh")], start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=open(mdir / "init.log", "w"))
            state["machines"].append({"name": name, "address": address, "outer": proc.pid,
                                      "outer_start": _wait_start(proc.pid), "offset": offsets[i - 1]})
            _write_state(state)
            pid = _child(proc.pid)
            state["machines"][-1].update(pid=pid, start=_proc_start_time(pid))
            _write_state(state)
            _wait_own_netns(pid)
            port = f"{PREFIX}fc-{name}"
            _in_head(head.pid, f"ip link add {port} type veth peer name eth0 netns {pid}; "
                               f"ip link set {port} master {_BRIDGE}; ip link set {port} up")
            machines.append(FakeMachine(name, address, pid, offsets[i - 1]))
        deadline = time.monotonic() + 20
        for m in machines:
            ready = FAKE_DIR / m.name / "ready"
            while not ready.exists():
                if time.monotonic() > deadline:
                    log = (FAKE_DIR / m.name / "init.log").read_text().strip().splitlines()
                    raise FakeClusterError(f"fake machine {m.name} did not come up: {log[-1] if log else 'no log'}")
                time.sleep(0.05)
        return FakeCluster(head.pid, machines, str(key))
    except BaseException:
        destroy()
        raise


def load() -> FakeCluster | None:
    """The fake cluster that is up now, if any."""
    try:
        state = json.loads(_state_path().read_text())
    except (OSError, ValueError):
        return None
    if not state.get("head") or _proc_start_time(state["head"]["pid"]) != state["head"]["start"]:
        return None
    return FakeCluster(state["head"]["pid"],
                       [FakeMachine(m["name"], m["address"], m["pid"], m["offset"]) for m in state["machines"]
                        if m.get("pid")], str(FAKE_DIR / "id_ed25519"))


def destroy() -> list[int]:
    """End every process of the fake cluster (its namespaces, underlay and interfaces go with
    them) and remove its folder; the PIDs ended.  Safe when there is none."""
    try:
        state = json.loads(_state_path().read_text())
    except (OSError, ValueError):
        state = {}
    pids = []
    for m in state.get("machines", []):
        pids += [(m.get("pid"), m.get("start")), (m.get("outer"), m.get("outer_start"))]
    if state.get("head"):
        pids.append((state["head"]["pid"], state["head"]["start"]))
    ended = []
    for pid, start in pids:
        if pid and start is not None and _proc_start_time(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)  # PID 1 of a machine: everything in it goes too
                ended.append(pid)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    for pid in ended:
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.02)
    shutil.rmtree(FAKE_DIR, ignore_errors=True)
    return ended


def _write_state(state: dict) -> None:
    _state_path().write_text(json.dumps(state))


def _wait_start(pid: int) -> int:
    for _ in range(100):
        start = _proc_start_time(pid)
        if start is not None:
            return start
        time.sleep(0.01)
    raise FakeClusterError(f"process {pid} vanished as it started")


def _child(pid: int, timeout: float = 5.0) -> int:
    """The first child of ``pid`` (unshare --fork's child: PID 1 of the new namespaces)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid]
        if kids:
            return min(kids)
        time.sleep(0.01)
    raise FakeClusterError("a fake machine's init did not start")


def _wait_own_netns(pid: int, timeout: float = 5.0) -> None:
    mine = os.stat("/proc/self/ns/net").st_ino
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino != mine:
                return
        except OSError:
            pass
        time.sleep(0.005)
    raise FakeClusterError(f"process {pid} did not get a network namespace of its own")


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _in_head(head_pid: int, script: str) -> None:
    r = subprocess.run(["nsenter", f"--net=/proc/{head_pid}/ns/net", "sh", "-ec", script],
                       capture_output=True, text=True)
    if r.returncode:
        raise FakeClusterError(f"underlay: {(r.stderr.strip().splitlines() or ['failed'])[-1]}")


def describe(cluster: FakeCluster) -> dict:
    return {"head_pid": cluster.head_pid, "machines": [asdict(m) for m in cluster.machines], "key": cluster.key}
