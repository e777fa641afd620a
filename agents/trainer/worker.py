"""One pipeline-parallel worker: stage s of DP replica r, on one emulated host.

How it fits: ``testbed run`` (``testbed/runner.py``) starts one worker per (stage, replica)
inside its host's namespace and CPU container, with a JSON config.  The worker builds its
stage of the model, opens its pipeline channels (``transport.py``; N TCP connections across
a DC boundary), joins its stage's DP group (torch.distributed: gloo, or NCCL on distinct
GPUs), reports ready, waits for the go, then runs the schedule's op list
(``testbed/schedules.py``) every iteration, all-reduces gradients inside its DC, steps the
optimizer, and streams a timeline of typed intervals to the orchestrator over a Unix
socket as it goes.

Timeline: intervals are contiguous on the shared monotonic clock (each starts where the
previous ended), so per iteration they add up to the worker's iteration time exactly.
Kinds: forward, backward, optimizer (the device is busy); recv (waiting for a peer),
send (handing a tensor to the transport), allreduce, idle (the device is free).

    python -m agents.trainer.worker CONFIG.json
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback

from agents.trainer.config import WorkerConfig

ACT, GRAD = 0, 1


class Telemetry:
    """JSON lines to and from the orchestrator over its Unix socket."""

    def __init__(self, path: str, worker: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self._file = self.sock.makefile("r")
        self._lock = threading.Lock()
        self.send({"type": "hello", "worker": worker, "pid": os.getpid()})

    def send(self, msg: dict) -> None:
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self.sock.sendall(data)

    def receive(self) -> dict:
        line = self._file.readline()
        if not line:
            raise ConnectionError("orchestrator closed the telemetry socket")
        return json.loads(line)


def run(cfg: WorkerConfig) -> None:
    import torch
    import torch.distributed as dist

    from agents.trainer.data import Corpus
    from agents.trainer.model import ModelConfig, build_model, loss_fn, stage_module
    from agents.trainer.transport import Endpoint
    from agents.trainer.waitboard import WaitBoard, wait_id
    from testbed import schedules as sch

    torch.set_num_threads(1)
    # transport threads wait for the GIL behind the compute thread: hand it over sooner
    # than the default 5 ms, or every received slice waits that long
    sys.setswitchinterval(0.0005)
    me = cfg.worker
    stage, replica, stages, replicas = me.stage, me.replica, cfg.stages, cfg.replicas
    tel = Telemetry(cfg.telemetry, me.name)
    device = torch.device(cfg.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)

    mcfg = ModelConfig(**cfg.model)
    tr = cfg.training
    model = stage_module(build_model(mcfg, tr["seed"]), stage, stages).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=tr["lr"], weight_decay=0.0)
    corpus = Corpus() if stage in (0, stages - 1) else None
    M, mb_size = tr["microbatches"], tr["microbatch_size"]
    program = sch.ops(cfg.schedule, stage, stages, M, cfg.extra_warmup)

    # -- channels: connect outgoing first (the kernel completes handshakes), then accept
    transfers: list[list] = []
    tlock = threading.Lock()

    def on_transfer(kind):
        def record(rec):
            with tlock:
                transfers.append([kind, rec.seq % M, rec.start, rec.end, rec.nbytes, rec.seq // M])
        return record

    ep = Endpoint(me.name, me.ip, cfg.port)
    nxt, prv = cfg.next, cfg.prev
    act_out = grad_out = act_in = grad_in = None
    # transfers are recorded where they end: the receiver sees the last byte arrive
    if nxt:
        act_out = ep.connect(nxt.name, nxt.ip, cfg.port, ACT, nxt.connections, nxt.buf)
    if prv:
        grad_out = ep.connect(prv.name, prv.ip, cfg.port, GRAD, prv.connections, prv.buf)
    if prv:
        act_in = ep.accept(prv.name, ACT, prv.connections, prv.buf, on_receive=on_transfer("xfer_act"))
    if nxt:
        grad_in = ep.accept(nxt.name, GRAD, nxt.connections, nxt.buf, on_receive=on_transfer("xfer_grad"))

    group = None
    if replicas > 1:
        dp = cfg.dp
        dist.init_process_group(dp.backend, init_method=f"tcp://{dp.master}:{dp.port}",
                                rank=replica, world_size=replicas)
        group = dist.group.WORLD

    tel.send({"type": "ready"})
    go = tel.receive()
    assert go["type"] == "go", go
    # after the go the orchestrator may send a temporal plan (Atlas: this pipeline's start
    # offset) at any time, and finally "bye"; a thread keeps the latest plan
    plan = {"offset_s": 0.0}
    bye = threading.Event()

    def listen() -> None:
        try:
            while True:
                msg = tel.receive()
                if msg.get("type") == "plan":
                    plan["offset_s"] = max(0.0, float(msg.get("offset_s", 0.0)))
                elif msg.get("type") == "bye":
                    break
        except (ConnectionError, OSError, ValueError):
            pass
        bye.set()

    threading.Thread(target=listen, daemon=True).start()

    events: list[list] = []
    cursor = time.monotonic()

    def mark(kind: str, mb: int, it: int) -> None:
        nonlocal cursor
        if cuda and kind in ("forward", "backward", "optimizer"):
            torch.cuda.synchronize(device)
        now = time.monotonic()
        events.append([kind, mb, cursor, now, it])
        cursor = now

    def flush(it: int, extra: dict | None = None) -> None:
        nonlocal events
        with tlock:
            xf, transfers[:] = list(transfers), []
        msg = {"type": "events", "it": it, "events": events, "transfers": xf}
        if extra:
            msg.update(extra)
        tel.send(msg)
        events = []

    announce = cfg.announce_waits  # BubbleTea: say when a wait for a peer begins
    board = WaitBoard(cfg.wait_board) if cfg.wait_board else None  # ... and show while it lasts
    for it in range(tr["iterations"]):
        inputs, outputs, losses = {}, {}, []
        waits = 0
        offset = plan["offset_s"] if stage == 0 else 0.0
        if offset > 0:  # Atlas's stagger: this pipeline enters the WAN after the ones before it
            time.sleep(offset)
            mark("idle", -1, it)
        for op in program:
            k, i = op.kind, op.mb
            if announce and k in (sch.RECV_ACT, sch.RECV_GRAD):
                tel.send({"type": "wait", "it": it, "n": waits, "t": time.monotonic()})
                if board is not None:
                    board.show(wait_id(it, waits))
                waits += 1
            if k == sch.RECV_ACT:
                x = act_in.recv(timeout=cfg.recv_timeout_s).to(device).requires_grad_(True)
                inputs[i] = x
                if board is not None:
                    board.show(0)
                mark("recv", i, it)
            elif k == sch.FORWARD:
                if stage == 0:
                    x, _ = corpus.batch(tr["seed"], it, replica, i, replicas, M, mb_size, mcfg.seq_len)
                    inputs[i] = x.to(device)
                out = model(inputs[i])
                if stage == stages - 1:
                    _, y = corpus.batch(tr["seed"], it, replica, i, replicas, M, mb_size, mcfg.seq_len)
                    out = loss_fn(out, y.to(device)) / (M * replicas)
                    losses.append(out.detach())
                outputs[i] = out
                mark("forward", i, it)
            elif k == sch.SEND_ACT:
                act_out.send(outputs[i].detach())
                mark("send", i, it)
            elif k == sch.RECV_GRAD:
                g = grad_in.recv(timeout=cfg.recv_timeout_s).to(device)
                outputs[i] = (outputs[i], g)
                if board is not None:
                    board.show(0)
                mark("recv", i, it)
            elif k == sch.BACKWARD:
                if stage == stages - 1:
                    outputs[i].backward()
                else:
                    out, g = outputs[i]
                    out.backward(g)
                outputs.pop(i)
                mark("backward", i, it)
            elif k == sch.SEND_GRAD:
                grad_out.send(inputs.pop(i).grad)
                mark("send", i, it)
            if len(events) >= 8:
                flush(it)
        if group is not None:
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
            mark("allreduce", -1, it)
        optim.step()
        optim.zero_grad(set_to_none=False)
        mark("optimizer", -1, it)
        loss = float(torch.stack(losses).sum()) if losses else None
        flush(it, {"end": cursor, "loss": loss, "iteration_done": True})

    for ch in (act_out, grad_out):  # let the last sends leave before saying done
        if ch is not None:
            ch.flush()
    with tlock:
        tail = list(transfers)
    tel.send({"type": "done", "transfers": tail})
    bye.wait()  # the orchestrator says when everyone is done (peers may still read)
    for ch in (act_out, grad_out, act_in, grad_in):
        if ch is not None:
            ch.close()
    ep.close()
    if group is not None:
        dist.destroy_process_group()


def main() -> int:
    cfg = WorkerConfig.load(sys.argv[1])
    try:
        run(cfg)
    except Exception as exc:  # report, then fail: the orchestrator ends the run
        msg = f"{type(exc).__name__}: {exc}"
        try:
            tel = Telemetry(cfg.telemetry, cfg.worker.name)
            tel.send({"type": "error", "msg": msg, "trace": traceback.format_exc()[-2000:]})
        except OSError:
            pass
        print(traceback.format_exc(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
