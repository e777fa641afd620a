"""BubbleTea's side of a training run: start its processes, and fold its results in.

How it fits: ``runner.TrainingRun`` calls ``BubbleTeaSide.start`` after the workers are
launched (when ``bubbletea.enabled``): one prefill server per training worker in the
worker's host namespace and in an idle-priority child cgroup of the worker's CPU container
(``cpu.idle = 1``), one decode worker per DC on a host training leaves free (KV caches stay
inside their DC; ``decode_dc`` puts a single one in that DC instead), and the controller.
After training, ``summarise`` reads the controller's results and adds BubbleTea's figures to the run's summary: utilization with and without prefill (from the
timelines, and from CPU time against the quota), the training slowdown between the
iterations served and those not served (interleaved), request accounting and TTFT.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
CPU_TICK = os.sysconf("SC_CLK_TCK")


class BubbleTeaError(RuntimeError):
    pass


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CPU_TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def _lower_weight(cgroup: Path) -> None:
    """A decode worker has devices of its own in a real deployment; here it shares the
    machine's cores with the training devices, so when they contend it yields (1/8 of a
    device's weight) without starving: SCHED_IDLE starved it on a busy machine."""
    for name, value in (("cpu.shares", "128"), ("cpu.weight", "12")):
        if (cgroup / name).exists():
            (cgroup / name).write_text(value)
            return


