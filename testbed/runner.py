"""``testbed run``: build the topology, launch the workers, train, collect, write results.

How it fits: ``TrainingRun`` owns one run.  It builds the ``Network`` for the experiment's
topology, puts each worker host in its own CPU container (cgroup CPU quota with a 5 ms CFS
period: the stand-in for one device per worker) or gives it its own GPU, starts
``agents.trainer.worker`` there, and listens on a Unix socket for the workers' telemetry
(the filesystem is shared by all namespaces; the network is not, by design).  Live
telemetry goes to subscribers (``subscribe``; BubbleTea and Atlas use it), and, when the
run ends, ``metrics.py`` turns it into per-iteration figures, a Chrome trace and plots.

With ``atlas: {sharing: temporal | paced}`` the run also starts the Atlas controller and
(temporal) one agent per gateway (``agents/atlas``): the controller connects to the
telemetry socket as ``atlas-controller``, receives every worker's timeline, and answers
with plans; the run passes each pipeline's start offset to its first stage.  A dead
controller or agent is logged and training goes on under fair sharing.

A worker that dies or reports an error ends the whole run within a second or two, with an
error naming the worker; every process, namespace and cgroup is removed in all cases.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .experiment import Experiment, WorkerSlot
from .network import Network
from .registry import PREFIX

REPO = Path(__file__).resolve().parent.parent
_PORT = 29400
_DP_PORT = 29500
_CFS_PERIOD_US = 5000
_READY_TIMEOUT_S = 180.0


class RunError(RuntimeError):
    """The run failed; the message is one line naming the cause."""


@dataclass
class WorkerState:
    slot: WorkerSlot
    host: object
    proc: subprocess.Popen | None = None
    sock: socket.socket | None = None
    ready: bool = False
    done: bool = False
    iterations_done: int = 0
    events: list = field(default_factory=list)
    transfers: list = field(default_factory=list)
    iteration_end: dict = field(default_factory=dict)
    losses: dict = field(default_factory=dict)
    device: str = "cpu"
    reported_error: bool = False
    cgroup: Path | None = None  # its CPU container
    cpu: int | None = None  # the core it is pinned to (with BubbleTea)
    prefill: list = field(default_factory=list)  # BubbleTea's prefill intervals on its device


def detect_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


class _CpuContainers:
    """cgroup CPU quota per worker (v1 ``cpu`` controller or v2 ``cpu.max``)."""

    def __init__(self, registry, run_name: str):
        self.registry = registry
        if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            self.version, root = 2, Path("/sys/fs/cgroup")
        else:
            self.version, root = 1, Path("/sys/fs/cgroup/cpu")
            if not root.exists():
                root = Path("/sys/fs/cgroup/cpu,cpuacct")
        self.base = root / f"{PREFIX}-{run_name}-{os.getpid()}"
        self.available = root.exists() and os.access(root, os.W_OK)

    def make(self, name: str, cpus: float) -> Path | None:
        if not self.available or cpus <= 0:
            return None
        if not self.base.exists():
            self.base.mkdir()
            self.registry.cgroup(self.base)
            if self.version == 2:
                try:
                    (self.base / "cgroup.subtree_control").write_text("+cpu")
                except OSError:
                    pass
        path = self.base / name
        path.mkdir(exist_ok=True)
        self.registry.cgroup(path)
        quota = max(1000, int(cpus * _CFS_PERIOD_US))
        if self.version == 1:
            (path / "cpu.cfs_period_us").write_text(str(_CFS_PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
            burst = path / "cpu.cfs_burst_us"
            if burst.exists():
                burst.write_text("0")
        else:
            (path / "cpu.max").write_text(f"{quota} {_CFS_PERIOD_US}")
        return path


class TrainingRun:
    def __init__(self, exp: Experiment, out_dir: Path, delay_backend: str = "auto",
                 progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] | None = None):
        self.exp = exp
        self.out_dir = Path(out_dir)
        self.delay_backend = delay_backend
        self._progress = progress or (lambda done, total: None)
        self._log = log or (lambda msg: None)
        self._subscribers: list[Callable[[str, dict], None]] = []
        self.workers: dict[str, WorkerState] = {}
        self.net: Network | None = None
        self.go_time = 0.0
        self.log_lines: list[str] = []
        self.warnings: list[str] = []
        self.wan_check: list[dict] = []
        self.atlas_plans: list[dict] = []
        self.steady_from = 0  # the first iteration the summary counts (after warm-up, in force)
        self._controller: socket.socket | None = None  # Atlas's
        self._bt_sock: socket.socket | None = None  # BubbleTea's controller
        self._bt = None
        self._bt_ready = False  # its prefill servers have loaded and profiled their model
        self._containers = None
        self._atlas_procs: dict[str, subprocess.Popen] = {}
        self._atlas_dead: set[str] = set()

    def subscribe(self, fn: Callable[[str, dict], None]) -> None:
        """``fn(worker_name, message)`` for every telemetry message, as it arrives."""
        self._subscribers.append(fn)

    def log(self, msg: str) -> None:
        self.log_lines.append(f"{time.strftime('%H:%M:%S')} {msg}")
        self._log(msg)

    # -- the run --------------------------------------------------------------------
    def run(self) -> dict:
        from . import metrics

        self.out_dir.mkdir(parents=True, exist_ok=True)
        exp = self.exp
        self.net = Network(exp.topo, delay_backend=self.delay_backend,
                           scheduling=exp.atlas.sharing == "temporal")
        with self.net as net:
            self.log(f"network {exp.topo.name} up in {net.startup_s:.2f} s (delay: {net.backends.delay})")
            self._check_wan(net)
            server_path = net.registry.dir / "telemetry.sock"
            net.registry.file(server_path)
            if server_path.exists():
                server_path.unlink()
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(str(server_path))
            server.listen(512)
            try:
                self._launch(net, server_path)
                if exp.atlas.sharing != "fair":
                    self._start_atlas(net, server_path)
                if exp.bubbletea.enabled:
                    from agents.bubbletea.launch import BubbleTeaError, BubbleTeaSide

                    self._bt = BubbleTeaSide(self, net, server_path)
                    try:
                        cgroups = {n: w.cgroup for n, w in self.workers.items()}
                        self._bt.start(cgroups, lambda name, dc: self._containers.make(
                            name, exp.topo.dc(dc).host.cpus) if self._containers is not None else None)
                    except BubbleTeaError as exc:
                        raise RunError(str(exc)) from None
                self._collect(server)
            finally:
                self._stop_atlas()
                if self._bt is not None:
                    self._bt.stop(self.out_dir)
                server.close()
                _copy_worker_logs(net.registry.dir / "workers", self.out_dir / "worker-logs")
                for w in self.workers.values():
                    if w.sock is not None:
                        w.sock.close()
        result = metrics.summarise(self)
        if self._bt is not None:
            from agents.bubbletea.launch import summarise as bt_summarise, ttft_cdf

            result["summary"].update(bt_summarise(self, result, self.out_dir))
            reqs = json.loads((self.out_dir / "bubbletea.json").read_text())["requests"] \
                if (self.out_dir / "bubbletea.json").exists() else []
            ttft_cdf(reqs, self.out_dir / "ttft_cdf.png", f"{exp.name}: prefill TTFT", exp.bubbletea.slo_ttft_s)
        metrics.write_outputs(self, result)
        return result

    def _check_wan(self, net: Network) -> None:
        """Every run measures its own WAN before training: configured against measured per
        direction, in metrics.json; a direction outside tolerance is a warning."""
        from .fidelity import check_wan

        t0 = time.monotonic()
        checks = check_wan(net)
        self.wan_check = [c.to_dict() for c in checks]
        bad = [c for c in checks if not c.ok]
        for c in bad:
            self.warn(f"WAN {c.src} -> {c.dst} is not as configured: {c.problem}")
        self.log(f"WAN check: {len(checks) - len(bad)}/{len(checks)} directions within max(0.5 ms, 2%) of their "
                 f"configured delay ({time.monotonic() - t0:.1f} s)")

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)
        self.log(f"warning: {msg}")

    def _device_plan(self) -> list[str]:
        slots = self.exp.workers()
        want = self.exp.device
        gpus = detect_gpus() if want in ("auto", "cuda") else 0
        if want == "cuda" and gpus == 0:
            raise RunError("device: cuda asked for, but torch sees no GPU here")
        if gpus == 0:
            return ["cpu"] * len(slots)
        if gpus < len(slots):
            self.log(f"{gpus} GPU(s) for {len(slots)} workers: GPUs are shared round-robin")
        return [f"cuda:{i % gpus}" for i in range(len(slots))]

    def _launch(self, net: Network, server_path: Path) -> None:
        exp = self.exp
        slots = exp.workers()
        devices = self._device_plan()
        by_key = {(s.stage, s.replica): s for s in slots}
        containers = self._containers = _CpuContainers(net.registry, exp.name.replace("/", "-")[:20])
        cfg_dir = net.registry.dir / "workers"
        cfg_dir.mkdir(exist_ok=True)
        for slot, device in zip(slots, devices):
            host = net.host(slot.dc, slot.host_index)
            self.workers[slot.name] = WorkerState(slot, host, device=device)
            if not exp.parallel.slow_start_after_idle:  # a per-namespace sysctl: this host only
                host.node.cmd("sysctl -qw net.ipv4.tcp_slow_start_after_idle=0")
        for slot, device in zip(slots, devices):
            w = self.workers[slot.name]
            cfg = {
                "worker": {"name": slot.name, "stage": slot.stage, "replica": slot.replica, "ip": w.host.ip},
                "stages": exp.parallel.stages, "replicas": exp.parallel.replicas,
                "schedule": exp.parallel.schedule, "extra_warmup": exp.parallel.extra_warmup,
                "model": exp.model.model_dump(), "training": exp.training.model_dump(),
                "telemetry": str(server_path), "port": _PORT, "device": device,
                "announce_waits": exp.bubbletea.enabled,
            }
            if exp.bubbletea.enabled:  # the wait under way, for the prefill server beside it
                board = wait_board_path(cfg_dir, slot.name)
                board.write_bytes(bytes(8))
                net.registry.file(board)
                cfg["wait_board"] = str(board)
            for key, peer_stage in (("next", slot.stage + 1), ("prev", slot.stage - 1)):
                peer = by_key.get((peer_stage, slot.replica))
                if peer is None:
                    continue
                cfg[key] = self._peer(slot, peer)
            if exp.parallel.replicas > 1:
                master = self.workers[by_key[(slot.stage, 0)].name].host.ip
                group_devices = {self.workers[by_key[(slot.stage, r)].name].device for r in range(exp.parallel.replicas)}
                nccl = device.startswith("cuda") and len(group_devices) == exp.parallel.replicas
                cfg["dp"] = {"master": master, "port": _DP_PORT, "backend": "nccl" if nccl else "gloo"}
            path = cfg_dir / f"{slot.name}.json"
            path.write_text(json.dumps(cfg))
            net.registry.file(path)
            cpus = exp.topo.dc(slot.dc).host.cpus if device == "cpu" else 0.0
            cgroup = containers.make(slot.name, cpus)
            launch = f"exec {sys.executable} -m agents.trainer.worker {path}"
            if cgroup is not None:
                # Mininet hosts remount /sys, so the cgroup tree is not visible inside: the
                # shell stops itself, we move it into its container from here, then let it
                # exec the worker (which inherits the container before torch starts a thread).
                launch = f"kill -STOP $$; {launch}"
            env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                       GLIBC_TUNABLES="glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824")
            # gloo/NCCL otherwise bind to what the hostname resolves to (127.0.0.1 in here)
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = f"{w.host.name}-eth0"
            if device.startswith("cuda"):
                env["CUDA_VISIBLE_DEVICES"] = device.split(":")[1]
                cfg["device"] = "cuda:0"
                path.write_text(json.dumps(cfg))
            log_path = cfg_dir / f"{slot.name}.log"
            net.registry.file(log_path)
            with open(log_path, "w") as log:
                w.proc = net.popen(w.host, ["sh", "-c", launch], env=env, stdout=subprocess.DEVNULL, stderr=log)
            if cgroup is not None:
                if exp.bubbletea.enabled:
                    # a co-tenant (the prefill server) must share the worker's CPU: on another
                    # core it would draw on the same quota in parallel and throttle the worker
                    w.cpu = len([x for x in self.workers.values() if x.cpu is not None]) % (os.cpu_count() or 1)
                    os.sched_setaffinity(w.proc.pid, {w.cpu})
                _enter_container(w.proc, cgroup)
            w.cgroup = cgroup
        self.log(f"launched {len(slots)} workers ({exp.parallel.stages} stages x {exp.parallel.replicas} replicas, "
                 f"{exp.parallel.schedule}, {exp.parallel.connections} connection(s) per WAN transfer, "
                 f"device {devices[0].split(':')[0]})")

    def _peer(self, me: WorkerSlot, peer: WorkerSlot) -> dict:
        from agents.trainer.transport import socket_buffer_bytes

        ip = self.workers[peer.name].host.ip
        if peer.dc == me.dc:
            return {"name": peer.name, "ip": ip, "connections": 1, "buf": 0}
        n = self.exp.parallel.connections
        topo = self.exp.topo
        hops = topo.path(me.dc, peer.dc)
        rate = min(topo.direction(a, b).rate_mbps for a, b in zip(hops, hops[1:]))
        rtt = topo.one_way_delay_ms(me.dc, peer.dc) + topo.one_way_delay_ms(peer.dc, me.dc)
        return {"name": peer.name, "ip": ip, "connections": n, "buf": socket_buffer_bytes(rate, rtt, n)}

    def _collect(self, server: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(server, selectors.EVENT_READ, None)
        total = self.exp.training.iterations
        bufs: dict[socket.socket, bytes] = {}
        owner: dict[socket.socket, WorkerState] = {}
        started = time.monotonic()
        last_check = 0.0
        while True:
            for key, _ in sel.select(timeout=0.2):
                if key.data is None:
                    conn, _ = server.accept()
                    bufs[conn] = b""
                    sel.register(conn, selectors.EVENT_READ, "conn")
                    continue
                conn = key.fileobj
                try:
                    chunk = conn.recv(1 << 20)
                except ConnectionResetError:  # a peer killed with data unread: an end like any other
                    chunk = b""
                if not chunk:
                    sel.unregister(conn)
                    if conn is self._controller:
                        self._controller_gone("closed its connection")
                    elif conn is self._bt_sock:
                        self._bt_sock = None
                    continue
                bufs[conn] += chunk
                while b"\n" in bufs[conn]:
                    line, bufs[conn] = bufs[conn].split(b"\n", 1)
                    msg = json.loads(line)
                    if conn not in owner:  # the first line names the worker
                        if msg["worker"] == "bubbletea-controller":
                            owner[conn] = "bubbletea"
                            conn.settimeout(1.0)
                            self._bt_sock = conn
                            continue
                        if msg["worker"] == "atlas-controller":
                            owner[conn] = None
                            conn.settimeout(1.0)  # a stuck controller must not stall the run
                            self._controller = conn
                            continue
                        w = owner[conn] = self.workers[msg["worker"]]
                        w.sock = w.sock or conn  # a later connection only carries an error report
                        continue
                    if owner[conn] is None:
                        self._from_controller(msg)
                        continue
                    if owner[conn] == "bubbletea":
                        self._bt_ready = self._bt_ready or msg.get("type") == "ready"
                        continue
                    self._handle(owner[conn], msg)
            now = time.monotonic()
            if now - last_check > 0.5:
                last_check = now
                self._check_alive()
                self._check_atlas()
                if self._bt is not None:
                    self._bt.check()
                if not self.go_time and now - started > _READY_TIMEOUT_S:
                    waiting = [n for n, w in self.workers.items() if not w.ready]
                    parts = [f"workers {', '.join(waiting)}"] if waiting else []
                    if not self._bubbletea_ready():
                        parts.append("BubbleTea's prefill servers")
                    raise RunError(f"{' and '.join(parts)} not ready after {_READY_TIMEOUT_S:.0f} s")
            if not self.go_time and all(w.ready for w in self.workers.values()) and self._bubbletea_ready():
                self.go_time = time.monotonic()
                for w in self.workers.values():
                    w.sock.sendall(b'{"type":"go"}\n')
                self.log("all workers ready: training")
            self._progress(min(w.iterations_done for w in self.workers.values()), total)
            if all(w.done for w in self.workers.values()):
                for w in self.workers.values():
                    w.sock.sendall(b'{"type":"bye"}\n')
                if self._controller is not None:
                    self._to_controller({"type": "bye"})
                self._to_bubbletea({"type": "bye"})
                break
        for w in self.workers.values():
            try:
                w.proc.wait(30)
            except subprocess.TimeoutExpired:
                raise RunError(f"worker {w.slot.name} did not exit after training") from None

    def _handle(self, w: WorkerState, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "ready":
            w.ready = True
        elif kind == "events":
            w.events.extend(msg["events"])
            w.transfers.extend(msg.get("transfers", []))
            if msg.get("iteration_done"):
                w.iteration_end[msg["it"]] = msg["end"]
                if msg.get("loss") is not None:
                    w.losses[msg["it"]] = msg["loss"]
                w.iterations_done = msg["it"] + 1
        elif kind == "done":
            w.transfers.extend(msg.get("transfers", []))
            w.done = True
        elif kind == "error":
            w.reported_error = True
            # a peer's death shows up first as a broken channel elsewhere: name the root cause
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                self._check_alive()
                time.sleep(0.05)
            raise RunError(f"worker {w.slot.name} (stage {w.slot.stage}, replica {w.slot.replica}, "
                           f"{w.host.name} in {w.slot.dc}) failed: {msg['msg']}")
        for fn in self._subscribers:
            fn(w.slot.name, msg)
        if self._controller is not None and kind == "events":
            self._to_controller(dict(msg, worker=w.slot.name))
        if self._bt_sock is not None and kind in ("events", "wait"):
            self._to_bubbletea(dict(msg, worker=w.slot.name))

    def _bubbletea_ready(self) -> bool:
        """Training starts once BubbleTea's inference model is loaded and profiled beside every
        stage (as it would be on the GPUs before a job starts), or once BubbleTea is gone."""
        return self._bt is None or self._bt_ready or self._bt.dead

    def _to_bubbletea(self, msg: dict) -> None:
        if self._bt_sock is not None and not _send_line(self._bt_sock, msg):
            self._bt_sock = None  # its death is logged by BubbleTeaSide.check

    # -- Atlas ----------------------------------------------------------------------------
    def _start_atlas(self, net: Network, server_path: Path) -> None:
        """The controller and (temporal sharing) one agent per gateway with WAN links to enforce."""
        exp = self.exp
        links: dict[tuple[str, str], dict[str, list]] = {}
        delays: dict[str, float] = {}  # one-way WAN delay of each cross-DC transfer, by kind and receiver
        slots = {(s.stage, s.replica): s for s in exp.workers()}
        for (stage, r), a in slots.items():
            b = slots.get((stage + 1, r))
            if b is None or a.dc == b.dc:
                continue
            ip_a, ip_b = self.workers[a.name].host.ip, self.workers[b.name].host.ip
            hops = exp.topo.path(a.dc, b.dc)
            for x, y in zip(hops, hops[1:]):  # activations one way, gradients the other
                links.setdefault((x, y), {}).setdefault(f"r{r}", []).append([ip_a, ip_b])
                links.setdefault((y, x), {}).setdefault(f"r{r}", []).append([ip_b, ip_a])
            pairs = list(zip(hops, hops[1:]))
            delays[f"xfer_act:{stage + 1}"] = sum(exp.topo.direction(x, y).delay_ms for x, y in pairs) / 1e3
            delays[f"xfer_grad:{stage}"] = sum(exp.topo.direction(y, x).delay_ms for x, y in pairs) / 1e3
        rates = [exp.topo.direction(x, y).rate_mbps for x, y in links]
        state = net.registry.dir
        agents: dict[str, str] = {}
        env = dict(os.environ, PYTHONPATH=str(REPO))
        if exp.atlas.sharing == "temporal":
            for dc in sorted({x for x, _ in links}):
                mine = {f"{x}->{y}": (x, y) for x, y in links if x == dc}
                cfg = {"dc": dc, "listen": str(state / f"atlas-agent-{dc}.sock"), "lease_s": exp.atlas.lease_s,
                       "links": {n: {"control": net.link(*k).control_path, "lane": net.link(*k).lane}
                                 for n, k in mine.items()}}
                self._spawn_atlas(f"agent-{dc}", cfg, "agents.atlas.agent", state, env)
                agents[dc] = cfg["listen"]
        cfg = {
            "telemetry": str(server_path), "agents": agents, "sharing": exp.atlas.sharing,
            "lease_s": exp.atlas.lease_s, "replan_threshold": exp.atlas.replan_threshold,
            "stages": exp.parallel.stages, "replicas": exp.parallel.replicas,
            "warmup_iterations": exp.training.warmup_iterations,
            "message_bytes": exp.training.microbatch_size * exp.model.seq_len * exp.model.hidden * 4,
            "link_bytes_s": min(rates) * 1e6 / 8 if rates else 0.0,
            "transfer_delays_s": delays,
            "links": {f"{x}->{y}": {"classes": classes, "rate_mbps": exp.topo.direction(x, y).rate_mbps}
                      for (x, y), classes in links.items()},
        }
        self._spawn_atlas("controller", cfg, "agents.atlas.controller", state, env)
        self.log(f"atlas: controller and {len(agents)} agent(s) started ({exp.atlas.sharing} sharing, "
                 f"{len(links)} WAN direction(s) carry pipelines)")

    def _spawn_atlas(self, name: str, cfg: dict, module: str, state: Path, env: dict) -> None:
        path = state / f"atlas-{name}.json"
        path.write_text(json.dumps(cfg))
        self.net.registry.file(path)
        if "listen" in cfg:  # the agent's socket, and one per delay line it talks to
            for sock_path in [cfg["listen"]] + [f"{cfg['listen']}.{i}" for i in range(len(cfg["links"]))]:
                self.net.registry.file(sock_path)
        log_path = state / f"atlas-{name}.log"
        self.net.registry.file(log_path)
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", module, str(path)], stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=str(state), start_new_session=True)
        self.net.registry.process(proc.pid, f"atlas-{name}", own_netns=False)
        self._atlas_procs[name] = proc

    def _to_controller(self, msg: dict) -> None:
        if not _send_line(self._controller, msg):
            self._controller_gone("stopped reading")

    def _from_controller(self, msg: dict) -> None:
        if msg.get("type") != "plan":
            return
        plan = msg["plan"]
        at = min((w.iterations_done for w in self.workers.values()), default=0)
        self.atlas_plans.append(dict(plan, published_at_iteration=at))
        if len(self.atlas_plans) == 1:  # iterations under way when it came are not the plan's
            self.steady_from = max(w.iterations_done for w in self.workers.values()) + 1
        self._send_offsets({int(r): v for r, v in plan["offsets"].items()})
        self.log(f"atlas plan at iteration {at}: order {plan['order']}, offsets "
                 f"{[round(v * 1e3, 1) for v in plan['offsets'].values()]} ms")

    def _send_offsets(self, offsets: dict[int, float]) -> None:
        for w in self.workers.values():
            if w.slot.stage == 0 and w.sock is not None:
                try:
                    w.sock.sendall((json.dumps({"type": "plan", "offset_s": offsets.get(w.slot.replica, 0.0)})
                                    + "\n").encode())
                except OSError:
                    pass

    def _controller_gone(self, how: str) -> None:
        if self._controller is None:
            return
        self._controller = None
        at = min((w.iterations_done for w in self.workers.values()), default=0)
        self._atlas_dead.add("controller")
        self._send_offsets({})
        self.log(f"atlas controller {how} at iteration {at}: training continues under fair sharing "
                 f"(offsets reset; the agents restore FIFO within {self.exp.atlas.lease_s:.1f} s)")

    def _check_atlas(self) -> None:
        for name, proc in self._atlas_procs.items():
            if name in self._atlas_dead or proc.poll() is None:
                continue
            if name == "controller":
                self._controller_gone(f"died (exit {proc.returncode})")
            else:
                self._atlas_dead.add(name)
                at = min((w.iterations_done for w in self.workers.values()), default=0)
                self.log(f"atlas {name} died (exit {proc.returncode}) at iteration {at}: its links fall back "
                         f"to fair sharing when their lease ends ({self.exp.atlas.lease_s:.1f} s); training continues")

    def _stop_atlas(self) -> None:
        procs = list(self._atlas_procs.items())
        for name, proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for name, proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if procs:
            dst = self.out_dir / "atlas-logs"
            dst.mkdir(parents=True, exist_ok=True)
            for name, _ in procs:
                try:
                    shutil.copyfile(self.net.registry.dir / f"atlas-{name}.log", dst / f"{name}.log")
                except OSError:
                    pass
            (self.out_dir / "atlas-plans.json").write_text(json.dumps(self.atlas_plans, indent=1))

    def _check_alive(self) -> None:
        dead = [w for w in self.workers.values()
                if w.proc and w.proc.poll() is not None and (w.proc.returncode != 0 or not w.done)]
        if not dead:
            return
        # a worker that died unannounced is the cause; those that reported a broken channel follow
        w = sorted(dead, key=lambda w: w.reported_error)[0]
        code = w.proc.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        tail = ""
        try:
            log = self.net.registry.dir / "workers" / f"{w.slot.name}.log"
            lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
            tail = f": {lines[-1]}" if lines else ""
        except OSError:
            pass
        raise RunError(f"worker {w.slot.name} (stage {w.slot.stage}, replica {w.slot.replica}, "
                       f"{w.host.name} in {w.slot.dc}) died ({how}){tail}")


def _send_line(sock: socket.socket, msg: dict) -> bool:
    """One JSON line to a controller; False when it no longer reads."""
    try:
        sock.sendall((json.dumps(msg, separators=(",", ":")) + "\n").encode())
        return True
    except OSError:
        return False


def wait_board_path(cfg_dir: Path, worker: str) -> Path:
    """The 8-byte file where a worker shows the wait it is in (BubbleTea reads it)."""
    return cfg_dir / f"{worker}.board"


def _enter_container(proc: subprocess.Popen, cgroup: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _proc_state(proc.pid) != "T":
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RunError(f"worker process {proc.pid} did not reach its start point (state {_proc_state(proc.pid)})")
        time.sleep(0.002)
    (cgroup / "cgroup.procs").write_text(str(proc.pid))
    os.kill(proc.pid, signal.SIGCONT)


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _copy_worker_logs(src: Path, dst: Path) -> None:
    logs = [f for f in src.glob("*.log") if f.stat().st_size] if src.exists() else []
    if logs:
        dst.mkdir(parents=True, exist_ok=True)
        for f in logs:
            shutil.copy(f, dst / f.name)
