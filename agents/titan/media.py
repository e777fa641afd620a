"""A media agent: sends and receives a host's calls as real UDP streams, measures them.

How it fits: ``emulate.py`` starts one agent inside every participant and media-server host
of the emulated network (``Network.popen``), and drives it over a Unix datagram socket (a
filesystem path, reachable from the root namespace).  A stream is a constant-bitrate UDP
flow at a fixed packet rate from this host to another host's agent, between two instants
of CLOCK_MONOTONIC (which every namespace shares, so the orchestrator schedules every host
on one clock).  Its packets carry the DSCP that selects the route (0: the WAN; ``INTERNET_TOS``:
the routers' policy routing sends it to the Internet path).

Each packet holds (stream id, sequence number, send time: CLOCK_REALTIME ns, which every
namespace shares); the receiver takes the arrival time from the kernel (SO_TIMESTAMPNS,
the same clock), so an agent that is scheduled late does not inflate the delays it
measures.  The receiving agent keeps
per stream: packets received, the highest and lowest sequence seen, every one-way delay
(ms), and RFC 3550 inter-arrival jitter.  The sender notes its own stalls: whenever it sends
packets more than ``STALL_MS`` after they fell due (the shared machine did not schedule it),
one row (first due, sent, packets, bytes; CLOCK_MONOTONIC ns), so the orchestrator can tell
a link's load that a stall moved into the next slot from the policy's; ``window`` reports what arrived since the last
window (the Titan controller's measurements), ``dump`` writes everything (receiver side
and the sender's counts) to a JSON file.

Control messages (typed: ``messages.py``): ``StartStreams`` (a list of ``StreamSpec``: sid, dst,
ip_kbps, pps, tos, t_start, t_end; answered ``Started``), ``Reroute`` (streams in progress
take another DSCP, so another route, from their next packet: a call moved off a degraded
path; answered ``Rerouted``), ``Window`` (answered ``WindowReply``), ``Dump`` (path), ``Reset``, ``Quit`` (answered ``Ok``); a bad one is
answered ``Refused``.

Run as ``python -m agents.titan.media CONFIG.json`` (``{"control": path, "port": n}``); it
prints ``ready`` once both sockets are bound.
"""

from __future__ import annotations

import heapq
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from array import array

from agents.titan import messages as tm
from testbed import messages as m

PORT = 5004
INTERNET_TOS = 0x20  # DSCP 8 (CS1)
HEADER = struct.Struct("!IIq")
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("qq")
IP_UDP_BYTES = 28
MIN_IP_BYTES = IP_UDP_BYTES + HEADER.size
STALL_MS = 10.0


def ip_bytes_per_packet(ip_kbps: float, pps: float) -> int:
    """Bytes of one IP packet (headers included) for a stream of ``ip_kbps`` at ``pps``."""
    return max(MIN_IP_BYTES, int(round(ip_kbps * 1000 / 8 / pps)))


class _Rx:
    __slots__ = ("n", "lo", "hi", "owd", "jitter", "last_arr", "last_send", "wn", "wlo", "whi", "wowd")

    def __init__(self) -> None:
        self.n = 0
        self.lo = 1 << 32
        self.hi = -1
        self.owd = array("f")
        self.jitter = 0.0
        self.last_arr = None
        self.last_send = None
        self.wn = 0
        self.wlo = 1 << 32
        self.whi = -1
        self.wowd = array("f")


