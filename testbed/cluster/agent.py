"""``testbed machine-agent``: one machine's part of a run across several machines.

How it fits: the orchestrator (``remote.py``) starts one agent per machine over SSH, from
the build it installed there (``build.py``), and speaks to it on the SSH session's stdin and
stdout (``wire.py``); nothing listens on a port.  The first call is ``hello`` with the
orchestrator's build: the agent refuses any other build than its own, naming both.  Then it
serves requests: build this machine's DCs of the topology (``network.Network`` with ``dcs``
and VXLAN ``tunnels``), run commands and processes in its hosts, start workers in their CPU
containers (``procs``), and an extension's processes beside the network, relay what they
say on the machine's own telemetry hub (``hub.TelemetryHub``, raw: undecoded JSON objects),
answer clock samples.  ``Launcher.socket`` paths of another machine's processes are bound
here (``relay``) and what this machine's processes send to them goes up as ``Datagram``s; a
``Datagram`` that comes down is delivered to its path here, held in order up to
``PENDING_S`` while the path is not bound yet.  A link's delay line (``link_info``,
``delay_line_stats``, ``link_sched``) and a file a process left (``read_file``) are
reached the same way.  For a ``testbed torchrun`` job
(``jobs.py``): take the user's files into a folder of the run's own (``put_file``, in
chunks), start a rank there with this agent's Python (``job_start``: its output to a log in
the run's folder), signal a rank's process group (``job_signal``).  One thread answers
requests (a clock sample is answered the moment it arrives); a second relays telemetry and
the ranks' output as it is written (``Output``, whole lines), and reports processes that
ended (a rank's ``Exited`` after the last of its output) and delay lines that died.  The
agent's log is its stderr, which SSH carries back to the orchestrator.

Leases: the agent serves one orchestrator.  When its stdin closes (the orchestrator ended,
or was killed, and its SSH client with it) or it hears nothing for ``lease_s`` (a hung
orchestrator, a cut management network), it removes everything it made and exits, so a
machine is left clean without anyone reaching it; ``testbed clean`` on the machine does the
same after a crash of the agent itself, and leaves a live agent (another orchestrator's run)
alone unless forced (``PID_FILE`` says whose run it is).
"""

from __future__ import annotations

import base64
import collections
import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from testbed import messages as m
from testbed.cluster import wire
from testbed.cluster.build import version

PENDING_S = 60.0  # a relayed datagram waits this long for its socket to be bound (or drained)
PID_FILE = Path("/run/gtb-agent.pid")  # {"pid", "orchestrator", "run"}: the live agent of this machine


