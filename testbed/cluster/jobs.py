"""``testbed torchrun --inventory``: a user's own ``torch.distributed`` job across machines.

How it fits: ``open_job_lab`` opens the cluster as ``testbed run --inventory`` does
(``remote.open_cluster``: the inventory, the placement of DCs on machines, the build
installed, one agent per machine over SSH), builds every machine's DCs with a VXLAN per WAN
link that crosses machines (``remote.ClusterNetwork``) and runs the WAN self-check
(``fidelity.check_wan``).  The ``ClusterJobLab`` it returns is the ``run.lab.LabHandle``
that ``run.torchrun.run_job`` drives, as it drives a ``lab.Lab`` on one machine: the host
table (each host's emulated interface is GLOO_SOCKET_IFNAME, so gloo crosses the emulated
WAN and the VXLANs between machines), each WAN direction's settings and counters (read by
its sending gateway's agent), and ``popen`` of a rank in its host, on its machine.

The user's script is not in the build.  ``ship`` copies the folder that holds it (every
file under it, ``.*`` and ``__pycache__`` left out, at most ``SHIP_LIMIT_BYTES``) to each
machine with a rank, through that machine's agent (``put_file``, in chunks), into a folder
of the run's own named by the files' digest (``torchrun-<digest>``, inside the agent's
process folder, so it goes with the run: at the end, on Ctrl-C, when the orchestrator dies
and the agent's lease ends, or by ``testbed clean`` there).  Each rank runs that copy with
its machine's Python (the agent's), with the copy as its working folder, so a module or a
file beside the script is found as on one machine.  Its environment is the one
``run_job`` gives it less what equals this process's own (the machine keeps its own PATH,
HOME and the build's PYTHONPATH).

A rank's output is written to a log on its machine; the agent sends what it gains, whole
lines, as ``Output`` events and the exit as ``Exited`` after the last of it; the
``RankProcess`` here turns them into ``stdout`` lines and a ``returncode`` (``poll`` and
``wait`` drain the cluster's events), so ``run_job`` writes ``OUT/logs/rankN.log`` and
``metrics.json`` as on one machine.  ``terminate``/``kill`` signal the rank's process group
through its agent.  A machine whose agent is gone ends its ranks with exit code 255.
``down`` ends the network on every machine (what the agents started with it) and the agents.
"""

from __future__ import annotations

import base64
import hashlib
import os
import queue
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

from testbed.cluster.inventory import ClusterError
from testbed.cluster.remote import Cluster, ClusterNetwork, open_cluster
from testbed.run.lab import counters_dict, link_key, pick_host
from testbed.spec.topology import Topology, default_queue_bytes

SHIP_LIMIT_BYTES = 64 << 20
_CHUNK = 512 << 10
_SKIP = {"__pycache__"}
AGENT_GONE_RC = 255


def folder_files(folder: Path) -> list[Path]:
    """The files ``ship`` copies: everything under ``folder`` but hidden entries and
    ``__pycache__``, relative paths, sorted; a ClusterError naming the folder past the limit."""
    out, total = [], 0
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if any(part.startswith(".") or part in _SKIP for part in rel.parts) or not p.is_file():
            continue
        total += p.stat().st_size
        if total > SHIP_LIMIT_BYTES:
            raise ClusterError(f"script folder {folder}: more than {SHIP_LIMIT_BYTES >> 20} MiB to copy to each "
                               f"machine; put the script in a folder of its own")
        out.append(rel)
    return out


def folder_digest(folder: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    for rel in files:
        h.update(str(rel).encode() + b"\0" + (folder / rel).read_bytes() + b"\0")
    return h.hexdigest()[:16]


class RankProcess:
    """A rank on another machine, as much of ``subprocess.Popen`` as ``run_job`` uses:
    ``stdout`` (its lines, until it ended), ``poll``, ``wait``, ``terminate``, ``kill``."""

    def __init__(self, cluster: Cluster, machine: str, name: str, pid: int):
        self.cluster, self.machine, self.name, self.pid = cluster, machine, name, pid
        self.agent = cluster.agents[machine]
        self.returncode: int | None = None
        self._lines: "queue.Queue[str | None]" = queue.Queue()
        self._partial = ""
        self.stdout = self._read()

    # what the cluster's events say (``Cluster.drain``)
    def output(self, text: str) -> None:
        text = self._partial + text
        lines = text.splitlines(keepends=True)
        self._partial = lines.pop() if lines and not lines[-1].endswith("\n") else ""
        for line in lines:
            self._lines.put(line)

    def ended(self, rc: int) -> None:
        if self.returncode is not None:
            return
        if self._partial:
            self._lines.put(self._partial)
            self._partial = ""
        self.returncode = rc
        self._lines.put(None)

    def _read(self) -> Iterator[str]:
        while (line := self._lines.get()) is not None:
            yield line

    # Popen's side
    def poll(self) -> int | None:
        if self.returncode is None:
            gone = self.agent.closed  # before draining: what it sent before it went is queued by then
            self.cluster.drain()
            if self.returncode is None and gone:
                self._lines.put(f"testbed: machine {self.machine}: its agent is gone; rank ended\n")
                self.ended(AGENT_GONE_RC)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.name, timeout)
            self.cluster.drain(0.05)
        return self.returncode

    def _signal(self, kill: bool) -> None:
        if self.poll() is None:
            try:
                self.agent.call("job_signal", name=self.name, kill=kill, wait_s=30.0)
            except ClusterError:
                pass

    def terminate(self) -> None:
        self._signal(kill=False)

    def kill(self) -> None:
        self._signal(kill=True)


