"""From worker timelines to figures: per-iteration metrics, a Chrome trace, plots.

How it fits: ``runner.py`` and the simulator (``sim/build.py``) both produce a
``records.RunRecord``: each worker's typed intervals (contiguous, on the monotonic clock
every namespace shares), transfers and iteration ends.  ``summarise`` turns a record into
a ``RunSummary`` (typed: ``Summary``, ``IterationFigures``, ``WorkerIteration``; its
``to_dict()`` is the ``metrics.json`` content, key for key as it has always been);
``write_outputs`` writes ``metrics.json``, ``timeline.json``
(Chrome trace format: open it in Perfetto or chrome://tracing), ``loss.png`` and
``gantt.png``.  Run extensions add their own figures to the summary (``Summary.extra``,
written after the core's figures; ``testbed/run/hooks.py``).

Definitions (per iteration k):
* iteration time: the moment the last worker finished iteration k minus the moment the
  last finished k-1 (the go signal for k = 0);
* a worker's window: from its own end of k-1 (its go, for k = 0) to its end of k; its
  intervals tile it;
* busy fraction ("device utilization"): forward + backward + optimizer time / window;
* bubbles: maximal runs of non-busy intervals (recv, send, allreduce, idle) >= 1 ms;
* bubble fraction: 1 - busy fraction.  Summary figures average the steady-state
  iterations: all but the first ``training.warmup_iterations`` (default 2: the first
  ones pay for memory allocation and TCP slow start).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.messages import UNSET
from testbed.spec import modelshape
from testbed.results.records import BUSY_KINDS as BUSY
from testbed.results.records import RunRecord
MIN_BUBBLE_S = 0.001
_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868", "allreduce": "#8172B3",
           "recv": "#EEEEEE", "send": "#CCCCCC", "idle": "#FFFFFF", "cotenant": "#C44E52",
           "xfer_act": "#64B5CD", "xfer_grad": "#E5AE38"}


def worker_iteration(events: list, start: float, end: float) -> dict:
    """Busy time, covered time and bubbles of one worker inside [start, end]."""
    busy = covered = 0.0
    bubbles: list[list[float]] = []
    run_start = None
    for kind, _mb, s, e, *_ in events:
        s, e = max(s, start), min(e, end)
        if e <= s:
            continue
        covered += e - s
        if kind in BUSY:
            busy += e - s
            if run_start is not None and s - run_start >= MIN_BUBBLE_S:
                bubbles.append([run_start, s - run_start])
            run_start = None
        elif run_start is None:
            run_start = s
    if run_start is not None and end - run_start >= MIN_BUBBLE_S:
        bubbles.append([run_start, end - run_start])
    return {"busy_s": busy, "covered_s": covered, "bubbles": bubbles}


class _Figures:
    """Typed figures that are still read by key, too (``s["bubble_fraction"]``, for readers not
    yet converted; ``extra`` keys the same way) and written as JSON by ``to_dict()``: fields
    in order, ``UNSET`` ones left out, ``extra`` merged in last."""

    def __getitem__(self, key: str) -> Any:
        names = {f.name for f in dataclasses.fields(self)} - {"extra"}
        if key in names and getattr(self, key) is not UNSET:
            return getattr(self, key)
        extra = getattr(self, "extra", None)
        if extra is not None and key in extra:
            return extra[key]
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: str) -> bool:
        return self.get(key, UNSET) is not UNSET

    def to_dict(self) -> dict:
        out: dict = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "extra":
                out.update(v)
            elif v is not UNSET:
                out[f.name] = _json(v)
        return out


def _json(v: Any) -> Any:
    if isinstance(v, _Figures):
        return v.to_dict()
    if isinstance(v, list):
        return [_json(x) for x in v]
    if isinstance(v, dict):
        return {k: _json(x) for k, x in v.items()}
    return v


@dataclass
class WorkerIteration(_Figures):
    """One worker in one iteration: its window and how much of it was busy, covered, bubbles
    ([start from the go, length])."""

    window_s: float
    busy_fraction: float
    covered_fraction: float
    bubbles: list[list[float]]


@dataclass
class IterationFigures(_Figures):
    iteration: int
    time_s: float
    loss: float | None
    tokens_per_s: float | None
    mean_busy_fraction: float
    workers: dict[str, WorkerIteration]


@dataclass
class Summary(_Figures):
    """The run's figures over its steady-state iterations (metrics.json's ``summary``)."""

    iterations: int
    steady_state_iterations: list[int]
    mean_iteration_time_s: float
    mean_busy_fraction: float
    bubble_fraction: float
    busy_fraction_per_worker: dict[str, float]
    tokens_per_s: float | None
    final_loss: float | None
    time_dilation: float = 1.0  # k: every time here is in emulated seconds (the wall clock's / k)
    loss_note: str = UNSET  # only when the devices are emulated
    tcp_timeouts: int = UNSET  # these three only when the hosts' TCP counters were read
    tcp_loss_probes: int = UNSET
    tcp_retransmitted_fraction: float | None = UNSET
    warnings: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # extensions' figures, e.g. {"<extension>": {..}}


@dataclass
class RunSummary(_Figures):
    """What ``summarise`` makes of a run: ``to_dict()`` is metrics.json."""

    experiment: str
    topology: str
    parallel: dict
    model: dict
    training: dict
    workers: dict[str, dict]
    device: dict | None
    iterations: list[IterationFigures]
    summary: Summary
    wan_check: list[dict]
    tcp_per_host: dict | None
    log: list[str]
    extra: dict = field(default_factory=dict)  # e.g. "cluster" (a run across machines), "simulated"

    @property
    def losses(self) -> list[float | None]:
        return [it.loss for it in self.iterations]


RTO_MIN_S = 0.2  # Linux's tcp_rto_min: a steady connection's RTO is about its round trip + 200 ms
IDLE_AT_RTO = (0.8, 1.25)  # an idle gap this many RTOs long restarts the window, or not, by chance


def idle_at_rto(run: RunRecord) -> list[str]:
    """A warning per WAN channel whose idle gaps sit at its connections' RTO, with Linux's
    default ``net.ipv4.tcp_slow_start_after_idle = 1``: a connection idle for longer than its
    RTO (about RTT + 200 ms) restarts its window in slow start, so where the gaps between a
    channel's messages lie within ``IDLE_AT_RTO`` of it, each restart is decided by a few
    milliseconds of jitter, and a slower iteration makes longer gaps and more restarts: a run
    settles into one of several iteration times (measured: BubbleTea's emulated job at
    0.74 / 0.79 / 0.83 s, docs/benchmarks.md).  A gap is from the sender's last byte (the
    message's arrival less one way) to its next message; at least 10% of a channel's gaps
    near the RTO make a warning.  Under time dilation the kernel's 200 ms is a wall-clock
    floor: in emulated seconds it is 200 ms / k."""
    exp = run.exp
    if not exp.parallel.slow_start_after_idle:
        return []
    topo = exp.topo
    place = {(w.stage, w.replica): w for w in run.workers.values()}
    found: dict[tuple[str, str], tuple[float, list[float]]] = {}  # (src DC, dst DC) -> (RTO, gaps / RTO)
    for w in run.workers.values():
        for kind, step in (("xfer_act", -1), ("xfer_grad", 1)):
            sender = place.get((w.stage + step, w.replica))
            if sender is None or sender.dc == w.dc:
                continue
            one_way = topo.one_way_delay_ms(sender.dc, w.dc) / 1000
            rto = topo.rtt_ms(sender.dc, w.dc) / 1000 + RTO_MIN_S / run.time_dilation
            msgs = sorted((t for t in w.transfers if t.kind == kind), key=lambda t: t.start)
            found.setdefault((sender.dc, w.dc), (rto, []))[1].extend(
                (b.start - (a.end - one_way)) / rto for a, b in zip(msgs, msgs[1:]))
    out = []
    for (src, dst), (rto, ratios) in sorted(found.items()):
        near = [r for r in ratios if IDLE_AT_RTO[0] <= r <= IDLE_AT_RTO[1]]
        if ratios and len(near) >= 0.1 * len(ratios):
            out.append(f"{len(near)} of {len(ratios)} idle gaps between messages {src}->{dst} last "
                       f"{IDLE_AT_RTO[0]:g}-{IDLE_AT_RTO[1]:g}x the connections' RTO (~{1000 * rto:.0f} ms): with "
                       f"slow start after idle (Linux's default) each restart is a coin flip, and runs may "
                       f"settle into different iteration times; parallel.slow_start_after_idle: false "
                       f"(WAN-tuned hosts) removes it")
    return out


def summarise(run: RunRecord) -> RunSummary:
    exp = run.exp
    workers = run.workers
    n_it = exp.training.iterations
    t0 = run.go_time
    tokens = exp.parallel.replicas * exp.training.microbatches * exp.training.microbatch_size * exp.model.seq_len
    iterations = []
    prev_job_end = t0
    # a worker's first window starts when it got the go (its first interval's start)
    prev_end = {name: min((e.start for e in w.events if e.iteration == 0), default=t0)
                for name, w in workers.items()}
    for k in range(n_it):
        job_end = max(w.iteration_end[k] for w in workers.values())
        time_s = job_end - prev_job_end
        per_worker = {}
        for name, w in workers.items():
            end = w.iteration_end[k]
            window = end - prev_end[name]
            stats = worker_iteration([e for e in w.events if e.iteration == k], prev_end[name], end)
            per_worker[name] = WorkerIteration(
                window_s=round(window, 6),
                busy_fraction=round(stats["busy_s"] / window, 6) if window > 0 else 0.0,
                covered_fraction=round(stats["covered_s"] / window, 6) if window > 0 else 0.0,
                bubbles=[[round(s - t0, 6), round(d, 6)] for s, d in stats["bubbles"]],
            )
            prev_end[name] = end
        losses = [w.losses[k] for w in workers.values() if k in w.losses]
        iterations.append(IterationFigures(
            iteration=k,
            time_s=round(time_s, 6),
            loss=sum(losses) if losses else None,
            tokens_per_s=round(tokens / time_s, 2) if time_s > 0 else None,
            mean_busy_fraction=round(sum(p.busy_fraction for p in per_worker.values()) / len(per_worker), 6),
            workers=per_worker,
        ))
        prev_job_end = job_end
    # a run may start its steady state later (Atlas: once the plan is in force)
    skip = min(max(exp.training.warmup_iterations, run.steady_from), len(iterations) - 1)
    steady = iterations[skip:]
    mean_time = sum(it.time_s for it in steady) / len(steady)
    mean_busy = sum(it.mean_busy_fraction for it in steady) / len(steady)
    per_worker_busy = {
        name: round(sum(it.workers[name].busy_fraction for it in steady) / len(steady), 6) for name in workers
    }
    return RunSummary(
        experiment=exp.name,
        topology=exp.topo.name,
        parallel=exp.parallel.model_dump(),
        model=exp.model.model_dump() | {"params": _params(exp)},
        training=exp.training.model_dump(),
        workers={name: w.describe() for name, w in workers.items()},
        device=run.device or None,
        iterations=iterations,
        summary=Summary(
            iterations=n_it,
            steady_state_iterations=[it.iteration for it in steady],
            mean_iteration_time_s=round(mean_time, 6),
            mean_busy_fraction=round(mean_busy, 6),
            bubble_fraction=round(1.0 - mean_busy, 6),
            busy_fraction_per_worker=per_worker_busy,
            tokens_per_s=round(tokens / mean_time, 2) if mean_time > 0 else None,
            final_loss=iterations[-1].loss,
            time_dilation=run.time_dilation,
            **({"loss_note": "no loss: the devices are emulated (device time from a profile, no model is "
                             "computed)"} if run.device.get("computes_model") is False else {}),
            **_tcp_summary(run.tcp),
            warnings=list(run.warnings) + idle_at_rto(run),
        ),
        wan_check=list(run.wan_check),
        tcp_per_host=dict(run.tcp) or None,
        log=run.log_lines,
    )


def _tcp_summary(tcp: dict) -> dict:
    """The whole run's TCP loss recovery: retransmission timeouts (each stalls its connection
    for at least 200 ms on Linux), tail-loss probes, retransmitted segments over those sent."""
    if not tcp:
        return {}
    total = {k: sum(c.get(k, 0) for c in tcp.values()) for k in ("out_segments", "retransmitted_segments",
                                                                  "timeouts", "loss_probes")}
    return {"tcp_timeouts": total["timeouts"], "tcp_loss_probes": total["loss_probes"],
            "tcp_retransmitted_fraction": round(total["retransmitted_segments"] / total["out_segments"], 6)
            if total["out_segments"] else None}


def _params(exp) -> int:
    m = exp.model
    return sum(modelshape.stage_params(m.layers, m.hidden, m.seq_len, 1))


def timeline_to_chrome(workers: dict[str, dict], t0: float) -> dict:
    """``workers``: name -> {"dc", "events": [[kind, mb, start, end, it], ...], "transfers": [...]}."""
    trace = []
    pids = {}
    for name, w in sorted(workers.items()):
        pid = pids.setdefault(w["dc"], len(pids) + 1)
        trace.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"DC {w['dc']}"}})
        trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": name, "args": {"name": name}})
        for kind, mb, s, e, *rest in w["events"]:
            label = kind if mb is None or mb < 0 else f"{kind} {mb}"
            trace.append({"name": label, "cat": kind, "ph": "X", "pid": pid, "tid": name,
                          "ts": round((s - t0) * 1e6, 1), "dur": round((e - s) * 1e6, 1),
                          "args": {"iteration": rest[0] if rest else None, "microbatch": mb}})
        kind = w.get("cotenant_kind", "co-tenant")
        for s, e in w.get("cotenant", []):
            trace.append({"name": kind, "cat": "cotenant", "ph": "X", "pid": pid, "tid": f"{name} {kind}",
                          "ts": round((s - t0) * 1e6, 1), "dur": round((e - s) * 1e6, 1), "args": {}})
        for kind, mb, s, e, nbytes, it in w.get("transfers", []):
            trace.append({"name": f"{kind} {mb}", "cat": kind, "ph": "X", "pid": pid, "tid": f"{name} wan",
                          "ts": round((s - t0) * 1e6, 1), "dur": round((e - s) * 1e6, 1),
                          "args": {"bytes": nbytes, "iteration": it, "microbatch": mb}})
    trace += _transfer_flows(workers, pids, t0)
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


# A transfer's flow: from the sender's ``send`` of (iteration, microbatch) (or, where the
# record has none, as the simulator's, the compute that made the tensor), through the
# receiver's WAN track where the bytes arrived, to the receiver's compute that used them.
# kind: (the sender's stage less the receiver's, the compute on both ends)
_FLOW_OF = {"xfer_act": (-1, "forward"), "xfer_grad": (+1, "backward")}


def _transfer_flows(workers: dict[str, dict], pids: dict[str, int], t0: float) -> list[dict]:
    """Perfetto flow arrows (legacy ``s``/``t``/``f`` events, each bound to the slice around
    its time) for every transfer whose sender and consumer are in the record."""
    by_place = {(w.get("stage"), w.get("replica")): name for name, w in workers.items()}
    slices: dict[str, dict[tuple, list[tuple[float, float]]]] = {}
    for name, w in workers.items():
        mine = slices.setdefault(name, {})
        for kind, mb, s, e, *rest in w["events"]:
            mine.setdefault((kind, rest[0] if rest else None, mb), []).append((s, e))

    def mid(s: float, e: float) -> float:
        return round(((s + e) / 2 - t0) * 1e6, 1)

    out: list[dict] = []
    for name, w in sorted(workers.items()):
        for kind, mb, s, e, _nbytes, it in w.get("transfers", []):
            if kind not in _FLOW_OF:
                continue
            step, consumer = _FLOW_OF[kind]
            sender = by_place.get((w.get("stage", 0) + step, w.get("replica")))
            # a middle stage sends an activation and, later, a gradient of the same microbatch
            theirs = slices.get(sender, {})
            sends = sorted(theirs.get(("send", it, mb), [])) or theirs.get((consumer, it, mb), [])
            used = slices[name].get((consumer, it, mb))
            if not sends or not used:
                continue
            sent, used = (sends[0] if kind == "xfer_act" else sends[-1]), used[0]
            fid = len(out) // 3 + 1
            common = {"name": kind, "cat": "flow", "id": fid}
            out += [common | {"ph": "s", "pid": pids[workers[sender]["dc"]], "tid": sender, "ts": mid(*sent)},
                    common | {"ph": "t", "pid": pids[w["dc"]], "tid": f"{name} wan", "ts": mid(s, e)},
                    common | {"ph": "f", "bp": "e", "pid": pids[w["dc"]], "tid": name, "ts": mid(*used)}]
    return out


def _link_rates(samples: list[tuple[float, int, int, int]]):
    """(time, tx_bytes, drops, backlog, Mbit/s since the previous sample or None) per sample."""
    prev = None
    for t, tx, drops, backlog in samples:
        rate = (tx - prev[1]) * 8 / (t - prev[0]) / 1e6 if prev is not None and t > prev[0] else None
        yield t, tx, drops, backlog, rate
        prev = (t, tx)


def write_links_csv(links: dict[str, list[tuple[float, int, int, int]]], t0: float, path: Path) -> None:
    """links.csv: each WAN direction's counters over the run, one row per sample (time from the
    go, bytes and drops so far, the queue's backlog, the rate since the previous sample)."""
    import csv

    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["time_s", "link", "tx_bytes", "drops", "backlog_bytes", "mbps"])
        for name, samples in sorted(links.items()):
            for t, tx, drops, backlog, rate in _link_rates(samples):
                w.writerow([f"{t - t0:.4f}", name, tx, drops, backlog, "" if rate is None else f"{rate:.3f}"])


