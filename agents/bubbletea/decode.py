"""A decode worker: receives KV caches over the network and generates the tokens asked for.

How it fits: ``testbed run`` starts one on a host of the decode DC that training does not
use (prefill and decode disaggregated, as in Splitwise/DistServe).  Prefill servers connect
over TCP through the emulated WAN and send ``!QQQ`` (request id, output tokens, cache bytes)
then the cache; the worker acknowledges with one byte, generates greedily (the caches that
have arrived decode together as one batch, up to ``max_batch``), and reports each completed
request to the controller (Unix datagram).

    python -m agents.bubbletea.decode CONFIG.json
"""

from __future__ import annotations

import json
import queue
import socket
import struct
import sys
import threading
import time

from agents.bubbletea.config import DecodeConfig


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def run(cfg: DecodeConfig) -> None:
    import torch

    from agents.bubbletea.inference import decode_batch, load_model, unpack

    torch.set_num_threads(1)
    m = cfg.model
    model = load_model(m.layers, m.hidden, m.heads, m.max_context, m.seed)
    report = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    work: queue.Queue = queue.Queue()

    def tell(msg: dict) -> None:
        try:
            report.sendto(json.dumps(msg).encode(), cfg.controller)
        except OSError:
            pass

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                rid, steps, size = struct.unpack("!QQQ", _recv_exact(conn, 24))
                blob = _recv_exact(conn, size)
                conn.sendall(b"k")
            except (OSError, ConnectionError, struct.error) as exc:
                tell({"type": "decode_error", "error": str(exc)})
                return
            work.put((rid, steps, blob, time.monotonic()))

    def decoder() -> None:  # batches what has arrived: one forward per step for all of it
        while True:
            batch = [work.get()]
            while len(batch) < cfg.max_batch:
                try:
                    batch.append(work.get_nowait())
                except queue.Empty:
                    break
            caches = [unpack(blob) for _rid, _steps, blob, _received in batch]
            tokens = decode_batch(model, caches, [steps for _rid, steps, _blob, _received in batch])
            done = time.monotonic()
            for (rid, _steps, _blob, received), out in zip(batch, tokens):
                tell({"type": "decoded", "rid": rid, "tokens": len(out), "received": received, "done": done})

    threading.Thread(target=decoder, daemon=True).start()
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((cfg.ip, cfg.port))
    server.listen(64)
    tell({"type": "decode_ready"})
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def main() -> int:
    run(DecodeConfig.load(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
