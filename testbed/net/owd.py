"""One-way delay probe: UDP datagrams (or TCP messages) stamped with the shared monotonic clock.

How it fits: every emulated host is a network namespace on one kernel, so all of them
read the same CLOCK_MONOTONIC.  ``send`` stamps each datagram with its send time;
``recv`` subtracts it from the arrival time, which measures each direction of a WAN link
on its own (ping only sees the sum of both).  ``fidelity.one_way_delays`` drives it.
The ``msg-`` pair does the same for TCP messages of SIZE bytes, from the first byte handed
to the socket to the last byte read (``fidelity.message_delays``): what a pipeline stage's
activation takes, serialisation at the link's rate included.

    python -m testbed.net.owd recv PORT COUNT TIMEOUT_S [IDLE_S]   -> prints "delay_ms seq" per datagram, in arrival order
                                   (TIMEOUT_S for the first; after it, IDLE_S without one ends it)
    python -m testbed.net.owd send HOST PORT COUNT INTERVAL_S
    python -m testbed.net.owd msg-recv PORT COUNT SIZE TIMEOUT_S   -> one delay (ms) per message
    python -m testbed.net.owd msg-send HOST PORT COUNT SIZE INTERVAL_S [START_AT]
                                   (START_AT: the shared clock's instant of the first message; then
                                   one every INTERVAL_S from it, so senders in several hosts send
                                   together: how flows share a link, ``experiments/measure_shares.py``)
"""

from __future__ import annotations

import socket
import struct
import sys
import time

_DGRAM = struct.Struct("!dI")  # send time (shared CLOCK_MONOTONIC), sequence number


def recv(port: int, count: int, timeout_s: float, idle_s: float | None = None) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    sock.settimeout(timeout_s)
    print("listening", flush=True)
    rows = []  # written at the end: a line per datagram into a pipe nobody reads yet would fill
    for _ in range(count):  # it (64 KiB, ~4000 lines), block this loop and drop the rest
        try:
            data = sock.recv(64)
        except socket.timeout:
            break
        now = time.monotonic()
        if idle_s is not None and not rows:  # the sender is sending: a long silence is its end
            sock.settimeout(idle_s)  # (with losses, COUNT never arrives)
        sent, seq = _DGRAM.unpack(data[:_DGRAM.size])
        rows.append(f"{(now - sent) * 1000.0:.4f} {seq}\n")
    sys.stdout.write("".join(rows))
    sys.stdout.flush()


def send(host: str, port: int, count: int, interval_s: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for seq in range(count):
        sock.sendto(_DGRAM.pack(time.monotonic(), seq), (host, port))
        time.sleep(interval_s)


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = conn.recv(min(n - got, 1 << 20))
        if not part:
            raise EOFError
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def msg_recv(port: int, count: int, size: int, timeout_s: float) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(1)
    server.settimeout(timeout_s)
    print("listening", flush=True)
    conn, _ = server.accept()
    conn.settimeout(timeout_s)
    for _ in range(count):
        try:
            data = _read_exactly(conn, 8 + size)
        except (EOFError, socket.timeout):
            break
        now = time.monotonic()
        (sent,) = struct.unpack("!d", data[:8])
        print(f"{(now - sent) * 1000.0:.4f}", flush=True)


def msg_send(host: str, port: int, count: int, size: int, interval_s: float, start_at: float | None = None) -> None:
    conn = socket.create_connection((host, port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = bytes(size)
    for k in range(count):
        if start_at is not None:
            time.sleep(max(0.0, start_at + k * interval_s - time.monotonic()))
        conn.sendall(struct.pack("!d", time.monotonic()) + body)
        if start_at is None:
            time.sleep(interval_s)
    conn.close()


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "recv":
        recv(int(args[0]), int(args[1]), float(args[2]), float(args[3]) if len(args) > 3 else None)
    elif cmd == "send":
        send(args[0], int(args[1]), int(args[2]), float(args[3]))
    elif cmd == "msg-recv":
        msg_recv(int(args[0]), int(args[1]), int(args[2]), float(args[3]))
    else:
        msg_send(args[0], int(args[1]), int(args[2]), int(args[3]), float(args[4]),
                 float(args[5]) if len(args) > 5 else None)
