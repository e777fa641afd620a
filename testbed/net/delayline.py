"""Userspace delay line: one-way delay and jitter on a kernel without netem.

How it fits: ``network.py`` starts one delay-line process inside each DC gateway
(router) namespace when the kernel has no ``netem`` qdisc (or when the TUN backend is
forced).  The process opens one TUN device per outgoing WAN direction ("lane").  Policy
routing in the router sends every packet bound for that WAN link into the lane's TUN;
this process reads it, holds it until ``arrival + delay (+ jitter)``, and writes it back
into the same TUN.  The kernel then routes it normally out of the WAN interface, where
HTB (``shaping.py``) applies the rate and the byte-limited queue.  So a WAN direction is:
delay line -> HTB rate -> bfifo queue -> the peer router.

Why a hand-written loop rather than a library: no maintained Python package implements
a TUN delay line, and the kernel's own answer (netem) is what is missing.  The design is
the one measured in the brief: ``IFF_VNET_HDR`` plus ``TUNSETOFFLOAD`` so the kernel hands
over GSO super-packets (tens of KB), which keeps the per-packet Python cost small.

Packets keep their order within a lane: jitter only stretches the gap behind a packet
(``due = max(previous due, now + delay + U(-jitter, +jitter))``), as on a real path and
unlike netem, which may reorder.

Temporal sharing (Atlas): a lane may carry a **strict-priority scheduler** in front of the
delay: packets are classified by (source, destination) IPv4 address into per-pipeline
drop-tail queues, and the line's own token bucket serves the *owner's* queue first and the
others only when it is empty (work-conserving: an idle owner leaves the link to the rest).
The owner is either the first class of a priority ``order`` (pipelines fall into a
staggered rhythm by themselves) or taken from the clock (``turns``: a repeating plan of
who owns the link when, anchored at a CLOCK_MONOTONIC instant every namespace shares).
Small packets (pure ACKs, pings) bypass the queues, so one pipeline's turn does not delay
the others' acknowledgements.  The bucket counts wire bytes (GSO segments x headers, read
from the virtio-net header) at slightly less than the HTB rate behind it, so HTB stays the
cap but never builds a FIFO queue that would mix the pipelines again.  The brief explains
why this sits here rather than in HTB: every HTB mechanism switched through netlink (rate,
prio, filters) fails to give a turn's owner the link; this measurably does.

Control: a Unix datagram socket (a filesystem path, so it is reachable from the root
namespace) takes typed messages (``testbed/messages.py``): ``LaneSet`` changes the fields it
gives, e.g. ``{"kind": "lane", "lane": name, "delay_ms": .., "jitter_ms": .., "loss": ..}``,
and is answered ``Ok`` (or ``Refused``, with why); ``LaneStats`` is answered with per-lane
counters.  Scheduler fields: ``{"lane", "classes": {name: [[src|null, dst|null], ..]}, "rate_mbps", "queue_bytes"}``
installs it (without ``rate_mbps``, at the link's rate as last set with ``{"lane", "rate_mbps"}``;
``"queue_bytes": "share"`` splits the link's own queue among the classes) (``"classes": null`` removes it: plain FIFO again; ``"lease_s"`` makes it
expire unless renewed, so a dead agent leaves fair sharing behind), ``{"lane", "order": [..]}``
sets the priority order, ``{"lane", "turns": {"t0", "period_s", "slots": [[class, start_s,
end_s], ..]}}`` the clock plan (``null``: back to ``order``).  Changes
apply to packets that arrive afterwards, as netem's do.

Waking late: this process sleeps in ``select()`` and the host takes time to wake it (tens of
microseconds on a quiet machine; on a shared VM after a second of idle, 2-4 ms measured on
2026-12-06), and every held packet would pay that twice: once between entering the TUN and
being read, once between its due instant and its release.  Three things take it out:

- **Arrival stamps** (``_ArrivalTap``): a packet socket on each TUN, filtered to small
  outgoing packets, records when the kernel handed each one over; after a sleep the line
  starts the delay from that instant, not from its own wake-up.  Large packets come in
  bursts, while the line is awake.
- **Spinning to a release** while the line holds few packets (sparse traffic: probes, ACKs
  after idle, a message's last packets): it sleeps until ``spin_lead_s`` before the due
  instant (2 ms, longer by how late the last such sleeps woke, at most 8 ms) and polls from
  there, within a budget of 5% of a core; a busy line holds many packets and never spins.
- **The aim**: other timed wake-ups are aimed earlier by a low quantile of their recent
  lateness (the 10th percentile of the last 64, the first estimate after 8), so the delay
  keeps to the configured one without releasing packets early on a punctual machine.

Measured on the 2-core VM (``experiments/bench_wan.py --only rtt``, docs/benchmarks.md):
the min-RTT error of 10 probes 0.2 s apart at 5-50 ms one-way went from +0.57..+2.03 ms to
+0.11..+1.21 ms.  What is left is the host's: the first milliseconds after a long idle run
slow whatever the line does (a 5 ms link probed once a second reads 8-11 ms over its RTT on
the mean: the process stalls while running).

Run as ``python -m testbed.net.delayline CONFIG.json``; it prints ``ready`` once every TUN
exists and exits on SIGTERM.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

from testbed import messages as m

_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000
_TUN_F_CSUM = 0x01
_TUN_F_TSO4 = 0x02
_TUN_F_TSO6 = 0x04
_READ_SIZE = 65536 + 64
_MAX_BATCH = 256  # packets read from one TUN before looking at the clock again
_LATE_WINDOW = 64  # timed wake-ups per re-estimate of the aim
_LATE_FIRST = 8  # ... the first estimate after this many (a short probe gets an aim too)
_AIM_CAP_S = 0.001  # never aim earlier than this
_SPIN_S = 0.002  # a release after an idle gap: sleep until at least this long before it, then spin ...
_SPIN_LEAD_MAX_S = 0.008  # ... or longer, by how late the last sleeps woke (at most this)
_SPIN_HELD = 2  # spin only while the line holds at most this many packets (sparse traffic) ...
_SPIN_SHARE = 0.05  # spinning may take at most this share of one core ...
_SPIN_DEPTH_S = 0.1  # ... with this much saved up
_TAP_KEY = 28  # an IPv4 header and 8 bytes of what it carries: one packet among those in flight
_TAP_AFTER_S = 0.0005  # arrival stamps are read after a sleep at least this long ...
_TAP_EVERY_S = 0.005  # ... and the tap drained before a long sleep at most this often


@dataclass
class _Lane:
    name: str
    fd: int
    delay_s: float
    jitter_s: float
    loss: float
    queue: collections.deque = field(default_factory=collections.deque)
    last_due: float = 0.0
    packets_in: int = 0
    packets_out: int = 0
    bytes_out: int = 0
    dropped: int = 0
    sched: _Scheduler | None = None
    wake: float | None = None  # when the scheduler wants to run again
    lease_until: float | None = None  # the scheduler goes unless renewed by then (its agent died)
    rate_mbps: float = 0.0  # the link's rate as last set (a scheduler installed later paces to it)
    queue_bytes: int = 0  # the link's bottleneck queue (a scheduler's classes share it when asked to)
    tap: _ArrivalTap | None = None  # when small packets entered the TUN (None: not available)

_VNET_HDR = 10
_BYPASS_BYTES = 256  # pure ACKs and pings skip the per-pipeline queues
_ETH = 14
RATE_FACTOR = 0.97  # the line paces a little under the HTB cap behind it (the simulator models it: engine.PriorityPolicy)


def bucket_bytes(rate_bytes_s: float) -> float:
    """The scheduler's token bucket: what it may send at once after a pause (two GSO packets
    and a little, or 2 ms at its rate).  Sent at once, it goes on first in first out through
    the delay and the HTB queue behind: a lower-ranked pipeline's burst let through in a pause
    is not overtaken by the owner's next (the simulator models it: ``packets.PacketNet``)."""
    return max(2 * 65536 + 4096, rate_bytes_s * 0.002)


