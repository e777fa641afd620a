"""``testbed torchrun``: a user's own ``torch.distributed`` script, one process per rank in
the DCs' hosts, with torchrun's environment.

How it fits: the caller hands over a lab (``lab.Lab`` built for this job, or
``labserver.LabClient`` for one that ``testbed up`` holds) and ``--ranks DC=N,...``.
``place_ranks`` puts one rank per host, DCs in the order given, hosts in index order (a DC
holds as many ranks as it has hosts), so rank 0 is host 0 of the first DC and is
``MASTER_ADDR``.  Each rank gets RANK, LOCAL_RANK (0: one rank per host), WORLD_SIZE,
LOCAL_WORLD_SIZE (1), GROUP_RANK, MASTER_ADDR, MASTER_PORT, TESTBED_DC, TESTBED_HOST,
GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (the host's emulated interface, so gloo and NCCL
cross the emulated WAN), and NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD = ``connections``
(NCCL's many-connections lever; gloo has none).  ``run_job`` starts them (``lab.popen``:
recorded in the registry), prefixes and copies their output to the terminal and to
``OUT/logs/rankN.log``, samples every WAN direction's counters while they run, and ends the
job at the first rank that fails (the others are ended: the job's exit code is that rank's,
128 + N for a signal N).  It writes ``OUT/metrics.json`` (the job, each rank's exit, bytes
per WAN direction from the counters before and after, the WAN self-check, provenance) and
``OUT/timeline.json`` (each direction's throughput and queue as Perfetto counter tracks).
Extensions the user asked for (``--with NAME=VALUE``: ``hooks.JobExtension``) are applied to
the lab after the ranks are placed and before they start, and removed after they end; what
each returns goes into metrics.json under ``extensions``.

Across machines (``--inventory``) the lab is ``cluster.jobs.ClusterJobLab``: the same
tables, and a ``popen`` that starts the rank on its machine from a copy of the script's
folder (the caller ships it first) and returns a ``subprocess.Popen`` look-alike whose
output and exit come from the machine's agent; ``_end`` stops such a rank through its
``terminate``/``kill`` (its agent signals the rank's process group).  metrics.json then
gains a ``cluster`` section (placement, underlay, MTU, clocks) and each rank its machine.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from testbed.run.hooks import JobExtension
from testbed.run.lab import LabError, LabHandle
from testbed.run.procs import python_env

_KILL_GRACE_S = 3.0


def parse_ranks(text: str) -> list[tuple[str, int]]:
    """``virginia=2,ohio=1`` -> [("virginia", 2), ("ohio", 1)]; a LabError naming the bad part."""
    out: list[tuple[str, int]] = []
    for part in (p.strip() for p in text.split(",")):
        dc, sep, n = part.partition("=")
        if not sep or not dc.strip() or not n.strip().isdigit() or int(n) < 1:
            raise LabError(f"--ranks: {part!r} is not DC=N with N a positive whole number")
        if any(d == dc.strip() for d, _ in out):
            raise LabError(f"--ranks: DC {dc.strip()} is named twice")
        out.append((dc.strip(), int(n)))
    return out


def check_ranks(ranks: list[tuple[str, int]], hosts_per_dc: dict[str, int], lab: str) -> None:
    """Every DC named exists and has a host for each of its ranks."""
    for dc, n in ranks:
        if dc not in hosts_per_dc:
            raise LabError(f"--ranks: {lab} has no DC {dc!r} (DCs: {', '.join(hosts_per_dc)})")
        if n > hosts_per_dc[dc]:
            raise LabError(f"--ranks {dc}={n}: DC {dc} has {hosts_per_dc[dc]} host(s), one rank per host")


def place_ranks(ranks: list[tuple[str, int]], hosts: list[dict], lab: str) -> list[dict]:
    per_dc: dict[str, list[dict]] = {}
    for h in hosts:
        per_dc.setdefault(h["dc"], []).append(h)
    check_ranks(ranks, {dc: len(hs) for dc, hs in per_dc.items()}, lab)
    placed = []
    for dc, n in ranks:
        for h in sorted(per_dc[dc], key=lambda h: h["index"])[:n]:
            placed.append({"rank": len(placed), **h})
    return placed


def nccl_sockets(connections: int) -> tuple[int, int]:
    """(NCCL_SOCKET_NTHREADS, NCCL_NSOCKS_PERTHREAD) whose product is ``connections``: as many
    threads as divide it, up to NCCL's 16."""
    if not 1 <= connections <= 64:
        raise LabError(f"--connections {connections}: NCCL allows 1 to 64 sockets per peer")
    threads = max(d for d in range(1, min(16, connections) + 1) if connections % d == 0)
    return threads, connections // threads