def link_counter_tracks(links: dict[str, list[tuple[float, int, int, int]]], t0: float) -> list[dict]:
    """Counter tracks for the Chrome/Perfetto timeline: per WAN direction its rate (Mbit/s) and
    its queue's backlog (bytes), under a process of their own ("WAN links")."""
    if not links:
        return []
    pid = 0
    out: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": "WAN links"}}]
    for name, samples in sorted(links.items()):
        for t, _tx, _drops, backlog, rate in _link_rates(samples):
            ts = round((t - t0) * 1e6, 1)
            if rate is not None:
                out.append({"name": f"{name} Mbit/s", "ph": "C", "pid": pid, "ts": ts, "args": {"Mbit/s": round(rate, 3)}})
            out.append({"name": f"{name} queue", "ph": "C", "pid": pid, "ts": ts, "args": {"bytes": backlog}})
    return out


def gantt(workers: dict[str, dict], t0: float, path: Path, title: str, window: tuple[float, float] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = sorted(workers, key=lambda n: (workers[n]["stage"], workers[n]["replica"]))
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(names) + 1.6))
    for y, name in enumerate(names):
        w = workers[name]
        for kind, _mb, s, e, *_ in w["events"]:
            if window and (e < window[0] or s > window[1]):
                continue
            ax.barh(y, e - s, left=s - t0, height=0.7, color=_COLORS.get(kind, "#999999"),
                    edgecolor="#999999" if kind in ("recv", "idle", "send") else None, linewidth=0.3)
        for kind, _mb, s, e, *_ in w.get("transfers", []):
            if window and (e < window[0] or s > window[1]):
                continue
            ax.barh(y + 0.42, e - s, left=s - t0, height=0.14, color=_COLORS.get(kind, "#999999"))
        for s, e in w.get("cotenant", []):  # a co-tenant's work on the device, drawn inside the bubbles
            if window and (e < window[0] or s > window[1]):
                continue
            ax.barh(y, e - s, left=s - t0, height=0.45, color=_COLORS["cotenant"])
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{n} ({workers[n]['dc']})" for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("time since start (s)")
    if window:
        ax.set_xlim(window[0] - t0, window[1] - t0)
    ax.set_title(title)
    kinds = ["forward", "backward", "optimizer", "allreduce", "recv", "xfer_act", "xfer_grad"]
    labels = {"recv": "recv (bubble)"}
    if any(w.get("cotenant") for w in workers.values()):
        kinds.append("cotenant")
        labels["cotenant"] = next(w["cotenant_kind"] for w in workers.values() if w.get("cotenant"))
    ax.legend(handles=[Patch(color=_COLORS[k], label=labels.get(k, k)) for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(kinds), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def loss_plot(iterations: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if all(it["loss"] is None for it in iterations):
        ax.text(0.5, 0.5, "no loss: emulated devices compute no model", ha="center", va="center",
                transform=ax.transAxes)
    else:
        ax.plot([it["iteration"] for it in iterations], [it["loss"] for it in iterations], marker="o")
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (bytes, nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(run: RunRecord, result: RunSummary, out: Path | None = None) -> None:
    out = Path(out or run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workers = {
        name: {"dc": w.dc, "stage": w.stage, "replica": w.replica,
               "events": w.events, "transfers": w.transfers,
               "cotenant": w.cotenant, "cotenant_kind": w.cotenant_kind}
        for name, w in run.workers.items()
    }
    (out / "metrics.json").write_text(json.dumps(result.to_dict(), indent=1))
    trace = timeline_to_chrome(workers, run.go_time)
    trace["traceEvents"] += link_counter_tracks(run.link_samples, run.go_time)
    (out / "timeline.json").write_text(json.dumps(trace))
    if run.link_samples:
        write_links_csv(run.link_samples, run.go_time, out / "links.csv")
    loss_plot([it.to_dict() for it in result.iterations], out / "loss.png", f"{run.exp.name}: loss")
    ends = run.iteration_ends()
    k0 = max(0, len(ends) - 3)
    start = ends[k0 - 1] if k0 > 0 else run.go_time
    s = result.summary
    gantt(workers, run.go_time, out / "gantt.png",
          f"{run.exp.name}: last iterations (mean {s.mean_iteration_time_s:.3f} s/it, "
          f"busy {s.mean_busy_fraction:.0%}, bubbles {s.bubble_fraction:.0%})",
          window=(start, ends[-1]))
