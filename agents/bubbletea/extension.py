"""BubbleTea's side of a training run: start its processes, watch them, and fold its results in.

How it fits: the run makes this class (``plugin.py`` names it) when the experiment says
``bubbletea: {enabled: true}``.  It asks the run to announce each wait for a peer on the
worker's wait board (and, on CPUs, to pin each worker to one core: its prefill server must
share it).  ``start`` then starts, through the run's launcher: one prefill server per
training worker in the worker's host namespace, one decode worker per DC on a host
training leaves free (KV caches stay inside their DC; ``decode_dc`` puts a single one in
that DC instead), and the controller, which connects to the run's hub as
``bubbletea-controller``.  On CPUs a server runs in an idle-priority child cgroup of the
worker's CPU container (``cpu.idle = 1``) and a decode worker in a container of its own at
1/8 of a device's weight; on emulated devices (``device: emulated``) a server occupies the
worker's own emulated device and a decode worker one of its own, for the times of the
serving profile (``profile.py``'s JSON, checked here against the experiment's model before
anything is built).  Training starts once the controller says every prefill server has
profiled its model and every decode worker listens.  While training runs, ``check``
watches every server and decode worker: one that dies is named in the run's log and the controller rejects its requests with that
reason; training goes on.  After training the controller is stopped first (it drains and
accounts for every request), then the rest; ``summarise`` adds BubbleTea's figures to the
run's summary: utilization with and without prefill (from the timelines), the request
accounting as the controller counted it (arrivals, admitted, completed, rejected with
reasons, the run's end among them), TTFT and TBT percentiles over completed requests, goodput under the SLO
over all arrivals, and the interleaved slowdown (served against unserved iterations of the
same run; the headline slowdown is back to back: ``backtoback.py``); ``write_outputs``
draws the TTFT CDF.

Under time dilation k (``time_dilation``, emulated devices only) BubbleTea does as Atlas:
its processes never learn k.  Their inputs are put on the wall clock (the serving profile's
times, the SLOs, the margin, the drain and the workload's arrivals x k), and what they
report comes back in emulated terms (``emulated_results``, when ``stop`` copies it); the
run's record is in emulated terms already, so ``summarise`` reads one clock.
"""

from __future__ import annotations

import bisect
import json
import statistics
from dataclasses import replace
from pathlib import Path

from agents.bubbletea.messages import Died
from agents.bubbletea.config import ControllerConfig, DecodeConfig, InferenceModel, ServerConfig, Workload
from agents.bubbletea.predictor import is_peer_wait
from testbed import messages as m
from testbed.run.hooks import ExtensionError, RunContext, RunExtension
from testbed.run.procs import CpuContainers, python_env
from testbed.results.metrics import RunSummary
from testbed.results.records import BUSY_KINDS, RunRecord
from testbed.spec.topology import SpecError

_DECODE_PORT = 29700
DEFAULT_PROFILE = Path(__file__).resolve().parent / "data" / "serving-profile-cpu.json"


def serving_profile(exp) -> Path:
    """The serving profile an emulated run of ``exp`` replays; SpecError (one line) when it is
    missing or was measured for another model than ``bubbletea.model``."""
    spec = exp.bubbletea
    path = Path(spec.serving_profile) if spec.serving_profile else DEFAULT_PROFILE
    if not path.is_absolute() and not path.exists():
        path = Path(exp.origin).parent / path
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"{exp.origin}: bubbletea.serving_profile: cannot read {path} ({type(exc).__name__}); "
                        "measure one with python -m agents.bubbletea.profile") from None
    want = spec.model.model_dump()
    if {k: data.get("model", {}).get(k) for k in want} != want:
        raise SpecError(f"{exp.origin}: bubbletea.serving_profile: {path} was measured for model {data.get('model')}, "
                        f"the experiment serves {want}; measure it with python -m agents.bubbletea.profile")
    return path


