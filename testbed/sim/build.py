"""From an experiment file to a simulated job, and from a simulated job to the run's figures.

How it fits: ``simulate(exp)`` builds one ``Link`` per topology direction, one ``Worker``
per (stage, replica) with the schedule's op list, per-stage compute times (given in the
experiment's ``sim`` section, profiled from an emulator run's ``timeline.json``, or
estimated from the model's FLOPs and a device speed), runs the engine, and returns a
``SimResult``: a ``records.RunRecord`` like the emulator's, so ``metrics.summarise`` and
``write_outputs`` produce the same ``metrics.json`` and Chrome trace.

Two models of TCP sit between a message and its flow: ``sim.tcp_window_model``
(``tcpwindow.TcpWindow``: each channel's window as Linux validates it -- grown only while used,
decayed while application-limited, restarted after idle -- sets the flow's ceiling as it grows;
on by default where the hosts keep Linux's ``tcp_slow_start_after_idle = 1``, off on WAN-tuned
hosts: ``window_model`` says which and why) and the opt-in ``sim.tail_loss``
(``_late_if_overflowing``: a message in flight while its bottleneck's FIFO overflows arrives
one tail-loss probe late).  Neither changes the engine's sharing; both only
change a flow's ceiling or a message's arrival.  With ``sim.sharing: fifo-bursts`` the window
model instead sends each message a window at a time, each round a burst in the FIFO, with the
drop-tail queue's losses (``rounds.RoundsChannel``; ``sim.tail_loss`` is not applied there).
A third is on wherever a WAN path has random loss (``sim.loss_model``, default true:
``loss_cap``): each connection is held to what CUBIC sustains under that loss and round trip
(``testbed/net/tcpmodel.py``: Linux's CUBIC driven by the random drops, a seeded Monte Carlo's
long-run mean on the connection's share of the link), so a channel of N connections to N times
that, with the window's cap (the lower); and a message its windows hold, sent in a flight or a
few, arrives late by the recovery of a segment it loses (``_late_if_lost``: RACK, 1.25 round
trips, or for a lost last segment the RTO; seeded draws), in order behind it on its channel.
Random loss is not in ``rounds.RoundsChannel`` (fifo-bursts with the window model): its losses
are the queues' own.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from testbed.extension import device_kind
from testbed.net.delayline import bucket_bytes, class_queue_bytes, shared_class_queue_bytes
from testbed.net.tcpmodel import MSS, PAYLOAD_FRACTION, RTO_MIN_S, loss_limited_rate, path_loss
from testbed.spec import modelshape
from testbed.spec import schedules as sch
from testbed.spec.experiment import Experiment
from testbed.results.records import Interval, RunRecord, Transfer, WorkerRecord
from testbed.spec.topology import default_queue_bytes
from testbed.sim import packets, validity
from testbed.sim.engine import (FifoBurstPolicy, Link, PipelineJob, PriorityPolicy, SharingPolicy, Simulator,
                                SpreadPolicy, StageTimes, Worker)
from testbed.sim.packets import PacketSharing
from testbed.sim.rounds import RoundsChannel
from testbed.sim.tcpwindow import INIT_SEGMENTS, INITIAL_WINDOW, TcpWindow  # noqa: F401 (also this module's names)


def window_model(exp: Experiment) -> tuple[bool, str]:
    """Whether a simulation of ``exp`` runs the TCP window model (``tcpwindow.TcpWindow``), and
    why, in words (``testbed sim`` prints it; the result's ``model`` carries it).

    ``sim.tcp_window_model`` true or false decides; unset (the default), it is on where the
    hosts restart slow start after idle (``parallel.slow_start_after_idle``, Linux's default)
    and off on WAN-tuned hosts.  Issue #30's validation matrix (80 cells on the emulator,
    docs/benchmarks.md) chose this: on default hosts the restart after idle is measured as a
    whole slow start per message, and the window model takes those 40 cells from mean |error|
    10.6% (bias -9.6%) to 6.7% (-4.2%); on the 40 WAN-tuned cells it changes no prediction."""
    chosen = exp.sim.tcp_window_model
    if chosen is not None:
        return chosen, f"sim.tcp_window_model: {str(chosen).lower()}"
    if exp.parallel.slow_start_after_idle:
        return True, ("on by default: the hosts restart slow start after idle (parallel.slow_start_after_idle: "
                      "true, Linux's default); sim.tcp_window_model: false turns it off")
    return False, ("off by default: WAN-tuned hosts (parallel.slow_start_after_idle: false) keep their windows "
                   "across idle gaps, where the window model changes no validation cell; "
                   "sim.tcp_window_model: true turns it on")


HYSTART_DEFAULT = True  # sim.tcp_hystart unset: HyStart in the window model (see ``hystart_model``)


def hystart_model(exp: Experiment) -> tuple[bool, str]:
    """Whether the window model ends slow start by CUBIC's HyStart (``TcpWindow._hystart``),
    and why: ``sim.tcp_hystart`` if set, else ``HYSTART_DEFAULT`` (on: the 80-cell matrix re-predicted
    7.6% / 25.3% / -5.6% -> 7.3% / 25.3% / -5.3%, mean / max / bias; the long haul's Linux-default runs
    -44% -> -11.8% and -9.7% -> -8.4%, docs/benchmarks.md "HyStart in the window model")."""
    chosen = exp.sim.tcp_hystart
    if chosen is not None:
        return chosen, f"sim.tcp_hystart: {str(chosen).lower()}"
    return HYSTART_DEFAULT, ("on by default with the window model (Linux's CUBIC runs it; chosen 2026-12-06 on "
                             "issue #30's matrix and the long haul); sim.tcp_hystart: false turns it off")


def _profiled(exp: Experiment) -> bool:
    """Whether ``exp``'s devices take their times from its ``emulation`` section (its kind says)."""
    return device_kind(exp.device).profiled


def stage_params(exp: Experiment) -> list[int]:
    m = exp.model
    return modelshape.stage_params(m.layers, m.hidden, m.seq_len, exp.parallel.stages)


def flops_stage_times(exp: Experiment) -> list[StageTimes]:
    """Forward = 2 x params x tokens (+ attention), backward = 2 x forward, at the device's speed."""
    sim = exp.sim
    tokens = exp.training.microbatch_size * exp.model.seq_len
    speed = sim.device_tflops * 1e12 * sim.efficiency * sim.tensor_parallel
    out = []
    for (a, b), p in zip(modelshape.layer_split(exp.model.layers, exp.parallel.stages), stage_params(exp)):
        attn = 4 * (b - a) * tokens * exp.model.seq_len * exp.model.hidden
        fwd = (2 * p * tokens + attn) / speed
        # the optimizer step streams weights, gradients and two Adam moments: ~16 bytes a parameter
        opt = p * 16 / (sim.memory_gbps * 1e9) / sim.tensor_parallel
        out.append(StageTimes(fwd, 2 * fwd, opt))
    return out


def profiled_stage_times(timeline: Path, exp: Experiment, skip_iterations: int = 2,
                         distributions: bool = True) -> tuple[list[StageTimes], float]:
    """Per-stage times from an emulator run of ``exp``, and the transport's per-message latency.

    Per stage: the medians of forward/backward/optimizer (with every observed duration as
    ``samples`` when ``distributions``, and each op of the first ``skip_iterations`` as its
    ``warmup``, by worker: a simulated run starts as slowly as this one did) and of the
    per-message hand-off costs on the worker's own CPU: ``send`` (the send intervals) and ``recv`` (receive intervals whose
    data had already arrived when they began, so all of the interval is taking the tensor
    out of the transport).

    The latency is what a message takes beyond the network's share: each cross-DC transfer
    the receiver was waiting for and that had its path to itself (no other message on the path
    between its send and its arrival), minus when a FIFO link of the path's rate and delay
    would have delivered it (at the channel's TCP window: ``TcpWindow``), median over the run
    of those under half the path's round trip, at least 50 ms (more is a round the network
    model missed); 0 where no message was alone.  Messages that shared the path are left out:
    how they shared it (fair, by turns, with losses) is the network model's business, and their residuals
    against any one reference measured that, not the hosts (1.4 s a message on
    experiments/atlas-regime.yaml's fair arm, added by the simulator to every message).  On
    CPU-limited hosts this is the writer and reader threads waiting for their share of the
    worker's CPU quota (a few ms at 0.3 cores); the fluid network model knows nothing of it.
    """
    trace = json.loads(Path(timeline).read_text())["traceEvents"]
    per: dict[tuple[int, str], list[float]] = {}
    ops: dict[str, list[dict]] = {}
    arrived: dict[tuple[str, str, int, int], float] = {}  # (worker, act|grad, iteration, mb) -> end
    transfers: list[tuple[str, str, dict]] = []  # (receiver, act|grad, event)
    for e in trace:
        if e.get("ph") != "X":
            continue
        tid = str(e.get("tid", ""))
        if tid.endswith(" wan") and e["cat"] in ("xfer_act", "xfer_grad"):
            key = (tid[:-4], e["cat"][5:], e["args"].get("iteration"), e["args"].get("microbatch"))
            arrived[key] = (e["ts"] + e["dur"]) / 1e6
            if (e["args"].get("iteration") or 0) >= skip_iterations:
                transfers.append((tid[:-4], e["cat"][5:], e))
        elif tid.startswith("s") and " " not in tid:
            ops.setdefault(tid, []).append(e)
    waited: set[tuple[str, str, int, int]] = set()  # transfers that arrived while the receiver waited
    warm: dict[int, dict[tuple[str, int, str, int], float]] = {}  # stage -> its workers' warm-up ops
    for tid, events in ops.items():
        stage = int(tid[1:].split("r")[0])
        events.sort(key=lambda e: e["ts"])
        for e, nxt in zip(events, events[1:] + [None]):
            it = e["args"].get("iteration") or 0
            if it < skip_iterations:
                if e["cat"] in ("forward", "backward", "optimizer"):
                    mb = e["args"].get("microbatch")
                    warm.setdefault(stage, {})[(tid, it, e["cat"], -1 if mb is None else mb)] = e["dur"] / 1e6
                continue
            kind = e["cat"]
            if kind in ("forward", "backward", "optimizer", "send"):
                per.setdefault((stage, kind), []).append(e["dur"] / 1e6)
            elif kind == "recv" and nxt is not None and nxt["cat"] in ("forward", "backward"):
                what = "act" if nxt["cat"] == "forward" else "grad"
                key = (tid, what, it, e["args"].get("microbatch"))
                t_arrived = arrived.get(key)
                if t_arrived is not None and t_arrived <= e["ts"] / 1e6:
                    per.setdefault((stage, "recv"), []).append(e["dur"] / 1e6)
                elif t_arrived is not None:
                    waited.add(key)
    times = []
    for s in range(exp.parallel.stages):
        def med(kind, required=True):
            values = per.get((s, kind))
            if not values:
                if required:
                    raise ValueError(f"{timeline}: no {kind} intervals for stage {s}")
                return 0.0
            return statistics.median(values)
        samples = {k: tuple(per[(s, k)]) for k in ("forward", "backward", "optimizer")
                   if distributions and per.get((s, k))}
        warmup = warm.get(s, {}) if distributions else {}
        times.append(StageTimes(med("forward"), med("backward"), med("optimizer"),
                                send=med("send", False), recv=med("recv", False), samples=samples,
                                warmup=warmup))
    return times, _message_latency(exp, transfers, waited)


def profiled_write_latency(run: Path, skip_iterations: int = 2) -> list[float]:
    """How long the transport's writer threads took to start each slice of a traced run
    (``parallel.tcp_trace``: ``tcp-trace/*.jsonl`` beside its timeline; the "start" row's time
    less the message's ``queued_at``), past the warm-up; empty where the run was not traced.  On
    hosts held to a share of a CPU the threads wait for it (aws-longhaul3 at 0.25: median 5.2 ms,
    p90 14 ms; no limit: 0.46 / 0.94 ms); the packet model replays them (``PacketChannel``)."""
    folder = Path(run)
    if folder.suffix == ".json":
        folder = folder.parent
    out = []
    for path in sorted((folder / "tcp-trace").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("phase") == "start" and row.get("it", 0) >= skip_iterations and "queued_at" in row:
                out.append(max(0.0, row["t"] - row["queued_at"]))
    return out


def _message_latency(exp: Experiment, transfers: list[tuple[str, str, dict]],
                     waited: set[tuple[str, str, int, int]]) -> float:
    """Median of (arrival - FIFO link's delivery) over the transfers a receiver waited for."""
    topo = exp.topo
    dc_of = {slot.name: slot.dc for slot in exp.workers()}
    paths: dict[tuple[str, str], list[tuple[float, float, float, tuple]]] = {}
    for receiver, what, e in transfers:
        stage, replica = receiver[1:].split("r")
        sender = f"s{int(stage) + (-1 if what == 'act' else 1)}r{replica}"
        a, b = dc_of.get(sender), dc_of.get(receiver)
        if a is None or b is None or a == b:
            continue
        key = (receiver, what, e["args"].get("iteration"), e["args"].get("microbatch"))
        start = e["ts"] / 1e6
        paths.setdefault((a, b), []).append((start, start + e["dur"] / 1e6, e["args"].get("bytes", 0), key))
    excess = []
    n = exp.parallel.connections
    tcp = window_model(exp)[0]
    for (a, b), items in paths.items():
        hops = topo.path(a, b)
        rate = min(topo.direction(x, y).rate_mbps for x, y in zip(hops, hops[1:])) * 1e6 / 8 * PAYLOAD_FRACTION
        delay = topo.one_way_delay_ms(a, b) / 1000.0
        rtt = topo.rtt_ms(a, b) / 1000.0
        queue = min(default_queue_bytes(topo.direction(x, y), topo.rtt_ms(x, y)) for x, y in zip(hops, hops[1:]))
        window = exp.parallel.tcp_window_bytes or exp.sim.tcp_window_bytes
        per_connection = loss_cap(exp, hops, rtt)  # what each connection sustains under the path's loss
        rate = min(rate, n * per_connection)
        window = min(window, _window_for(per_connection, rtt))
        windows: dict[tuple, TcpWindow] = {}  # per channel: what TCP's window costs (slow start, restarts)
        free = 0.0
        ordered = sorted(items)
        alone, reach = set(), float("-inf")  # reach: the latest arrival of the messages sent before
        for i, (start, end, _size, key) in enumerate(ordered):
            if reach <= start and (i + 1 == len(ordered) or ordered[i + 1][0] >= end):
                alone.add(key)
            reach = max(reach, end)
        for start, end, size, key in ordered:
            begin = max(start, free)
            if tcp:
                win = windows.setdefault(key[:2], TcpWindow(rtt, n, min(window, (rate * rtt + queue) / n),
                                                            exp.parallel.slow_start_after_idle,
                                                            exp.sim.tcp_ssthresh_segments))
                win.begin(begin, size)
                free = begin + win.send_time(size, rate)
                win.end(free, size)
            else:
                free = begin + size / rate
            # an excess of half a round trip or more is a round the network model missed (a
            # restart's or a loss's), the network's business, not the hosts': a lossy long haul
            # (2026-12-07) had 36 such messages, half within 10 ms and half 0.18-0.26 s over, one
            # round trip; their median, 182 ms, added to every message, read +46%.  (At least
            # 50 ms: on shorter paths a round is the size of the hosts' own latency, p99 28 ms at
            # 0.25 of a CPU, and the two cannot be told apart.)
            if key in waited and key in alone and end - (free + delay) < max(rtt / 2, 0.05):
                excess.append(end - (free + delay))
    return max(0.0, statistics.median(excess)) if excess else 0.0


@dataclass
class SimResult(RunRecord):
    """A simulated run's record, plus the simulator's own: its links (bytes carried), how
    many events it processed, and how many DP replicas each simulated one stands for."""

    links: dict = field(default_factory=dict)
    events_processed: int = 0
    folded: int = 1
    model: dict = field(default_factory=dict)  # the parts of the model used, and their validated ranges
    # the window model under fair sharing: each WAN message's channel window as it started (``window_trace``)
    windows: list[dict] = field(default_factory=list)


def link_capacity(exp: Experiment) -> Callable[[Any], float]:
    """A WAN direction's capacity in payload bytes/s: the topology's (wire) rate, of which TCP
    payload is MSS/(MSS + TCP/IP/Ethernet headers); or (wan_link_gbps set) the DC pair's."""
    if exp.sim.wan_link_gbps:
        return lambda p: exp.sim.wan_link_gbps * 1e9 / 8
    return lambda p: p.rate_mbps * 1e6 / 8 * PAYLOAD_FRACTION


def loss_cap(exp: Experiment, hops: list[str], rtt: float) -> float:
    """One connection's most (payload bytes/s) over the path ``hops`` under its random loss:
    ``tcpmodel.loss_limited_rate`` (the loss-driven CUBIC window model's long-run mean) of the
    path's loss (its hops' drops, independent) and round trip ``rtt``, the connection as if
    alone on the bottleneck (its rate and queue: the window past that BDP plus queue overflows
    it; the sharing among connections is the fluid model's); the RTO's rttvar is half the jitter summed over
    the round trip (the delay line's jitter is uniform, +-jitter_ms).  ``inf`` on a lossless
    path or with ``sim.loss_model`` off.  The loss on the way back (ACKs) is left out:
    cumulative ACKs make a lost ACK nearly free."""
    if not exp.sim.loss_model:
        return float("inf")
    topo = exp.topo
    pairs = list(zip(hops, hops[1:]))
    p = path_loss(topo.direction(x, y).loss for x, y in pairs)
    if p <= 0:
        return float("inf")
    jitter = sum(topo.direction(x, y).jitter_ms + topo.direction(y, x).jitter_ms for x, y in pairs) / 1000.0
    bottleneck = min(link_capacity(exp)(topo.direction(x, y)) for x, y in pairs)
    queue = min(default_queue_bytes(topo.direction(x, y), topo.rtt_ms(x, y)) for x, y in pairs)
    return loss_limited_rate(p, rtt, MSS, rttvar_s=jitter / 2, link_rate=bottleneck, queue_bytes=queue)


def _window_for(rate: float, rtt: float) -> float:
    """rate x rtt, the window that sustains ``rate``: unbounded for an unbounded rate (even at rtt 0)."""
    return rate * rtt if rate < float("inf") else float("inf")


def _flow_ceiling(exp: Experiment, hops: list[str], rtt: float) -> float:
    """One channel's most over the path ``hops``: N connections x window / RTT, N x what one
    connection sustains under the path's random loss (``loss_cap``), and (with wan_link_gbps)
    N x the measured single-connection bandwidth of its slowest hop."""
    n = exp.parallel.connections
    window = exp.parallel.tcp_window_bytes or exp.sim.tcp_window_bytes
    ceiling = n * window / rtt if rtt > 0 else float("inf")
    ceiling = min(ceiling, n * loss_cap(exp, hops, rtt))
    if exp.sim.wan_link_gbps:
        ceiling = min(ceiling, n * min(exp.topo.direction(x, y).rate_mbps for x, y in zip(hops, hops[1:])) * 1e6 / 8)
    return ceiling


def wan_can_contend(exp: Experiment) -> bool:
    """Whether the job's WAN transfers can ever want more of a link than it has: on some
    directed WAN link, every pipeline's channels that cross it at their ceilings (N x window
    / RTT, or N x the measured single-connection bandwidth) add up to more than its capacity.
    Where they cannot, every flow always runs at its ceiling whatever the sharing policy, so
    a policy such as strict priority or turns gives fair sharing's result (and may be folded
    as fair sharing is).  Data parallelism across DCs counts as contended."""
    if exp.parallel.dp_across_dcs:
        return True
    topo, capacity = exp.topo, link_capacity(exp)
    load: dict[tuple[str, str], float] = {}
    dc = {(s.stage, s.replica): s.dc for s in exp.workers()}
    for (stage, replica), here in dc.items():
        there = dc.get((stage + 1, replica))
        if there is None or there == here:
            continue
        for a, b in ((here, there), (there, here)):  # activations one way, gradients the other
            hops = topo.path(a, b)
            pairs = list(zip(hops, hops[1:]))
            ceiling = _flow_ceiling(exp, hops, 2 * sum(topo.direction(x, y).delay_ms for x, y in pairs) / 1000)
            for pair in pairs:
                load[pair] = load.get(pair, 0.0) + ceiling
    return any(total > capacity(topo.direction(*pair)) * (1 + 1e-9) for pair, total in load.items())


SHARING = {"fair": SharingPolicy, "fifo-bursts": FifoBurstPolicy, "spread": SpreadPolicy,
           "packets": PacketSharing}  # sim.sharing -> its policy


def sharing_policy(exp: Experiment) -> SharingPolicy:
    """The sharing policy ``sim.sharing`` names (a fresh one; spread's weights seeded by the
    training seed)."""
    if exp.sim.sharing == "spread":
        return SpreadPolicy(exp.sim.share_spread, seed=exp.training.seed)
    return SHARING[exp.sim.sharing]()


def connection_window(exp: Experiment, hops: list[str], rtt: float) -> float:
    """The most one connection over ``hops`` holds in flight: its window, held to its share of
    the path's BDP + queue (past which a real flow loses packets and backs off) and under
    random loss to the window that sustains the loss-limited rate (the window model's cap,
    where slow start ends).  N connections x this is what a channel can send at once: a
    message of at most that many bytes is a burst (``FifoBurstPolicy``)."""
    topo = exp.topo
    n = exp.parallel.connections
    pairs = list(zip(hops, hops[1:]))
    window = exp.parallel.tcp_window_bytes or exp.sim.tcp_window_bytes
    bottleneck = min(link_capacity(exp)(topo.direction(x, y)) for x, y in pairs)
    queue = min(default_queue_bytes(topo.direction(x, y), topo.rtt_ms(x, y)) for x, y in pairs)
    return min(window, (bottleneck * rtt + queue) / n, _window_for(loss_cap(exp, hops, rtt), rtt))


def bursts_possible(exp: Experiment, message_bytes: float) -> bool:
    """Whether some pipeline boundary's message fits its channel's windows (``connection_window``):
    where none does, ``FifoBurstPolicy`` is fair sharing exactly."""
    topo = exp.topo
    dc = {(s.stage, s.replica): s.dc for s in exp.workers()}
    for (stage, replica), here in dc.items():
        there = dc.get((stage + 1, replica))
        if there is None or there == here:
            continue
        for a, b in ((here, there), (there, here)):
            hops = topo.path(a, b)
            rtt = 2 * sum(topo.direction(x, y).delay_ms / 1000.0 for x, y in zip(hops, hops[1:]))
            if message_bytes <= exp.parallel.connections * connection_window(exp, hops, rtt):
                return True
    return False


def simulate(exp: Experiment, policy: SharingPolicy | None = None, iterations: int | None = None,
             stage_times: list[StageTimes] | None = None, message_overhead_s: float | None = None,
             record: bool = True, fold_replicas: bool | None = None,
             start_offsets: dict[int, float] | None = None, seed: int | None = None,
             tcp: bool | None = None, write_latency: list[float] | None = None,
             priority_plans: list[tuple[int, list[str]]] | None = None) -> SimResult:
    """Simulate ``exp``.  ``policy``: how flows share a link (default: the one ``sim.sharing``
    names).  ``fold_replicas`` (default: when D > 8 and sharing is fair, or fifo-bursts where
    no message is a burst) simulates one pipeline with every WAN link's bandwidth divided by D:
    under fair sharing identical replicas move in lockstep, so each sees exactly that share
    (under FIFO they take turns, which folding cannot show); the DP all-reduce keeps the real D.  It makes paper-scale jobs (D in the hundreds) cost what one pipeline
    costs.  With drawn op times (profiled ``samples``) replicas are no longer identical and
    folding is an approximation: pass ``fold_replicas=False`` where D is small enough.
    ``priority_plans``: with an extension's strict priority on packets, when each order came
    into force in the run, as (iterations every worker had ended, the owners by rank); the
    gateways are first in first out before the first (a controller that plans after warm-up
    iterations).  Without it, or in the fluid model, ``policy``'s order holds from the start."""
    sim_spec = exp.sim
    topo = exp.topo
    n_it = iterations or exp.training.iterations
    tcp_why = window_model(exp) if tcp is None else (tcp, f"simulate(tcp={tcp})")
    sim = Simulator(policy if policy is not None else sharing_policy(exp))
    # every connection segment by segment (no window model): sim.sharing: packets, and with it an
    # extension's strict priority (Atlas's temporal sharing at the gateway) as the gateway's scheduler
    packet_mode = packet_run(exp, sim.policy)
    if packet_mode:
        tcp_why = (False, PACKETS_WHY)
    tcp = tcp_why[0]
    D = exp.parallel.replicas
    act_bytes = exp.training.microbatch_size * exp.model.seq_len * exp.model.hidden * sim_spec.dtype_bytes
    if fold_replicas is None:
        # (with the window model, fifo-bursts sends every message in rounds, each a burst: never fair)
        fair = type(sim.policy) is SharingPolicy or (type(sim.policy) is FifoBurstPolicy and not tcp
                                                     and not bursts_possible(exp, act_bytes))
        fold_replicas = D > 8 and fair and not (_profiled(exp) and exp.emulation.slowdown)
    share = D if fold_replicas else 1
    capacity = link_capacity(exp)
    links = {(s, d): Link(f"{s}->{d}", capacity(p) / share, p.delay_ms / 1000.0) for s, d, p in topo.directions()}
    if stage_times is None:
        if sim_spec.stage_times:
            stage_times = [StageTimes(t.forward_s, t.backward_s, t.optimizer_s) for t in sim_spec.stage_times]
        else:
            stage_times = flops_stage_times(exp)
    if len(stage_times) != exp.parallel.stages:
        raise ValueError(f"{len(stage_times)} stage times for {exp.parallel.stages} stages")
    overhead = sim_spec.message_overhead_s if message_overhead_s is None else message_overhead_s
    P, M = exp.parallel.stages, exp.training.microbatches
    workers = []
    for slot in exp.workers():
        if fold_replicas and slot.replica > 0:
            continue
        program = sch.ops(exp.parallel.schedule, slot.stage, P, M, exp.parallel.extra_warmup)
        times = stage_times[slot.stage]
        slow = exp.emulation.slowdown.get(slot.replica, 1.0) if _profiled(exp) else 1.0
        if slow != 1.0:  # a heterogeneous job: this pipeline's devices are slower
            times = StageTimes(times.forward * slow, times.backward * slow, times.optimizer * slow,
                               times.send * slow, times.recv * slow,
                               {k: tuple(v * slow for v in vs) for k, vs in times.samples.items()})
        workers.append(Worker(slot.name, slot.stage, slot.replica, slot.dc, program, times))
    by_key = {(w.stage, w.replica): w for w in workers}
    intra = sim_spec.intra_dc_gbps * 1e9 / 8
    params = stage_params(exp)
    n_conn = exp.parallel.connections

    routes = {}  # (src DC, dst DC) -> (links crossed, one flow's ceiling): computed once
    route_loss: dict[tuple[str, str], float] = {}  # (src DC, dst DC) -> the path's random loss (sim.loss_model)
    loss_draws = random.Random(1_000_003 * (exp.training.seed if seed is None else seed) + 7)
    for a in topo.dcs:
        for b in topo.dcs:
            if a.name == b.name:
                continue
            hops = topo.path(a.name, b.name)
            path = [links[(x, y)] for x, y in zip(hops, hops[1:])]
            rtt = 2 * sum(link.delay for link in path)
            window = exp.parallel.tcp_window_bytes or sim_spec.tcp_window_bytes
            ceiling = _flow_ceiling(exp, hops, rtt)
            # the window model's cap per connection: the path's BDP + queue, and under random
            # loss the window that sustains the loss-limited rate (slow start ends there)
            cap = connection_window(exp, hops, rtt)
            routes[(a.name, b.name)] = (path, ceiling, rtt, cap)
            if sim_spec.loss_model:
                route_loss[(a.name, b.name)] = path_loss(topo.direction(x, y).loss for x, y in zip(hops, hops[1:]))

    channels: dict[tuple[str, str], dict] = {}
    window_trace: list[dict] = []  # SimResult.windows
    # a message a window at a time into drop-tail FIFOs (``rounds.RoundsChannel``)
    rounds = tcp and type(sim.policy) is FifoBurstPolicy
    # every WAN message as TCP segments through the delay lines and drop-tail queues (``packets``)
    packet_net = None
    packet_counts = packets.new_counts()
    packet_hystart = hystart_model(exp)
    write_draws = random.Random(1_000_003 * (exp.training.seed if seed is None else seed) + 13)
    writes = (lambda: write_draws.choice(write_latency)) if write_latency else None
    # an extension's strict priority on packets: its rank once every worker has ended n iterations
    # (``priority_plans``); before the first, the gateways are FIFO (rank None)
    plan_ranks = ({n: {owner: i for i, owner in enumerate(order)} for n, order in priority_plans or ()}
                  if packet_mode and isinstance(sim.policy, PriorityPolicy) else {})
    if packet_mode:
        packet_net = packets.PacketNet(sim, seed=1_000_003 * (exp.training.seed if seed is None else seed) + 11,
                                       host_rate=intra)
        for s, d, p in topo.directions():
            queue = default_queue_bytes(p, topo.rtt_ms(s, d))
            packet_net.add(links[(s, d)], queue, p.jitter_ms / 1000.0, p.loss)
            if isinstance(sim.policy, PriorityPolicy):  # the delay line's scheduler, in front of it
                per_class = (shared_class_queue_bytes(queue, D) if sim.policy.class_queue == "share"
                             else class_queue_bytes(p.rate_mbps, p.delay_ms / 1000.0))
                packet_net.prioritise(links[(s, d)], plan_ranks.get(0) if plan_ranks else sim.policy.rank,
                                      sim.policy.rate_factor, per_class,
                                      bucket_bytes(p.rate_mbps * 1e6 / 8 * sim.policy.rate_factor))
    hystart = tcp and hystart_model(exp)[0]
    flow_rtt: dict[int, float] = {}  # fid -> its path's round trip (WAN flows of the window model)
    hystart_exits: list[tuple[int, str]] = []  # (the window HyStart set ssthresh to, how), every channel

    def queued_ahead(path: list[Link], own=None) -> float:
        """Seconds a segment entering ``path`` now waits in its queues (HyStart's delay sample): at
        each link what its flows have put in flight and the link not yet served -- a message sent
        whole all it has left, a window-limited one what its window holds beyond its rate's
        round trip (``own``, the channel's flow, left out)."""
        delay = 0.0
        for link in path:
            sim.backlog(link)  # (brings the link's flows up to now)
            queued = 0.0
            for f in link.flows:
                if f is own:
                    continue
                if f.burst or f.fid not in flow_rtt:
                    queued += f.remaining
                else:
                    rtt_f = flow_rtt[f.fid]
                    queued += max(0.0, min(f.remaining, f.ceiling * rtt_f) - f.rate * rtt_f)
            delay += queued / link.bandwidth
        return delay

    def round_rate(path: list[Link], own=None) -> float:
        """The rate a round of a new flow on ``path`` leaves its bottleneck at: the link's
        bandwidth over the flows sending there (max-min's equal share)."""
        return min(link.bandwidth / (1 + sum(1 for f in link.flows if f is not own and f.rate > 0)) for link in path)
    # WAN messages sent whole in a window, in several rounds (``rounds``), larger ones shared
    # fairly; and (``rounds``) the segments the queues dropped
    counts = {"burst": 0, "rounds": 0, "bulk": 0, "lost": 0, "loss_recoveries": 0}
    in_flight: dict[int, float] = {}  # fid -> the bytes its channel's windows hold (sim.tail_loss)
    lossy: set[int] = set()  # fids in flight while their bottleneck overflowed (sim.tail_loss)
    routes_queue = {id(links[(s, d)]): default_queue_bytes(p, topo.rtt_ms(s, d)) for s, d, p in topo.directions()}
    window = exp.parallel.tcp_window_bytes or sim_spec.tcp_window_bytes

    def _late_if_overflowing(path: list[Link], rtt: float, window_bytes: float, arrived):
        """``arrived`` one tail-loss probe later if this message is in flight while its
        bottleneck overflows: the channels with a rate there hold more than its BDP + queue
        (checked as each message starts, which marks every message then in flight)."""
        link = min(path, key=lambda x: x.bandwidth)
        queue = routes_queue[id(link)]
        state: dict = {}

        def late(t):
            fid = state.get("fid")
            in_flight.pop(fid, None)
            if fid not in lossy:
                arrived(t)
                return
            lossy.discard(fid)
            srtt = rtt + queue / (link.bandwidth * share)  # the full queue's delay in every sample
            sim.at(t + 2 * srtt, lambda: arrived(sim.now))

        def started(flow):
            state["fid"] = flow.fid
            in_flight[flow.fid] = window_bytes
            rated = [f.fid for f in link.flows if f.rate > 0]
            if sum(in_flight.get(fid, 0.0) for fid in rated) * share > link.bandwidth * share * rtt + queue:
                lossy.update(rated)

        late.started = started
        return late

    def _late_if_lost(channel: dict, p: float, rtt: float, segments: int, arrived):
        """``arrived`` later by the recovery of a segment its connections lose at random
        (``sim.loss_model``; the path's loss ``p``, each of the channel's connections carrying a
        slice of ``segments``, drawn seeded), for a message its windows hold (sent in a flight or
        a few: a longer transfer's recoveries are in the loss-limited rate it is held to,
        ``loss_cap``, a long-run mean over many loss epochs): a lost segment that later ones of its slice
        follow is found by RACK (RFC 8985: their SACKs, plus a reordering window of a quarter
        round trip) and sent again, 1.25 round trips late; a lost last segment has none after
        it and waits for the probe or the timeout: RTO (RTT + 200 ms) late.  The slowest slice
        decides.  TCP hands the receiver its bytes in order, so a message of the same channel
        after a late one arrives no earlier than it (``channel["in_order"]``)."""
        extra = 0.0
        if p > 0 and segments > 0:
            hit = 1.0 - (1.0 - p) ** segments
            for _ in range(n_conn):
                if loss_draws.random() < hit:
                    last = loss_draws.random() < 1.0 / segments
                    extra = max(extra, rtt + RTO_MIN_S if last else 1.25 * rtt)
                    counts["loss_recoveries"] += 1
        if extra <= 0 and "in_order" not in channel:
            return arrived

        def late(t):
            due = max(t + extra, channel.get("in_order", t))
            if extra > 0:
                channel["in_order"] = max(channel.get("in_order", 0.0), due)
            if due > t:
                sim.at(due, lambda: arrived(sim.now))
            else:
                arrived(t)

        late.started = getattr(arrived, "started", None)
        return late

    def send(w: Worker, kind: str, mb: int, it: int, on_arrival) -> None:
        peer = by_key[(w.stage + 1 if kind == sch.SEND_ACT else w.stage - 1, w.replica)]
        start = sim.now

        def arrived(t, peer=peer, kind=kind):
            if overhead > 0:  # the transport's own per-message latency: the tensor is usable later
                sim.at(t + overhead, lambda: delivered(sim.now, peer, kind))
            else:
                delivered(t, peer, kind)

        def delivered(t, peer, kind):
            if record:
                peer.transfers.append(["xfer_act" if kind == sch.SEND_ACT else "xfer_grad", mb, start, t, act_bytes, it])
            on_arrival(t)

        if peer.dc == w.dc:
            sim.at(sim.now + act_bytes / intra, lambda: arrived(sim.now))
            return
        # one channel (a TCP connection set) carries its messages in order: a message queued
        # behind an earlier one of the same channel enters the network when that one has left
        path, ceiling, rtt, cap = routes[(w.dc, peer.dc)]
        channel = channels.get((w.name, kind))
        if channel is None:
            channel = channels[(w.name, kind)] = {"busy": False, "queue": [], "window": TcpWindow(
                rtt, n_conn, cap, exp.parallel.slow_start_after_idle, sim_spec.tcp_ssthresh_segments, hystart)}
            if packet_net is not None:
                channel["packets"] = packets.PacketChannel(
                    sim, packet_net, w.name, path, routes[(peer.dc, w.dc)][0], rtt, n_conn,
                    exp.parallel.slow_start_after_idle, packet_hystart[0], packet_counts, owner=f"r{w.replica}",
                    write_latency=writes)
            if rounds:
                channel["rounds"] = RoundsChannel(sim, path, routes[(peer.dc, w.dc)][0], ceiling, channel["window"],
                                                  n_conn, lambda link: routes_queue[id(link)], counts)

        whole = act_bytes <= n_conn * cap  # the channel's windows hold the message: a burst

        def go(channel=channel, path=path, ceiling=ceiling, arrived=arrived, owner=f"r{w.replica}", rtt=rtt,
               whole=whole):
            channel["busy"] = True
            win = channel["window"]
            if rounds:
                channel["rounds"].send(act_bytes, owner, arrived, on_free=lambda: left(channel))
                return
            if sim_spec.tail_loss:
                arrived = _late_if_overflowing(path, rtt, n_conn * window, arrived)
            p_loss = route_loss.get((w.dc, peer.dc), 0.0) if whole else 0.0
            if p_loss > 0 or "in_order" in channel:
                arrived = _late_if_lost(channel, p_loss, rtt, win.segments(act_bytes), arrived)
            if not tcp:
                # sent whole (FifoBurstPolicy serves it first-in first-out) if the channel's windows hold it
                flow = sim.transfer(path, act_bytes, ceiling, arrived, owner=owner, on_sent=lambda t: left(channel),
                                    burst=whole)
                counts["burst" if whole else "bulk"] += 1
                if sim_spec.tail_loss and flow is not None:
                    arrived.started(flow)
                return
            before = win.segs
            idle = None if win.last_sent is None else sim.now - win.last_sent
            win.begin(sim.now, act_bytes)
            if record:  # what the traced emulator run reports per slice (parallel.tcp_trace), per message
                window_trace.append({"sender": w.name, "kind": kind, "iteration": it, "microbatch": mb,
                                     "t": sim.now, "cwnd_before": before, "cwnd": win.segs,
                                     "idle_s": idle, "restarts": win.restarts})

            def cap(remaining: float) -> float:
                # a round whose window, less what the channel still has in flight, holds what is
                # left sends it at the link's rate (then the message is out); otherwise it follows
                # the acknowledgements: a full round's window spread over its round trip
                left = win.segments(remaining) - (0 if remaining >= act_bytes else win.HEADER_SEGMENTS)
                if left <= win.room(sim.now):
                    return ceiling
                return min(ceiling, win.rate())

            burst = win.segments(act_bytes) <= win.room(sim.now)  # the window as it is now holds all of it
            if hystart:
                # the first flight leaves at once, each connection's slice behind the one written
                # before it: the typical connection's first segment waits behind half its siblings'
                # (n - 1) slices and what the path's queues hold; its ACKs come a segment apart
                first = min(win.segments(act_bytes), win.room(sim.now))
                bottleneck = min(link.bandwidth for link in path)
                win.sample_round(queued_ahead(path) + (win.n - 1) / 2 * first * MSS / bottleneck,
                                 MSS / round_rate(path))
            counts["burst" if burst else "bulk"] += 1
            flow = sim.transfer(path, act_bytes, cap(act_bytes), arrived, owner=owner,
                                on_sent=lambda t: left(channel), burst=burst)
            channel["flow"], channel["sent"] = flow, 0.0
            if flow is not None:
                flow_rtt[flow.fid] = rtt
            if sim_spec.tail_loss and flow is not None:
                arrived.started(flow)

            def grow(flow=flow):  # slow start: the window doubles every round trip while the message is under way
                if channel.get("flow") is not flow or flow.remaining <= 0:
                    return
                sim.settle(flow)
                sent = act_bytes - flow.remaining  # what the message has sent so far
                grew = win.grow((sent - channel.get("sent", 0.0)) / win.n, sim.now)
                channel["sent"] = sent
                if hystart:  # the next round, ACK-clocked: the connections' segments interleave
                    win.sample_round(queued_ahead(flow.links, flow), win.n * MSS / round_rate(flow.links, flow))
                sim.set_ceiling(flow, cap(flow.remaining))
                if grew or flow.ceiling < ceiling:
                    sim.at(sim.now + win.rtt, grow)

            if flow is not None and flow.ceiling < ceiling:
                sim.at(sim.now + win.rtt, grow)

        if packet_net is not None:  # the transport's writes return at once: the kernel queues the bytes
            channel["packets"].send(act_bytes + packets.CODEC_HEADER_BYTES, arrived)
            counts["burst"] += 1
            return
        if channel["busy"]:
            channel["queue"].append(go)
        else:
            go()

    def left(channel: dict) -> None:
        channel["busy"] = False
        channel["flow"] = None
        if not rounds:  # (in rounds the window has accounted each round as it went)
            channel["window"].end(sim.now, act_bytes)
        if channel["queue"]:
            channel["queue"].pop(0)()

    stage_dcs = {}
    for slot in exp.workers():
        stage_dcs.setdefault(slot.stage, [])
        if slot.dc not in stage_dcs[slot.stage]:
            stage_dcs[slot.stage].append(slot.dc)

    def allreduce_time(stage: int) -> float:
        """Ring all-reduce: 2 (D-1)/D of the stage's gradients per rank.  Inside a DC at the
        intra-DC rate; across DCs (baseline d) at the ring's slowest WAN hop, shared by the
        P stages all-reducing at once, plus a one-way delay per ring step."""
        d = exp.parallel.replicas
        size = 2 * (d - 1) / d * params[stage] * sim_spec.dtype_bytes
        ring = stage_dcs[stage]
        if len(ring) == 1:
            return size / intra + sim_spec.allreduce_latency_s
        hops = [(a, b) for a, b in zip(ring, ring[1:] + ring[:1])]
        rate = min(links[(x, y)].bandwidth for a, b in hops for x, y in zip(topo.path(a, b), topo.path(a, b)[1:]))
        delay = max(topo.one_way_delay_ms(a, b) for a, b in hops) / 1000.0
        return size / (rate / exp.parallel.stages) + 2 * (d - 1) * delay + sim_spec.allreduce_latency_s

    job = PipelineJob(sim, workers, n_it, send, allreduce_time, record=record, dp_replicas=D,
                      start_offsets=start_offsets, seed=exp.training.seed if seed is None else seed,
                      iterations_ended=(lambda n: n in plan_ranks and packet_net.reorder(plan_ranks[n]))
                      if plan_ranks else None)
    job.start()
    sim.run()
    states = {}
    for w in workers:
        states[w.name] = WorkerRecord(w.name, w.stage, w.replica, w.dc, f"sim-{w.name}", "", "simulated",
                                      [Interval(*e) for e in w.events], [Transfer(*t) for t in w.transfers],
                                      w.iteration_end)
    note = f"simulated {n_it} iteration(s), {sim.events_processed} events"
    hystart_why = hystart_model(exp) if tcp or packet_net is not None else None
    if hystart:
        exits = [c["window"].hystart_exit for c in channels.values() if c["window"].hystart_exit]
        segs = sorted(e[0] for e in exits)
        note += (f"; HyStart ended slow start on {len(exits)} of {len(channels)} WAN channel(s)"
                 + (f" (ssthresh {segs[0]}-{segs[-1]} segments: {sum(e[1] == 'delay' for e in exits)} by delay, "
                    f"{sum(e[1] == 'train' for e in exits)} by ACK train)" if exits else ""))
    if fold_replicas:
        note += f"; {D} DP replicas folded into one (each WAN link's bandwidth / {D})"
    if packet_net is not None:
        c = packet_counts
        note += (f"; packets: {c['restarts']} restart(s) after idle, HyStart ended slow start {c['hystart_delay']} "
                 f"time(s) by delay and {c['hystart_train']} by ACK train, {packet_net.dropped} segment(s) dropped "
                 f"at full queues, {packet_net.scheduler_drops} at schedulers' queues and {packet_net.lost} at "
                 f"random, {c['retransmits']} retransmitted, {c['recoveries']} recoveries, {c['probes']} loss "
                 f"probe(s), {c['timeouts']} timeout(s) ({c['undos']} found spurious and undone)")
    if packet_net is not None and write_latency:
        note += (f"; each slice written a draw of {len(write_latency)} measured writer latencies later (median "
                 f"{statistics.median(write_latency) * 1000:.2f} ms)")
    if route_loss and any(route_loss.values()):
        note += (f"; {counts['loss_recoveries']} WAN slice(s) lost a segment at random and arrived late by its "
                 f"recovery (RACK or the timeout)")
    # the result's experiment says how many iterations were simulated (metrics.summarise reads it)
    ran = exp if n_it == exp.training.iterations else exp.with_iterations(n_it)
    if type(sim.policy) is FifoBurstPolicy:
        split = (f" ({counts['rounds']} of them a window at a time; {counts['lost']} segment(s) dropped at "
                 f"full queues)" if rounds else "")
        note += (f"; sharing fifo-bursts: {counts['burst'] + counts['rounds']} WAN message(s) served first-in "
                 f"first-out{split}, {counts['bulk']} shared max-min fairly")
    model = model_parts(exp, act_bytes, sim.policy, tcp_why, overhead,
                        {"burst": counts["burst"] + counts["rounds"], "bulk": counts["bulk"]}, hystart_why)
    return SimResult(ran, states, 0.0, [note], links=links, events_processed=sim.events_processed, folded=share,
                     model=model, windows=window_trace)


def packet_run(exp: Experiment, policy: SharingPolicy) -> bool:
    """Whether a run goes segment by segment (``packets``): ``sim.sharing: packets``, its own
    policy or an extension's strict priority (then the gateway's scheduler in the packet model)."""
    return type(policy) is PacketSharing or (exp.sim.sharing == "packets" and type(policy) is PriorityPolicy)


PACKETS_WHY = ("off: sim.sharing: packets runs every connection segment by segment (testbed/sim/packets.py), "
               "its window Linux's own")


def model_parts(exp: Experiment, message_bytes: float, policy: SharingPolicy, tcp: bool | tuple[bool, str],
                overhead: float, messages: dict[str, int] | None = None,
                hystart: tuple[bool, str] | None = None) -> dict:
    """Which parts of the model a run of ``exp`` uses, each with the run's figures and its
    validated range (``validity.report``, which also names the sharing model that ran): the
    fluid sharing (fair, or the policy given; under fifo-bursts, FIFO for the messages sent
    whole and fair sharing for the others, each where the run had such a message:
    ``messages`` counts them, else ``bursts_possible`` says) where a pipeline boundary crosses
    a WAN, the TCP models switched on, the loss model where a crossed path drops packets, the
    per-message latency where there is one, the WAN all-reduce where a stage spans DCs.
    ``tcp``: whether the window model ran, with why (``window_model``); the report carries
    both under ``tcp_window_model`` ({"on": ..., "why": ...}) whether or not a WAN is crossed;
    ``hystart``: with the window model, whether HyStart ran in it and why (``hystart_model``),
    carried under ``tcp_hystart``, and a part ``tcp_hystart`` where it ran on a WAN."""
    tcp, why = tcp if isinstance(tcp, tuple) else (tcp, "")
    boundary = validity.run_figures(exp, message_bytes, link_capacity(exp))
    parts: dict[str, validity.RunFigures] = {}
    if boundary.rtt_ms is not None:
        if type(policy) is FifoBurstPolicy:
            if messages is None:
                bursts = bursts_possible(exp, message_bytes)
                messages = {"burst": int(bursts), "bulk": int(not bursts)}
            if messages["burst"]:
                parts["fifo-bursts sharing"] = boundary
            if messages["bulk"] or not messages["burst"]:
                parts["fluid max-min sharing"] = boundary
        elif packet_run(exp, policy):
            parts["packet-level TCP"] = boundary
            if type(policy) is not PacketSharing:
                parts[f"sharing policy {policy.name}"] = boundary
        else:
            parts["fluid max-min sharing" if type(policy) is SharingPolicy else f"sharing policy {policy.name}"] = boundary
        if tcp:
            parts["tcp_window_model"] = boundary
            if hystart is not None and hystart[0]:
                parts["tcp_hystart"] = boundary
        if exp.sim.tail_loss:
            parts["tail_loss"] = boundary
        if exp.sim.loss_model and boundary.loss and boundary.loss[1] > 0 and not packet_run(exp, policy):
            parts["loss_model"] = boundary
        if overhead > 0:
            parts["message_overhead"] = boundary
    ring = validity.ring_figures(exp)
    if ring.rtt_ms is not None:
        parts["wan_allreduce"] = ring
    packet = packet_run(exp, policy)
    return validity.report(parts, sharing=policy.name, window=(tcp, why), hystart=hystart if tcp or packet else None)


def wan_utilization(result: SimResult) -> float:
    """Bytes carried over all WAN directions / (their capacity x the simulated time)."""
    end = max(max(w.iteration_end.values()) for w in result.workers.values())
    carried = sum(link.bytes_carried for link in result.links.values()) * result.folded
    capacity = sum(link.bandwidth for link in result.links.values()) * result.folded * end
    return carried / capacity if capacity else 0.0
