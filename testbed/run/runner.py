"""``testbed run``: build the topology, launch the workers, train, collect, write results.

How it fits: ``TrainingRun`` owns one run.  It takes its parts from a ``site.Site``
(``LocalSite`` here; ``cluster.remote.ClusterSite`` across machines) and uses them only
through ``site``'s protocols: it builds the network for the experiment's topology, checks
the WAN against its configuration (``fidelity.check_wan``), puts each worker host in its own
CPU container (on one machine ``procs.CpuContainers``: the stand-in for one device per
worker) or gives it its own GPU, starts ``testbed.train.worker`` there through the run's
launcher, and listens on the run's telemetry hub (on one machine ``hub.TelemetryHub``: the
filesystem is shared by all namespaces; the network is not, by design).  Everything
else that plugs into a run is a ``RunExtension`` (``extension.py``): the run drives each
through the same hooks and knows none of them by name.  When training ends, ``records``
hold what happened and ``metrics.py`` turns them into per-iteration figures, a Chrome
trace and plots.

Faults, and how a run ends (``testbed chaos`` measures them, docs/benchmarks.md): a worker
that dies or reports an error ends the whole run within a second or two, with an error
naming the worker (its log's last line when it had last words); a delay
line that dies ends it naming its links; a peer silent for ``training.recv_timeout_s``
(a WAN link down that long) ends it naming the worker, the peer and the WAN link between
them with its state, while a shorter outage only stalls training.  Every finished iteration
is appended to ``iterations.jsonl`` in the results folder as it completes, so a run that
fails, or whose orchestrator is killed, keeps what it did; a results folder that cannot be
written (a full disk) ends the run naming the folder.  A requested resource that cannot be
had is an error (``device: cuda`` without a usable GPU, with torch's reason) or a warning
recorded in metrics.json's ``summary.warnings`` (CPU quotas the cgroup tree refuses; an
NVIDIA GPU that torch cannot use under ``device: auto``).  Every process, namespace and
cgroup is removed in all cases.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from testbed import messages as m
from testbed.extension import DeviceKind, device_kind
from testbed.train.config import DataParallel, Me, Peer, WorkerConfig, socket_buffer_bytes

from testbed.spec.experiment import Experiment, WorkerSlot
from testbed.run.hooks import ExtensionError, RunExtension, extensions_for
from testbed.run.hub import TelemetryHub
from testbed.run.lab import Lab
from testbed.net.network import Network
from testbed.net.surface import HostInfo, NetworkError, NetworkSurface
from testbed.results.provenance import provenance
from testbed.results.records import RunRecord, WorkerRecord, in_emulated_time
from testbed.run import procs
from testbed.run.procs import ProcessError, python_env
from testbed.run.site import Containers, Hub, Launcher, Process, RunView, Site

if TYPE_CHECKING:
    from testbed.results.metrics import RunSummary

_PORT = 29400
_DP_PORT = 29500
_READY_TIMEOUT_S = 180.0
_LINK_SAMPLE_S = 0.25  # WAN counters sampled this often while training (wall clock)


class RunError(RuntimeError):
    """The run failed; the message is one line naming the cause."""


@dataclass
class WorkerState:
    """A live worker: where it runs, its process, and what it has reported (``record``)."""

    slot: WorkerSlot
    host: HostInfo
    record: WorkerRecord
    proc: Process | None = None
    ready: bool = False
    done: bool = False
    iterations_done: int = 0
    reported_error: bool = False
    cgroup: Any = None  # its CPU container (``Containers.make``: a cgroup folder on one machine)
    cpu: int | None = None  # the core it is pinned to, when an extension asks
    device_file: Path | None = None  # its emulated device (device: emulated), shared with co-tenants
    report: dict | None = None  # what it said of itself when done (an emulated device's op timing)

    @property
    def name(self) -> str:
        return self.slot.name

    def where(self) -> str:
        return f"worker {self.name} (stage {self.slot.stage}, replica {self.slot.replica}, {self.host.name} in {self.slot.dc})"


class LocalSite:
    """Where a run's parts come from on one machine (``site.Site``): a ``lab.Lab`` (its
    ``Network`` and its ``procs.Launcher``; the run makes its own WAN check, to log it), a
    Unix-socket ``TelemetryHub`` in the network's state folder and ``procs.CpuContainers``.
    A run across machines passes ``cluster.remote.ClusterSite`` instead."""

    def lab(self, topo, delay_backend: str, options: dict) -> Lab:
        return Lab(topo, delay_backend=delay_backend, check=False, network_options=options)

    def hub(self, run: RunView, net: Network) -> tuple[TelemetryHub, Path]:
        path = net.registry.dir / "telemetry.sock"
        net.registry.file(path)
        return TelemetryHub(path), path

    def containers(self, net: Network, run_name: str) -> procs.CpuContainers:
        return procs.CpuContainers(net.registry, run_name)

    def gpus(self) -> int:
        from testbed.run.devices import detect_gpus

        return detect_gpus()

    def finish(self, run: RunView) -> None:
        """Training is over, the parts are still up (a cluster: the end clock sample, and
        every timestamp corrected for the drift it measured)."""

    def summary(self) -> dict:
        """What the site adds to metrics.json (a cluster: machines, clocks, underlay)."""
        return {}


class TrainingRun:
    """One run of ``exp``; results go to ``out_dir``.  ``extensions``: what plugs in (default
    ``extensions_for(exp)``)."""

    def __init__(self, exp: Experiment, out_dir: Path, delay_backend: str = "auto",
                 progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] | None = None,
                 extensions: list[RunExtension] | None = None, site: Site[Any] | None = None):
        self.exp = exp
        self.site: Site[Any] = site or LocalSite()
        self.out_dir = Path(out_dir)
        self.delay_backend = delay_backend
        self.extensions = extensions if extensions is not None else extensions_for(exp)
        self._progress = progress or (lambda done, total: None)
        self._log = log or (lambda msg: None)
        self._subscribers: list[Callable[[str, m.Message], None]] = []
        self.workers: dict[str, WorkerState] = {}
        self.net: NetworkSurface | None = None
        self.launcher: Launcher | None = None
        self.containers: Containers | None = None
        self.telemetry_path: Path | None = None
        self._hub: Hub | None = None
        self.go_time = 0.0
        self.log_lines: list[str] = []
        self.warnings: list[str] = []
        self.tcp: dict = {}  # per host: TCP counters over the run (retransmissions, timeouts)
        self.wan_check: list[dict] = []
        self.device: DeviceKind | None = None  # the experiment's device kind (a registry plug-in)
        self._devices: list[str] = []
        self._iterations_file = None
        self._iterations_written = 0
        self._links: dict[str, list[tuple[float, int, int, int]]] = {}  # WAN counter samples (record.links)
        self._last_link_sample = 0.0
        self._peer_owner = {p: ext for ext in self.extensions for p in ext.peers}

    # -- what extensions and callers use -----------------------------------------------
    def subscribe(self, fn: Callable[[str, m.Message], None]) -> None:
        """``fn(worker_name, message)`` for every telemetry message, as it arrives."""
        self._subscribers.append(fn)

    def log(self, msg: str) -> None:
        self.log_lines.append(f"{time.strftime('%H:%M:%S')} {msg}")
        self._log(msg)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)
        self.log(f"warning: {msg}")

    def send_to_worker(self, name: str, msg: m.Message) -> bool:
        return self._hub is not None and self._hub.send(name, msg)

    def send_to_peer(self, name: str, msg: m.Message) -> bool:
        return self._hub is not None and self._hub.send(name, msg)

    def iterations_done(self) -> int:
        return min((w.iterations_done for w in self.workers.values()), default=0)

    def extension(self, name: str) -> RunExtension:
        for ext in self.extensions:
            if ext.name == name:
                return ext
        raise KeyError(f"no extension {name!r} in this run")

    def pids(self) -> dict[str, int]:
        """Every process this run started, by name (workers by their slot name)."""
        return self.launcher.pids() if self.launcher is not None else {}

    # -- the run --------------------------------------------------------------------
    def run(self) -> "RunSummary":
        exp = self.exp
        if importlib.util.find_spec("torch") is None:  # the workers' (pyproject.toml's extra "train")
            raise ModuleNotFoundError("PyTorch is not installed, and every run's workers need it: "
                                      "pip install 'geo-testbed[train]'", name="torch")
        try:  # a bad profile, or device: cuda without a usable GPU, fails here, before anything is built
            self.device = device_kind(exp.device)(exp)
            self.device.check()
            self._devices = self.device.plan(self.site, len(exp.workers()), self.warn)
        except ExtensionError as exc:
            raise RunError(str(exc)) from None
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._iterations_file = open(self.out_dir / "iterations.jsonl", "w")
        except OSError as exc:
            raise self._write_error(exc) from None
        try:
            return self._run()
        finally:
            self._iterations_file.close()

    def _run(self) -> dict:
        from testbed.results import metrics

        exp = self.exp
        options: dict = {"time_dilation": exp.time_dilation} if exp.time_dilation != 1.0 else {}
        for ext in self.extensions:
            options.update(ext.network_options())
        with self.site.lab(exp.topo, self.delay_backend, options) as lab:
            self.net = net = lab.network
            self.log(f"network {exp.topo.name} up in {net.startup_s:.2f} s (delay: {net.backends.delay})")
            self._check_wan(net)
            self._hub, self.telemetry_path = self.site.hub(self, net)
            self._hub.expect_peers(set(self._peer_owner))
            self.launcher = lab.launcher
            self.containers = self.site.containers(net, exp.name)
            try:
                self._tcp_start = net.tcp_counters()
                try:
                    self._launch(net)
                    for ext in self.extensions:
                        ext.start(self)
                except (ExtensionError, ProcessError) as exc:
                    raise RunError(str(exc)) from None
                self._collect()
                self.site.finish(self)
                after = net.tcp_counters()
                self.tcp = {h: {k: v - self._tcp_start.get(h, {}).get(k, 0) for k, v in c.items()}
                            for h, c in after.items()}
            finally:
                for ext in self.extensions:
                    try:
                        ext.stop(self.out_dir)
                    except Exception as exc:  # a broken extension must not keep the run from cleaning up
                        self.log(f"{ext.name}: stopping failed: {type(exc).__name__}: {exc}")
                self.launcher.stop(list(self.workers))
                try:
                    self.launcher.copy_logs(self.out_dir / "worker-logs", list(self.workers))
                except OSError as exc:  # a full disk must not hide why the run ended
                    self.log(f"worker logs not kept: {exc.strerror}")
                self._hub.close()
                self._hub = None
        record = self.record()
        result = metrics.summarise(record)
        result.extra["provenance"] = provenance(self.exp)
        site = self.site.summary()
        if site:
            result.extra["cluster"] = site
        for ext in self.extensions:
            result.summary.extra.update(ext.summarise(record, result, self.out_dir))
        try:
            self._write_tcp_traces()
            metrics.write_outputs(record, result, self.out_dir)
            for ext in self.extensions:
                ext.write_outputs(record, result, self.out_dir)
        except OSError as exc:
            raise self._write_error(exc) from None
        return result

    def _write_tcp_traces(self) -> None:
        """``parallel.tcp_trace``: each worker's rows (``transport.Channel._traced``) as
        ``tcp-trace/WORKER.jsonl``, times from the run's start (the go) like the timeline's."""
        if not self.exp.parallel.tcp_trace:
            return
        folder = self.out_dir / "tcp-trace"
        folder.mkdir(exist_ok=True)
        t0 = self.go_time or 0.0
        for name, w in self.workers.items():
            rows = (w.report or {}).pop("tcp_trace", None)
            if not rows:
                continue
            with open(folder / f"{name}.jsonl", "w") as f:
                for r in rows:
                    r["t"], r["queued_at"] = round(r["t"] - t0, 6), round(r["queued_at"] - t0, 6)
                    f.write(json.dumps(r) + "\n")

    def _write_error(self, exc: OSError) -> RunError:
        what = f" ({Path(exc.filename).name})" if exc.filename else ""
        return RunError(f"results folder {self.out_dir}: cannot write{what}: {exc.strerror or exc}")

    def _iteration_finished(self) -> None:
        """Append every iteration all workers have now finished to iterations.jsonl, once each,
        as it completes (a failed or killed run keeps them)."""
        done = self.iterations_done()
        while self._iterations_written < done:
            k = self._iterations_written
            ends = [w.record.iteration_end[k] for w in self.workers.values() if k in w.record.iteration_end]
            losses = [w.record.losses[k] for w in self.workers.values() if k in w.record.losses]
            end = (max(ends) - self.go_time) / self.exp.time_dilation if ends else None  # emulated seconds
            line = {"iteration": k, "end_s": None if end is None else round(end, 6),
                    "loss": sum(losses) if losses else None}
            try:
                self._iterations_file.write(json.dumps(line) + "\n")
                self._iterations_file.flush()
            except OSError as exc:
                raise self._write_error(exc) from None
            self._iterations_written += 1

    def record(self) -> RunRecord:
        """What this run has recorded so far, as the metrics read it."""
        steady = max((ext.steady_state_from() for ext in self.extensions), default=0)
        device = self.device.describe(self) if self.device is not None else {}
        record = RunRecord(self.exp, {n: w.record for n, w in self.workers.items()}, self.go_time,
                           self.log_lines, steady_from=steady, warnings=self.warnings, wan_check=self.wan_check,
                           device=device, tcp=self.tcp, out_dir=self.out_dir, link_samples=self._links)
        return in_emulated_time(record, self.exp.time_dilation)  # every figure in emulated seconds

    def _sample_links(self, force: bool = False) -> None:
        """Every WAN direction's counters, every ``_LINK_SAMPLE_S`` while training (in this
        loop, so no other thread shares the network's netlink sockets): links.csv and the
        timeline's counter tracks."""
        now = time.monotonic()
        if not force and now - self._last_link_sample < _LINK_SAMPLE_S:
            return
        self._last_link_sample = now
        for wd in self.net.links():
            try:
                c = wd.counters()
            except Exception:  # a link being changed or taken down: the next sample will do
                continue
            self._links.setdefault(f"{wd.src}->{wd.dst}", []).append((c.time, c.tx_bytes, c.drops, c.backlog_bytes))

    def _check_wan(self, net: NetworkSurface) -> None:
        """Every run measures its own WAN before training: configured against measured per
        direction, in metrics.json; a direction outside tolerance is a warning."""
        from testbed.net.fidelity import check_wan

        t0 = time.monotonic()
        checks = check_wan(net)
        self.wan_check = [c.to_dict() for c in checks]
        bad = [c for c in checks if not c.ok]
        for c in bad:
            self.warn(f"WAN {c.src} -> {c.dst} is not as configured: {c.problem}")
        self.log(f"WAN check: {len(checks) - len(bad)}/{len(checks)} directions within max(0.5 ms, 2%) of their "
                 f"configured delay ({time.monotonic() - t0:.1f} s)")

    def _launch(self, net: NetworkSurface) -> None:
        exp = self.exp
        slots = exp.workers()
        devices = self._devices
        quotas = sorted({s.dc for s, d in zip(slots, devices) if d == "cpu" and exp.topo.dc(s.dc).host.cpus > 0})
        problem = self.containers.problem() if quotas else None
        if problem:  # the figures would not be one device's per worker: say so, loudly, in metrics.json too
            self.warn(f"the topology gives hosts in {', '.join(quotas)} a CPU quota (host.cpus), but {problem}: "
                      f"the workers run without one")
        for slot, device in zip(slots, devices):
            host = net.host(slot.dc, slot.host_index)
            rec = WorkerRecord(slot.name, slot.stage, slot.replica, slot.dc, host.name, host.ip, device)
            self.workers[slot.name] = WorkerState(slot, host, rec)
            if not exp.parallel.slow_start_after_idle:  # a per-namespace sysctl: this host only
                host.node.cmd("sysctl -qw net.ipv4.tcp_slow_start_after_idle=0")
            window = exp.parallel.tcp_window_bytes
            if window:  # every connection of this host window-bound: the transport clamps the
                # window to the byte (``transport.py``); other connections (gloo's, when DP crosses
                # the WAN) by their buffers, so within the payload/truesize ratio (tcp_rmem/tcp_wmem
                # are per namespace; net.core.rmem_max is not, here)
                host.node.cmd(f"sysctl -qw 'net.ipv4.tcp_rmem=4096 {min(131072, window)} {window}' "
                              f"'net.ipv4.tcp_wmem=4096 {min(16384, window)} {window}'")
        # a co-tenant of a worker's device (a prefill server, say) must share its core:
        # on another core it would draw on the same quota in parallel and throttle the worker
        pin = any(ext.pins_workers for ext in self.extensions)
        pinned = 0
        for slot, device in zip(slots, devices):
            w = self.workers[slot.name]
            cfg = self._worker_config(slot, device)
            # gloo/NCCL otherwise bind to what the hostname resolves to
            env = python_env(GLOO_SOCKET_IFNAME=f"{w.host.name}-eth0", NCCL_SOCKET_IFNAME=f"{w.host.name}-eth0")
            cpus = self.device.configure(self, w, cfg, env)
            w.cgroup = self.containers.make(slot.name, cpus, limit_later=True)  # see the go below
            if pin and w.cgroup is not None:
                w.cpu = pinned % (os.cpu_count() or 1)
                pinned += 1
            w.proc = self.launcher.start(slot.name, "testbed.train.worker", cfg.to_dict(), host=w.host,
                                         cgroup=w.cgroup, cpu=w.cpu, env=env)
        self.log(f"launched {len(slots)} workers ({exp.parallel.stages} stages x {exp.parallel.replicas} replicas, "
                 f"{exp.parallel.schedule}, {exp.parallel.connections} connection(s) per WAN transfer, "
                 f"device {devices[0].split(':')[0]})")

    def _worker_config(self, slot: WorkerSlot, device: str) -> WorkerConfig:
        exp = self.exp
        by_key = {(s.stage, s.replica): s for s in exp.workers()}
        w = self.workers[slot.name]
        cfg = WorkerConfig(
            worker=Me(slot.name, slot.stage, slot.replica, w.host.ip),
            stages=exp.parallel.stages, replicas=exp.parallel.replicas, schedule=exp.parallel.schedule,
            extra_warmup=exp.parallel.extra_warmup, model=exp.model.model_dump(),
            training=exp.training.model_dump(), telemetry=str(self.telemetry_path), port=_PORT, device=device,
            recv_timeout_s=exp.training.recv_timeout_s * exp.time_dilation, tcp_trace=exp.parallel.tcp_trace)
        for key, peer_stage in (("next", slot.stage + 1), ("prev", slot.stage - 1)):
            peer = by_key.get((peer_stage, slot.replica))
            if peer is not None:
                setattr(cfg, key, self._peer(slot, peer))
        if exp.parallel.replicas > 1:
            stage_slots = [by_key[(slot.stage, r)] for r in range(exp.parallel.replicas)]
            ips = [self.workers[s.name].host.ip for s in stage_slots]
            backend = self.device.dp_backend([self.workers[s.name].record.device for s in stage_slots])
            cfg.dp = DataParallel(ips[0], _DP_PORT, backend, ring=ips)
        for ext in self.extensions:
            for key, value in ext.worker_options(self, slot).items():
                setattr(cfg, key, value)
        return cfg

    def _peer(self, me: WorkerSlot, peer: WorkerSlot) -> Peer:
        ip = self.workers[peer.name].host.ip
        if peer.dc == me.dc:
            return Peer(peer.name, ip)
        n = self.exp.parallel.connections
        topo = self.exp.topo
        hops = topo.path(me.dc, peer.dc)
        rate = min(topo.direction(a, b).rate_mbps for a, b in zip(hops, hops[1:]))
        window = self.exp.parallel.tcp_window_bytes or 0  # exact: the transport clamps it
        # paced at the wire's rate (under time dilation, the dilated one), payload bytes
        wire = min(self.net.topo.direction(a, b).rate_mbps for a, b in zip(hops, hops[1:]))
        pace = int(1.25 * wire * 1e6 / 8 * 1448 / 1514 / n) if self.exp.parallel.paced else 0
        return Peer(peer.name, ip, n, socket_buffer_bytes(rate, topo.rtt_ms(me.dc, peer.dc), n), window, pace,
                    wan=True)

    def _collect(self) -> None:
        hub = self._hub
        total = self.exp.training.iterations
        started = time.monotonic()
        last_check = 0.0
        while True:
            for name, msg in hub.poll(0.2):
                if name in self.workers:
                    if msg is not None:  # a closed channel: its process's fate is checked below
                        self._handle(self.workers[name], msg)
                elif name in self._peer_owner:
                    ext = self._peer_owner[name]
                    if msg is None:
                        ext.on_peer_gone(name)
                    else:
                        ext.on_peer_message(name, msg)
            now = time.monotonic()
            if now - last_check > 0.5:
                last_check = now
                self._check_alive()
                for ext in self.extensions:
                    ext.check()
                if not self.go_time and now - started > _READY_TIMEOUT_S:
                    waiting = [n for n, w in self.workers.items() if not w.ready]
                    parts = [f"workers {', '.join(waiting)}"] if waiting else []
                    parts += [ext.waiting_for() for ext in self.extensions if not ext.ready()]
                    raise RunError(f"{' and '.join(parts)} not ready after {_READY_TIMEOUT_S:.0f} s")
            if not self.go_time and all(w.ready for w in self.workers.values()) and \
                    all(ext.ready() for ext in self.extensions):
                # the workers' quotas from here: their start-up ran without (CpuContainers.make)
                self.containers.enforce()
                self.go_time = time.monotonic()
                for name in self.workers:
                    hub.send(name, m.Go())
                self.log("all workers ready: training")
            self._progress(self.iterations_done(), total)
            if self.go_time:
                self._sample_links()
            if all(w.done for w in self.workers.values()):
                self._sample_links(force=True)
                for name in self.workers:
                    hub.send(name, m.Bye())
                for ext in self.extensions:
                    ext.training_done()
                break
        for w in self.workers.values():
            try:
                w.proc.wait(30)
            except Exception:
                raise RunError(f"{w.where()} did not exit after training") from None

    def _handle(self, w: WorkerState, msg: m.Message) -> None:
        if isinstance(msg, m.Ready):
            w.ready = True
        elif isinstance(msg, m.Events):
            w.record.add_events(msg.events)
            w.record.add_transfers(msg.transfers)
            if msg.iteration_done:
                w.record.iteration_end[msg.it] = msg.end
                if msg.loss is not None:
                    w.record.losses[msg.it] = msg.loss
                w.iterations_done = msg.it + 1
                self._iteration_finished()
        elif isinstance(msg, m.Done):
            w.record.add_transfers(msg.transfers)
            w.report = msg.report
            w.done = True
        elif isinstance(msg, m.WorkerError):
            w.reported_error = True
            # a peer's death shows up first as a broken channel elsewhere: name the root cause
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                self._check_alive()
                time.sleep(0.05)
            if msg.peer in self.workers:  # a peer silent for recv_timeout_s: name the link between
                raise RunError(self._silent_peer(w, self.workers[msg.peer], msg.silent_s))
            raise RunError(f"{w.where()} failed: {msg.msg}")
        for fn in self._subscribers:
            fn(w.name, msg)
        for ext in self.extensions:
            ext.on_worker_message(w.name, msg)

    def _silent_peer(self, w: WorkerState, peer: WorkerState, seconds: float | None) -> str:
        head = (f"{w.where()} heard nothing from {peer.name} in {peer.slot.dc} for "
                f"{seconds if seconds is not None else self.exp.training.recv_timeout_s:g} s (training.recv_timeout_s)")
        if peer.slot.dc == w.slot.dc:
            return f"{head}, inside DC {w.slot.dc}"
        hops = self.exp.topo.path(peer.slot.dc, w.slot.dc)
        links = []
        for a, b in zip(hops, hops[1:]):
            try:
                state = self.net.link_state(a, b)
            except (NetworkError, OSError) as exc:
                state = f"state unknown: {exc}"
            links.append((f"WAN link {a} -> {b}", state))
        bad = [(name, state) for name, state in links if state != "up"] or links
        return f"{head}: " + ", ".join(f"{name} is {state}" if state in ("up", "down") else f"{name}: {state}"
                                       for name, state in bad)

    def _check_alive(self) -> None:
        if self.net is not None:
            try:
                self.net.check()  # a dead delay line: its links would lose their delay silently
            except NetworkError as exc:
                raise RunError(str(exc)) from None
        dead = [w for w in self.workers.values()
                if w.proc and not w.proc.alive() and (w.proc.returncode != 0 or not w.done)]
        if not dead:
            return
        # a worker that died unannounced is the cause; those that reported a broken channel follow
        w = sorted(dead, key=lambda w: w.reported_error)[0]
        code = w.proc.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        tail = w.proc.last_log_line()
        raise RunError(f"{w.where()} died ({how}){': ' + tail if tail else ''}")
