"""The prefill server beside one training worker: prefill in its bubbles, at idle priority.

How it fits: ``testbed run`` starts one server per training worker, on the worker's host
(its network namespace) and inside the worker's CPU container, in a child cgroup with
``cpu.idle = 1``: it competes only with its own training stage (as a second stream on a
shared GPU would), and the kernel runs it only when the worker leaves the quota unused.
The BubbleTea controller sends it prefill jobs with a deadline (the predicted bubble's end
less a margin).  It runs the prompt chunk by chunk and stops at the first chunk boundary
where the next chunk, at its measured speed, would pass the deadline, or where the
worker's wait board (``agents/trainer/waitboard.py``) shows that the wait it was sent for is
over; the request's cache stays here and the next job for it continues.  When the prompt
is done it ships the KV cache over TCP through the emulated network to its DC's decode
worker (in the background, but only inside a bubble), and reports.

    python -m agents.bubbletea.server CONFIG.json

Messages (Unix datagrams, JSON) in: ``{"type": "prefill", "jobs": [{"rid", "tokens",
"output_tokens"}, ..], "deadline", "chunk", "decode": [ip, port]}`` (the jobs run in order,
with no round trip between them, until the deadline), ``{"type": "drop", "rid"}``,
``{"type": "stop"}``.  Out, to the controller: ``{"type": "ready", "profile": [[tokens,
seconds], ..]}``, per job ``{"type": "progress", "rid", "done", "total", "intervals":
[[start, end, tokens], ..], "last"}`` (``last``: the server is free again),
``{"type": "prefilled", "rid", "kv_bytes", "kv_send_s", "first_token"}``, ``{"type": "error", ..}``.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import struct
import sys
import threading
import time
from collections import deque

from agents.bubbletea.config import ServerConfig


_KV_GUARD_S = 0.002  # no KV transfer starts this close to a bubble's end


def _send_kv(decode: list, rid: int, output_tokens: int, blob: bytes) -> float:
    t0 = time.monotonic()
    with socket.create_connection((decode[0], int(decode[1])), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(struct.pack("!QQQ", rid, output_tokens, len(blob)) + blob)
        s.recv(1)  # the decode worker acknowledges the whole cache
    return time.monotonic() - t0


def run(cfg: ServerConfig) -> None:
    import torch

    from agents.bubbletea.inference import PrefillState, load_model, pack, prefill_chunk, prompt_tokens
    from agents.trainer.waitboard import WaitBoard

    torch.set_num_threads(1)
    m = cfg.model
    model = load_model(m.layers, m.hidden, m.heads, m.max_context, m.seed)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if os.path.exists(cfg.listen):
        os.unlink(cfg.listen)
    sock.bind(cfg.listen)
    controller = cfg.controller

    def tell(msg: dict) -> None:
        try:
            sock.sendto(json.dumps(dict(msg, worker=cfg.worker)).encode(), controller)
        except OSError:
            pass  # the controller is gone: nothing more will come

    # calibrate: prefill time against prompt length, on this worker's device
    profile = []
    for n in cfg.calibrate:
        n = min(n, m.max_context)
        state = PrefillState(prompt_tokens(10**6 + n, n))
        t0 = time.monotonic()
        prefill_chunk(model, state, n)
        profile.append([n, time.monotonic() - t0])
    tell({"type": "ready", "profile": profile})
    states: dict[int, PrefillState] = {}
    outbox: queue.Queue = queue.Queue()

    # KV caches leave in the background (the next prefill need not wait), but only inside a
    # bubble: packing and sending draw on the worker's quota, and a send started as the
    # bubble ends would leave the training op that follows a spent CFS period
    gate = threading.Condition()
    bubble = {"deadline": 0.0}

    board = WaitBoard(cfg.wait_board) if cfg.wait_board else None

    def in_bubble() -> bool:
        return time.monotonic() < bubble["deadline"] - _KV_GUARD_S and (board is None or board.read() != 0)

    def ship() -> None:
        while True:
            rid, decode, output_tokens, first, state, finished = outbox.get()
            with gate:
                gate.wait_for(in_bubble)
            blob = pack(state)
            try:
                sent = _send_kv(decode, rid, output_tokens, blob)
            except OSError as exc:
                tell({"type": "error", "rid": rid, "error": f"KV transfer failed: {exc}"})
                continue
            tell({"type": "prefilled", "rid": rid, "kv_bytes": len(blob), "kv_send_s": sent, "first_token": first,
                  "at": finished})

    for _ in range(cfg.kv_senders):  # a cache takes a few WAN round trips: several at once
        threading.Thread(target=ship, daemon=True).start()
    # a chunk's wall time varies several-fold (the quota runs out mid-chunk and the kernel
    # throttles at tick granularity): judge the next chunk by the slow end of the recent ones
    recent = deque([max(1e-5, profile[-1][1] / profile[-1][0])], maxlen=32)
    while True:
        data = sock.recv(65536)
        msg = json.loads(data)
        kind = msg.get("type")
        if kind == "stop":
            return
        if kind == "drop":
            states.pop(msg["rid"], None)
            continue
        if kind != "prefill":
            continue
        with gate:
            bubble["deadline"] = msg["deadline"]
            gate.notify_all()
        chunk = int(msg.get("chunk", 64))
        stopped = False
        jobs = msg["jobs"]
        for i, job in enumerate(jobs):  # in order, until the deadline; the last report says so
            rid = job["rid"]
            state = states.get(rid)
            intervals = []
            if state is None and not stopped:
                state = states[rid] = PrefillState(prompt_tokens(rid, job["tokens"]))
            while state is not None and not stopped and state.done < state.tokens.shape[1]:
                n = min(chunk, state.tokens.shape[1] - state.done)
                per_token = sorted(recent)[int(0.9 * (len(recent) - 1))]
                if time.monotonic() + n * per_token > msg["deadline"]:
                    stopped = True  # the next chunk would overrun the bubble: stop at this boundary
                    break
                if board is not None and "wait" in msg and board.read() != msg["wait"]:
                    stopped = True  # the wait is over earlier than predicted: training runs now
                    break
                t0 = time.monotonic()
                ran = prefill_chunk(model, state, n)
                t1 = time.monotonic()
                intervals.append([t0, t1, ran])
                recent.append((t1 - t0) / ran)
            done = state.done if state is not None else 0
            total = int(state.tokens.shape[1]) if state is not None else job["tokens"]
            tell({"type": "progress", "rid": rid, "done": done, "total": total, "intervals": intervals,
                  "last": i == len(jobs) - 1})
            if state is not None and state.done == total:
                finished = intervals[-1][1] if intervals else time.monotonic()  # the first token exists now
                states.pop(rid)
                outbox.put((rid, msg["decode"], job["output_tokens"], int(state.logits.argmax(-1)), state,
                            finished))


def main() -> int:
    run(ServerConfig.load(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
