"""One pipeline-parallel worker: stage s of DP replica r, on one emulated host.

How it fits: ``testbed run`` (``testbed/run/runner.py``) starts one worker per (stage, replica)
inside its host's namespace (and CPU container, for a CPU device), with a JSON config
(``config.py``).  The worker opens its pipeline channels (``transport.py``; N TCP
connections across a DC boundary), joins its stage's DP group, reports ready, waits for the
go, then runs the schedule's op list (``testbed/spec/schedules.py``) every iteration,
all-reduces gradients inside its DC, steps the optimizer, and streams a timeline of typed
intervals to the orchestrator (``telemetry.py``) as it goes.

What an op does is the ``compute``'s business: ``TorchCompute`` (``torch_compute.py``)
runs the real model on a CPU or a GPU; ``EmulatedCompute`` (``emulated.py``, ``device:
emulated``) occupies an emulated device for a profiled duration and sends buffers of the
real tensors' size.  Everything else (channels, telemetry, waits, Atlas's offsets) is this
one loop, so the two kinds of worker cannot drift apart.

Timeline: intervals are contiguous on the shared monotonic clock (each starts where the
previous ended), so per iteration they add up to the worker's iteration time exactly.
Kinds: forward, backward, optimizer (the device is busy); recv (waiting for a peer),
send (handing a tensor to the transport), allreduce, idle (the device is free).

    python -m testbed.train.worker CONFIG.json
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
import traceback
from typing import Protocol

from testbed import messages as m
from testbed.net.sendturns import TurnClient
from testbed.train.config import SendTurns, WorkerConfig
from testbed.train.telemetry import Telemetry
from testbed.train.transport import Endpoint
from testbed.train.waitboard import WaitBoard, wait_id
from testbed.spec import schedules as sch

ACT, GRAD = 0, 1


class PeerSilent(RuntimeError):
    """A pipeline peer sent nothing for ``recv_timeout_s``; the orchestrator names the WAN
    link between the two."""

    def __init__(self, peer: str, what: str, seconds: float):
        super().__init__(f"no {what} from {peer} for {seconds:g} s")
        self.peer, self.seconds = peer, seconds


def _turn_client(turns: SendTurns | None, name: str, timeout_s: float) -> TurnClient | None:
    """A cross-DC channel's turns on the WAN, when the run takes them at the senders."""
    if turns is None:
        return None
    return TurnClient(turns.server, turns.pipeline, turns.links, turns.handover_bytes, turns.rate_bytes_s,
                      timeout_s=timeout_s, name=name, ceiling_bytes_s=turns.ceiling_bytes_s)


def _recv(channel, peer: str, what: str, timeout: float) -> bytearray:
    try:
        return channel.recv(timeout=timeout)
    except TimeoutError:
        raise PeerSilent(peer, what, timeout) from None


class Compute(Protocol):
    """What a worker's device does for each op of the schedule."""

    busy_kinds: tuple[str, ...]

    def start_iteration(self, it: int) -> None: ...
    def forward(self, it: int, mb: int) -> None: ...
    def backward(self, it: int, mb: int) -> None: ...
    def activation(self, mb: int) -> bytes | memoryview: ...  # to send to the next stage
    def gradient(self, mb: int) -> bytes | memoryview: ...  # to send to the previous stage
    def take_activation(self, mb: int, buf: bytearray, arrived: float) -> None: ...  # from the previous stage
    def take_gradient(self, mb: int, buf: bytearray, arrived: float) -> None: ...  # from the next stage
    def allreduce(self) -> None: ...
    def optimizer_step(self) -> float | None: ...  # the iteration's loss (last stage), or None
    def synchronize(self) -> None: ...  # the device's queued work is done (CUDA)
    def report(self) -> dict: ...  # extra figures for the orchestrator, once at the end
    def close(self) -> None: ...


def _announce(tel: Telemetry, board: WaitBoard | None, it: int, n: int) -> int:
    """A wait for a peer begins: say so (telemetry) and show it on the board, with one start."""
    now = time.monotonic()
    tel.send(m.Wait(it=it, n=n, t=now))
    if board is not None:
        board.show(wait_id(it, n), now)
    return n + 1


