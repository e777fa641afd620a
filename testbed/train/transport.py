"""Point-to-point message transfer between pipeline stages over N parallel TCP connections.

How it fits: each worker runs one ``Endpoint``: a listening socket on its own host address
and, per peer, a ``Channel`` of N TCP connections (N = ``connections`` for a cross-DC
boundary, 1 inside a DC).  A message (one activation or gradient, as bytes: ``codec.py``
turns tensors into them, an emulated device sends buffers of the same size) is cut into N
nearly equal slices, one per connection, sent concurrently by one thread per connection,
and reassembled by one reader thread per connection on the other side.  Sends return at
once (asynchronous, in order); ``recv`` blocks until the next message of that channel is
whole.  No torch here: an emulated worker imports this and little else.

Why sockets and not torch.distributed P2P: the transfer must be striped over N real TCP
connections whose addresses name the pipeline (host of replica d -> host of replica d), so
tc can classify each pipeline's flows, and it must always cross the emulated links, also
where GPUs share a machine (tensors are copied to host memory; no CUDA IPC, no NVLink).
Socket buffers are sized from the link's bandwidth-delay product (``config.py``); a paced
channel's connections carry the kernel's own pacing rate (``parallel.paced``).  A window
cap (``parallel.tcp_window_bytes``) is each connection's window clamp, held by the reader
(``testbed/net/tcpwindow.py``): buffers of the cap alone gave 1.33x the cap across one
machine's veths and 0.63x across the fake cluster's VXLAN; clamped, 0.99 of cap/RTT on both.

Turns (Atlas's temporal sharing enforced at the senders): an outgoing channel given a
``TurnClient`` writes each message only once its pipeline holds the link, and hands the
link on when the message's tail is in flight (``testbed/net/sendturns.py``); ``send`` still
returns at once.

Trace (``parallel.tcp_trace``, off by default): an outgoing channel given a list appends each
connection's TCP state (``testbed/net/tcpinfo.py``: cwnd, ssthresh, RTT, RTO, idle time,
retransmissions) before, as and after each message's slice is written (``Channel._traced``);
the worker hands the rows to the runner, which writes ``tcp-trace/WORKER.jsonl``.

Wire format per slice: header ``!QIQQd`` = (message seq, slice index, total bytes, slice
bytes, the sender's monotonic send time), then the slice.  All hosts share one clock, so
the receiver records each message's real transfer time: from the send to the last byte in.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from testbed.net import tcpinfo
from testbed.net.sendturns import TurnClient
from testbed.net.tcpwindow import hold_window, set_window

_HELLO = struct.Struct("!16sBBB")  # peer name, channel kind, connection index, connections
_SLICE = struct.Struct("!QIQQd")  # seq, slice, total bytes, slice bytes, send time


class TransportError(RuntimeError):
    pass


def _recv_exact(sock: socket.socket, view: memoryview, clamp: int = 0) -> None:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise TransportError("peer closed the connection")
        view = view[n:]
        if clamp:
            hold_window(sock, clamp)


def _recv_exact_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf))
    return bytes(buf)


@dataclass
class TransferRecord:
    """One message: sent at ``start`` (the sender's clock is everyone's clock), fully received
    at ``end``."""

    seq: int
    nbytes: int
    start: float
    end: float


@dataclass
class _Outgoing:
    seq: int
    payload: bytes | memoryview
    start: float
    pending: int
    done: threading.Event = field(default_factory=threading.Event)


class Channel:
    """One direction of traffic to/from one peer over ``n`` connections."""

    def __init__(self, socks: list[socket.socket], on_receive=None, window_bytes: int = 0,
                 turns: "TurnClient | None" = None, trace: "list | None" = None):
        self.socks = socks
        self.trace = trace  # rows of each connection's TCP state per slice (``_traced``); None: off
        self._turns = turns
        self.n = len(socks)
        self._clamp = window_bytes
        self._on_receive = on_receive
        self._send_queues = [queue.Queue() for _ in socks]
        self._seq = 0
        self._lock = threading.Lock()
        self._partial: dict[int, tuple[bytearray, int]] = {}
        self._complete: dict[int, bytearray] = {}
        self._arrival: dict[int, float] = {}
        self.last_arrival = 0.0  # when the message ``recv`` last returned was whole
        self._next_recv = 0
        self._cv = threading.Condition()
        self._error: Exception | None = None
        self._threads = []
        for i, sock in enumerate(socks):
            for target in (self._writer, self._reader):
                t = threading.Thread(target=target, args=(i, sock), daemon=True)
                t.start()
                self._threads.append(t)
        if turns is not None:  # messages wait for their turn on the WAN in this thread
            self._turn_queue: queue.Queue = queue.Queue()
            t = threading.Thread(target=self._take_turns, daemon=True)
            t.start()
            self._threads.append(t)

    # -- sending ----------------------------------------------------------------------
    def send(self, payload: bytes | memoryview) -> _Outgoing:
        """Queue one message; it leaves in order, sliced over the connections."""
        with self._lock:
            out = _Outgoing(self._seq, payload, time.monotonic(), self.n)
            self._seq += 1
        self._last = out
        if self._turns is not None:
            self._turn_queue.put(out)
        else:
            self._start_writing(out)
        return out

    def _start_writing(self, out: _Outgoing) -> None:
        for q in self._send_queues:
            q.put(out)

    def _take_turns(self) -> None:
        """Each message in order: the link's turn, the message written, its tail in flight,
        the turn handed on (``testbed/net/sendturns.py``)."""
        turns = self._turns
        while True:
            out = self._turn_queue.get()
            if out is None:
                return
            turns.acquire()
            self._start_writing(out)
            out.done.wait()
            if self._error is not None:
                return
            turns.release(self.socks, len(out.payload), more=not self._turn_queue.empty())

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every message sent so far is on the wire."""
        last = getattr(self, "_last", None)
        return last is None or last.done.wait(timeout)

    def _writer(self, i: int, sock: socket.socket) -> None:
        try:
            while True:
                out = self._send_queues[i].get()
                if out is None:
                    return
                total = len(out.payload)
                lo, hi = total * i // self.n, total * (i + 1) // self.n
                trace = self.trace
                if trace is not None:
                    self._traced(trace, "before", out, i, sock, hi - lo)
                sock.sendall(_SLICE.pack(out.seq, i, total, hi - lo, out.start))
                if trace is not None:
                    self._traced(trace, "start", out, i, sock, hi - lo)
                if hi > lo:
                    sock.sendall(memoryview(out.payload)[lo:hi])
                if trace is not None:
                    self._traced(trace, "end", out, i, sock, hi - lo)
                with self._lock:
                    out.pending -= 1
                    last = out.pending == 0
                if last:
                    out.done.set()
        except OSError as exc:
            self._fail(exc)

    @staticmethod
    def _traced(trace: list, phase: str, out: _Outgoing, i: int, sock: socket.socket, nbytes: int) -> None:
        """One row of the per-message TCP trace (``parallel.tcp_trace``): connection ``i``'s
        state (``testbed/net/tcpinfo.py``) as its slice of message ``out`` is written.
        ``before``: before the slice's header is written (``idle_ms`` is the idle gap the
        message found); ``start``: after it, once the kernel has queued the first new data and
        with it run its check for a restart after idle (``tcp_skb_entail`` ->
        ``tcp_slow_start_after_idle_check``), so ``cwnd`` is the window the slice starts with;
        ``end``: the whole slice handed to the kernel (``notsent``: what of it waits for room
        in the window)."""
        row = {"t": time.monotonic(), "seq": out.seq, "conn": i, "phase": phase, "bytes": nbytes,
               "queued_at": out.start}
        row.update(tcpinfo.read(sock))
        trace.append(row)  # (list.append is atomic: one writer thread a connection)

    # -- receiving --------------------------------------------------------------------
    def _reader(self, i: int, sock: socket.socket) -> None:
        try:
            while True:
                header = _recv_exact_bytes(sock, _SLICE.size)
                seq, idx, total, size, sent_at = _SLICE.unpack(header)
                with self._cv:
                    if seq not in self._partial:
                        self._partial[seq] = (bytearray(total), self.n)
                    buf, _ = self._partial[seq]
                lo = total * idx // self.n
                _recv_exact(sock, memoryview(buf)[lo:lo + size], self._clamp)
                with self._cv:
                    buf, left = self._partial[seq]
                    left -= 1
                    if left == 0:
                        del self._partial[seq]
                        now = time.monotonic()
                        self._complete[seq] = buf
                        self._arrival[seq] = now
                        self._cv.notify_all()
                        if self._on_receive:
                            self._on_receive(TransferRecord(seq, total, sent_at, now))
                    else:
                        self._partial[seq] = (buf, left)
        except (OSError, TransportError) as exc:
            self._fail(exc)

    def recv(self, timeout: float | None = None) -> bytearray:
        """The next whole message of this channel."""
        with self._cv:
            ok = self._cv.wait_for(lambda: self._next_recv in self._complete or self._error is not None, timeout)
            if self._next_recv in self._complete:
                buf = self._complete.pop(self._next_recv)
                self.last_arrival = self._arrival.pop(self._next_recv)
                self._next_recv += 1
                return buf
            if self._error is not None:
                raise TransportError(f"channel broken: {self._error}")
            if not ok:
                raise TimeoutError("no message within the timeout")
        raise AssertionError("unreachable")

    def _fail(self, exc: Exception) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()

    def close(self) -> None:
        if self._turns is not None:
            self._turn_queue.put(None)
            self._turns.close()
        for q in self._send_queues:
            q.put(None)
        for sock in self.socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