class MediaAgent:
    def __init__(self, control: str, port: int = PORT):
        self.rx_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.rx_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.rx_sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        self.rx_sock.bind(("0.0.0.0", port))
        self.rx_sock.setblocking(False)
        self.tx: dict[int, socket.socket] = {}
        self.port = port
        if os.path.exists(control):
            os.unlink(control)
        self.ctl = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.ctl.bind(control)
        self.ctl.setblocking(False)
        self.control = control
        self.heap: list[tuple[int, int]] = []  # (due ns, stream index)
        self.streams: list[list] = []  # [id, (ip, port), bytes, interval ns, tos, end ns, seq]
        self.sent: dict[int, int] = {}
        self.by_sid: dict[int, int] = {}  # stream id -> index in self.streams
        self.stalls: list[list[int]] = []  # [first due ns, sent ns, packets, bytes] (module docstring)
        self.rx: dict[int, _Rx] = {}
        self.running = True
        self._payload = bytearray(65536)

    def _sock(self, tos: int) -> socket.socket:
        s = self.tx.get(tos)
        if s is None:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            s.setblocking(False)
            self.tx[tos] = s
        return s

    # -- control --------------------------------------------------------------------
    def _control(self) -> None:
        while True:
            try:
                data, addr = self.ctl.recvfrom(1 << 20)
            except BlockingIOError:
                return
            try:
                reply = self._handle(m.decode(data))
            except Exception as exc:  # a bad message must not kill the agent
                reply = m.Refused(error=f"{type(exc).__name__}: {exc}")
            if addr:
                try:
                    self.ctl.sendto(m.encode(reply), addr)
                except OSError:
                    pass

    def _handle(self, msg: m.Message) -> m.Message:
        if isinstance(msg, tm.StartStreams):
            for st in msg.streams:
                size = ip_bytes_per_packet(st.ip_kbps, st.pps) - IP_UDP_BYTES
                idx = len(self.streams)
                self.streams.append([st.sid, (st.dst, self.port), size, int(1e9 / st.pps), st.tos,
                                     int(st.t_end * 1e9), 0])
                self.sent.setdefault(st.sid, 0)
                self.by_sid[st.sid] = idx
                heapq.heappush(self.heap, (int(st.t_start * 1e9), idx))
            return tm.Started(streams=len(self.streams))
        if isinstance(msg, tm.Reroute):
            moved = 0
            for sid in msg.sids:
                idx = self.by_sid.get(sid)
                if idx is not None:
                    self.streams[idx][4] = msg.tos
                    moved += 1
            return tm.Rerouted(streams=moved)
        if isinstance(msg, tm.Window):
            out = {}
            for sid, r in self.rx.items():
                if r.wn:
                    w = sorted(r.wowd)
                    out[str(sid)] = tm.StreamWindow(r.wn, r.wlo, r.whi, w[len(w) // 2], r.jitter)
                r.wn, r.wlo, r.whi, r.wowd = 0, 1 << 32, -1, array("f")
            return tm.WindowReply(window=out)
        if isinstance(msg, tm.Dump):
            rx = {}
            for sid, r in self.rx.items():
                w = sorted(r.owd)
                rx[sid] = {"received": r.n, "seq_lo": r.lo, "seq_hi": r.hi, "jitter_ms": r.jitter,
                           "owd_p50_ms": w[len(w) // 2] if w else None, "owd_min_ms": w[0] if w else None,
                           "owd_p95_ms": w[min(len(w) - 1, int(0.95 * len(w)))] if w else None}
            with open(msg.path, "w") as fh:
                json.dump({"rx": rx, "sent": self.sent, "stalls": self.stalls}, fh)
            return m.Ok()
        if isinstance(msg, tm.Reset):
            self.heap.clear()
            self.streams.clear()
            self.sent.clear()
            self.by_sid.clear()
            self.stalls.clear()
            self.rx.clear()
            return m.Ok()
        if isinstance(msg, tm.Quit):
            self.running = False
            return m.Ok()
        raise ValueError(f"message {msg.kind!r} is not for a media agent")

    # -- data -----------------------------------------------------------------------
    def _receive(self) -> None:
        space = socket.CMSG_SPACE(_TIMESPEC.size)
        while True:
            try:
                data, anc, _, _ = self.rx_sock.recvmsg(65536, space)
            except BlockingIOError:
                return
            if len(data) < HEADER.size:
                continue
            now_ns = None
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(payload) >= _TIMESPEC.size:
                    sec, nsec = _TIMESPEC.unpack_from(payload)
                    now_ns = sec * 1_000_000_000 + nsec
            if now_ns is None:
                now_ns = time.time_ns()
            sid, seq, sent_ns = HEADER.unpack_from(data)
            r = self.rx.get(sid)
            if r is None:
                r = self.rx[sid] = _Rx()
            owd = (now_ns - sent_ns) / 1e6
            r.n += 1
            r.wn += 1
            r.lo = min(r.lo, seq)
            r.hi = max(r.hi, seq)
            r.wlo = min(r.wlo, seq)
            r.whi = max(r.whi, seq)
            r.owd.append(owd)
            r.wowd.append(owd)
            if r.last_arr is not None:  # RFC 3550 interarrival jitter, in ms
                d = ((now_ns - r.last_arr) - (sent_ns - r.last_send)) / 1e6
                r.jitter += (abs(d) - r.jitter) / 16.0
            r.last_arr, r.last_send = now_ns, sent_ns

    def _send_due(self) -> None:
        now = time.monotonic_ns()
        late_before = now - int(STALL_MS * 1e6)
        stall = None  # [first due, sent, packets, bytes] of this catch-up, if it is one
        while self.heap and self.heap[0][0] <= now:
            due, idx = heapq.heappop(self.heap)
            st = self.streams[idx]
            sid, addr, size, interval, tos, end, seq = st
            if due >= end:
                continue
            HEADER.pack_into(self._payload, 0, sid, seq, time.time_ns())
            try:
                self._sock(tos).sendto(memoryview(self._payload)[:size], addr)
                self.sent[sid] += 1
            except OSError:
                pass  # a full buffer or no route: counted as lost by the receiver
            if due < late_before:
                if stall is None:
                    stall = [due, now, 0, 0]
                stall[0] = min(stall[0], due)
                stall[2] += 1
                stall[3] += size + IP_UDP_BYTES
            st[6] = seq + 1
            nxt = due + interval
            if nxt < end:
                heapq.heappush(self.heap, (nxt, idx))
        if stall is not None:
            self.stalls.append(stall)

    def run(self) -> None:
        print("ready", flush=True)
        while self.running:
            timeout = 0.2
            if self.heap:
                timeout = max(0.0, (self.heap[0][0] - time.monotonic_ns()) / 1e9)
            r, _, _ = select.select([self.rx_sock, self.ctl], [], [], min(timeout, 0.2))
            if self.rx_sock in r:
                self._receive()
            if self.ctl in r:
                self._control()
            self._send_due()
        self.ctl.close()
        try:
            os.unlink(self.control)
        except OSError:
            pass


def main() -> None:
    cfg = json.loads(open(sys.argv[1]).read())
    agent = MediaAgent(cfg["control"], cfg.get("port", PORT))
    signal.signal(signal.SIGTERM, lambda s, f: setattr(agent, "running", False))
    agent.run()


if __name__ == "__main__":
    main()