class BubbleTeaExtension(RunExtension):
    name = "bubbletea"
    peers = ("bubbletea-controller",)
    pins_workers = True

    def __init__(self, exp):
        self.exp = exp
        self.spec = exp.bubbletea
        self.emulated = exp.device == "emulated"
        self.pins_workers = not self.emulated  # a CPU quota's co-tenant must share its core
        self.profile = serving_profile(exp) if self.emulated else None
        self._ctx: RunContext | None = None
        self._names: list[str] = []
        self._components: dict[str, str] = {}  # process name -> the controller's name for it (s0r0, decode-ohio)
        self._gone: set[str] = set()
        self._ready = False  # every prefill server has loaded and profiled its model
        self.dead = False  # the controller has died (and the run's log says so)
        self._connected = False
        self._results: Path | None = None
        self._drain_s = ControllerConfig.drain_s

    def worker_options(self, ctx: RunContext, slot) -> dict:
        """Each worker says when a wait for a peer begins and shows the wait under way on its
        board (an 8-byte file its prefill server reads)."""
        board = ctx.launcher.file(f"{slot.name}.board")  # the worker or its server makes it, where they run
        ctx.launcher.file(f"{slot.name}.board.bell")
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
        """Every process through the run's launcher, on the machine of its DC (the controller
        on the first DC's), their sockets ``Launcher.socket`` paths (relayed between machines),
        their devices and boards made by whoever opens them first, where they run."""
        self._ctx = ctx
        spec = self.spec
        if not self.emulated and not hasattr(ctx.containers, "idle_child"):
            raise ExtensionError("bubbletea: prefill servers on CPUs share their worker's container as an idle "
                                 "child, on one machine only, for now: across machines use device: emulated")
        model = InferenceModel(**spec.model.model_dump())
        first = self.exp.topo.dcs[0].name
        ctl_sock = str(ctx.launcher.socket("bubbletea-controller.sock", near=first))
        # under time dilation k the serving profile's times stretch with the training ops' (a
        # device k times slower), and every emulated-seconds input of the controller with them
        k = self.exp.time_dilation
        emulated = {"serving_profile": str(self.profile), "speedup": self.exp.emulation.speedup / k} \
            if self.emulated else {}
        decoders = {}
        for dc, host in self._decode_hosts(ctx).items():
            name = f"decode-{dc}"
            cgroup, extra = None, dict(emulated)
            if self.emulated:  # a device of its own (the decode worker makes it, where it runs)
                extra["device_file"] = str(ctx.launcher.file(f"{name}.device"))
            else:
                # its own CPU container, like any device here, at 1/8 of a device's weight: a decode
                # worker has devices of its own in a real deployment; here it shares the cores, and
                # when they contend it yields without starving (SCHED_IDLE starved it)
                cgroup = ctx.containers.make(name, self.exp.topo.dc(dc).host.cpus)
                if cgroup is not None:
                    CpuContainers.lower_weight(cgroup, 1 / 8)
            cfg = DecodeConfig(model, ctl_sock, host.ip, _DECODE_PORT, name=name,
                               clock_offset_s=ctx.launcher.clock_offset(dc), **extra)
            self._start(ctx, name, "agents.bubbletea.decode", cfg.to_dict(), name, host=host, cgroup=cgroup,
                        near=dc)
            decoders[name] = [host.ip, _DECODE_PORT]
        servers = {}
        for name, w in ctx.workers.items():
            listen = str(ctx.launcher.socket(f"bubbletea-{name}.sock", near=w.slot.dc))
            cfg = ServerConfig(name, listen, ctl_sock, model, wait_board=str(ctx.launcher.file(f"{name}.board")),
                               clock_offset_s=ctx.launcher.clock_offset(w.slot.dc), **emulated)
            if self.emulated:  # the worker's own device: its chunks queue on the stream training ops use
                cfg.device_file = str(w.device_file)
                if spec.control:  # the control arm: a device of its own (the server makes it), all else the same
                    cfg.device_file = str(ctx.launcher.file(f"{name}-control.device"))
                self._start(ctx, f"server-{name}", "agents.bubbletea.server", cfg.to_dict(), name, host=w.host)
            elif w.record.device.startswith("cuda"):  # the worker's own GPU, as the worker sees it
                cfg.device = "cuda:0"
                self._start(ctx, f"server-{name}", "agents.bubbletea.server", cfg.to_dict(), name, host=w.host,
                            sched_idle=True, env=python_env(CUDA_VISIBLE_DEVICES=w.record.device.split(":")[1]))
            else:
                # an idle-priority co-tenant of the worker's own quota, on the worker's core, and
                # SCHED_IDLE (inherited by its threads): any waking task preempts it at once, also
                # the workers of other containers on that core (cpu.idle acts only inside its parent)
                child = ctx.containers.idle_child(w.cgroup, "prefill") if w.cgroup is not None else None
                self._start(ctx, f"server-{name}", "agents.bubbletea.server", cfg.to_dict(), name, host=w.host,
                            cgroup=child, cpu=w.cpu, sched_idle=True)
            servers[name] = listen
        exp = self.exp
        self._results = ctx.launcher.file("bubbletea-results.json")  # the controller writes it, on its machine
        dc_decoder = {n.removeprefix("decode-"): n for n in decoders}
        self._drain_s = ControllerConfig.drain_s * k
        ccfg = ControllerConfig(
            telemetry=str(ctx.telemetry_path), listen=ctl_sock, results=str(self._results), servers=servers,
            decoders=decoders,
            decode={name: dc_decoder.get(w.slot.dc) or next(iter(decoders)) for name, w in ctx.workers.items()},
            warmup_iterations=exp.training.warmup_iterations, interleave=spec.interleave,
            slo_ttft_s=spec.slo_ttft_s * k, slo_tbt_s=None if spec.slo_tbt_s is None else spec.slo_tbt_s * k,
            margin_s=spec.margin_s * k, margin_frac=spec.margin_frac, chunk_tokens=spec.chunk_tokens,
            dispatch_ahead=spec.dispatch_ahead,
            max_prompt_tokens=min(spec.max_prompt_tokens, spec.model.max_context),
            # the same requests, k times further apart (a trace's rate scale and a Poisson rate / k)
            workload=Workload(spec.source, spec.duration_s * k, spec.rate_scale / k, spec.token_scale,
                              spec.rate_per_s / k, spec.max_output_tokens),
            drain_s=self._drain_s, clock_offset_s=ctx.launcher.clock_offset(first))
        self._start(ctx, "controller", "agents.bubbletea.controller", ccfg.to_dict(), None, near=first)
        self._connected = True
        where = (f"on the workers' emulated devices ({self.profile.name}, speedup {exp.emulation.speedup:g})"
                 if self.emulated else "idle-priority, in the workers' containers")
        ctx.log(f"bubbletea: {len(servers)} prefill servers ({where}), decode worker(s) "
                f"{', '.join(decoders)}, controller started ({spec.source} workload)")

    def _start(self, ctx: RunContext, name: str, module: str, cfg: dict, component: str | None, **where) -> None:
        ctx.launcher.start(f"bubbletea-{name}", module, cfg, **where)
        self._names.append(f"bubbletea-{name}")
        if component is not None:
            self._components[f"bubbletea-{name}"] = component

    # -- during the run -------------------------------------------------------------------
    def on_worker_message(self, worker: str, msg: m.Message) -> None:
        if self._connected and isinstance(msg, (m.Events, m.Wait)):
            if not self._ctx.send_to_peer("bubbletea-controller", replace(msg, worker=worker)):
                self._connected = False  # its death is logged by check()

    def on_peer_message(self, peer: str, msg: m.Message) -> None:
        if isinstance(msg, m.Log):  # a failure the controller saw (a decode that raised, a KV transfer)
            self._ctx.log(msg.msg)
        self._ready = self._ready or isinstance(msg, m.Ready)

    def on_peer_gone(self, peer: str) -> None:
        self._connected = False

    def ready(self) -> bool:
        """Training starts once the inference model is loaded and profiled beside every stage
        (as it would be on the GPUs before a job starts) and the decode workers listen, or
        once BubbleTea is gone."""
        return self._ready or self.dead

    def waiting_for(self) -> str:
        return "BubbleTea's prefill servers and decode workers"

    def check(self) -> None:
        launcher = self._ctx.launcher
        ctl = launcher.processes.get("bubbletea-controller")
        if ctl is not None and not ctl.alive() and not self.dead:
            self.dead = True
            self._ctx.log(f"bubbletea controller died (exit {ctl.returncode}) at iteration "
                          f"{self._ctx.iterations_done()}: no more prefills are dispatched; training continues "
                          "unaffected")
        for pname, component in self._components.items():
            proc = launcher.processes.get(pname)
            if proc is None or proc.alive() or pname in self._gone:
                continue
            self._gone.add(pname)
            code = proc.returncode
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            what = f"decode worker {component}" if component.startswith("decode-") else f"prefill server {component}"
            tail = proc.last_log_line()
            reason = f"{what} died ({how})"
            self._ctx.log(f"bubbletea: {reason} at iteration {self._ctx.iterations_done()}"
                          f"{' (' + tail[-160:] + ')' if tail and code > 0 else ''}: its requests are rejected "
                          "with that reason; training continues unaffected")
            if self._connected:
                self._ctx.send_to_peer("bubbletea-controller", Died(component=component, reason=reason))

    # -- after the run ------------------------------------------------------------------
    def training_done(self) -> None:
        if self._connected:
            self._ctx.send_to_peer("bubbletea-controller", m.Bye())

    def stop(self, out_dir: Path) -> None:
        if self._ctx is None:
            return
        launcher = self._ctx.launcher
        # SIGTERM to the controller first: it lets the servers ship what they have prefilled and
        # the decode workers finish (drain_s), then accounts for every request and writes its
        # results; only then the servers and decode workers
        launcher.stop(["bubbletea-controller"], timeout=self._drain_s + 2.0)
        launcher.stop(self._names, timeout=2.0)
        launcher.copy_logs(out_dir / "bubbletea-logs", self._names, rename=lambda n: n.removeprefix("bubbletea-"))
        raw = launcher.read(self._results, near=self.exp.topo.dcs[0].name) if self._results is not None else None
        if raw is not None:
            data = emulated_results(json.loads(raw), self.exp.time_dilation, self._ctx.go_time)
            (out_dir / "bubbletea.json").write_text(json.dumps(data))

    def summarise(self, record: RunRecord, result: RunSummary, out_dir: Path) -> dict:
        return summarise(record, result, out_dir)

    def write_outputs(self, record: RunRecord, result: RunSummary, out_dir: Path) -> None:
        path = out_dir / "bubbletea.json"
        reqs = json.loads(path.read_text())["requests"] if path.exists() else []
        ttft_cdf(reqs, out_dir / "ttft_cdf.png", f"{self.exp.name}: prefill TTFT", self.spec.slo_ttft_s)


