"""Turns taken at the senders: a WAN direction handed to one pipeline's message at a time.

How it fits: temporal sharing of a WAN link (Atlas) can be enforced in the network (the
delay line's per-pipeline scheduler, ``delayline.py``) or here, at the senders.  A
``TurnServer`` runs in the process that plans the turns (Atlas's gateway agent of the
sending DC: it sets each link's ``order`` from the plan); every cross-DC channel of the
testbed's trainer (``testbed/train/transport.py``) holds a ``TurnClient`` when the run asks
for it (``testbed.train.config.SendTurns``).  Before a message's first byte is written the
channel asks for the link (``TurnWant``); the server grants it (``TurnGrant``) to one
pipeline at a time, the highest-ranked in the plan's order among those waiting (FIFO among
equals), or to as many at once as it takes to fill the link where one pipeline's
connections cannot (their ceilings, N x window / RTT, add up to less than the link's
rate); the channel writes the message and, once what is left of it is no more than is in
flight on the path (``handover_bytes``: the path's bandwidth-delay product), says
``TurnDone``, and the next pipeline's message starts as this one's tail crosses the WAN.  A
link without an order (no plan yet, or the plan withdrawn) grants every want at once: TCP's
fair sharing.  Messages are newline-framed JSON (``testbed/messages.py``) on a Unix stream
socket (a filesystem path: reachable from every namespace).

Why at the senders: a waiting pipeline's message stays in its writer, not in a gateway
queue.  Held at the gateway, the waiting pipelines' packets sit there for the owner's
whole turn: with the link's buffer split among them their tails are dropped with no
duplicate ACKs behind (retransmission timeouts), and whatever is queued reports round trips
of seconds that inflate their timers (docs/benchmarks.md counts both).  Here nothing waits in
the network, so every variant keeps the link's own FIFO and the same buffer.  The price:
a turn is a whole message (no preemption), and where holders' ceilings are not known the
link idles while an owner that cannot fill it alone holds it; the gateway's scheduler
stays for jobs whose senders are not ours (``testbed torchrun --with atlas=``).

Fail-safe: a client that cannot reach its server, or whose server goes away, sends without
turns from then on (fair sharing, as when the gateway's lease runs out); a dead client's
turn is released when its connection closes.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

from testbed import messages as m

_TIOCOUTQ = 0x5411  # SIOCOUTQ: bytes not yet acknowledged (sent or not)
_POLL_MIN_S = 0.0005


def unacknowledged(socks: list[socket.socket]) -> int:
    """Bytes written to these TCP sockets and not yet acknowledged by the peer."""
    total = 0
    for s in socks:
        try:
            total += struct.unpack("i", fcntl.ioctl(s.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[0]
        except OSError:
            return 0  # a closed socket: nothing more will leave it
    return total


class TurnClient:
    """One channel's side: ``acquire()`` before a message, ``release(socks, nbytes)`` after.

    ``links`` are the WAN directions the channel crosses, taken in sorted order (so two
    channels over overlapping paths cannot each hold what the other waits for)."""

    def __init__(self, server: str, pipeline: str, links: list[str], handover_bytes: int, rate_bytes_s: float,
                 timeout_s: float = 120.0, name: str = "", connect_s: float = 5.0, ceiling_bytes_s: float = 0.0):
        self.server, self.pipeline, self.links = server, pipeline, sorted(links)
        self.handover_bytes, self.rate = handover_bytes, max(1.0, rate_bytes_s)
        self.timeout_s, self.name, self.connect_s = timeout_s, name, connect_s
        self.ceiling = ceiling_bytes_s  # what its connections can carry (0: the whole link)
        self._sock: socket.socket | None = None
        self._buf = b""
        self._queued = False  # the last release asked for the first link again (``more``)
        self.down = False  # no server: send without turns (fair sharing)

    def _connect(self) -> None:
        deadline = time.monotonic() + self.connect_s  # its agent may still be starting
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.server)
                self._sock = sock
                return
            except OSError:
                sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _gone(self, why: str) -> None:
        if not self.down:
            print(f"{self.name}: turn server {why}: sending without turns (fair sharing)", file=sys.stderr,
                  flush=True)
        self.down = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _read_grant(self, link: str, deadline: float) -> bool:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self._gone(f"gave no turn on {link} within {self.timeout_s:g} s")
                return False
            self._sock.settimeout(left)
            try:
                data = self._sock.recv(4096)
            except socket.timeout:
                continue  # the deadline, judged above
            except OSError:
                data = b""
            if not data:
                self._gone("closed the connection")
                return False
            self._buf += data
        raw, self._buf = self._buf.split(b"\n", 1)
        msg = m.decode(raw, expect=(m.TurnGrant,))
        return msg.link == link

    def acquire(self) -> None:
        """Block until every link of the path is this pipeline's (or turns are off)."""
        if self.down:
            return
        t0 = time.monotonic()
        try:
            if self._sock is None:
                self._connect()
            for i, link in enumerate(self.links):
                if not (i == 0 and self._queued):
                    self._sock.sendall(m.line(m.TurnWant(link=link, pipeline=self.pipeline,
                                                         ceiling_bytes_s=self.ceiling)))
                if not self._read_grant(link, t0 + self.timeout_s):
                    return
            self._queued = False
        except OSError as exc:
            self._gone(f"unreachable ({exc})")

    def release(self, socks: list[socket.socket], nbytes: int, more: bool = False) -> None:
        """Wait until no more than ``handover_bytes`` of the message are unacknowledged (the
        rest is in flight, not queued), then hand the links on; ``more``: the next message is
        ready, so the sender waits for the first link again at once, in its pipeline's rank
        (the rest of its links it asks for in order once it has the first, as ``acquire``
        does: sorted acquisition keeps two overlapping paths from holding what the other waits for)."""
        if self.down:
            return
        while True:
            left = unacknowledged(socks) - self.handover_bytes
            if left <= 0:
                break
            time.sleep(max(_POLL_MIN_S, min(0.05, left / self.rate / 2)))
        try:
            for link in reversed(self.links):
                again = more and link == self.links[0]
                self._sock.sendall(m.line(m.TurnDone(link=link, nbytes=nbytes, more=again)))
                self._queued = again
        except OSError as exc:
            self._gone(f"unreachable ({exc})")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


