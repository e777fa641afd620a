"""A connection's congestion state, read from the kernel: ``getsockopt(TCP_INFO)``.

How it fits: the transport's opt-in per-message trace (``parallel.tcp_trace``;
``testbed/train/transport.py``) reads it on each WAN connection as each message's slice
starts and ends, and the runner writes the rows to ``tcp-trace/WORKER.jsonl``; ``goodput.py``
reads ``tcpi_total_retrans`` the same way.  One call costs a few microseconds.

What it reads from Linux's ``struct tcp_info`` (``include/uapi/linux/tcp.h``, unchanged
at these offsets since 4.x; byte offset, C type, unit), and the key each becomes:

====== ======================= ========== ==============================================
offset field                   type       key (unit)
====== ======================= ========== ==============================================
0      tcpi_state              u8         ``state`` (1 = ESTABLISHED)
1      tcpi_ca_state           u8         ``ca_state`` (0 Open, 1 Disorder, 2 CWR, 3 Recovery, 4 Loss)
8      tcpi_rto                u32 (us)   ``rto_ms``
24     tcpi_unacked            u32        ``unacked`` (segments in flight, packets_out)
32     tcpi_lost               u32        ``lost`` (segments marked lost now)
36     tcpi_retrans            u32        ``retrans`` (retransmitted segments in flight)
44     tcpi_last_data_sent     u32 (ms)   ``idle_ms`` (since the last data segment left: lsndtime)
68     tcpi_rtt                u32 (us)   ``rtt_ms`` (smoothed)
72     tcpi_rttvar             u32 (us)   ``rttvar_ms``
76     tcpi_snd_ssthresh       u32 (seg)  ``ssthresh`` (None while infinite: >= 0x7fffffff)
80     tcpi_snd_cwnd           u32 (seg)  ``cwnd``
100    tcpi_total_retrans      u32        ``total_retrans`` (segments retransmitted, ever)
120    tcpi_bytes_acked        u64        ``bytes_acked``
144    tcpi_notsent_bytes      u32        ``notsent`` (queued, not yet sent)
148    tcpi_min_rtt            u32 (us)   ``min_rtt_ms``
168    tcpi_busy_time          u64 (us)   ``busy_ms`` (time with data in flight, ever)
176    tcpi_rwnd_limited       u64 (us)   ``rwnd_limited_ms`` (of it, held by the peer's window)
184    tcpi_sndbuf_limited     u64 (us)   ``sndbuf_limited_ms`` (of it, held by the send buffer)
200    tcpi_bytes_sent         u64        ``bytes_sent`` (retransmissions included)
228    tcpi_snd_wnd            u32        ``snd_wnd`` (bytes: the window the peer advertised)
====== ======================= ========== ==============================================

A kernel whose struct is shorter than an offset gives None for that field.
"""

from __future__ import annotations

import socket
import struct

TCP_INFO_BYTES = 232  # what is asked for; the kernel copies min(this, its own size)
INFINITE_SSTHRESH = 0x7FFFFFFF  # TCP_INFINITE_SSTHRESH

# (key, offset, struct format, scale): value = raw * scale
_FIELDS = (
    ("state", 0, "B", None), ("ca_state", 1, "B", None),
    ("rto_ms", 8, "I", 1e-3), ("unacked", 24, "I", None), ("lost", 32, "I", None),
    ("retrans", 36, "I", None), ("idle_ms", 44, "I", None), ("rtt_ms", 68, "I", 1e-3),
    ("rttvar_ms", 72, "I", 1e-3), ("ssthresh", 76, "I", None), ("cwnd", 80, "I", None),
    ("total_retrans", 100, "I", None), ("bytes_acked", 120, "Q", None), ("notsent", 144, "I", None),
    ("min_rtt_ms", 148, "I", 1e-3), ("busy_ms", 168, "Q", 1e-3), ("rwnd_limited_ms", 176, "Q", 1e-3),
    ("sndbuf_limited_ms", 184, "Q", 1e-3), ("bytes_sent", 200, "Q", None), ("snd_wnd", 228, "I", None),
)
FIELDS = tuple(f[0] for f in _FIELDS)


def parse(info: bytes) -> dict:
    """The fields above from the bytes of a ``struct tcp_info``."""
    out: dict = {}
    for key, off, fmt, scale in _FIELDS:
        if off + struct.calcsize(fmt) > len(info):
            out[key] = None
            continue
        v = struct.unpack_from(fmt, info, off)[0]
        if key == "ssthresh" and v >= INFINITE_SSTHRESH:
            v = None
        elif scale is not None:
            v = round(v * scale, 3)
        out[key] = v
    return out


def read(sock: socket.socket) -> dict:
    """The connection's state now (the fields above)."""
    return parse(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES))
