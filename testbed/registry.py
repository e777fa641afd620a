"""What the testbed made, written down as it is made, so it can always be removed.

How it fits: ``network.py`` records every process (Mininet host shells, delay lines,
iperf3 and workers it starts), every named namespace and every root-namespace interface
in an append-only file under ``STATE_DIR`` the moment it exists.  ``clean()`` reads that
file and removes all of it: processes are ended by PID (checked against their start time,
so a recycled PID is never hit), then every process still living inside one of the
recorded network namespaces (they can only be ours), then named namespaces and
interfaces whose names start with ``PREFIX``.  It works after the orchestrator was killed
with SIGKILL, because nothing it needs lives in that process.

Everything the testbed creates is named with ``PREFIX`` ("gtb": geo-distributed training
testbed) so that ``testbed clean`` finds all of it and nothing else.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
from pathlib import Path

PREFIX = "gtb"
STATE_DIR = Path(os.environ.get("GTB_STATE_DIR", "/run/gtb"))
_REGISTRY = "registry.jsonl"
NOTHING_LEFT = {"processes": [], "netns": [], "links": [], "cgroups": [], "files": []}  # leftovers() after a clean
_LOCK = "lock"


class Busy(RuntimeError):
    """Another testbed network is running on this machine."""


class CleanError(RuntimeError):
    """Something the testbed made could not be removed; the message is one line naming it."""


def _proc_start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    # field 22 (starttime), counted after the ')' that closes the command name
    return int(stat.rsplit(")", 1)[1].split()[19])


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), None when there is none: with its
    PID, what tells a process from a later one that reuses the PID."""
    return _proc_start_time(pid)


def process_running(pid: int, start: int | None) -> bool:
    """The process recorded as (``pid``, ``start``) still runs: the same start time and not a
    zombie (an orphan killed by SIGKILL stays one until whatever adopted it reaps it, which a
    container's init may never do)."""
    return start is not None and _proc_start_time(pid) == start and not _is_zombie(pid)


def netns_inode(pid: int | str) -> int | None:
    path = f"/proc/{pid}/ns/net" if isinstance(pid, int) else pid
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _outside_namespaces() -> set[int]:
    """Namespaces that are never the testbed's: this process's and init's."""
    return {ns for ns in (netns_inode("/proc/self/ns/net"), netns_inode(1)) if ns is not None}