@dataclass
class _Link:
    order: list[str] | None = None  # None: no turns (every want granted at once)
    capacity: float = 0.0  # bytes/s; 0: one holder at a time, whatever its ceiling
    holders: dict[int, list] = field(default_factory=dict)  # fd -> its turn's entry in ``log``
    ceilings: dict[int, float] = field(default_factory=dict)  # fd -> its ceiling (0: the whole link)
    waiting: list[tuple[int, str, float, float]] = field(default_factory=list)  # (fd, pipeline, since, ceiling)
    # per pipeline: turns, seconds waited, seconds held, bytes
    counters: dict[str, dict[str, float]] = field(default_factory=dict)
    # every turn: [pipeline, asked, granted, handed on, bytes, planned] (monotonic seconds)
    log: list[list] = field(default_factory=list)
    last_order: list[str] | None = None


class TurnServer:
    """Grants each link to one pipeline at a time in its ``order``; drive it from a select loop
    (``fds()``, ``handle(fd)``).  Single-threaded, like the agent that hosts it."""

    def __init__(self, path: str):
        if os.path.exists(path):
            os.unlink(path)
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(256)
        self._listener.setblocking(False)
        self._conns: dict[int, socket.socket] = {}
        self._bufs: dict[int, bytes] = {}
        self.links: dict[str, _Link] = {}

    def fds(self) -> list[int]:
        return [self._listener.fileno(), *self._conns]

    def set_order(self, link: str, order: list[str] | None, capacity_bytes_s: float = 0.0) -> None:
        """The plan's order on ``link`` (None: no turns; whoever waits is granted now).  With
        ``capacity_bytes_s``, a turn goes to as many pipelines as it takes to fill the link
        (while the holders' ceilings add up to less); without, to one at a time."""
        ln = self.links.setdefault(link, _Link())
        ln.capacity = capacity_bytes_s
        ln.order = list(order) if order else None
        ln.last_order = ln.order or ln.last_order
        self._grant(link)

    def handle(self, fd: int) -> None:
        if fd == self._listener.fileno():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setblocking(False)
            self._conns[conn.fileno()] = conn
            self._bufs[conn.fileno()] = b""
            return
        conn = self._conns.get(fd)
        if conn is None:
            return
        try:
            data = conn.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(fd)
            return
        buf = self._bufs[fd] + data
        *lines, self._bufs[fd] = buf.split(b"\n")
        for raw in lines:
            try:
                msg = m.decode(raw, expect=(m.TurnWant, m.TurnDone))
            except ValueError:
                self._drop(fd)
                return
            if isinstance(msg, m.TurnWant):
                self.links.setdefault(msg.link, _Link()).waiting.append((fd, msg.pipeline, time.monotonic(),
                                                                         msg.ceiling_bytes_s))
            else:
                self._done(fd, msg.link, msg.nbytes, msg.more)
            self._grant(msg.link)

    def _counters(self, ln: _Link, pipeline: str) -> dict[str, float]:
        return ln.counters.setdefault(pipeline, {"turns": 0, "waited_s": 0.0, "held_s": 0.0, "bytes": 0})

    def _done(self, fd: int, link: str, nbytes: int, more: bool) -> None:
        ln = self.links.get(link)
        if ln is None or fd not in ln.holders:
            return
        turn = ln.holders.pop(fd)
        ceiling = ln.ceilings.pop(fd, 0.0)
        turn[3], turn[4] = time.monotonic(), nbytes
        if more:  # its next message is ready: it waits with the others, in its rank
            ln.waiting.append((fd, turn[0], turn[3], ceiling))
        c = self._counters(ln, turn[0])
        c["held_s"] += turn[3] - turn[2]
        c["bytes"] += nbytes

    def _grant(self, link: str) -> None:
        ln = self.links.get(link)
        if ln is None:
            return
        now = time.monotonic()
        while ln.waiting and (ln.order is None or self._room(ln)):
            if ln.order is None:
                pick = 0
            else:
                rank = {p: i for i, p in enumerate(ln.order)}
                pick = min(range(len(ln.waiting)), key=lambda i: (rank.get(ln.waiting[i][1], len(rank)), i))
            fd, pipeline, since, ceiling = ln.waiting.pop(pick)
            conn = self._conns.get(fd)
            if conn is None:
                continue
            ln.holders[fd] = [pipeline, since, now, None, 0, ln.order is not None]
            ln.ceilings[fd] = ceiling
            if len(ln.log) < 100_000:
                ln.log.append(ln.holders[fd])
            c = self._counters(ln, pipeline)
            c["turns"] += 1
            c["waited_s"] += now - since
            try:
                conn.sendall(m.line(m.TurnGrant(link=link)))
            except OSError:
                self._drop(fd)

    @staticmethod
    def _room(ln: _Link) -> bool:
        """Whether another pipeline may join the holders: none hold it, or the link has a
        capacity and their ceilings (none of them "the whole link") add up to less."""
        if not ln.holders:
            return True
        ceilings = [ln.ceilings.get(fd, 0.0) for fd in ln.holders]
        return ln.capacity > 0 and all(c > 0 for c in ceilings) and sum(ceilings) < ln.capacity

    def _drop(self, fd: int) -> None:
        """A sender gone: its turns and wants go with it."""
        conn = self._conns.pop(fd, None)
        self._bufs.pop(fd, None)
        if conn is not None:
            conn.close()
        for name, ln in self.links.items():
            ln.waiting = [w for w in ln.waiting if w[0] != fd]
            ln.ceilings.pop(fd, None)
            if ln.holders.pop(fd, None) is not None:
                self._grant(name)

    def stats(self) -> dict:
        """Per link: the last order planned; per pipeline, turns, seconds waited and held,
        bytes; and every turn, ``[pipeline, asked, granted, handed on, bytes, planned]``
        (monotonic seconds; handed on None while held; planned: granted under an order, not
        at once for want of one)."""
        return {name: {"order": ln.last_order,
                       "pipelines": {p: {k: round(v, 4) if isinstance(v, float) else v for k, v in c.items()}
                                     for p, c in sorted(ln.counters.items())},
                       "turns": [list(t) for t in ln.log]}
                for name, ln in sorted(self.links.items())}

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