def rank_env(place: dict, world: int, master: dict, master_port: int, connections: int, threads: int,
             lab: str) -> dict[str, str]:
    nthreads, nsocks = nccl_sockets(connections)
    return python_env(
        RANK=str(place["rank"]), LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1",
        GROUP_RANK=str(place["rank"]), ROLE_RANK=str(place["rank"]), ROLE_WORLD_SIZE=str(world),
        MASTER_ADDR=master["ip"], MASTER_PORT=str(master_port),
        TESTBED_DC=place["dc"], TESTBED_HOST=place["name"], TESTBED_LAB=lab,
        GLOO_SOCKET_IFNAME=place["ifname"], NCCL_SOCKET_IFNAME=place["ifname"],
        NCCL_SOCKET_NTHREADS=str(nthreads), NCCL_NSOCKS_PERTHREAD=str(nsocks),
        OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
    )


@dataclass
class JobResult:
    exit_code: int
    message: str  # one line: how the job ended
    failed_rank: int | None = None
    metrics: dict = field(default_factory=dict)


class _Sampler(threading.Thread):
    """Every WAN direction's counters every ``interval_s`` until stopped."""

    def __init__(self, lab: LabHandle, interval_s: float):
        super().__init__(daemon=True)
        self.lab, self.interval_s = lab, interval_s
        self.samples: list[dict[str, dict]] = []
        self.error: str | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.samples.append(self.lab.counter_table())
            except Exception as exc:  # a lab that stops answering ends the timeline, not the job
                self.error = str(exc)
                return
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def timeline(samples: list[dict[str, dict]], t0: float) -> dict:
    """Perfetto / Chrome-trace counter tracks ("ph": "C"): per WAN direction, its throughput
    (Mbit/s between two samples) and its queue (bytes)."""
    events = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "WAN links"}}]
    for prev, cur in zip(samples, samples[1:]):
        for key, c in cur.items():
            p = prev.get(key)
            if p is None or c["time"] <= p["time"]:
                continue
            ts = round((c["time"] - t0) * 1e6, 1)
            mbps = (c["tx_bytes"] - p["tx_bytes"]) * 8 / (c["time"] - p["time"]) / 1e6
            events.append({"name": f"{key} throughput", "ph": "C", "pid": 1, "ts": ts,
                           "args": {"Mbit/s": round(mbps, 3)}})
            events.append({"name": f"{key} queue", "ph": "C", "pid": 1, "ts": ts,
                           "args": {"bytes": c["backlog_bytes"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _pump(proc: subprocess.Popen, prefix: str, log: Path, lock: threading.Lock, echo: bool) -> None:
    with open(log, "w") as fh:
        for line in proc.stdout:
            fh.write(line)
            fh.flush()
            if echo:
                with lock:
                    sys.stdout.write(prefix + line)
                    sys.stdout.flush()


def _end(proc: subprocess.Popen) -> None:
    if not isinstance(proc, subprocess.Popen):  # a rank on another machine: its agent signals its group
        for stop in (proc.terminate, proc.kill):
            if proc.poll() is not None:
                return
            stop()
            try:
                proc.wait(_KILL_GRACE_S)
                return
            except subprocess.TimeoutExpired:
                continue
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            continue


def _code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def provenance(command: list[str], topology_file: Path | None, topology_name: str, lab: str) -> dict:
    from importlib import metadata

    versions = {"python": platform.python_version(), "kernel": platform.release()}
    for pkg in ("geo-testbed", "torch"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    topo = {"name": topology_name, "file": str(topology_file) if topology_file else None}
    if topology_file is not None and topology_file.is_file():
        topo["sha256"] = hashlib.sha256(topology_file.read_bytes()).hexdigest()
    return {"command": command, "topology": topo, "lab": lab, "versions": versions,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.node()}


def _remove(applied: list[JobExtension]) -> dict[str, dict]:
    """Remove the extensions applied, last first; one that fails is named, the others still go."""
    out: dict[str, dict] = {}
    for ext in reversed(applied):
        try:
            out[ext.name] = ext.remove()
        except Exception as exc:
            why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            out[ext.name] = {"error": f"removing it failed: {why}"}
            print(f"warning: {ext.name}: {out[ext.name]['error']}", file=sys.stderr, flush=True)
    return out


def run_job(lab: LabHandle, ranks: list[tuple[str, int]], script: Path, args: list[str], out: Path,
            connections: int = 1, master_port: int = 29500, threads: int = 1, timeout_s: float | None = None,
            sample_ms: float = 50.0, wan_check: list[dict] | None = None, prov: dict | None = None,
            echo: bool = True, log: Callable[[str], None] = lambda m: None,
            extensions: list[JobExtension] = (), cluster: dict | None = None) -> JobResult:
    """Run ``script`` on ``lab`` as a torchrun job; write OUT/metrics.json and OUT/timeline.json
    (``cluster``: the machines' part, for metrics.json, where the lab spans several)."""
    placed = place_ranks(ranks, lab.host_table(), lab.name)
    nccl_sockets(connections)
    if not script.is_file():
        raise LabError(f"script {script}: no such file")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    master = placed[0]
    argv = [sys.executable, str(script.resolve()), *args]
    applied: list[JobExtension] = []
    try:
        for ext in extensions:
            ext.apply(lab, [dict(p) for p in placed])
            applied.append(ext)
            log(f"{ext.name} applied")
    except BaseException:
        _remove(applied)
        raise
    links_before = lab.link_table()
    sampler = _Sampler(lab, sample_ms / 1000)
    before = lab.counter_table()
    t0 = time.monotonic()
    started = time.time()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    lock = threading.Lock()
    result: JobResult | None = None
    try:
        sampler.start()
        for p in placed:
            env = rank_env(p, len(placed), master, master_port, connections, threads, lab.name)
            proc = lab.popen(p["dc"], p["index"], argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=os.getcwd())
            procs.append(proc)
            pump = threading.Thread(target=_pump, args=(proc, f"[{p['rank']} {p['dc']}] ",
                                                        out / "logs" / f"rank{p['rank']}.log", lock, echo),
                                    daemon=True)
            pump.start()
            pumps.append(pump)
        log(f"{len(placed)} rank(s) started; MASTER_ADDR {master['ip']}:{master_port}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while result is None:
            codes = [proc.poll() for proc in procs]
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                i = bad[0]
                p = placed[i]
                result = JobResult(_code(codes[i]), f"rank {i} ({p['dc']}, {p['name']}) {_how(codes[i])}"
                                   + ("; the other ranks were stopped" if len(placed) > 1 else ""), i)
            elif all(c == 0 for c in codes):
                result = JobResult(0, f"{len(placed)} rank(s) exited with code 0")
            elif deadline is not None and time.monotonic() > deadline:
                result = JobResult(124, f"the job did not end within --timeout {timeout_s:g} s; its ranks were stopped")
            else:
                time.sleep(0.05)
    finally:
        for proc in procs:
            _end(proc)
        for pump in pumps:
            pump.join(5)
        sampler.stop()
        ext_out = _remove(applied)
    wall = time.monotonic() - t0
    after = lab.counter_table()
    samples = [before, *sampler.samples, after]
    settings = {f"{x['src']}->{x['dst']}": x for x in links_before}
    links = {}
    for key, c in after.items():
        b = before.get(key, {"tx_bytes": 0, "tx_packets": 0, "drops": 0})
        series = [s[key]["backlog_bytes"] for s in samples if key in s]
        nbytes = c["tx_bytes"] - b["tx_bytes"]
        links[key] = {"bytes": nbytes, "packets": c["tx_packets"] - b["tx_packets"], "drops": c["drops"] - b["drops"],
                      "mean_mbps": round(nbytes * 8 / wall / 1e6, 3) if wall > 0 else None,
                      "max_queue_bytes": max(series, default=0),
                      "settings": {k: v for k, v in settings.get(key, {}).items()
                                   if k not in ("src", "dst", "delay_line")}}
    metrics = {
        "job": {"script": str(script), "args": list(args), "ranks": dict(ranks), "world_size": len(placed),
                "master": f"{master['ip']}:{master_port}", "connections": connections,
                "exit_code": result.exit_code, "failed_rank": result.failed_rank, "ended": result.message,
                "started": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(timespec="seconds"),
                "wall_s": round(wall, 3), "samples": len(samples), "sample_ms": sample_ms,
                "sampling_problem": sampler.error},
        "ranks": [{"rank": p["rank"], "dc": p["dc"], "host": p["name"], "ip": p["ip"], "ifname": p["ifname"],
                   **({"machine": p["machine"]} if "machine" in p else {}),
                   "exit_code": None if procs[i].returncode is None else _code(procs[i].returncode),
                   "log": f"logs/rank{p['rank']}.log"} for i, p in enumerate(placed) if i < len(procs)],
        "links": links,
        "extensions": ext_out,
        "wan_check": wan_check or [],
        "provenance": prov or {},
        **({"cluster": cluster} if cluster is not None else {}),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    (out / "timeline.json").write_text(json.dumps(timeline(samples, t0)))
    result.metrics = metrics
    return result