class _Session:
    def __init__(self, conn: wire.Channel, lease_s: float, log):
        self.conn = conn
        self.lease_s = lease_s
        self.log = log
        self.lock = threading.Lock()
        self.net = None
        self.launcher = None
        self.containers = None
        self.hub = None
        self.hosts: dict = {}
        self.procs: dict[int, subprocess.Popen] = {}
        self.jobs: dict[str, _Rank] = {}  # a torchrun job's ranks on this machine, by name
        self.reported: set[str] = set()
        self.net_error_sent = False
        self.alive = True
        self.relays: dict[str, socket.socket] = {}  # Launcher.socket paths bound here for another machine's process
        self.out: socket.socket | None = None  # delivers the datagrams relayed to this machine's processes
        self.pending: dict[str, collections.deque] = {}  # path -> (since, data) not yet bound or full, in order
        self.pending_lock = threading.Lock()
        self.undelivered = 0

    # -- the wire ---------------------------------------------------------------------
    def emit(self, msg: m.Message) -> None:
        with self.lock:
            try:
                self.conn.send(msg)
            except OSError:
                self.alive = False

    def serve(self, reader: wire.LineReader, first: m.Call) -> None:
        heard = time.monotonic()
        relay = threading.Thread(target=self._relay, daemon=True)
        relay.start()
        threading.Thread(target=self._relay_datagrams, daemon=True).start()
        self.emit(m.Answer(id=first.id, result=self.op_hello()))
        try:
            while self.alive:
                ready, _, _ = select.select([self.conn], [], [], 0.5)
                if not ready:
                    if time.monotonic() - heard > self.lease_s:
                        self.log(f"lease expired: nothing heard for {self.lease_s:g} s")
                        return
                    continue
                lines = reader.read()
                if lines is None:
                    self.log("orchestrator closed the connection")
                    return
                heard = time.monotonic()
                for req in lines:
                    if isinstance(req, m.Datagram):
                        self.deliver(req)
                        continue
                    if not isinstance(req, m.Call):
                        self.log(f"ignored a {req.kind!r} message: the orchestrator sends calls")
                        continue
                    try:
                        result = self._handle(req)
                        self.emit(m.Answer(id=req.id, result=result))
                    except Exception as exc:  # one line back; the orchestrator decides
                        self.emit(m.Answer(id=req.id, error=f"{type(exc).__name__}: {exc}".splitlines()[0]))
                    if req.op == "teardown":
                        return
        finally:
            self.alive = False
            self.teardown()

    def _relay(self) -> None:
        while self.alive:
            hub = self.hub
            if hub is None:
                time.sleep(0.05)
                continue
            try:
                for name, msg in hub.poll(0.1):
                    self.emit(m.Telemetry(name=name, msg=msg, t=time.monotonic()))  # msg: its JSON object
            except (OSError, ValueError) as exc:
                if not self.alive:
                    return
                self.log(f"telemetry relay: {type(exc).__name__}: {exc}")
            for name, rank in list(self.jobs.items()):
                if name in self.reported:
                    continue
                rc = rank.proc.poll()
                while text := rank.read(whole_lines=rc is None):  # once it ended: to the end of its log
                    self.emit(m.Output(name=name, text=text))
                    if rc is None:
                        break
                if rc is not None:
                    self.reported.add(name)
                    self.emit(m.Exited(name=name, rc=rc))
            launcher = self.launcher
            for name, p in list(launcher.processes.items()) if launcher else []:
                if name not in self.reported and p.poll() is not None:
                    self.reported.add(name)
                    self.emit(m.Exited(name=name, rc=p.returncode, tail=p.last_log_line() or ""))
            if self.net is not None and not self.net_error_sent:
                try:
                    self.net.check()
                except Exception as exc:
                    self.net_error_sent = True
                    self.emit(m.NetworkFailed(error=str(exc)))

    def _relay_datagrams(self) -> None:
        """What this machine's processes send to another machine's socket (``op_relay``), up to
        the orchestrator as it arrives."""
        while self.alive:
            if self.pending:
                self.flush()
            socks = list(self.relays.items())
            if not socks:
                time.sleep(0.05)
                continue
            try:
                ready, _, _ = select.select([s for _, s in socks], [], [], 0.05 if self.pending else 0.2)
            except (OSError, ValueError):  # one closed meanwhile
                continue
            for path, sock in socks:
                if sock in ready:
                    try:
                        data = sock.recv(1 << 16)
                    except OSError:
                        continue
                    self.emit(m.Datagram(path=path, data=base64.b64encode(data).decode()))

    def deliver(self, msg: m.Datagram) -> None:
        """A datagram another machine's process sent to a socket of a process here.  Where
        the socket is not bound yet (its process is starting) or its queue is full, it waits
        here, in order, up to ``PENDING_S``: what a sender on this machine would do, retrying
        or blocking, the relay does for it (it cannot tell the sender)."""
        with self.pending_lock:
            self.pending.setdefault(msg.path, collections.deque()).append((time.monotonic(),
                                                                           base64.b64decode(msg.data)))
        self.flush()

    def flush(self) -> None:
        if self.out is None:
            self.out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self.out.setblocking(False)
        now = time.monotonic()
        with self.pending_lock:
            for path, queue in list(self.pending.items()):
                while queue:
                    since, data = queue[0]
                    try:
                        self.out.sendto(data, path)
                    except OSError as exc:
                        waits = exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.ENOBUFS)
                        if waits and now - since < PENDING_S:
                            break
                        queue.popleft()  # a datagram's fate: lost, as one sent to a socket that is gone
                        self.undelivered += 1
                        if self.undelivered <= 3:
                            self.log(f"a datagram for {path} was not delivered: {exc.strerror or exc}")
                        continue
                    queue.popleft()
                if not queue:
                    del self.pending[path]

    # -- requests ---------------------------------------------------------------------
    def _handle(self, req: m.Call):
        fn = getattr(self, f"op_{req.op}", None)
        if fn is None:
            raise ValueError(f"unknown op {req.op!r}")
        return fn(**req.args)

    def op_hello(self, **_orchestrator) -> dict:
        return {"machine": machine_name(), "pid": os.getpid(), "t": time.monotonic(), "build": version()}

    def op_clock(self) -> dict:
        return {"t": time.monotonic()}

    def op_renew(self) -> dict:
        return {}

    def op_underlay_rtt(self, peers: list[str], count: int = 20) -> dict:
        """Min RTT (ms) to each peer's underlay address: what a VXLAN adds to a WAN link."""
        out = {}
        for ip in peers:
            r = subprocess.run(["ping", "-n", "-q", "-c", str(count), "-i", "0.01", "-W", "1", ip],
                               capture_output=True, text=True, timeout=30)
            line = [ln for ln in r.stdout.splitlines() if "min/avg" in ln]
            out[ip] = float(line[0].split("=")[1].split("/")[0]) if line else None
        return out

    def op_underlay_mtu(self, address: str) -> int:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            found = ipr.get_addr(address=address)
            if not found:
                raise ValueError(f"underlay address {address} is on no interface of this machine")
            return ipr.get_links(found[0]["index"])[0].get_attr("IFLA_MTU")

    def op_build(self, topology: dict, dcs: list[str], tunnels: list[dict], mtu: int | None,
                 delay_backend: str = "auto", loss_backend: str = "auto", run_name: str = "run",
                 options: dict | None = None) -> dict:
        from testbed.run.hub import TelemetryHub
        from testbed.net.network import Network, Tunnel
        from testbed.run.procs import CpuContainers, Launcher
        from testbed.spec.topology import parse_topology

        topo = parse_topology(topology, "topology", strict=False)
        tun = {(t["local"], t["remote"]): Tunnel(t["local_ip"], t["remote_ip"], t["vni"], t["mtu"]) for t in tunnels}
        net = Network(topo, delay_backend=delay_backend, loss_backend=loss_backend, dcs=dcs, tunnels=tun, mtu=mtu,
                      **(options or {}))
        self.net = net
        net.start()
        self.launcher = Launcher(net.registry, net)
        self.containers = CpuContainers(net.registry, run_name)
        path = net.registry.dir / "telemetry.sock"
        net.registry.file(path)
        self.hub = TelemetryHub(path, raw=True)  # relayed undecoded: an extension's kinds are decoded where it runs
        self.hosts = {h.name: h for h in net.hosts()}
        return {"hosts": {dc: [[h.name, h.ip] for h in net.hosts(dc)] for dc in net.local},
                "backends": {"delay": net.backends.delay, "loss": net.backends.loss, "rate": net.backends.rate},
                "startup_s": net.startup_s, "files": str(self.launcher.dir)}

    def op_cmd(self, host: str, command: str) -> str:
        return self.hosts[host].node.cmd(command)

    def op_popen(self, host: str, argv: list[str], pipe: bool = True) -> dict:
        kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) if pipe else \
            dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = self.net.popen(self.hosts[host], argv, **kw)
        self.procs[proc.pid] = proc
        return {"pid": proc.pid}

    def op_readline(self, pid: int, timeout: float = 10.0) -> str:
        proc = self.procs[pid]
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        return proc.stdout.readline() if ready else ""

    def op_communicate(self, pid: int, timeout: float | None = None) -> dict:
        proc = self.procs[pid]
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        return {"stdout": stdout or "", "stderr": stderr or "", "rc": proc.returncode}

    def op_poll(self, pid: int) -> int | None:
        return self.procs[pid].poll()

    def op_wait(self, pid: int, timeout: float | None = None) -> int | None:
        try:
            return self.procs[pid].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def op_signal(self, pid: int, kill: bool = False) -> None:
        proc = self.procs[pid]
        if proc.poll() is None:
            proc.kill() if kill else proc.terminate()

    def op_containers_problem(self) -> str | None:
        return self.containers.problem()

    def op_containers_enforce(self) -> None:
        self.containers.enforce()

    def op_launch(self, name: str, module: str, config: dict, host: str | None, cpus: float, env: dict,
                  limit_later: bool = False, cpu: int | None = None, sched_idle: bool = False) -> dict:
        """Start a process in ``host`` (None: beside this machine's network), its
        ``telemetry`` this machine's hub."""
        from testbed.run.procs import python_env

        if "telemetry" in config:
            config = dict(config, telemetry=str(self.hub.path))
        cgroup = self.containers.make(name, cpus, limit_later)
        proc = self.launcher.start(name, module, config, host=self.hosts[host] if host is not None else None,
                                   cgroup=cgroup, cpu=cpu, sched_idle=sched_idle, env=python_env(**env))
        return {"pid": proc.pid}

    def op_relay(self, path: str) -> None:
        """Bind ``path`` (a ``Launcher.socket`` of another machine's process) here and relay
        what this machine's processes send to it."""
        p = Path(path)
        if p.parent != self.launcher.dir:
            raise ValueError(f"{path}: a socket in the run's process folder")
        if path in self.relays:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if p.exists():
            p.unlink()
        sock.bind(path)
        self.net.registry.file(p)
        self.relays[path] = sock

    def op_read_file(self, path: str) -> str | None:
        """A file in the run's process folder (base64; None: there is none)."""
        p = Path(path)
        if p.parent != self.launcher.dir:
            raise ValueError(f"{path}: not a file of the run's process folder")
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            return None
        if len(data) > 64 << 20:
            raise ValueError(f"{path}: {len(data)} bytes, more than 64 MiB")
        return base64.b64encode(data).decode()

    def op_expect_peers(self, names: list[str]) -> None:
        self.hub.expect_peers(set(names))

    def op_connected(self, name: str) -> bool:
        return self.hub.connected(name)

    def op_link_info(self, src: str, dst: str) -> dict:
        link = self.net.link(src, dst)
        return {"control_path": link.control_path, "lane": link.lane}

    def op_delay_line_stats(self, src: str, dst: str, turns_since: int | None = None) -> dict | None:
        return self.net.link(src, dst).delay_line_stats(turns_since)

    def op_link_sched(self, src: str, dst: str, msg: dict) -> None:
        self.net.link(src, dst)._sched(msg)

    def op_put_file(self, folder: str, path: str, data: str, offset: int = 0) -> str:
        """Write ``data`` (base64) at ``offset`` of ``path`` in ``folder`` of the run's process
        folder (removed with it); the file's path here."""
        rel = Path(path)
        if rel.is_absolute() or ".." in rel.parts or "/" in folder or folder in ("", ".", ".."):
            raise ValueError(f"{folder}/{path}: a path inside the run's folder")
        dst = self.launcher.dir / folder / rel
        if not dst.parent.is_dir():
            dst.parent.mkdir(parents=True, exist_ok=True)
        if offset == 0:
            self.net.registry.file(dst)
        with open(dst, "r+b" if offset else "wb") as fh:
            fh.seek(offset)
            fh.write(base64.b64decode(data))
        return str(dst)

    def op_job_start(self, name: str, host: str, folder: str, script: str, args: list[str], env: dict) -> dict:
        """Start ``script`` (in ``folder``, put there by ``put_file``) with this agent's Python
        in ``host``, in its folder, in a session of its own; its output goes to a log that the
        relay sends on as it grows."""
        from testbed.run.procs import python_env

        if name in self.jobs:
            raise ValueError(f"a rank named {name!r} was already started")
        cwd = self.launcher.dir / folder
        log = self.launcher.dir / f"{name}.log"
        self.net.registry.file(log)
        with open(log, "wb") as out:
            proc = self.net.popen(self.hosts[host], [sys.executable, str(cwd / script), *args],
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  env=python_env(**env), cwd=str(cwd))
        self.jobs[name] = _Rank(proc, log)
        return {"pid": proc.pid}

    def op_job_signal(self, name: str, kill: bool = False) -> None:
        """SIGTERM (or SIGKILL) a rank's process group (``mnexec -d`` made it a session leader)."""
        proc = self.jobs[name].proc
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            except ProcessLookupError:
                pass

    def op_send(self, name: str, msg: dict) -> bool:
        return self.hub.send(name, msg)

    def op_tcp_counters(self) -> dict:
        return self.net.tcp_counters()

    def op_link_state(self, src: str, dst: str) -> str:
        return self.net.link_state(src, dst)

    def op_link_counters(self, src: str, dst: str) -> dict:
        """The counters of WAN direction src -> dst (shaped here, at its sending gateway)."""
        from dataclasses import asdict

        return asdict(self.net.link(src, dst).counters())

    def op_stop(self, names: list[str]) -> None:
        self.launcher.stop(names)

    def op_logs(self, names: list[str]) -> dict:
        out = {}
        for name in names:
            p = self.launcher.processes.get(name)
            if p is not None and p.log.exists() and p.log.stat().st_size:
                out[name] = p.log.read_text(errors="replace")[-1_000_000:]
        return out

    def op_teardown(self) -> None:
        self.teardown()

    def teardown(self) -> None:
        for sock in list(self.relays.values()):
            sock.close()
        self.relays.clear()
        if self.launcher is not None:
            try:
                self.launcher.stop()
            except Exception:
                pass
        if self.hub is not None:
            try:
                self.hub.close()
            except Exception:
                pass
            self.hub = None
        if self.net is not None:
            self.net.stop()  # the ranks with the rest of what it started
            self.net = None
        self.launcher = None
        self.jobs.clear()