class BubbleTeaSide:
    def __init__(self, run, net, server_path: Path):
        self.run, self.net, self.spec = run, net, run.exp.bubbletea
        self.state = net.registry.dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.server_pids: dict[str, int] = {}
        self.results_path = self.state / "bubbletea-results.json"
        self.telemetry = server_path
        self.dead = False  # the controller has died (and the run's log says so)

    def _decode_hosts(self) -> dict[str, object]:
        """The decode worker of each DC with prefill servers (a host training leaves free), so
        KV caches stay inside their DC; or one for all in ``decode_dc``."""
        exp = self.run.exp
        names = {d.name for d in exp.topo.dcs}
        if self.spec.decode_dc is not None and self.spec.decode_dc not in names:
            raise BubbleTeaError(f"bubbletea.decode_dc: no DC {self.spec.decode_dc!r} in topology {exp.topo.name}")
        dcs = [self.spec.decode_dc] if self.spec.decode_dc else sorted({s.dc for s in exp.workers()})
        hosts = {}
        for dc in dcs:
            used = {s.host_index for s in exp.workers() if s.dc == dc}
            free = [i for i in range(exp.topo.dc(dc).hosts) if i not in used]
            if not free:
                raise BubbleTeaError(f"bubbletea: DC {dc!r} has no host left for a decode worker "
                                     f"(training uses all {exp.topo.dc(dc).hosts}; add one to the topology)")
            hosts[dc] = self.net.host(dc, free[-1])
        return hosts

    def start(self, containers: dict[str, Path | None], make_container) -> None:
        """``containers``: each worker's CPU container; ``make_container(name, dc)``: a new one
        for a decode worker, sized like that DC's hosts (None without cgroups)."""
        from testbed.runner import _enter_container, wait_board_path

        spec, reg = self.spec, self.net.registry
        model = spec.model.model_dump()
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        ctl_sock = str(self.state / "bubbletea-controller.sock")
        reg.file(ctl_sock)
        decoders = {}
        for dc, host in self._decode_hosts().items():
            dcfg = {"model": model, "controller": ctl_sock, "ip": host.ip, "port": 29700}
            cgroup = make_container(f"decode-{dc}", dc)  # its own CPU container, like any device here
            if cgroup is not None:
                _lower_weight(cgroup)
            name = f"decode-{dc}"
            self.procs[name] = self._spawn_in(host, name, dcfg, "agents.bubbletea.decode", env, cgroup)
            if cgroup is not None:
                _enter_container(self.procs[name], cgroup)
            decoders[dc] = [host.ip, 29700]
        servers = {}
        for name, w in self.run.workers.items():
            listen = str(self.state / f"bubbletea-{name}.sock")
            reg.file(listen)
            cfg = {"worker": name, "listen": listen, "controller": ctl_sock, "model": model,
                   "wait_board": str(wait_board_path(self.state / "workers", name))}
            parent = containers.get(name)
            child = None
            if parent is not None:  # an idle-priority co-tenant of the worker's own quota
                child = parent / "prefill"
                child.mkdir(exist_ok=True)
                reg.cgroup(child)
                idle = child / "cpu.idle"
                if idle.exists():
                    idle.write_text("1")
                else:
                    (child / "cpu.shares").write_text("2")
            proc = self._spawn_in(w.host, f"server-{name}", cfg, "agents.bubbletea.server", env, child)
            if w.cpu is not None:
                os.sched_setaffinity(proc.pid, {w.cpu})  # the worker's core: idle priority works there
            # SCHED_IDLE (inherited by its threads): any waking task preempts it at once, also the
            # workers of other containers on that core (cpu.idle acts only inside its parent)
            os.sched_setscheduler(proc.pid, os.SCHED_IDLE, os.sched_param(0))
            if child is not None:
                _enter_container(proc, child)
            self.procs[f"server-{name}"] = proc
            self.server_pids[name] = proc.pid
            servers[name] = listen
        exp = self.run.exp
        ccfg = {
            "telemetry": str(self.telemetry), "listen": ctl_sock, "results": str(self.results_path),
            "servers": servers,
            "decode": {name: decoders.get(w.slot.dc) or next(iter(decoders.values()))
                       for name, w in self.run.workers.items()},
            "warmup_iterations": exp.training.warmup_iterations,
            "interleave": spec.interleave, "slo_ttft_s": spec.slo_ttft_s, "margin_s": spec.margin_s,
            "margin_frac": spec.margin_frac, "chunk_tokens": spec.chunk_tokens,
            "max_prompt_tokens": min(spec.max_prompt_tokens, spec.model.max_context),
            "workload": {"source": spec.source, "duration_s": spec.duration_s, "rate_scale": spec.rate_scale,
                         "token_scale": spec.token_scale, "rate_per_s": spec.rate_per_s,
                         "max_output_tokens": spec.max_output_tokens},
        }
        path = self.state / "bubbletea-controller.json"
        path.write_text(json.dumps(ccfg))
        reg.file(path)
        log = self.state / "bubbletea-controller.log"
        reg.file(log)
        reg.file(self.results_path)
        with open(log, "w") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "agents.bubbletea.controller", str(path)], stdout=fh,
                                    stderr=subprocess.STDOUT, env=env, cwd=str(self.state), start_new_session=True)
        reg.process(proc.pid, "bubbletea-controller", own_netns=False)
        self.procs["controller"] = proc
        self.run.log(f"bubbletea: {len(servers)} prefill servers (idle-priority, in the workers' containers), "
                     f"decode worker(s) in {', '.join(decoders)}, controller started ({spec.source} workload)")

    def _spawn_in(self, host, name: str, cfg: dict, module: str, env: dict, cgroup) -> subprocess.Popen:
        path = self.state / f"bubbletea-{name}.json"
        path.write_text(json.dumps(cfg))
        self.net.registry.file(path)
        log = self.state / f"bubbletea-{name}.log"
        self.net.registry.file(log)
        launch = f"exec {sys.executable} -m {module} {path}"
        if cgroup is not None:
            launch = f"kill -STOP $$; {launch}"
        with open(log, "w") as fh:
            proc = self.net.popen(host, ["sh", "-c", launch], env=env, stdout=fh, stderr=subprocess.STDOUT)
        return proc

    def check(self) -> None:
        ctl = self.procs.get("controller")
        if ctl is not None and ctl.poll() is not None and not self.dead:
            self.dead = True
            at = min((w.iterations_done for w in self.run.workers.values()), default=0)
            self.run.log(f"bubbletea controller died (exit {ctl.returncode}) at iteration {at}: no more prefills "
                         "are dispatched; training continues unaffected")

    def stop(self, out_dir: Path) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        dst = out_dir / "bubbletea-logs"
        dst.mkdir(parents=True, exist_ok=True)
        for name in self.procs:
            try:
                (dst / f"{name}.log").write_text((self.state / f"bubbletea-{name}.log").read_text())
            except OSError:
                pass
        if self.results_path.exists():
            (out_dir / "bubbletea.json").write_text(self.results_path.read_text())