def emulated_results(data: dict, k: float, go: float) -> dict:
    """The controller's results (on the wall clock: its inputs were stretched by ``k``) in the
    emulated world's terms under time dilation ``k``: instants ``go + (t - go) / k`` (as the
    run's record, ``results.records.in_emulated_time``), durations / k, a prefill profile's
    seconds / k; counts, tokens, bytes and reasons as they are."""
    if k == 1:
        return data

    def t(x):
        return None if x is None else go + (x - go) / k

    def d(x):
        return None if x is None else x / k

    out = dict(data, time_dilation=k, t0=t(data.get("t0")), serving_s=d(data.get("serving_s")))
    out["prefill_intervals"] = {n: [[t(a), t(b), *rest] for a, b, *rest in iv]
                                for n, iv in data.get("prefill_intervals", {}).items()}
    durations = ("arrival_s", "ttft_s", "kv_transfer_s", "prefill_s", "completed_s", "admitted_s")
    out["requests"] = [dict(r, **{key: d(r[key]) for key in durations if key in r},
                            **({"first_token_at": t(r["first_token_at"])} if "first_token_at" in r else {}),
                            **({"tbt_s": [g / k for g in r["tbt_s"]]} if "tbt_s" in r else {}))
                       for r in data.get("requests", [])]
    out["failures"] = [dict(f, at_s=d(f.get("at_s"))) for f in data.get("failures", [])]
    out["profiles"] = {n: None if ab is None else [v / k for v in ab] for n, ab in data.get("profiles", {}).items()}
    return out


