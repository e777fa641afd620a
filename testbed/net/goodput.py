"""Steady-state goodput probe: one bulk TCP flow whose window the receiver clamps.

How it fits: ``fidelity.steady_goodput`` starts ``recv`` on the destination host and
``send`` on the source host (each in its host's namespace, on its machine) and reads what
they print.  The receiver clamps the window it advertises at exactly ``CLAMP`` bytes
(``TCP_WINDOW_CLAMP``, with its socket buffers set and so locked at twice that, which turns
receive autotuning off: autotuning raises a clamp), so the flow fills a link without
overflowing its queue when the clamp sits between one bandwidth-delay product and one BDP
plus the queue (``fidelity.measuring_window``).  It counts the bytes it reads in intervals
of about ``INTERVAL_S``, each with its own measured length; the sender reports its
retransmissions (``tcp_info.tcpi_total_retrans``) at the same pace, on its own clock; it
runs cubic, whatever the host's default.

Why not iperf3: iperf3 has no window clamp, only ``-w`` (socket buffers), and the window the
kernel makes of a buffer depends on the path (``-w`` bytes gave a window of ``-w`` to 1.3
``-w`` across one machine's veths but 0.66 ``-w`` across a VXLAN: every direction of aws-us3
across fake machines read 0.79-0.82 of its rate, window-limited 87% of the time, 0
retransmits).  Here the clamp (``tcpwindow.py``) holds for the whole flow (``ss`` shows the
sender's ``snd_wnd`` at the clamp, to the byte): the receiver sets it again after every
read where the kernel moved it, and reports how often it had.

    python -m testbed.net.goodput recv PORT CLAMP_BYTES TIMEOUT_S  -> "listening", then one JSON line
    python -m testbed.net.goodput send HOST PORT SECONDS            -> one JSON line
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

from testbed.net.tcpwindow import hold_window, set_window

INTERVAL_S = 0.5
_TOTAL_RETRANS = struct.Struct("I")  # struct tcp_info's tcpi_total_retrans
_TOTAL_RETRANS_OFFSET = 100
_CHUNK = 1 << 16


def recv(port: int, clamp: int, timeout_s: float) -> None:
    """Accept one flow, read it to its end; print ``{"intervals": [[seconds, bytes], ...],
    "reclamped": n}`` from the first byte on (n: how often the kernel had moved the clamp)."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    set_window(server, clamp)  # inherited by the connection
    server.bind(("0.0.0.0", port))
    server.listen(1)
    server.settimeout(timeout_s)
    print("listening", flush=True)
    conn, _ = server.accept()
    hold_window(conn, clamp)
    conn.settimeout(timeout_s)
    buf = memoryview(bytearray(64 * _CHUNK))
    intervals: list[list[float]] = []
    last: float | None = None
    got = reclamped = 0
    try:
        while True:
            n = conn.recv_into(buf)
            now = time.monotonic()
            if not n:
                break
            if last is None:
                last = now
            got += n
            reclamped += hold_window(conn, clamp)
            if now - last >= INTERVAL_S:
                intervals.append([round(now - last, 6), got])
                last, got = now, 0
    except socket.timeout:
        pass
    if got and last is not None:
        intervals.append([round(time.monotonic() - last, 6), got])
    print(json.dumps({"intervals": intervals, "reclamped": reclamped}), flush=True)


def _total_retrans(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return _TOTAL_RETRANS.unpack_from(info, _TOTAL_RETRANS_OFFSET)[0]


def send(host: str, port: int, seconds: float) -> None:
    """Send for ``seconds``; print ``{"retransmits": [[t, total], ...], "bytes": n}`` (t from the
    connection's start, sampled about every ``INTERVAL_S``)."""
    conn = socket.socket()
    # cubic, as iperf3 -C cubic: a new namespace here defaults to BBR, whose ProbeRTT halts
    # the flow for 200 ms plus a round trip every 10 s (0.46-0.59 of the rate in two
    # half-second intervals 11.5-12.5 s into a 262 ms flow, 0 retransmits)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic")
    conn.settimeout(30)
    conn.connect((host, port))
    data = memoryview(bytes(_CHUNK))
    start = time.monotonic()
    end, mark, sent = start + seconds, start, 0
    samples = [[0.0, 0]]
    while (now := time.monotonic()) < end:
        conn.sendall(data)
        sent += len(data)
        if now - mark >= INTERVAL_S:
            samples.append([round(now - start, 6), _total_retrans(conn)])
            mark = now
    samples.append([round(time.monotonic() - start, 6), _total_retrans(conn)])
    conn.close()
    print(json.dumps({"retransmits": samples, "bytes": sent}), flush=True)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "recv":
        recv(int(args[0]), int(args[1]), float(args[2]))
    else:
        send(args[0], int(args[1]), float(args[2]))