def summarise(run, result: dict, out_dir: Path) -> dict:
    """BubbleTea's figures for the summary, from the run's timelines and the controller's results."""
    path = out_dir / "bubbletea.json"
    data = json.loads(path.read_text()) if path.exists() else {"requests": [], "prefill_intervals": {}}
    steady = result["summary"]["steady_state_iterations"]
    spec = run.exp.bubbletea
    # the controller's rule (its iteration count from the warm-up on): with Atlas the steady
    # state starts later, and counting from there swapped served and unserved
    first = run.exp.training.warmup_iterations
    served = [k for k in steady if not spec.interleave or (k - first) % 2 == 1]
    unserved = [k for k in steady if k not in served] if spec.interleave else []
    ends = {k: max(w.iteration_end[k] for w in run.workers.values()) for k in range(run.exp.training.iterations)}
    util_with, util_without = [], []
    for name, w in run.workers.items():
        prefills = [(s, e) for s, e, _ in data["prefill_intervals"].get(name, [])]
        w.prefill = prefills
        for k in steady:
            start = w.iteration_end[k - 1] if k > 0 else run.go_time
            end = w.iteration_end[k]
            busy = [(s, e) for kind, _mb, s, e, it in w.events if it == k and kind in ("forward", "backward",
                                                                                       "optimizer")]
            mine = [(max(s, start), min(e, end)) for s, e in prefills if e > start and s < end]
            window = end - start
            if window <= 0:
                continue
            train = sum(e - s for s, e in busy) / window
            union = _union(busy + mine) / window
            (util_with if k in served else util_without).append(union if k in served else train)
    times = {k: ends[k] - (ends[k - 1] if k > 0 else run.go_time) for k in steady}
    t_on = statistics.fmean([times[k] for k in served]) if served else None
    t_off = statistics.fmean([times[k] for k in unserved]) if unserved else None
    reqs = data["requests"]
    done = [r for r in reqs if r["status"] == "completed"]
    rejected = [r for r in reqs if r["status"] == "rejected"]
    ttft = sorted(r["ttft_s"] for r in reqs if "ttft_s" in r)
    reasons: dict[str, int] = {}
    for r in rejected:
        key = r.get("reason", "?").split(":")[0]
        reasons[key] = reasons.get(key, 0) + 1

    def pct(q):
        return round(ttft[min(len(ttft) - 1, int(q * len(ttft)))], 4) if ttft else None

    slo = spec.slo_ttft_s
    busy_without = result["summary"]["mean_busy_fraction"]
    return {
        "utilization_with_prefill": round(statistics.fmean(util_with), 4) if util_with else None,
        "utilization_without_prefill": round(statistics.fmean(util_without), 4) if util_without else busy_without,
        "training_slowdown": round(t_on / t_off - 1, 4) if t_on and t_off else None,
        "iteration_time_served_s": round(t_on, 4) if t_on else None,
        "iteration_time_unserved_s": round(t_off, 4) if t_off else None,
        "requests_admitted": len(reqs),
        "requests_completed": len(done),
        "requests_rejected": len(rejected),
        "rejection_reasons": reasons,
        "ttft_p50_s": pct(0.5), "ttft_p90_s": pct(0.9), "ttft_p99_s": pct(0.99),
        "goodput_within_slo": round(sum(1 for t in ttft if t <= slo) / len(reqs), 4) if reqs else None,
        "kv_transfer_mean_s": round(statistics.fmean([r["kv_transfer_s"] for r in reqs if "kv_transfer_s" in r]), 4)
        if any("kv_transfer_s" in r for r in reqs) else None,
        "bubble_time_filled": round(_filled(run, data, served), 4),
    }


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _filled(run, data: dict, served: list[int]) -> float:
    """Fraction of the served iterations' bubble time that prefills ran in."""
    bubble, filled = 0.0, 0.0
    for name, w in run.workers.items():
        prefills = [(s, e) for s, e, _ in data["prefill_intervals"].get(name, [])]
        for kind, _mb, s, e, it in w.events:
            if it not in served or kind in ("forward", "backward", "optimizer"):
                continue
            bubble += e - s
            filled += sum(max(0.0, min(e, pe) - max(s, ps)) for ps, pe in prefills)
    return filled / bubble if bubble else 0.0


def ttft_cdf(reqs: list[dict], path: Path, title: str, slo: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft = sorted(r["ttft_s"] for r in reqs if "ttft_s" in r)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if ttft:
        ax.step(ttft, [(i + 1) / len(reqs) for i in range(len(ttft))], where="post", color="#C44E52")
    ax.axvline(slo, color="#999999", linestyle="--", label=f"TTFT SLO {slo:g} s")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of admitted requests")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