def _pct(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of ``values``; None when there are none."""
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))], 4)


def serving_figures(data: dict, slo_ttft_s: float, slo_tbt_s: float | None = None) -> dict:
    """The serving side of a run, from the controller's results: the accounting as it was
    counted, checked against every request's final state; TTFT and TBT percentiles over the
    completed requests; goodput under the SLO over all arrivals (a rejected
    request is a miss), as a fraction and per second of serving."""
    reqs = data["requests"]
    counts = data.get("counts") or {}
    status: dict[str, int] = {}
    for r in reqs:
        status[r["status"]] = status.get(r["status"], 0) + 1
    done = [r for r in reqs if r["status"] == "completed"]
    arrivals = counts.get("arrivals", len(reqs))
    ttft = [r["ttft_s"] for r in done]
    tbt = [g for r in done for g in r.get("tbt_s", [])]
    tpot = [statistics.fmean(r["tbt_s"]) for r in done if r.get("tbt_s")]

    def good(r: dict) -> bool:
        if r["ttft_s"] > slo_ttft_s:
            return False
        return slo_tbt_s is None or not r.get("tbt_s") or statistics.fmean(r["tbt_s"]) <= slo_tbt_s

    n_good = sum(1 for r in done if good(r))
    serving = data.get("serving_s") or 0.0
    in_flight = sum(v for k, v in status.items() if k not in ("completed", "rejected"))
    decided = counts.get("completed", 0) + counts.get("rejected", 0)
    exact = (arrivals == decided == len(reqs) and in_flight == 0 and
             all(counts.get(k, 0) == status.get(k, 0) for k in ("completed", "rejected")))
    return {
        "requests_arrived": arrivals,
        "requests_admitted": counts.get("admitted"),
        "requests_completed": counts.get("completed", status.get("completed", 0)),
        "requests_rejected": counts.get("rejected", status.get("rejected", 0)),
        "rejection_reasons": data.get("rejection_reasons", {}),
        "requests_in_flight_after_run": in_flight,
        "accounting_exact": exact,
        "failures": [{k: f[k] for k in ("component", "reason", "requests")} for f in data.get("failures", [])][:20],
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9), "ttft_p99_s": _pct(ttft, 0.99),
        "tbt_p50_s": _pct(tbt, 0.5), "tbt_p90_s": _pct(tbt, 0.9), "tbt_p99_s": _pct(tbt, 0.99),
        "tpot_mean_s": round(statistics.fmean(tpot), 5) if tpot else None,
        "goodput_within_slo": round(n_good / arrivals, 4) if arrivals else None,
        "goodput_rps": round(n_good / serving, 3) if serving > 0 else None,
        "offered_rps": round(arrivals / serving, 3) if serving > 0 else None,
        "serving_s": round(serving, 3),
        "kv_transfer_mean_s": round(statistics.fmean([r["kv_transfer_s"] for r in done]), 4) if done else None,
        "kv_bytes_mean": round(statistics.fmean([r["kv_bytes"] for r in done])) if done else None,
    }


def summarise(run: RunRecord, result: RunSummary, out_dir: Path) -> dict:
    """BubbleTea's figures for the summary, from the run's timelines and the controller's results.
    Each worker's prefills go on its record as the device's co-tenant (the plots draw them).
    Utilization counts, per worker and served iteration, the union of training compute and
    prefill chunks over the worker's window (on an emulated device: the device's own
    schedule)."""
    path = out_dir / "bubbletea.json"
    data = json.loads(path.read_text()) if path.exists() else {"requests": [], "prefill_intervals": {}}
    steady = result.summary.steady_state_iterations
    spec = run.exp.bubbletea
    if spec.control:  # the control arm's chunks ran on devices of their own: none shares a worker's
        data = dict(data, prefill_intervals={})
    # the controller's rule (its iteration count from the warm-up on): with Atlas the steady
    # state starts later, and counting from there swapped served and unserved
    first = run.exp.training.warmup_iterations
    served = [k for k in steady if not spec.interleave or (k - first) % 2 == 1]
    unserved = [k for k in steady if k not in served] if spec.interleave else []
    ends = dict(enumerate(run.iteration_ends()))
    util_with, util_without, prefill_share = [], [], []
    for name, w in run.workers.items():
        prefills = [(s, e) for s, e, _ in data["prefill_intervals"].get(name, [])]
        w.cotenant, w.cotenant_kind = prefills, "prefill"
        for k in steady:
            start = w.iteration_end[k - 1] if k > 0 else run.go_time
            end = w.iteration_end[k]
            busy = [(i.start, i.end) for i in w.events if i.iteration == k and i.kind in BUSY_KINDS]
            mine = [(max(s, start), min(e, end)) for s, e in prefills if e > start and s < end]
            window = end - start
            if window <= 0:
                continue
            train = _union(busy) / window
            union = _union(busy + mine) / window
            if k in served:
                util_with.append(union)
                prefill_share.append(union - train)
            else:
                util_without.append(train)
    times = {k: ends[k] - (ends[k - 1] if k > 0 else run.go_time) for k in steady}
    filled, filled_by_kind = _filled(run, data, served)
    t_on = statistics.fmean([times[k] for k in served]) if served else None
    t_off = statistics.fmean([times[k] for k in unserved]) if unserved else None
    busy_without = result.summary.mean_busy_fraction
    return {
        "utilization_with_prefill": round(statistics.fmean(util_with), 4) if util_with else None,
        "utilization_without_prefill": round(statistics.fmean(util_without), 4) if util_without else busy_without,
        "prefill_share_of_device_time": round(statistics.fmean(prefill_share), 4) if prefill_share else None,
        "served_iterations": served,
        "training_slowdown_interleaved": round(t_on / t_off - 1, 4) if t_on and t_off else None,
        "iteration_time_served_s": round(t_on, 4) if t_on else None,
        "iteration_time_unserved_s": round(t_off, 4) if t_off else None,
        **serving_figures(data, spec.slo_ttft_s, spec.slo_tbt_s),
        "bubble_time_filled": round(filled, 4),
        "bubble_time_filled_by_kind": filled_by_kind,
        "prefill_overruns": _overruns(run, data),
        "prefill_start_after_wait": _start_latency(run, data, served),
        "prefill_dispatched_ahead": data.get("dispatched_ahead"),
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


def _filled(run: RunRecord, data: dict, served: list[int]) -> tuple[float, dict[str, float]]:
    """Fraction of the served iterations' bubble time that prefills ran in, in all and per
    kind of bubble (a receive's wait, the all-reduce's, a send's hand-off, idle)."""
    bubble, filled = {}, {}
    for name, w in run.workers.items():
        prefills = [(s, e) for s, e, _ in data["prefill_intervals"].get(name, [])]
        for kind, _mb, s, e, it in w.events:
            if it not in served or kind in BUSY_KINDS:
                continue
            bubble[kind] = bubble.get(kind, 0.0) + (e - s)
            filled[kind] = filled.get(kind, 0.0) + sum(max(0.0, min(e, pe) - max(s, ps)) for ps, pe in prefills)
    total = sum(bubble.values())
    by_kind = {k: round(filled[k] / v, 4) for k, v in sorted(bubble.items()) if v > 0}
    return (sum(filled.values()) / total if total else 0.0), by_kind


def _start_latency(run: RunRecord, data: dict, served: list[int]) -> dict:
    """How long after a wait for a peer began its first prefill chunk started (the waits of the
    served iterations that got one): a round trip through the controller, or none when the
    jobs were sent ahead and the server started them off the wait board."""
    lag = []
    for name, w in run.workers.items():
        starts = sorted(s for s, *_ in data["prefill_intervals"].get(name, []))
        for kind, mb, s, e, it in w.events:
            if it in served and is_peer_wait(kind, mb):
                i = bisect.bisect_left(starts, s)
                if i < len(starts) and starts[i] < e:
                    lag.append(1000 * (starts[i] - s))
    return {"waits_with_prefill": len(lag), "p50_ms": _pct(lag, 0.5), "p90_ms": _pct(lag, 0.9)}


def _overruns(run: RunRecord, data: dict) -> dict:
    """How often a prefill chunk ran past the end of the bubble it started in (the prediction
    missed, or the margin was too small), and by how much: past the issue of the worker's next
    training op (forward, backward, optimizer), which on an emulated device waited that long."""
    n, late = 0, []
    for name, w in run.workers.items():
        issued = sorted(s for kind, _mb, s, _e, _it in w.events if kind in BUSY_KINDS)
        for ps, pe, *_ in data["prefill_intervals"].get(name, []):
            i = bisect.bisect_right(issued, ps)
            if i >= len(issued):
                continue  # after the last op of the record
            n += 1
            if pe > issued[i]:
                late.append(1000 * (pe - issued[i]))

    def ms(q):
        return round(_pct(late, q), 3) if late else 0.0

    return {"chunks": n, "past_bubble_end": len(late), "fraction": round(len(late) / n, 4) if n else None,
            "overrun_p50_ms": ms(0.5), "overrun_p99_ms": ms(0.99), "overrun_max_ms": ms(1.0)}


def ttft_cdf(reqs: list[dict], path: Path, title: str, slo: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft = sorted(r["ttft_s"] for r in reqs if r["status"] == "completed")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if ttft:  # over all arrivals: the curve tops out at the fraction completed
        ax.step(ttft, [(i + 1) / len(reqs) for i in range(len(ttft))], where="post", color="#C44E52")
    ax.axvline(slo, color="#999999", linestyle="--", label=f"TTFT SLO {slo:g} s")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of arrivals (completed)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