class Registry:
    """Append-only record of what one run created; also the one-run-at-a-time lock."""

    def __init__(self, state_dir: Path = STATE_DIR):
        self.dir = state_dir
        self._lock_fd: int | None = None

    @property
    def path(self) -> Path:
        return self.dir / _REGISTRY

    def acquire(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Busy(
                "another testbed network is running on this machine (lock "
                f"{self.dir / _LOCK}); wait for it, or run 'testbed clean --force'"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd
        if self.path.exists():  # a crashed run left things behind
            clean(self.dir, holding_lock=True)

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _append(self, entry: dict) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
            fh.flush()

    def process(self, pid: int, role: str, own_netns: bool = True) -> None:
        """Record a process; ``own_netns`` when it holds one of the testbed's namespaces.

        A namespace is only recorded if it differs from every namespace outside the
        testbed (ours, init's): clean() ends every process inside a recorded namespace.
        """
        ns = netns_inode(pid) if own_netns else None
        if ns in _outside_namespaces():
            ns = None
        self._append({"kind": "process", "pid": pid, "start": _proc_start_time(pid), "netns": ns, "role": role})

    def netns(self, name: str) -> None:
        self._append({"kind": "netns", "name": name, "inode": netns_inode(f"/run/netns/{name}")})

    def link(self, name: str) -> None:
        self._append({"kind": "link", "name": name})

    def cgroup(self, path: str | Path) -> None:
        self._append({"kind": "cgroup", "path": str(path)})

    def file(self, path: str | Path) -> None:
        self._append({"kind": "file", "path": str(path)})


def _read(state_dir: Path) -> list[dict]:
    path = state_dir / _REGISTRY
    entries = []
    try:
        for line in path.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by SIGKILL
    except OSError:
        pass
    return entries


def _recorded_namespaces(entries: list[dict]) -> set[int]:
    return {e.get("netns") or e.get("inode") for e in entries} - {None} - _outside_namespaces()


def _kill(pids: set[int], timeout: float = 2.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in list(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pids.discard(pid)
        deadline = time.monotonic() + timeout
        while pids and time.monotonic() < deadline:
            for pid in list(pids):
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
                if _proc_start_time(pid) is None or _is_zombie(pid):
                    pids.discard(pid)
            time.sleep(0.02)
        if not pids:
            return


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _processes_in(inodes: set[int]) -> set[int]:
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me and netns_inode(int(entry)) in inodes:
            found.add(int(entry))
    return found


def leftovers(state_dir: Path = STATE_DIR) -> dict[str, list]:
    """What a clean would remove now (for reporting and tests)."""
    entries = _read(state_dir)
    inodes = _recorded_namespaces(entries)
    procs = {
        e["pid"]
        for e in entries
        if e["kind"] == "process" and e.get("start") is not None and _proc_start_time(e["pid"]) == e["start"]
    }
    procs |= _processes_in(inodes)
    procs.discard(os.getpid())  # a lab's own process records itself (``testbed clean`` ends it) and cleans up
    netns = sorted(n for n in _named_netns() if n.startswith(PREFIX))
    links = sorted(n for n in _root_links() if n.startswith(PREFIX))
    cgroups = sorted({e["path"] for e in entries if e["kind"] == "cgroup" and os.path.isdir(e["path"])}
                     | set(_prefixed_cgroups()))
    files = {e["path"] for e in entries if e["kind"] == "file" and os.path.lexists(e["path"])}
    if state_dir.is_dir():  # anything else in the state folder but the lock (and an empty registry)
        for path in state_dir.rglob("*"):
            if path.name != _LOCK and not path.is_dir() and not (path.name == _REGISTRY and not entries):
                files.add(str(path))
    return {"processes": sorted(procs), "netns": netns, "links": links, "cgroups": cgroups, "files": sorted(files)}


def _cgroup_roots() -> list[Path]:
    roots = [Path("/sys/fs/cgroup")] if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else \
        [Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct")]
    return [r for r in roots if r.is_dir()]


def _prefixed_cgroups() -> list[str]:
    """The testbed's top-level cgroups (named ``gtb-<run>-<pid>``) and everything under them."""
    out = []
    machine = os.environ.get("GTB_MACHINE")  # a fake machine cleans its own only
    mine = f"{PREFIX}-{machine}-" if machine else f"{PREFIX}-"
    for root in _cgroup_roots():
        try:
            tops = [p for p in root.iterdir() if p.name.startswith(mine) and p.is_dir()]
        except OSError:
            continue
        for top in tops:
            out.append(str(top))
            out.extend(str(p) for p in top.rglob("*") if p.is_dir())
    return out


def _named_netns() -> list[str]:
    try:
        return os.listdir("/run/netns")
    except OSError:
        return []


def _root_links() -> list[str]:
    try:
        return os.listdir("/sys/class/net")
    except OSError:
        return []


def _delete_links(names: list[str]) -> None:
    if not names:
        return
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with IPRoute() as ipr:
        for name in names:
            try:
                ipr.link("del", ifname=name)
            except NetlinkError:
                pass  # gone with its namespace meanwhile


def _remove_cgroups(paths: list[str], timeout: float = 5.0) -> list[str]:
    """Deepest first; a cgroup can only go once its last process has exited, so any process
    still in one is ended first.  Returns the cgroups that could not be removed."""
    left = []
    for path in sorted(set(paths), key=lambda p: -p.count("/")):
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    left.append(path)
                    break
                _kill(_cgroup_pids(path), timeout=0.5)
                time.sleep(0.02)
    return left


def _cgroup_pids(path: str) -> set[int]:
    try:
        return {int(x) for x in Path(path, "cgroup.procs").read_text().split()}
    except (OSError, ValueError):
        return set()


def clean(state_dir: Path = STATE_DIR, holding_lock: bool = False, force: bool = False) -> dict[str, list]:
    """Remove everything a (possibly crashed) run made; return what was removed."""
    if not holding_lock and (state_dir / _LOCK).exists():
        fd = os.open(state_dir / _LOCK, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not force:
                os.close(fd)
                holder = (state_dir / _LOCK).read_text().strip() or "?"
                raise Busy(f"a testbed run (pid {holder}) is still running; stop it, or use --force") from None
        os.close(fd)
    found = leftovers(state_dir)
    _kill(set(found["processes"]))
    # processes that entered our namespaces while we were killing (e.g. a shell's child)
    _kill(_processes_in(_recorded_namespaces(_read(state_dir))))
    for name in found["netns"]:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    _delete_links(sorted(n for n in _root_links() if n.startswith(PREFIX)))
    stuck = _remove_cgroups([e["path"] for e in _read(state_dir) if e["kind"] == "cgroup"] + _prefixed_cgroups())
    for entry in _read(state_dir):
        if entry["kind"] == "file":
            try:
                os.unlink(entry["path"])
            except OSError:
                pass
    try:
        (state_dir / _REGISTRY).unlink()
    except OSError:
        pass
    if state_dir.exists():
        for sub in sorted(state_dir.rglob("*"), key=lambda p: -len(p.parts)):  # what the registry did not name
            try:
                if sub.is_dir():
                    sub.rmdir()
                elif sub.name != _LOCK:
                    sub.unlink()
            except OSError:
                pass
    if stuck:
        raise CleanError(f"cgroup {stuck[0]} could not be removed (a process in it does not end)"
                         + (f", and {len(stuck) - 1} more" if len(stuck) > 1 else ""))
    return found
