"""A decode worker: receives KV caches over the network and generates the tokens asked for.

How it fits: ``testbed run`` starts one per DC on a host that training does not use (prefill
and decode disaggregated, as in Splitwise/DistServe).  Prefill servers connect over TCP
through the emulated network and send ``server.KV_HEADER`` (request id, output tokens,
prompt tokens, cache bytes) then the cache; the worker acknowledges the whole cache with
one byte, generates greedily (the caches that have arrived decode together as one batch,
up to ``max_batch``), and reports each completed request to the controller (Unix datagram)
with the time each of its tokens came out (the time between tokens).  Once it listens it
tells the controller (``decode_ready``); training starts only then, so no cache meets a
worker still loading its model.

The decoding is a backend's business: ``_TorchDecode`` runs the real model
(``inference.decode_batch``); ``_EmulatedDecode`` (``device: emulated``) occupies the
worker's own emulated device for the profiled set-up and step times of the batch
(``timing.py``) and imports no torch.

Failures are reported, never swallowed: a batch that raises is reported as
``DecodeError`` (``messages.py``: rids, error; the controller rejects those requests with
the reason) and the worker goes on; a cache that cannot be read is not acknowledged (its
prefill server reports the transfer failed); if the decoding thread itself dies, the
process exits (code 70), which the run's extension sees and logs.

    python -m agents.bubbletea.decode CONFIG.json
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
import traceback

from agents.bubbletea import messages as bt
from agents.bubbletea.config import DecodeConfig
from agents.bubbletea.server import KV_HEADER
from testbed import messages as m


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:], min(1 << 20, n - got))
        if not k:
            raise ConnectionError("peer closed")
        got += k
    return bytes(buf)


class _TorchDecode:
    def __init__(self, cfg: DecodeConfig):
        import torch

        from agents.bubbletea import inference

        torch.set_num_threads(1)
        self.inf = inference
        m = cfg.model
        self.model = inference.load_model(m.layers, m.hidden, m.heads, m.max_context, m.seed)

    def decode(self, batch: list[tuple]) -> list[tuple[int, list[float]]]:
        """(tokens generated, monotonic time of each token after the first) per request."""
        caches = [self.inf.unpack(blob) for _rid, _steps, _prompt, blob, _received in batch]
        times: list[float] = []
        out = self.inf.decode_batch(self.model, caches, [steps for _rid, steps, *_ in batch], times)
        return [(len(tokens), times[:len(tokens) - 1]) for tokens in out]


class _EmulatedDecode:
    """The batch occupies this worker's emulated device: its set-up, then one step per token,
    as ``decode_batch`` runs (the batch padded to its longest cache, every row to the end)."""

    def __init__(self, cfg: DecodeConfig):
        from agents.bubbletea.timing import ServingTimes
        from testbed.train.device import EmulatedDevice

        self.times = ServingTimes.load(cfg.serving_profile, cfg.speedup)
        self.device = EmulatedDevice(cfg.device_file)
        self.limit = cfg.model.max_context

    def decode(self, batch: list[tuple]) -> list[tuple[int, list[float]]]:
        size = len(batch)
        longest = max(prompt for _rid, _steps, prompt, _blob, _received in batch)
        steps = [max(0, min(want - 1, self.limit - prompt)) for _rid, want, prompt, _blob, _received in batch]
        self.device.run(self.times.decode_setup_s(size, longest))
        times: list[list[float]] = [[] for _ in batch]
        for k in range(max(steps, default=0)):
            _start, end = self.device.run(self.times.decode_step_s(size, longest + k))
            for j, n in enumerate(steps):
                if k < n:
                    times[j].append(end)
        return [(1 + n, t) for n, t in zip(steps, times)]


def run(cfg: DecodeConfig) -> None:
    backend = _EmulatedDecode(cfg) if cfg.device_file else _TorchDecode(cfg)
    report = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    work: queue.Queue = queue.Queue()

    def tell(msg: m.Message) -> None:
        try:
            report.sendto(m.encode(msg), cfg.controller)
        except OSError:
            pass

    def serve(conn: socket.socket) -> None:
        rid = None
        with conn:
            try:
                rid, steps, prompt, size = KV_HEADER.unpack(_recv_exact(conn, KV_HEADER.size))
                blob = _recv_exact(conn, size)
                conn.sendall(b"k")
            except (OSError, ConnectionError) as exc:  # not acknowledged: the server reports it too
                tell(bt.DecodeError(decoder=cfg.name, rids=[] if rid is None else [rid],
                                    error=f"receiving a cache: {type(exc).__name__}: {exc}"))
                return
            work.put((rid, steps, prompt, blob, time.monotonic()))

    def decoder() -> None:  # batches what has arrived: one forward per step for all of it
        while True:
            batch = [work.get()]
            while len(batch) < cfg.max_batch:
                try:
                    batch.append(work.get_nowait())
                except queue.Empty:
                    break
            try:
                results = backend.decode(batch)
            except Exception as exc:  # this batch's requests fail with the reason; the worker goes on
                tell(bt.DecodeError(decoder=cfg.name, rids=[b[0] for b in batch], error=f"{type(exc).__name__}: {exc}"))
                print(traceback.format_exc(), file=sys.stderr, flush=True)
                continue
            done = time.monotonic()
            off = cfg.clock_offset_s  # instants in messages are on the run's clock
            for (rid, _steps, _prompt, _blob, received), (tokens, token_times) in zip(batch, results):
                tell(bt.Decoded(decoder=cfg.name, rid=rid, tokens=tokens, received=received - off, done=done - off,
                                token_times=[t - off for t in token_times]))

    def guarded() -> None:
        try:
            decoder()
        except BaseException:  # never a silent death: the process ends and the run says so
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            os._exit(70)

    threading.Thread(target=guarded, daemon=True).start()
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((cfg.ip, cfg.port))
    server.listen(64)
    ready = m.encode(bt.DecodeReady(decoder=cfg.name))
    for _ in range(600):  # the controller starts after the decode workers: it may not be bound yet
        try:
            report.sendto(ready, cfg.controller)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.1)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def main() -> int:
    run(DecodeConfig.load(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
