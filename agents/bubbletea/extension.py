"""BubbleTea's side of a training run: start its processes, and fold its results in.

How it fits: ``testbed.extension`` finds this class when the experiment says
``bubbletea: {enabled: true}``.  It asks the run to pin each worker to one core (its
prefill server must share it) and to announce each wait for a peer on the worker's wait
board.  ``start`` then starts, through the run's launcher: one prefill server per training
worker in the worker's host namespace and in an idle-priority child cgroup of the worker's
CPU container (``cpu.idle = 1``), one decode worker per DC on a host training leaves free
(KV caches stay inside their DC; ``decode_dc`` puts a single one in that DC instead), and
the controller, which connects to the run's hub as ``bubbletea-controller``.  Training
starts once the controller says every prefill server has profiled its model.  After
training, ``summarise`` reads the controller's results and adds BubbleTea's figures to the
run's summary: utilization with and without prefill (from the timelines), the training
slowdown between the iterations served and those not served (interleaved), request
accounting and TTFT; ``write_outputs`` draws the TTFT CDF.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from agents.bubbletea.config import ControllerConfig, DecodeConfig, InferenceModel, ServerConfig, Workload
from agents.trainer.waitboard import create_board
from testbed.extension import ExtensionError, RunContext, RunExtension
from testbed.procs import CpuContainers
from testbed.records import BUSY_KINDS, RunRecord

_DECODE_PORT = 29700


class BubbleTeaExtension(RunExtension):
    name = "bubbletea"
    peers = ("bubbletea-controller",)
    pins_workers = True

    def __init__(self, exp):
        self.exp = exp
        self.spec = exp.bubbletea
        self._ctx: RunContext | None = None
        self._names: list[str] = []
        self._ready = False  # every prefill server has loaded and profiled its model
        self.dead = False  # the controller has died (and the run's log says so)
        self._connected = False
        self._results: Path | None = None

    @classmethod
    def for_experiment(cls, exp) -> "BubbleTeaExtension | None":
        return cls(exp) if exp.bubbletea.enabled else None

    def worker_options(self, ctx: RunContext, slot) -> dict:
        """Each worker says when a wait for a peer begins and shows the wait under way on its
        board (an 8-byte file its prefill server reads)."""
        board = ctx.launcher.dir / f"{slot.name}.board"
        create_board(board)
        ctx.net.registry.file(board)
        return {"announce_waits": True, "wait_board": str(board)}

    def _decode_hosts(self, ctx: RunContext) -> dict:
        """The decode worker of each DC with prefill servers (a host training leaves free), so
        KV caches stay inside their DC; or one for all in ``decode_dc``."""
        exp = self.exp
        names = {d.name for d in exp.topo.dcs}
        if self.spec.decode_dc is not None and self.spec.decode_dc not in names:
            raise ExtensionError(f"bubbletea.decode_dc: no DC {self.spec.decode_dc!r} in topology {exp.topo.name}")
        dcs = [self.spec.decode_dc] if self.spec.decode_dc else sorted({s.dc for s in exp.workers()})
        hosts = {}
        for dc in dcs:
            used = {s.host_index for s in exp.workers() if s.dc == dc}
            free = [i for i in range(exp.topo.dc(dc).hosts) if i not in used]
            if not free:
                raise ExtensionError(f"bubbletea: DC {dc!r} has no host left for a decode worker "
                                     f"(training uses all {exp.topo.dc(dc).hosts}; add one to the topology)")
            hosts[dc] = ctx.net.host(dc, free[-1])
        return hosts

    def start(self, ctx: RunContext) -> None:
        self._ctx = ctx
        spec, reg, state = self.spec, ctx.net.registry, ctx.net.registry.dir
        model = InferenceModel(**spec.model.model_dump())
        ctl_sock = str(state / "bubbletea-controller.sock")
        reg.file(ctl_sock)
        decoders = {}
        for dc, host in self._decode_hosts(ctx).items():
            # its own CPU container, like any device here, at 1/8 of a device's weight: a decode
            # worker has devices of its own in a real deployment; here it shares the cores, and
            # when they contend it yields without starving (SCHED_IDLE starved it)
            cgroup = ctx.containers.make(f"decode-{dc}", self.exp.topo.dc(dc).host.cpus)
            if cgroup is not None:
                CpuContainers.lower_weight(cgroup, 1 / 8)
            cfg = DecodeConfig(model, ctl_sock, host.ip, _DECODE_PORT)
            self._start(ctx, f"decode-{dc}", "agents.bubbletea.decode", cfg.to_dict(), host=host, cgroup=cgroup)
            decoders[dc] = [host.ip, _DECODE_PORT]
        servers = {}
        for name, w in ctx.workers.items():
            listen = str(state / f"bubbletea-{name}.sock")
            reg.file(listen)
            cfg = ServerConfig(name, listen, ctl_sock, model, wait_board=str(ctx.launcher.dir / f"{name}.board"))
            # an idle-priority co-tenant of the worker's own quota, on the worker's core, and
            # SCHED_IDLE (inherited by its threads): any waking task preempts it at once, also
            # the workers of other containers on that core (cpu.idle acts only inside its parent)
            child = ctx.containers.idle_child(w.cgroup, "prefill") if w.cgroup is not None else None
            self._start(ctx, f"server-{name}", "agents.bubbletea.server", cfg.to_dict(), host=w.host, cgroup=child,
                        cpu=w.cpu, sched_idle=True)
            servers[name] = listen
        exp = self.exp
        self._results = state / "bubbletea-results.json"
        reg.file(self._results)
        ccfg = ControllerConfig(
            telemetry=str(ctx.telemetry_path), listen=ctl_sock, results=str(self._results), servers=servers,
            decode={name: decoders.get(w.slot.dc) or next(iter(decoders.values())) for name, w in ctx.workers.items()},
            warmup_iterations=exp.training.warmup_iterations, interleave=spec.interleave,
            slo_ttft_s=spec.slo_ttft_s, margin_s=spec.margin_s, margin_frac=spec.margin_frac,
            chunk_tokens=spec.chunk_tokens, max_prompt_tokens=min(spec.max_prompt_tokens, spec.model.max_context),
            workload=Workload(spec.source, spec.duration_s, spec.rate_scale, spec.token_scale, spec.rate_per_s,
                              spec.max_output_tokens))
        self._start(ctx, "controller", "agents.bubbletea.controller", ccfg.to_dict())
        self._connected = True
        ctx.log(f"bubbletea: {len(servers)} prefill servers (idle-priority, in the workers' containers), "
                f"decode worker(s) in {', '.join(decoders)}, controller started ({spec.source} workload)")

    def _start(self, ctx: RunContext, name: str, module: str, cfg: dict, **where) -> None:
        ctx.launcher.start(f"bubbletea-{name}", module, cfg, **where)
        self._names.append(f"bubbletea-{name}")

    # -- during the run -------------------------------------------------------------------
    def on_worker_message(self, worker: str, msg: dict) -> None:
        if self._connected and msg.get("type") in ("events", "wait"):
            if not self._ctx.send_to_peer("bubbletea-controller", dict(msg, worker=worker)):
                self._connected = False  # its death is logged by check()

    def on_peer_message(self, peer: str, msg: dict) -> None:
        self._ready = self._ready or msg.get("type") == "ready"

    def on_peer_gone(self, peer: str) -> None:
        self._connected = False

    def ready(self) -> bool:
        """Training starts once the inference model is loaded and profiled beside every stage
        (as it would be on the GPUs before a job starts), or once BubbleTea is gone."""
        return self._ready or self.dead

    def waiting_for(self) -> str:
        return "BubbleTea's prefill servers"

    def check(self) -> None:
        ctl = self._ctx.launcher.processes.get("bubbletea-controller")
        if ctl is not None and not ctl.alive() and not self.dead:
            self.dead = True
            self._ctx.log(f"bubbletea controller died (exit {ctl.popen.returncode}) at iteration "
                          f"{self._ctx.iterations_done()}: no more prefills are dispatched; training continues "
                          "unaffected")

    # -- after the run ------------------------------------------------------------------
    def training_done(self) -> None:
        if self._connected:
            self._ctx.send_to_peer("bubbletea-controller", {"type": "bye"})

    def stop(self, out_dir: Path) -> None:
        if self._ctx is None:
            return
        launcher = self._ctx.launcher
        # SIGTERM: the controller lets prefills and decodes under way finish (drain_s), then
        # accounts for every request and writes its results
        launcher.stop(self._names, timeout=ControllerConfig.drain_s + 2.0)
        launcher.copy_logs(out_dir / "bubbletea-logs", self._names, rename=lambda n: n.removeprefix("bubbletea-"))
        if self._results is not None and self._results.exists():
            (out_dir / "bubbletea.json").write_text(self._results.read_text())

    def summarise(self, record: RunRecord, result: dict, out_dir: Path) -> dict:
        return summarise(record, result, out_dir)

    def write_outputs(self, record: RunRecord, result: dict, out_dir: Path) -> None:
        path = out_dir / "bubbletea.json"
        reqs = json.loads(path.read_text())["requests"] if path.exists() else []
        ttft_cdf(reqs, out_dir / "ttft_cdf.png", f"{self.exp.name}: prefill TTFT", self.spec.slo_ttft_s)


def summarise(run: RunRecord, result: dict, out_dir: Path) -> dict:
    """BubbleTea's figures for the summary, from the run's timelines and the controller's results.
    Each worker's prefills go on its record as the device's co-tenant (the plots draw them)."""
    path = out_dir / "bubbletea.json"
    data = json.loads(path.read_text()) if path.exists() else {"requests": [], "prefill_intervals": {}}
    steady = result["summary"]["steady_state_iterations"]
    spec = run.exp.bubbletea
    # the controller's rule (its iteration count from the warm-up on): with Atlas the steady
    # state starts later, and counting from there swapped served and unserved
    first = run.exp.training.warmup_iterations
    served = [k for k in steady if not spec.interleave or (k - first) % 2 == 1]
    unserved = [k for k in steady if k not in served] if spec.interleave else []
    ends = dict(enumerate(run.iteration_ends()))
    util_with, util_without = [], []
    for name, w in run.workers.items():
        prefills = [(s, e) for s, e, _ in data["prefill_intervals"].get(name, [])]
        w.cotenant = prefills
        for k in steady:
            start = w.iteration_end[k - 1] if k > 0 else run.go_time
            end = w.iteration_end[k]
            busy = [(i.start, i.end) for i in w.events if i.iteration == k and i.kind in BUSY_KINDS]
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


def _filled(run: RunRecord, data: dict, served: list[int]) -> float:
    """Fraction of the served iterations' bubble time that prefills ran in."""
    bubble, filled = 0.0, 0.0
    for name, w in run.workers.items():
        prefills = [(s, e) for s, e, _ in data["prefill_intervals"].get(name, [])]
        for kind, _mb, s, e, it in w.events:
            if it not in served or kind in BUSY_KINDS:
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
