"""One-way delay probe: UDP datagrams stamped with the shared monotonic clock.

How it fits: every emulated host is a network namespace on one kernel, so all of them
read the same CLOCK_MONOTONIC.  ``send`` stamps each datagram with its send time;
``recv`` subtracts it from the arrival time, which measures each direction of a WAN link
on its own (ping only sees the sum of both).  ``fidelity.one_way_delays`` drives it.

    python -m testbed.owd recv PORT COUNT TIMEOUT_S   -> prints one delay (ms) per line
    python -m testbed.owd send HOST PORT COUNT INTERVAL_S
"""

from __future__ import annotations

import socket
import struct
import sys
import time


def recv(port: int, count: int, timeout_s: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    sock.settimeout(timeout_s)
    print("listening", flush=True)
    for _ in range(count):
        try:
            data = sock.recv(64)
        except socket.timeout:
            break
        now = time.monotonic()
        (sent,) = struct.unpack("!d", data[:8])
        print(f"{(now - sent) * 1000.0:.4f}", flush=True)


def send(host: str, port: int, count: int, interval_s: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(count):
        sock.sendto(struct.pack("!d", time.monotonic()), (host, port))
        time.sleep(interval_s)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "recv":
        recv(int(args[0]), int(args[1]), float(args[2]))
    else:
        send(args[0], int(args[1]), int(args[2]), float(args[3]))