def run(cfg: WorkerConfig, compute_factory) -> None:
    me = cfg.worker
    stage, stages = me.stage, cfg.stages
    tel = Telemetry(cfg.telemetry, me.name)
    M = cfg.training["microbatches"]
    program = sch.ops(cfg.schedule, stage, stages, M, cfg.extra_warmup)

    # -- channels: connect outgoing first (the kernel completes handshakes), then accept
    transfers: list[m.Xfer] = []
    tlock = threading.Lock()

    def on_transfer(kind):
        def record(rec):
            with tlock:
                transfers.append(m.Xfer(kind, rec.seq % M, rec.start, rec.end, rec.nbytes, rec.seq // M))
        return record

    ep = Endpoint(me.name, me.ip, cfg.port)
    nxt, prv = cfg.next, cfg.prev
    act_out = grad_out = act_in = grad_in = None
    # transfers are recorded where they end: the receiver sees the last byte arrive
    traces: dict[str, list] = {}  # parallel.tcp_trace: per outgoing WAN channel, its connections' rows

    def trace(peer, what: str) -> list | None:
        if not (cfg.tcp_trace and peer.wan):
            return None
        return traces.setdefault(f"{what}:{peer.name}", [])

    if nxt:
        act_out = ep.connect(nxt.name, nxt.ip, cfg.port, ACT, nxt.connections, nxt.buf, window_bytes=nxt.window,
                             turns=_turn_client(cfg.turns_next, me.name, cfg.recv_timeout_s), pace=nxt.pace,
                             trace=trace(nxt, "act"))
    if prv:
        grad_out = ep.connect(prv.name, prv.ip, cfg.port, GRAD, prv.connections, prv.buf, window_bytes=prv.window,
                              turns=_turn_client(cfg.turns_prev, me.name, cfg.recv_timeout_s), pace=prv.pace,
                              trace=trace(prv, "grad"))
    if prv:
        act_in = ep.accept(prv.name, ACT, prv.connections, prv.buf, on_receive=on_transfer("xfer_act"),
                           window_bytes=prv.window)
    if nxt:
        grad_in = ep.accept(nxt.name, GRAD, nxt.connections, nxt.buf, on_receive=on_transfer("xfer_grad"),
                            window_bytes=nxt.window)
    compute: Compute = compute_factory(cfg, ep)  # it joins the stage's DP group

    tel.send(m.Ready())
    go = tel.receive()
    if not isinstance(go, m.Go):
        raise RuntimeError(f"the orchestrator sent {go.kind!r} before the go")
    # after the go the orchestrator may send a temporal plan (Atlas: this pipeline's start
    # offset) at any time, and finally the bye; a thread keeps the latest offset
    plan = {"offset_s": 0.0}
    bye = threading.Event()

    def listen() -> None:
        try:
            while True:
                msg = tel.receive()
                if isinstance(msg, m.StartOffset):
                    plan["offset_s"] = max(0.0, msg.offset_s)
                elif isinstance(msg, m.Bye):
                    break
        except (ConnectionError, OSError, ValueError):
            pass
        bye.set()

    threading.Thread(target=listen, daemon=True).start()

    events: list[m.Span] = []
    cursor = time.monotonic()
    busy = compute.busy_kinds

    def mark(kind: str, mb: int, it: int) -> None:
        nonlocal cursor
        if kind in busy:
            compute.synchronize()
        now = time.monotonic()
        events.append(m.Span(kind, mb, cursor, now, it))
        cursor = now

    def flush(it: int, **end) -> None:
        nonlocal events
        with tlock:
            xf, transfers[:] = list(transfers), []
        tel.send(m.Events(it=it, events=events, transfers=xf, **end))
        events = []

    announce = cfg.announce_waits  # BubbleTea: say when a wait for a peer begins
    board = WaitBoard(cfg.wait_board) if cfg.wait_board else None  # ... and show while it lasts
    for it in range(cfg.training["iterations"]):
        compute.start_iteration(it)
        waits = 0
        offset = plan["offset_s"] if stage == 0 else 0.0
        if offset > 0:  # Atlas's stagger: this pipeline enters the WAN after the ones before it
            time.sleep(offset)
            mark("idle", -1, it)
        for op in program:
            k, i = op.kind, op.mb
            if announce and k in (sch.RECV_ACT, sch.RECV_GRAD):
                waits = _announce(tel, board, it, waits)
            if k == sch.RECV_ACT:
                buf = _recv(act_in, prv.name, "activation", cfg.recv_timeout_s)
                if board is not None:
                    board.show(0)
                compute.take_activation(i, buf, act_in.last_arrival)
                mark("recv", i, it)
            elif k == sch.FORWARD:
                compute.forward(it, i)
                mark("forward", i, it)
            elif k == sch.SEND_ACT:
                act_out.send(compute.activation(i))
                mark("send", i, it)
            elif k == sch.RECV_GRAD:
                buf = _recv(grad_in, nxt.name, "gradient", cfg.recv_timeout_s)
                if board is not None:
                    board.show(0)
                compute.take_gradient(i, buf, grad_in.last_arrival)
                mark("recv", i, it)
            elif k == sch.BACKWARD:
                compute.backward(it, i)
                mark("backward", i, it)
            elif k == sch.SEND_GRAD:
                grad_out.send(compute.gradient(i))
                mark("send", i, it)
            if len(events) >= 8:
                flush(it)
        if cfg.replicas > 1:
            if announce:  # the all-reduce waits for the stage's other replicas: a bubble too
                waits = _announce(tel, board, it, waits)
            compute.allreduce()
            if board is not None:
                board.show(0)
            mark("allreduce", -1, it)
        loss = compute.optimizer_step()
        mark("optimizer", -1, it)
        flush(it, end=cursor, loss=loss, iteration_done=True)

    for ch in (act_out, grad_out):  # let the last sends leave before saying done
        if ch is not None:
            ch.flush()
    with tlock:
        tail = list(transfers)
    report = compute.report()
    if traces:  # each row named by its channel (kind:peer); the runner writes them out
        rows = [dict(r, channel=ch, mb=r["seq"] % M, it=r["seq"] // M) for ch, rs in traces.items() for r in rs]
        report = dict(report or {}, tcp_trace=sorted(rows, key=lambda r: r["t"]))
    tel.send(m.Done(transfers=tail, report=report))
    bye.wait()  # the orchestrator says when everyone is done (peers may still read)
    for ch in (act_out, grad_out, act_in, grad_in):
        if ch is not None:
            ch.close()
    compute.close()
    ep.close()


def main() -> int:
    cfg = WorkerConfig.load(sys.argv[1])
    try:
        module, _, name = cfg.compute.partition(":")  # the device kind chose it (testbed.run.devices)
        run(cfg, getattr(importlib.import_module(module), name))
    except Exception as exc:  # report, then fail: the orchestrator ends the run
        msg = f"{type(exc).__name__}: {exc}"
        try:
            tel = Telemetry(cfg.telemetry, cfg.worker.name)
            err = m.WorkerError(msg=msg, trace=traceback.format_exc()[-2000:])
            if isinstance(exc, PeerSilent):
                err.peer, err.silent_s = exc.peer, exc.seconds
            tel.send(err)
        except OSError:
            pass
        print(traceback.format_exc(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