class _Rank:
    """A torchrun rank the agent started: its process and its log, read on from ``offset``."""

    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log, self.offset = proc, log, 0

    def read(self, whole_lines: bool) -> str:
        """What the log gained since the last read (up to its last newline while it runs)."""
        try:
            with open(self.log, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read(1 << 20)
        except OSError:
            return ""
        if whole_lines and len(data) < 1 << 20:  # a line longer than a read goes in pieces
            data = data[:data.rfind(b"\n") + 1]
        self.offset += len(data)
        return data.decode(errors="replace")


def machine_name() -> str:
    return os.environ.get("GTB_MACHINE") or socket.gethostname()


def live_agent() -> dict | None:
    """The agent running on this machine now (``PID_FILE``, its command line checked), if any."""
    try:
        info = json.loads(PID_FILE.read_text())
        cmdline = Path(f"/proc/{int(info['pid'])}/cmdline").read_bytes()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if b"machine-agent" in cmdline else None


def serve_stdio(lease_s: float = 15.0, hello_s: float = 60.0,
                log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> int:
    """Serve the orchestrator on stdin/stdout (an SSH session); 0 when it ended cleanly, 2
    when it runs another build, 3 when another orchestrator's agent is live on this machine."""
    # the wire keeps the session's two pipes; anything else this process or its children
    # print goes to stderr (the log), never into the wire
    chan = wire.Channel(os.dup(0), os.dup(1))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    reader = wire.LineReader(chan)
    ready, _, _ = select.select([chan], [], [], hello_s)
    lines = (reader.read() or []) if ready else []
    first = lines[0] if lines else None
    if not (isinstance(first, m.Call) and first.op == "hello"):
        log(f"no hello from an orchestrator within {hello_s:g} s")
        chan.close()
        return 1
    theirs, mine = first.args.get("build"), version()
    if theirs != mine:
        chan.send(m.Answer(id=first.id, error=f"testbed build {mine} on machine {machine_name()}, the orchestrator "
                                              f"runs {theirs}: one build must run everywhere"))
        chan.close()
        return 2
    who = first.args.get("orchestrator", "?")
    busy = live_agent()
    if busy is not None:
        chan.send(m.Answer(id=first.id, error=f"machine {machine_name()} is running a run of "
                                              f"{busy.get('orchestrator', '?')} (machine agent pid {busy['pid']})"))
        chan.close()
        return 3
    PID_FILE.write_text(json.dumps({"pid": os.getpid(), "orchestrator": who, "run": first.args.get("run", "")}))
    log(f"machine agent {machine_name()} (build {mine}) serving {who}, lease {lease_s:g} s")
    session = _Session(chan, lease_s, log)
    try:
        session.serve(reader, first)
    finally:
        chan.close()
        try:
            if json.loads(PID_FILE.read_text()).get("pid") == os.getpid():  # ours, not a later agent's
                PID_FILE.unlink()
        except (OSError, ValueError, AttributeError):
            pass
    log("machine agent done: everything it made is removed")
    return 0