_SO_MAX_PACING_RATE = 47  # Linux's, not in Python's socket module


def _sized(sock: socket.socket, buf_bytes: int, window_bytes: int = 0, pace: int = 0) -> None:
    if window_bytes:  # the clamp is the window, with buffers that never bind
        set_window(sock, window_bytes, max(buf_bytes, 2 * window_bytes), send_buffer=True)
    elif buf_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf_bytes)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if pace:  # TCP's own pacing (no fq qdisc needed): a window spread over the round trip
        sock.setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, pace)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic")
    except OSError:
        pass


class Endpoint:
    """A worker's listening socket plus its outgoing and incoming channels."""

    def __init__(self, name: str, host: str, port: int):
        self.name = name
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(256)
        self._accepted: dict[tuple[str, int], list[socket.socket | None]] = {}

    def connect(self, peer: str, host: str, port: int, kind: int, connections: int, buf_bytes: int,
                timeout: float = 60.0, window_bytes: int = 0, turns: "TurnClient | None" = None,
                pace: int = 0, trace: "list | None" = None) -> Channel:
        """Open ``connections`` TCP connections to a peer's endpoint for one channel kind; with
        ``turns``, each message waits for its pipeline's turn on the WAN; with ``trace``, each
        connection's TCP state is appended to it as each message's slice is written
        (``Channel._traced``)."""
        socks = []
        for i in range(connections):
            deadline = time.monotonic() + timeout
            while True:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                _sized(sock, buf_bytes, window_bytes, pace)
                try:
                    sock.connect((host, port))
                    break
                except OSError:
                    sock.close()
                    if time.monotonic() > deadline:
                        raise TransportError(f"{self.name}: cannot connect to {peer} at {host}:{port}") from None
                    time.sleep(0.05)
            sock.sendall(_HELLO.pack(self.name.encode(), kind, i, connections))
            socks.append(sock)
        return Channel(socks, turns=turns, trace=trace)

    def accept(self, peer: str, kind: int, connections: int, buf_bytes: int, timeout: float = 60.0,
               on_receive=None, window_bytes: int = 0) -> Channel:
        """Wait for a peer's ``connections`` connections of one channel kind."""
        key = (peer, kind)
        deadline = time.monotonic() + timeout
        self._listener.settimeout(1.0)
        while None in self._accepted.get(key, [None]) or len(self._accepted.get(key, [])) < connections:
            if time.monotonic() > deadline:
                raise TransportError(f"{self.name}: {peer} did not connect within {timeout:.0f} s")
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            name, k, i, total = _HELLO.unpack(_recv_exact_bytes(sock, _HELLO.size))
            slot = self._accepted.setdefault((name.rstrip(b"\0").decode(), k), [None] * total)
            slot[i] = sock
        socks = self._accepted.pop(key)
        for sock in socks:  # sized once its channel is known: another peer's may come in first
            _sized(sock, buf_bytes, window_bytes)
        return Channel(socks, on_receive=on_receive, window_bytes=window_bytes)

    def close(self) -> None:
        self._listener.close()