def shared_class_queue_bytes(link_queue_bytes: int, classes: int) -> int:
    """A class's queue under ``"queue_bytes": "share"``: the link's own queue split among the
    classes (equal buffering), at least 64 KiB."""
    return max(65536, link_queue_bytes // max(1, classes))


def class_queue_bytes(rate_mbps: float, delay_s: float) -> int:
    """A class's queue: room for its whole window while another class owns the link.  A
    waiting pipeline's tail dropped there costs it a retransmission timeout (no duplicate
    ACKs behind a tail): with 500 KB queues, a 50 ms link lost 300 packets a run to the
    waiting pipeline and Atlas ran 28% slower than fair sharing.  4 x the path's BDP."""
    return int(max(500_000, 4 * rate_mbps * 1e6 / 8 * 2 * delay_s))


class _Scheduler:
    """Per-class drop-tail queues served owner-first through a token bucket of wire bytes."""

    def __init__(self, classes: dict, rate_mbps: float, queue_bytes: int, now: float):
        self.match: dict[tuple, str] = {}
        for name, pairs in classes.items():
            for src, dst in pairs:
                key = (socket.inet_aton(src) if src else None, socket.inet_aton(dst) if dst else None)
                self.match[key] = name
        self.names = list(classes)
        self.order = list(classes)
        self.queues = {n: collections.deque() for n in self.names}
        self.backlog = {n: 0 for n in self.names}
        self.bytes_out = {n: 0 for n in self.names}
        self.drops = {n: 0 for n in self.names}
        self.other = collections.deque()  # unclassified and bypassing packets, served first
        self.set_rate(rate_mbps)
        self.tokens = self.depth
        self.queue_bytes = queue_bytes
        self.last = now
        self.turns: dict | None = None
        self._cache: dict[tuple, str | None] = {}
        # per completed turn: [index, owner, start, {class: bytes}, backlogged seconds]
        self.turn_log: collections.deque = collections.deque(maxlen=4000)
        self._turn: list | None = None
        self._backlogged_since: float | None = None

    def set_rate(self, rate_mbps: float) -> None:
        """Pace to ``rate_mbps`` (a little under it: the HTB cap stays behind the line)."""
        self.rate = rate_mbps * 1e6 / 8 * RATE_FACTOR
        self.depth = bucket_bytes(self.rate)

    def classify(self, pkt: bytes) -> str | None:
        if len(pkt) < _VNET_HDR + 20 + _BYPASS_BYTES or pkt[_VNET_HDR] >> 4 != 4:
            return None
        key = (pkt[_VNET_HDR + 12:_VNET_HDR + 16], pkt[_VNET_HDR + 16:_VNET_HDR + 20])
        try:
            return self._cache[key]
        except KeyError:
            m = self.match
            name = m.get(key) or m.get((key[0], None)) or m.get((None, key[1]))
            self._cache[key] = name
            return name

    def enqueue(self, pkt: bytes) -> bool:
        name = self.classify(pkt)
        if name is None:
            self.other.append(pkt)
            return True
        if self.backlog[name] + len(pkt) > self.queue_bytes:
            self.drops[name] += 1
            return False
        self.queues[name].append(pkt)
        self.backlog[name] += len(pkt)
        return True

    def owner(self, now: float) -> str:
        t = self.turns
        if not t:
            return self.order[0]
        phase = (now - t["t0"]) % t["period_s"]
        index = int((now - t["t0"]) // t["period_s"])
        for n, (name, start, end) in enumerate(t["slots"]):
            if start <= phase < end:
                self._note_turn(index * len(t["slots"]) + n, name, now)
                return name
        self._note_turn(-1, "", now)
        return self.order[0]

    def _note_turn(self, index: int, name: str, now: float) -> None:
        cur = self._turn
        if cur is not None and cur[0] == index:
            return
        if cur is not None:
            self._close_backlog(now)
            self.turn_log.append(cur + [now])
        self._turn = [index, name, now, {n: 0 for n in self.names}, 0.0]

    def _close_backlog(self, now: float) -> None:
        if self._backlogged_since is not None and self._turn is not None:
            self._turn[4] += now - self._backlogged_since
            self._backlogged_since = now

    @staticmethod
    def wire_bytes(pkt: bytes) -> int:
        """Bytes HTB will count for this (possibly GSO) packet: one Ethernet + IP/TCP header per segment."""
        n = len(pkt) - _VNET_HDR
        if pkt[1] == 0:  # gso_type none
            return n + _ETH
        hdr_len = pkt[2] | pkt[3] << 8
        gso_size = pkt[4] | pkt[5] << 8
        if not gso_size or not hdr_len:
            return n + _ETH
        segs = max(1, -(-(n - hdr_len) // gso_size))
        return n + (segs - 1) * hdr_len + segs * _ETH

    def dequeue(self, now: float, out: list) -> float | None:
        """Move what the bucket allows into ``out``; the time to call again, or None if idle."""
        self.tokens = min(self.depth, self.tokens + (now - self.last) * self.rate)
        self.last = now
        while self.other:
            pkt = self.other.popleft()
            self.tokens -= self.wire_bytes(pkt)
            out.append(pkt)
        owner = self.owner(now)
        busy = any(self.backlog.values())
        if busy and self._backlogged_since is None:
            self._backlogged_since = now
        while self.tokens > 0 and busy:
            name = owner if self.queues[owner] else next((n for n in self.order if self.queues[n]), None)
            if name is None:
                break
            pkt = self.queues[name].popleft()
            self.backlog[name] -= len(pkt)
            size = self.wire_bytes(pkt)
            self.tokens -= size
            self.bytes_out[name] += size
            if self._turn is not None:
                self._turn[3][name] += size
            out.append(pkt)
            busy = any(self.backlog.values())
        if not busy:
            if self._backlogged_since is not None and self._turn is not None:
                self._turn[4] += now - self._backlogged_since
            self._backlogged_since = None
            return self._next_turn(now)
        wait = now + (-self.tokens + 1) / self.rate if self.tokens <= 0 else now
        turn = self._next_turn(now)
        return wait if turn is None else min(wait, turn)

    def _next_turn(self, now: float) -> float | None:
        t = self.turns
        if not t:
            return None
        phase = (now - t["t0"]) % t["period_s"]
        edges = sorted({e for _, s, e2 in t["slots"] for e in (s, e2)} | {t["period_s"]})
        nxt = next((e for e in edges if e > phase + 1e-9), t["period_s"])
        return now + (nxt - phase)

    def stats(self, turns_since: int | None = None) -> dict:
        """Counters; with ``turns_since``, up to 200 completed turns after that index:
        ``[index, owner, start, {class: wire bytes}, backlogged s, end]``."""
        out = {"bytes_out": dict(self.bytes_out), "drops": dict(self.drops), "backlog": dict(self.backlog),
               "order": list(self.order), "rate_bytes_s": self.rate, "turns_on": bool(self.turns),
               "queue_bytes": self.queue_bytes}
        if turns_since is not None:
            out["turns"] = [t for t in self.turn_log if t[0] > turns_since][:200]
        return out


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    ifr = struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI | _IFF_VNET_HDR)
    fcntl.ioctl(fd, _TUNSETIFF, ifr)
    fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6)
    return fd


class _ArrivalTap:
    """When each small packet entered a lane, to the microsecond: a packet socket on the TUN
    sees every packet the kernel hands the TUN, stamped then (``SO_TIMESTAMPNS``), before this
    process wakes up to read it.  A classic BPF filter keeps only outgoing packets (those bound
    for the line, not those it writes back) of at most ``_BYPASS_BYTES`` (probes, ACKs, small
    messages: the packets whose delay a reader measures one by one), cut to ``_TAP_KEY``
    bytes.  The loop drains it before a long sleep (at most every ``_TAP_EVERY_S``) and reads it
    after one, so its buffer holds little but what arrived while the line slept; while the line
    is busy the kernel drops the copies once the small buffer fills (cheap: nothing is read).
    By hand (a six-instruction classic BPF program, the constants of <linux/filter.h> and
    <asm/socket.h>): no maintained Python package attaches a filter to a packet socket or
    reads its ``SCM_TIMESTAMPNS``."""

    _SO_ATTACH_FILTER = 26
    _SO_TIMESTAMPNS = 35
    _SCM_TIMESTAMPNS = 35
    _ETH_P_ALL = 0x0003

    def __init__(self, ifname: str):
        prog = [  # (code, jt, jf, k)
            (0x20, 0, 0, 0xFFFFF004),  # ld pkttype (SKF_AD_OFF + SKF_AD_PKTTYPE)
            (0x15, 0, 3, 4),  # jeq PACKET_OUTGOING, else drop
            (0x80, 0, 0, 0),  # ld len
            (0x25, 1, 0, _BYPASS_BYTES),  # jgt: drop
            (0x06, 0, 0, _TAP_KEY),  # keep the first _TAP_KEY bytes
            (0x06, 0, 0, 0),  # drop
        ]
        self._filter = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in prog))
        fprog = struct.pack("HL", len(prog), ctypes.addressof(self._filter))
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, 0)  # protocol 0: nothing yet
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, self._SO_ATTACH_FILTER, fprog)
            self.sock.setsockopt(socket.SOL_SOCKET, self._SO_TIMESTAMPNS, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            self.sock.bind((ifname, self._ETH_P_ALL))  # Python applies htons to the protocol here
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise

    def drain(self) -> None:
        recv = self.sock.recv
        for _ in range(4096):
            try:
                recv(_TAP_KEY)
            except BlockingIOError:
                return
            except OSError:  # ENETDOWN, reported once: the TUN was down when bound (or went down)
                continue

    def stamps(self) -> dict[bytes, float]:
        """Packets seen since the last drain: their first ``_TAP_KEY`` bytes -> the
        CLOCK_MONOTONIC instant they entered the TUN."""
        out: dict[bytes, float] = {}
        offset = time.time() - time.monotonic()
        recvmsg = self.sock.recvmsg
        for _ in range(4096):
            try:
                data, anc, _flags, _addr = recvmsg(_TAP_KEY, 64)
            except BlockingIOError:
                break
            except OSError:  # ENETDOWN, as in drain
                continue
            for level, kind, value in anc:
                if level == socket.SOL_SOCKET and kind == self._SCM_TIMESTAMPNS and len(value) >= 16:
                    sec, nsec = struct.unpack("qq", value[:16])
                    out[data] = sec + nsec * 1e-9 - offset
        return out


def _open_tap(ifname: str) -> _ArrivalTap | None:
    try:
        return _ArrivalTap(ifname)
    except OSError as exc:
        print(f"{ifname}: no arrival stamps ({exc}); a packet's delay starts when the line reads it",
              file=sys.stderr, flush=True)
        return None


class DelayLine:
    """The event loop: read lanes, hold packets, release them when due."""

    def __init__(self, lanes: list[dict], control_path: str, compensation_ms: float, seed: int):
        self._rng = random.Random(seed)
        self._compensation_s = compensation_ms / 1000.0
        self.lanes: dict[str, _Lane] = {}
        for spec in lanes:
            lane = _Lane(spec["name"], _open_tun(spec["name"]), 0.0, 0.0, 0.0)
            lane.tap = _open_tap(spec["name"])
            self._configure(lane, spec)
            self.lanes[lane.name] = lane
        self._by_fd = {lane.fd: lane for lane in self.lanes.values()}
        self._control = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if os.path.exists(control_path):
            os.unlink(control_path)
        self._control.bind(control_path)
        self._control.setblocking(False)
        self._control_path = control_path
        self._running = True
        self.expired = 0
        self.aim_s = 0.0  # wake-ups (and releases) this much before the due time: see the docstring
        self._lateness: list[float] = []
        self._aimed = False  # whether the aim has had its first estimate
        self._spin_credit = _SPIN_DEPTH_S  # seconds of spinning saved up (see run)
        self._spin_at = time.monotonic()
        self.spun_s = 0.0
        self.spin_lead_s = _SPIN_S
        self._spin_late: collections.deque = collections.deque(maxlen=8)
        # a signal wakes select() through this pipe (PEP 475 would otherwise resume it)
        self._wake_r, wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)

    def _configure(self, lane: _Lane, spec: dict) -> None:
        if "delay_ms" in spec:
            lane.delay_s = max(0.0, float(spec["delay_ms"]) / 1000.0 - self._compensation_s)
        if "jitter_ms" in spec:
            lane.jitter_s = float(spec["jitter_ms"]) / 1000.0
        if "loss" in spec:
            lane.loss = float(spec["loss"])
        now = time.monotonic()
        if "classes" in spec:
            old = lane.sched
            if spec["classes"]:
                # the link's own rate, as last set: an agent that reinstalls a scheduler after a
                # restart must not pace at the rate the link had when the run began
                rate = spec.get("rate_mbps") or lane.rate_mbps or (old.rate * 8 / 1e6 / RATE_FACTOR if old else None)
                if not rate or rate <= 0:
                    raise ValueError("a scheduler needs rate_mbps > 0")
                queue = spec.get("queue_bytes")
                if queue == "share":  # the link's own queue, split among the classes (equal buffering)
                    queue = (shared_class_queue_bytes(lane.queue_bytes, len(spec["classes"]))
                             if lane.queue_bytes else None)
                queue = queue or class_queue_bytes(float(rate), lane.delay_s)
                lane.sched = _Scheduler(spec["classes"], float(rate), int(queue), now)
            else:
                lane.sched = None
            if old is not None:  # nothing queued is lost: it goes on through the new path
                for pkt in list(old.other) + [p for q in old.queues.values() for p in q]:
                    self._admit(lane, pkt, now)
            lane.wake = now
        if "rate_mbps" in spec and "classes" not in spec:  # the link's rate changed under us
            rate = float(spec["rate_mbps"])
            if rate <= 0:
                raise ValueError("rate_mbps must be > 0")
            lane.rate_mbps = rate
            if lane.sched is not None:
                lane.sched.set_rate(rate)
                lane.wake = now
        if "link_queue_bytes" in spec:
            lane.queue_bytes = int(spec["link_queue_bytes"])
        if lane.sched is not None:
            names = set(lane.sched.names)
            if "order" in spec:
                order = list(spec["order"])
                if set(order) != names:
                    raise ValueError(f"order {order} must name exactly the classes {sorted(names)}")
                lane.sched.order = order
            if "turns" in spec:
                turns = spec["turns"]
                if turns:
                    bad = [slot[0] for slot in turns["slots"] if slot[0] not in names]
                    if bad or float(turns["period_s"]) <= 0:
                        raise ValueError(f"turns: unknown classes {bad} or period_s <= 0")
                    lane.sched.turns = {"t0": float(turns["t0"]), "period_s": float(turns["period_s"]),
                                        "slots": [(str(n), float(a), float(b)) for n, a, b in turns["slots"]]}
                else:
                    lane.sched.turns = None
                lane.sched._turn = None
                lane.wake = now
            if "lease_s" in spec:  # None: no lease
                lane.lease_until = None if spec["lease_s"] is None else now + float(spec["lease_s"])
        elif any(k in spec for k in ("order", "turns")):
            raise ValueError(f"lane {lane.name} has no scheduler (send classes first)")
        if lane.sched is None:
            lane.lease_until = None

    def _expire(self, lane: _Lane, now: float) -> None:
        """The lease ran out: plain FIFO again (fair sharing); nothing queued is lost."""
        print(f"{lane.name}: scheduler lease expired, back to FIFO", file=sys.stderr, flush=True)
        self._configure(lane, {"classes": None})
        lane.wake = None
        self.expired += 1

    def _admit(self, lane: _Lane, pkt: bytes, now: float) -> None:
        """A packet entering the lane: into the scheduler's queues, or straight into the delay."""
        if lane.sched is not None:
            if not lane.sched.enqueue(pkt):
                lane.dropped += 1
            lane.wake = now
        else:
            self._delay(lane, pkt, now)

    def _delay(self, lane: _Lane, pkt: bytes, now: float) -> None:
        due = now + lane.delay_s
        if lane.jitter_s:
            due += self._rng.uniform(-lane.jitter_s, lane.jitter_s)
        if due < lane.last_due:
            due = lane.last_due
        lane.last_due = due
        lane.queue.append((due, pkt))

    def stop(self, *_args) -> None:
        self._running = False

    def _handle_control(self) -> None:
        while True:
            try:
                data, addr = self._control.recvfrom(65536)
            except BlockingIOError:
                return
            try:
                msg = m.decode(data, expect=(m.LaneSet, m.LaneStats))
                if isinstance(msg, m.LaneStats):
                    reply = m.LaneStatsReply(
                        lanes={
                            n: {
                                "packets_in": ln.packets_in,
                                "packets_out": ln.packets_out,
                                "bytes_out": ln.bytes_out,
                                "dropped": ln.dropped,
                                "held": len(ln.queue),
                                "sched": ln.sched.stats(msg.turns_since) if ln.sched is not None else None,
                                "aim_us": round(self.aim_s * 1e6, 1),  # the line's, the same for every lane
                                "spun_s": round(self.spun_s, 4),  # the line's CPU time spent spinning to releases
                                "spin_lead_us": round(self.spin_lead_s * 1e6, 1),
                            }
                            for n, ln in self.lanes.items()
                            if msg.lane in (None, n)
                        },
                    )
                else:
                    spec = msg.given()
                    self._configure(self.lanes[spec.pop("lane")], spec)
                    for ln in self.lanes.values():
                        if ln.sched is None:
                            ln.wake = None
                    reply = m.Ok()
            except (ValueError, KeyError) as exc:
                reply = m.Refused(error=f"{type(exc).__name__}: {exc}")
            if addr:
                try:
                    self._control.sendto(m.encode(reply), addr)
                except OSError:
                    pass

    def _read_lane(self, lane: _Lane, now: float, stamps: dict[bytes, float] | None) -> None:
        """Read what waits in a lane.  ``stamps`` (after a long sleep): when small packets
        entered the TUN, so the delay starts then and not when this process woke up."""
        rng = self._rng
        for _ in range(_MAX_BATCH):
            try:
                pkt = os.read(lane.fd, _READ_SIZE)
            except BlockingIOError:
                return
            lane.packets_in += 1
            if lane.loss and rng.random() < lane.loss:
                lane.dropped += 1
                continue
            at = now
            if stamps:
                entered = stamps.get(pkt[_VNET_HDR:_VNET_HDR + _TAP_KEY])
                if entered is not None and now - 0.5 < entered < now:
                    at = entered
            self._admit(lane, pkt, at)

    def run(self) -> None:
        lanes = list(self.lanes.values())
        fds = [lane.fd for lane in lanes] + [self._control.fileno(), self._wake_r]
        taps = [lane.tap for lane in lanes if lane.tap is not None]
        control_fd = self._control.fileno()
        monotonic = time.monotonic
        write = os.write
        spun = False  # this pass reached its release instant by spinning (no aim needed)
        tapped_at = 0.0  # when a tap was last emptied (all of them before a sleep, or one read after it)
        while self._running:
            now = monotonic()
            next_wake = None  # the scheduler's and the lease's instants (not aimed)
            next_release = None
            held = 0
            release_until = now if spun else now + self.aim_s
            for lane in lanes:
                if lane.lease_until is not None and now > lane.lease_until:
                    self._expire(lane, now)
                if lane.sched is not None and lane.wake is not None and lane.wake <= now:
                    out: list = []
                    lane.wake = lane.sched.dequeue(now, out)
                    for pkt in out:
                        self._delay(lane, pkt, now)
                if lane.wake is not None and (next_wake is None or lane.wake < next_wake):
                    next_wake = lane.wake
                if lane.lease_until is not None and (next_wake is None or lane.lease_until < next_wake):
                    next_wake = lane.lease_until
                queue = lane.queue
                while queue and queue[0][0] <= release_until:
                    pkt = queue.popleft()[1]
                    try:
                        write(lane.fd, pkt)
                        lane.packets_out += 1
                        lane.bytes_out += len(pkt)
                    except OSError:
                        lane.dropped += 1
                held += len(queue)
                if queue and (next_release is None or queue[0][0] < next_release):
                    next_release = queue[0][0]
            spun = False
            target, spin_to = None, None
            if next_release is not None:
                if held <= _SPIN_HELD and self._may_spin(now):  # sparse: spin (a short sleep wakes late too)
                    target, spin_to = next_release - self.spin_lead_s, next_release
                else:
                    target = next_release - self.aim_s
            if next_wake is not None and (target is None or next_wake < target):
                target, spin_to = next_wake, None
            slept_from = monotonic()
            timeout = None if target is None else max(0.0, target - slept_from)
            if taps and (timeout is None or timeout > _SPIN_S) and slept_from - tapped_at > _TAP_EVERY_S:
                for tap in taps:  # what it holds now arrived before this sleep
                    tap.drain()
                tapped_at = slept_from
            try:
                ready, _, _ = select.select(fds, [], [], timeout)
            except InterruptedError:
                continue
            now = monotonic()
            stamped = now - slept_from >= _TAP_AFTER_S  # slept: a packet waited for this process to wake
            if not ready and spin_to is not None:  # punctual: spin to the release, polling the lanes
                if timeout:  # how late the sleep before it woke: the next sleeps stop that much earlier
                    self._spin_late.append(now - target)
                    self.spin_lead_s = min(_SPIN_LEAD_MAX_S, max(_SPIN_S, max(self._spin_late) + 0.0005))
                began = now
                while now < spin_to:
                    ready = select.select(fds, [], [], 0)[0]
                    now = monotonic()
                    if ready:
                        break
                self._spin_credit -= now - began
                self.spun_s += now - began
                spun = not ready
            elif not ready and timeout:  # a timed wake-up: how late was it?
                self._note_lateness(now - target)
            for fd in ready:
                if fd == control_fd:
                    self._handle_control()
                elif fd == self._wake_r:
                    os.read(self._wake_r, 64)
                else:
                    lane = self._by_fd[fd]
                    stamps = None
                    if stamped and lane.tap is not None:
                        stamps, tapped_at = lane.tap.stamps(), now
                    self._read_lane(lane, now, stamps)
        try:
            os.unlink(self._control_path)
        except OSError:
            pass

    def _may_spin(self, now: float) -> bool:
        """Whether spinning is within its share of a core (a token bucket of CPU seconds)."""
        self._spin_credit = min(_SPIN_DEPTH_S, self._spin_credit + (now - self._spin_at) * _SPIN_SHARE)
        self._spin_at = now
        return self._spin_credit > 0

    def _note_lateness(self, late_s: float) -> None:
        self._lateness.append(late_s)
        if len(self._lateness) >= (_LATE_WINDOW if self._aimed else _LATE_FIRST):
            self._lateness.sort()
            self.aim_s = min(_AIM_CAP_S, max(0.0, self._lateness[len(self._lateness) // 10]))
            self._lateness.clear()
            self._aimed = True


def _raise_priority() -> None:
    """Real-time priority keeps the delay accurate on a loaded machine (see the brief)."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))
    except (OSError, AttributeError):
        try:
            os.nice(-10)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as fh:
        config = json.load(fh)
    if config.get("realtime", True):
        _raise_priority()
    line = DelayLine(
        config["lanes"],
        config["control_path"],
        float(config.get("compensation_ms", 0.0)),
        int(config.get("seed", 0)),
    )
    signal.signal(signal.SIGTERM, line.stop)
    signal.signal(signal.SIGINT, line.stop)
    print("ready", flush=True)
    line.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