class ClusterJobLab:
    """``run.lab.LabHandle`` across machines: the topology built on the cluster's machines,
    checked, and the ranks started through their machines' agents."""

    def __init__(self, cluster: Cluster, topo: Topology, delay_backend: str = "auto",
                 progress: Callable[[str], None] = lambda msg: None):
        self.cluster, self.topo, self.name = cluster, topo, topo.name
        self.net = ClusterNetwork(cluster, topo)
        self.net.delay_backend = delay_backend
        self._progress = progress
        self.wan_check: list[dict] = []
        self.warnings: list[str] = []
        self._shipped: dict[str, tuple[str, str]] = {}  # machine -> (folder, script) of this job

    def up(self) -> "ClusterJobLab":
        from testbed.net.fidelity import check_wan

        self.net.start()
        self._progress("checking the WAN")
        checks = check_wan(self.net)
        self.wan_check = [c.to_dict() for c in checks]
        self.warnings += [f"WAN {c.src} -> {c.dst} is not as configured: {c.problem}" for c in checks if not c.ok]
        return self

    def down(self) -> None:
        """End the ranks and the network on every machine, then the agents."""
        try:
            if self.net.started:
                self.net.stop()
        finally:
            self.cluster.close()

    # -- the user's script ----------------------------------------------------------------
    def ship(self, script: Path, dcs: list[str]) -> None:
        """Copy the folder holding ``script`` to each machine that holds one of ``dcs``."""
        folder = script.resolve().parent
        files = folder_files(folder)
        name = f"torchrun-{folder_digest(folder, files)}"
        for machine in dict.fromkeys(self.cluster.placement[dc] for dc in dcs):
            self._progress(f"copying {folder} ({len(files)} file(s)) to {machine}")
            agent = self.cluster.agents[machine]
            for rel in files:
                data, offset = (folder / rel).read_bytes(), 0
                while True:  # an empty file too: one call makes it
                    chunk = data[offset:offset + _CHUNK]
                    agent.call("put_file", folder=name, path=str(rel), data=base64.b64encode(chunk).decode(),
                               offset=offset)
                    offset += len(chunk)
                    if offset >= len(data):
                        break
            self._shipped[machine] = (name, script.resolve().name)

    def summary(self) -> dict:
        """The machines' part of metrics.json: placement, underlay, MTU, the clocks at the start."""
        return {"machines": sorted(set(self.cluster.placement.values())), "placement": dict(self.cluster.placement),
                "underlay": self.cluster.underlay, "mtu": getattr(self.net, "mtu", None),
                "clock": self.cluster.clock.get("start", {})}

    # -- LabHandle ----------------------------------------------------------------------
    def host_table(self) -> list[dict]:
        return [{"dc": h.dc, "index": h.index, "name": h.name, "ip": h.ip, "ifname": f"{h.name}-eth0",
                 "machine": self.cluster.placement[h.dc]} for h in self.net.hosts()]

    def link_table(self) -> list[dict]:
        return [{"src": x.src, "dst": x.dst, **x.params.model_dump(),
                 "queue_bytes": default_queue_bytes(x.params, self.topo.rtt_ms(x.src, x.dst)),
                 "machines": [self.cluster.placement[x.src], self.cluster.placement[x.dst]]}
                for x in self.net.links()]

    def counter_table(self) -> dict[str, dict]:
        return {link_key(x.src, x.dst): counters_dict(x.counters()) for x in self.net.links()}

    def popen(self, dc: str, index: int, argv: list[str], env: dict | None = None, **_local) -> RankProcess:
        """Start the shipped script in host ``index`` of ``dc`` with ``argv[2:]`` as its
        arguments (``argv`` is ``[python, SCRIPT, ARGS...]`` as ``run_job`` makes it for one
        machine); its output comes back as ``stdout``."""
        host = pick_host(self.host_table(), dc, index, self.name)
        machine = host["machine"]
        if machine not in self._shipped:
            raise ClusterError(f"machine {machine}: the script was not copied there (ship it first)")
        folder, script = self._shipped[machine]
        if len(argv) < 2 or Path(argv[1]).name != script:
            raise ClusterError(f"machine {machine}: {argv[1:2]} is not the script shipped there ({script})")
        base = os.environ
        extra = {k: v for k, v in (env or {}).items() if base.get(k) != v and k != "PYTHONPATH"}
        name = f"torchrun-{host['name']}"
        pid = self.cluster.agents[machine].call("job_start", name=name, host=host["name"], folder=folder,
                                                script=script, args=list(argv[2:]), env=extra)["pid"]
        proc = RankProcess(self.cluster, machine, name, pid)
        self.cluster.ranks[name] = proc
        return proc


def open_job_lab(topo: Topology, inventory: Path, machines_flag: str | None = None, delay_backend: str = "auto",
                 progress: Callable[[str], None] = lambda msg: None) -> ClusterJobLab:
    """The cluster opened, the topology built on it and checked; ``down()`` ends it all."""
    cluster = open_cluster(topo, inventory, machines_flag, progress=progress, run=f"torchrun-{topo.name}")
    lab = ClusterJobLab(cluster, topo, delay_backend, progress)
    try:
        return lab.up()
    except BaseException:
        lab.down()
        raise
