"""The prefill server beside one training worker: prefill in its bubbles, on the worker's device.

How it fits: ``testbed run`` starts one server per training worker, on the worker's host
(its network namespace).  The BubbleTea controller sends it prefill jobs with a deadline
(the predicted bubble's end less a margin, then later ends the wait reached before).  It runs
the prompt chunk by chunk (a bubble's last chunk cut to what fits, down to a quarter chunk)
and stops at the first chunk boundary where the worker's wait board
(``testbed/train/waitboard.py``) shows that the wait it was sent for is over, or where the
next chunk would pass the deadline and the wait is not seen to outlast it (then the next
deadline holds); the request's cache stays here and the next job for it continues.  Jobs
sent *ahead* of a wait (the server was idle outside a bubble) wait on the board's doorbell
and start when the wait begins, their deadlines counted from its start: no round trip
through the controller between the bubble's start and the first chunk; a wait already past,
or not begun within an iteration, hands them back untouched.  When the prompt
is done it ships the KV cache over TCP through the emulated network to its DC's decode
worker (in the background, but only inside a bubble), and reports it prefilled once the
decode worker has acknowledged the whole cache.

What a chunk runs on is the backend's business, and the loop above is the same for both:

* ``_TorchPrefill`` (CPU containers, GPUs): the real model of ``inference.py``, in an
  idle-priority child cgroup of the worker's CPU container (``cpu.idle = 1``): it competes
  only with its own training stage, as a second stream on a shared GPU would; on a GPU
  (``device: cuda``) on the worker's own GPU, a chunk timed to its end (``synchronize``).  The next
  chunk is judged by the slow end of the recent chunks' times (under a CPU quota a chunk's
  wall time varies several-fold).
* ``_EmulatedPrefill`` (``device: emulated``): each chunk occupies the worker's emulated
  device (``testbed/train/device.py``: the stream the worker's own ops queue on) for its
  profiled time (``timing.py``), so a chunk still running when training issues its next op
  delays that op exactly as on a GPU; the KV cache it ships has the real cache's size.
  It imports no torch.

    python -m agents.bubbletea.server CONFIG.json

Messages (Unix datagrams, typed: ``messages.py``) in: ``Prefill`` (jobs ``{rid, tokens,
output_tokens}``, deadlines, chunk, wait, decode: [ip, port]; the jobs run in order, with no
round trip between them, until the deadline), ``Drop``, ``Drain`` (training is over: ship
what is prefilled at once), ``Stop``.  Out, to the controller: ``ServerReady`` (profile:
[[tokens, seconds], ..]), per job ``Progress`` (rid, done, total, intervals: ``Chunk`` items
{start, end, tokens}, last: the server is free again), ``Prefilled`` (rid, kv_bytes,
kv_send_s, first_token, at), ``KvFailed`` (rid, error: the KV transfer failed).
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import sys
import threading
import time
from collections import deque
from dataclasses import replace

from agents.bubbletea import messages as bt
from agents.bubbletea.config import ServerConfig
from testbed import messages as m

_KV_GUARD_S = 0.002  # no KV transfer starts this close to a bubble's end
KV_HEADER = struct.Struct("!QQQQ")  # request id, output tokens, prompt tokens, cache bytes


def send_kv(decode: list, rid: int, output_tokens: int, prompt_tokens: int, blob) -> float:
    """Ship one cache; returns the seconds it took.  Raises ConnectionError unless the decode
    worker acknowledged the whole cache."""
    t0 = time.monotonic()
    with socket.create_connection((decode[0], int(decode[1])), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(KV_HEADER.pack(rid, output_tokens, prompt_tokens, len(blob)))
        s.sendall(blob)
        if s.recv(1) != b"k":
            raise ConnectionError("the decode worker closed the connection without acknowledging the cache")
    return time.monotonic() - t0


class _Prompt:
    """A prompt part-way through prefill (the emulated backend's state: no tensors)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0


class _TorchPrefill:
    """The real model, on the worker's CPU quota (or GPU)."""

    def __init__(self, cfg: ServerConfig):
        import torch

        from agents.bubbletea import inference

        torch.set_num_threads(1)
        self.inf = inference
        self.dev = torch.device(cfg.device)
        self._sync = (lambda: torch.cuda.synchronize(self.dev)) if self.dev.type == "cuda" else (lambda: None)
        m = cfg.model
        self.model = inference.load_model(m.layers, m.hidden, m.heads, m.max_context, m.seed).to(self.dev)
        self.max_context = m.max_context
        self.calibrate_lengths = cfg.calibrate
        self.recent: deque = deque(maxlen=32)  # seconds per token of recent chunks

    def calibrate(self) -> list[list[float]]:
        profile = []
        for n in self.calibrate_lengths:
            n = min(n, self.max_context)
            state = self.inf.PrefillState(self.inf.prompt_tokens(10**6 + n, n).to(self.dev))
            t0 = time.monotonic()
            self.inf.prefill_chunk(self.model, state, n)
            self._sync()
            profile.append([n, time.monotonic() - t0])
        self.recent.append(max(1e-5, profile[-1][1] / profile[-1][0]))
        return profile

    def new(self, rid: int, tokens: int):
        return self.inf.PrefillState(self.inf.prompt_tokens(rid, tokens).to(self.dev))

    @staticmethod
    def progress(state) -> tuple[int, int]:
        return state.done, int(state.tokens.shape[1])

    def chunk_s(self, state, n: int) -> float:
        """The next chunk's time, judged by the slow end of the recent ones (a chunk's wall time
        varies several-fold when the quota runs out mid-chunk)."""
        return n * sorted(self.recent)[int(0.9 * (len(self.recent) - 1))]

    def run_chunk(self, state, n: int) -> tuple[float, float, int]:
        t0 = time.monotonic()
        ran = self.inf.prefill_chunk(self.model, state, n)
        self._sync()
        t1 = time.monotonic()
        self.recent.append((t1 - t0) / max(1, ran))
        return t0, t1, ran

    @staticmethod
    def first_token(state) -> int:
        return int(state.logits.argmax(-1))

    def cache(self, state) -> bytes:
        return self.inf.pack(state)


class _EmulatedPrefill:
    """The worker's emulated device, for the profiled time of each chunk; no model."""

    def __init__(self, cfg: ServerConfig):
        from agents.bubbletea.timing import ServingTimes
        from testbed.train.device import EmulatedDevice

        self.times = ServingTimes.load(cfg.serving_profile, cfg.speedup)
        self.device = EmulatedDevice(cfg.device_file)
        self.max_context = cfg.model.max_context
        self.calibrate_lengths = cfg.calibrate
        self._zeros = memoryview(bytes(self.times.kv_bytes(self.max_context)))

    def calibrate(self) -> list[list[float]]:
        return [[n, self.times.chunk_s(min(n, self.max_context), 0)] for n in self.calibrate_lengths]

    @staticmethod
    def new(rid: int, tokens: int) -> _Prompt:
        return _Prompt(tokens)

    @staticmethod
    def progress(state: _Prompt) -> tuple[int, int]:
        return state.done, state.total

    def chunk_s(self, state: _Prompt, n: int) -> float:
        return self.times.chunk_s(n, state.done)

    def run_chunk(self, state: _Prompt, n: int) -> tuple[float, float, int]:
        n = min(n, state.total - state.done)
        start, end = self.device.run(self.times.chunk_s(n, state.done))  # queued behind what the device runs
        state.done += n
        return start, end, n

    @staticmethod
    def first_token(state: _Prompt) -> None:
        return None

    def cache(self, state: _Prompt) -> memoryview:
        return self._zeros[:self.times.kv_bytes(state.total)]


def _fitting(backend, state, n: int, room_s: float) -> int:
    """The chunk to run with ``room_s`` left: ``n`` tokens, or the last chunk of a bubble cut to
    what fits (halving, down to a quarter of ``n``); 0 when none does."""
    least = max(1, n // 4)
    while n >= least:
        if backend.chunk_s(state, n) <= room_s:
            return n
        n //= 2
    return 0


def run(cfg: ServerConfig) -> None:
    from testbed.train.waitboard import WaitBoard

    backend = _EmulatedPrefill(cfg) if cfg.device_file else _TorchPrefill(cfg)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if os.path.exists(cfg.listen):
        os.unlink(cfg.listen)
    sock.bind(cfg.listen)
    controller = cfg.controller
    off = cfg.clock_offset_s  # instants in messages are on the run's clock: this machine's less this

    def tell(msg: m.Message) -> None:
        try:
            sock.sendto(m.encode(msg), controller)
        except OSError:
            pass  # the controller is gone: nothing more will come

    # prefill time against prompt length, on this device
    ready = bt.ServerReady(worker=cfg.worker, profile=backend.calibrate())
    for _ in range(600):  # the controller may still be binding its socket
        try:
            sock.sendto(m.encode(ready), controller)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.1)
    states: dict = {}
    outbox: queue.Queue = queue.Queue()

    # KV caches leave in the background (the next prefill need not wait), but only inside a
    # bubble: packing and sending draw on the worker's quota, and a send started as the
    # bubble ends would leave the training op that follows a spent CFS period
    gate = threading.Condition()
    bubble = {"deadline": 0.0, "drain": False}
    board = WaitBoard(cfg.wait_board) if cfg.wait_board else None

    def in_bubble() -> bool:
        return bubble["drain"] or (time.monotonic() < bubble["deadline"] - _KV_GUARD_S
                                   and (board is None or board.read() != 0))

    def ship() -> None:
        while True:
            rid, decode, output_tokens, first, state, finished = outbox.get()
            with gate:
                gate.wait_for(in_bubble)
            try:
                blob = backend.cache(state)
                sent = send_kv(decode, rid, output_tokens, backend.progress(state)[1], blob)
            except (OSError, ConnectionError) as exc:
                tell(bt.KvFailed(worker=cfg.worker, rid=rid, error=f"{type(exc).__name__}: {exc}"))
                continue
            tell(bt.Prefilled(worker=cfg.worker, rid=rid, kv_bytes=len(blob), kv_send_s=sent, first_token=first,
                              at=finished - off))

    for _ in range(cfg.kv_senders):  # a cache takes a few round trips: several at once
        threading.Thread(target=ship, daemon=True).start()
    while True:
        msg = m.decode(sock.recv(65536), expect=(bt.Prefill, bt.Drop, bt.Drain, bt.Stop))
        if isinstance(msg, bt.Stop):
            return
        if isinstance(msg, bt.Drop):
            states.pop(msg.rid, None)
            continue
        if isinstance(msg, bt.Drain):
            with gate:
                bubble["drain"] = True
                gate.notify_all()
            continue
        if msg.lengths is not None:  # sent ahead: start when the wait does (the board's doorbell)
            began = board.await_wait(msg.wait, msg.give_up + off, also=sock.fileno()) if board is not None else "timeout"
            if isinstance(began, str):  # passed, not in time, or a message came: hand the jobs back
                for i, job in enumerate(msg.jobs):
                    state = states.get(job.rid)
                    done, total = backend.progress(state) if state is not None else (0, job.tokens)
                    tell(bt.Progress(worker=cfg.worker, rid=job.rid, done=done, total=total, intervals=[],
                                     last=i == len(msg.jobs) - 1, handed_back=began))
                continue
            deadlines = [began + x for x in msg.lengths]
        else:
            deadlines = [d + off for d in msg.deadlines]  # on this machine's clock
        deadline = deadlines.pop(0)
        with gate:
            bubble["deadline"] = deadline
            gate.notify_all()
        chunk = msg.chunk
        wait = msg.wait
        stopped = False
        jobs = msg.jobs
        for i, job in enumerate(jobs):  # in order, until the deadline; the last report says so
            rid = job.rid
            state = states.get(rid)
            intervals: list[bt.Chunk] = []
            if state is None and not stopped:
                state = states[rid] = backend.new(rid, job.tokens)
            while state is not None and not stopped:
                done, total = backend.progress(state)
                if done >= total:
                    break
                if board is not None and wait is not None and board.read() != wait:
                    stopped = True  # the wait is over earlier than predicted: training runs now
                    break
                n = _fitting(backend, state, min(chunk, total - done), deadline - time.monotonic())
                while not n and deadlines and (board is None or wait is None or board.read() == wait):
                    deadline = deadlines.pop(0)  # it outlasted the shortest: the next it lasted before
                    with gate:
                        bubble["deadline"] = deadline
                        gate.notify_all()
                    n = _fitting(backend, state, min(chunk, total - done), deadline - time.monotonic())
                if not n:
                    stopped = True  # the next chunk would overrun the bubble: stop at this boundary
                    break
                intervals.append(bt.Chunk(*backend.run_chunk(state, n)))
            done, total = backend.progress(state) if state is not None else (0, job.tokens)
            tell(bt.Progress(worker=cfg.worker, rid=rid, done=done, total=total,
                             intervals=[replace(c, start=c.start - off, end=c.end - off) for c in intervals],
                             last=i == len(jobs) - 1))
            if state is not None and done == total:
                finished = intervals[-1].end if intervals else time.monotonic()  # the first token exists now
                states.pop(rid)
                outbox.put((rid, msg.decode, job.output_tokens, backend.first_token(state), state, finished))


def main() -> int:
    run(ServerConfig.load(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
