"""WAN messages as TCP segments through the emulator's delay lines and drop-tail queues
(``sim.sharing: packets``): a packet-level TCP, as Linux runs it.

How it fits: ``build.simulate`` makes one ``PacketNet`` for the run when ``sim.sharing`` is
``packets`` and one ``PacketChannel`` per channel (a worker's connection set to one peer, for
one kind of message), and hands it every message the channel sends; the fluid engine
(``engine.Simulator``) carries no WAN flow then, only the clock: every segment, ACK and timer
is an event on its heap (``Simulator.at``).  A WAN direction is what ``network.py`` builds:
the delay line (one-way delay, jitter that keeps order, random loss: ``delayline.py``), then
the link's rate and its byte-limited drop-tail queue (``shaping.py``); a path is its links in
turn; with an extension's strict priority (Atlas's temporal sharing enforced at the gateway,
``engine.PriorityPolicy``), ``PacketNet.prioritise`` puts the delay line's scheduler in front of
each link (each pipeline's drop-tail queue, served by rank through the line's token bucket;
ACKs go past the queues but pay the bucket, as the line's ``other`` packets do, so the reverse
direction's ACKs take their 1.5-2% of a busy link's turns: ``delayline._Scheduler``).
Each connection is a sender and a receiver (``_Connection``); a message is split into
one slice a connection (``testbed/train/transport.py``: a 36-byte header, then the slice), and
arrives when every slice has arrived in order.

Why a packet model beside the fluid one (``engine``, ``tcpwindow``, ``rounds``): on the long
haul with Linux's default hosts the fluid model's one window a channel sat in a faster state of
the same feedback than the emulator (issue #30; docs/benchmarks.md, "Random loss on the long
haul, measured long enough"): how long a channel idles decides how far the restart after idle
cuts its window, and that idle is made of the transfers before it, to the round trip.  The
rounds of consecutive messages that share a window, HyStart's per-ACK samples, the smoothed
round trip in the RTO, a lost segment's recovery: each moves the idle, and here each comes from
the packets themselves rather than from a rule a channel.  Why hand-written rather than ns-3 or
htsim: neither runs Linux's restart after idle or its cwnd validation, which decide this
regime, and both would need the pipeline's schedule across a process boundary; this is a
transcription of the kernel functions named below, small enough to read against them.

What each connection runs (Linux 6.x, ``net/ipv4/``):

* the window: 10 segments to start (``tcp_init_cwnd``); slow start a segment per segment
  delivered, CUBIC above ssthresh (``bictcp_update`` with its Reno-friendly bound,
  ``tcp_cong_avoid_ai``), both only while the window is used (``tcp_is_cwnd_limited``, with
  ``max_packets_out``); HyStart's delay and ACK-train exits (``hystart_update``) on each ACK's
  sample, its rounds reset before the test for a window of 16 (as since Linux 6.11 and in
  stable 6.1/6.6, so a round is a flight from the first ACK), with CUBIC's rule that drops
  samples for a second after an epoch starts;
* restart after idle as the application writes (``tcp_slow_start_after_idle_check`` ->
  ``tcp_cwnd_restart``: halve per RTO idle since the last data sent, a retransmission too, down
  to 10) and the decay of an unused window (``tcp_cwnd_validate`` -> ``tcp_cwnd_application_limited``, an RTO
  after the window's stamp, which every ACK of data sets: ``tcp_cong_avoid``), both
  with ``parallel.slow_start_after_idle``; CUBIC's epoch moved by the idle (CA_EVENT_TX_START);
* the round trip (``tcp_rtt_estimator``: srtt, mdev, rttvar at least 200 ms; RTO = srtt +
  rttvar), queueing included, from the handshake on; each ACK's sample as
  ``tcp_ack_update_rtt`` takes it: the oldest original acknowledged, else the oldest newly
  SACKed, else (an ACK over retransmitted data only, as in recovery) its timestamp echo;
* the receiver: an ACK every second segment, at once for data out of order, a delayed ACK
  after 40 ms, and 16 quick ACKs after it has been idle longer than its RTO (1 s: it sends no
  data) (``__tcp_ack_snd_check``, ``tcp_event_data_recv``); ACKs carry SACK;
* losses: RACK (RFC 8985; no reordering window once 3 segments are SACKed or in recovery),
  the tail-loss probe (2 srtt; +200 ms with one segment out; one new segment, past a full window
  too, where data is unsent, else the last again), PRR's reduction to CUBIC's
  ssthresh (beta 717/1024, fast convergence), the RTO (one segment, go-back, doubled while it
  fires again; CUBIC forgets its state, its least delay too, so the next sample sets that:
  ``bictcp_reset``), and its undo when an ACK echoes the timestamp of an original sent before the
  timeout's first retransmission (``tcp_try_undo_loss``: segments that waited at a scheduler
  were not lost).

Left out: TSO/GSO (a segment is a packet; the emulator's hosts send GSO packets of 2 or more
segments on lossless links, single segments on lossy ones), pacing, receive-window limits
(the hosts' buffers are large), jiffies' 4 ms rounding,
reordering (the delay line keeps order), F-RTO's new data after a timeout and the DSACK undo of
a fast retransmit, the DC's own switch.
"""

from __future__ import annotations

import collections
import random
from typing import Callable

from testbed.net.tcpmodel import MSS, PAYLOAD_FRACTION, RTO_MIN_S
from testbed.sim.engine import Link, SharingPolicy, Simulator

CODEC_HEADER_BYTES = 64  # codec.py's META_SIZE: a message is this header and the tensor

SLICE_HEADER_BYTES = 36  # transport.py's _SLICE: seq, slice, total, slice bytes, send time
WIRE_OVERHEAD = 52 + 14  # TCP/IP headers with timestamps + Ethernet, as HTB counts a packet
ACK_BYTES = WIRE_OVERHEAD
INIT_CWND = 10  # TCP_INIT_CWND
QUICKACKS = 16  # TCP_MAX_QUICKACKS
DELACK_S = 0.040  # TCP_ATO_MIN: the delayed ACK
RECEIVER_RTO_S = 1.0  # TCP_TIMEOUT_INIT: the receiver's RTO (it never samples a round trip)
REORDERING = 3  # tp->reordering: the duplicate threshold RACK uses before reordering is seen
# CUBIC (tcp_cubic.c): beta 717/1024, C = 410/1024 segments / s^3, the Reno-friendly scale
BETA = 717 / 1024
CUBIC_C = 410 / 1024
BETA_SCALE = 8 * (1024 + 717) // 3 // (1024 - 717)  # 15: Reno's growth a window, x 8
HYSTART_LOW_WINDOW = 16
HYSTART_MIN_SAMPLES = 8
HYSTART_ACK_DELTA_S = 0.002
GSO_MAX_SIZE = 65536
CUBIC_REFRESH_S = 1 / 32  # bictcp_update recomputes cnt at most every HZ / 32 for one cwnd
INF = float("inf")


class PacketSharing(SharingPolicy):
    """``sim.sharing: packets``: the WAN's messages go as segments (``PacketChannel``), so the
    fluid engine shares no WAN link; what else it carries is shared max-min fairly."""

    name = "packets"


class PacketNet:
    """The WAN's directions as the emulator builds them: per ``Link``, a delay line (one-way
    delay, jitter that keeps order, random loss) and then the link's rate with a byte-limited
    drop-tail FIFO.  ``send`` takes a packet onto a path and calls ``deliver(t)`` when it
    reaches the far end (not at all if a queue or the line drops it)."""

    def __init__(self, sim: Simulator, seed: int, host_rate: float = INF):
        self._sim = sim
        self._rng = random.Random(seed)
        self._lanes: dict[int, list] = {}  # id(link) -> [link, queue bytes, jitter s, loss, due, free at, wire rate]
        self._host_rate = host_rate  # bytes/s: a sending host's own link (the DC's)
        self._host_free: dict[str, float] = {}  # host -> when its link has sent what it was given
        self._schedulers: dict[int, dict] = {}  # id(link) -> its strict-priority scheduler (``prioritise``)
        self.scheduler_drops = 0  # packets a pipeline's full queue at a scheduler dropped
        self.dropped = 0  # packets a full queue dropped
        self.lost = 0  # packets the delay line dropped at random

    def add(self, link: Link, queue_bytes: float, jitter_s: float = 0.0, loss: float = 0.0) -> None:
        # (the link's bandwidth is TCP payload a second: the line's wire rate carries the headers too)
        self._lanes[id(link)] = [link, float(queue_bytes), float(jitter_s), float(loss), 0.0, 0.0,
                                 link.bandwidth / PAYLOAD_FRACTION]

    def prioritise(self, link: Link, rank: dict[str, int] | None, rate_factor: float, queue_bytes: float,
                   burst_bytes: float = 0.0) -> None:
        """Atlas's temporal sharing at the gateway (``delayline._Scheduler``), in front of
        ``link``'s delay line: each pipeline's data (``owner``) in a drop-tail queue of
        ``queue_bytes``, served strictly by ``rank`` (unknown owners last) at ``rate_factor`` of
        the link's wire rate; pure ACKs pass its queues but pay its bucket.  ``rank`` None: not yet in force (packets go
        straight to the delay line, first in first out) until ``reorder`` gives one.
        ``burst_bytes``: the scheduler's token bucket (``delayline.bucket_bytes``): after a
        pause it lets that much through at once, by rank as it stands then, into the FIFO
        behind it, where the owner's next packets wait their turn (0: one packet at a time at
        the rate, strict to the packet)."""
        self._schedulers[id(link)] = {"rank": rank, "rate": self._lanes[id(link)][6] * rate_factor,
                                      "limit": float(queue_bytes), "queues": {}, "backlog": {}, "busy": False,
                                      "depth": float(burst_bytes), "tokens": float(burst_bytes), "last": 0.0}

    def reorder(self, rank: dict[str, int]) -> None:
        """Every scheduler serves by ``rank`` from now on (a new plan applied at the gateways)."""
        for sched in self._schedulers.values():
            sched["rank"] = rank

    def send_from(self, host: str, path: list[Link], wire_bytes: int, payload: int,
                  deliver: Callable[[float], None], owner: str = "") -> None:
        """A packet that ``host`` sends onto ``path`` now: it leaves over the host's own link,
        behind what the host sent before, so that bursts from several hosts reach a gateway
        interleaved, as they do, rather than one whole after another.  ``owner``: its pipeline,
        for a scheduler on the way (``prioritise``)."""
        now = self._sim.now
        leave = max(now, self._host_free.get(host, 0.0)) + wire_bytes / self._host_rate
        self._host_free[host] = leave
        self._sim.at(leave, lambda: self.send(path, wire_bytes, payload, deliver, owner=owner))

    def send(self, path: list[Link], wire_bytes: int, payload: int, deliver: Callable[[float], None],
             hop: int = 0, owner: str = "", scheduled: bool = False) -> None:
        """The packet reaches hop ``hop`` now: a scheduler first where there is one (data only),
        then the delay line (its release, in order), then its place in the link's queue behind
        it, or a drop."""
        sched = self._schedulers.get(id(path[hop])) if not scheduled else None
        if sched is not None and not payload:  # a pure ACK: past the queues, but it pays the bucket
            if sched["rank"] is not None and sched["depth"] > 0:
                self._refill(sched)
                sched["tokens"] -= wire_bytes
        elif sched is not None and sched["rank"] is not None:
            backlog = sched["backlog"].get(owner, 0.0)
            if backlog + wire_bytes > sched["limit"]:
                self.scheduler_drops += 1
                return
            sched["backlog"][owner] = backlog + wire_bytes
            sched["queues"].setdefault(owner, collections.deque()).append(
                (path, wire_bytes, payload, deliver, hop, owner))
            if not sched["busy"]:
                self._serve(sched)
            return
        lane = self._lanes[id(path[hop])]
        link, limit, jitter, loss = lane[0], lane[1], lane[2], lane[3]
        now = self._sim.now
        if loss and self._rng.random() < loss:
            self.lost += 1
            return
        due = now + link.delay
        if jitter:
            due += self._rng.uniform(-jitter, jitter)
        due = max(due, lane[4])
        lane[4] = due
        free, rate = lane[5], lane[6]
        if free > due and (free - due) * rate + wire_bytes > limit:
            self.dropped += 1
            return
        done = max(due, free) + wire_bytes / rate
        lane[5] = done
        link.bytes_carried += payload
        link.busy_time += wire_bytes / rate
        if hop + 1 < len(path):
            self._sim.at(done, lambda: self.send(path, wire_bytes, payload, deliver, hop + 1, owner))
        else:
            self._sim.at(done, lambda: deliver(self._sim.now))

    @staticmethod
    def _next_packet(sched: dict) -> tuple | None:
        """The highest-ranked pipeline's next packet, taken off its queue (None: all empty)."""
        rank = sched["rank"]
        queues = [(rank.get(o, len(rank)), o) for o, q in sched["queues"].items() if q]
        if not queues:
            return None
        owner = min(queues)[1]
        packet = sched["queues"][owner].popleft()
        sched["backlog"][owner] -= packet[1]
        return packet

    def _refill(self, sched: dict) -> None:
        """The scheduler's token bucket, refilled at its rate up to its depth since it was last
        touched (``delayline._Scheduler.dequeue``; a pure ACK takes its bytes from it too)."""
        now = self._sim.now
        sched["tokens"] = min(sched["depth"], sched["tokens"] + (now - sched["last"]) * sched["rate"])
        sched["last"] = now

    def _serve(self, sched: dict) -> None:
        """The scheduler sends its highest-ranked pipeline's next packet (work-conserving).
        Without a bucket, one packet per its time at the rate; with one (``burst_bytes``), as
        the delay line does: packets go while it holds tokens (the last may take it below
        zero), then it waits for the rate to bring them back above zero."""
        if sched["depth"] <= 0:
            packet = self._next_packet(sched)
            sched["busy"] = packet is not None
            if packet is None:
                return

            def sent() -> None:
                self.send(*packet, scheduled=True)
                self._serve(sched)

            self._sim.at(self._sim.now + packet[1] / sched["rate"], sent)
            return
        now, rate = self._sim.now, sched["rate"]
        self._refill(sched)
        while sched["tokens"] > 0:
            packet = self._next_packet(sched)
            if packet is None:
                sched["busy"] = False
                return
            sched["tokens"] -= packet[1]
            self.send(*packet, scheduled=True)
        sched["busy"] = any(sched["queues"].values())
        if sched["busy"]:  # (a byte past zero: as the line)
            self._sim.at(now + (1.0 - sched["tokens"]) / rate, lambda: self._serve(sched))


class _Seg:
    __slots__ = ("size", "sent_at", "retrans", "sacked", "lost", "in_flight_retrans")

    def __init__(self, size: int):
        self.size = size
        self.sent_at = -1.0  # the last transmission (s); -1: not sent yet
        self.retrans = False  # sent more than once (Karn: no round-trip sample from it)
        self.sacked = False
        self.lost = False  # marked lost and not delivered since
        self.in_flight_retrans = False  # its retransmission is in flight (retrans_out)


class _Connection:
    """One TCP connection: the sender's state and its peer's receiver (see the module)."""

    def __init__(self, sim: Simulator, net: PacketNet, host: str, path: list[Link], ack_path: list[Link],
                 rtt: float, restart_after_idle: bool, hystart: bool, counts: dict, owner: str = ""):
        self.sim, self.net, self.host, self.path, self.ack_path = sim, net, host, path, ack_path
        self.owner = owner  # the pipeline it belongs to (a scheduler's class)
        self.restart = restart_after_idle
        self.hystart = hystart
        self.counts = counts
        self.segs: list[_Seg] = []  # the byte stream, segment by segment
        self.ends: list[tuple[int, Callable[[float], None]]] = []  # (last segment of a slice, its arrival)
        self.una = 0  # snd_una
        self.nxt = 0  # snd_nxt
        self.cwnd = INIT_CWND
        self.ssthresh = INF
        self.cnt_ai = 0  # snd_cwnd_cnt
        self.packets_out = self.sacked_out = self.lost_out = self.retrans_out = 0
        self.max_packets_out = 0
        self.cwnd_limited = False
        self.cwnd_usage_seq = 0
        self.cwnd_used = 0
        self.cwnd_stamp = 0.0
        self.lsndtime = 0.0
        # the handshake's sample: srtt = rtt, mdev = rtt / 2, rttvar = max(2 rtt, 200 ms)
        self.srtt = rtt
        self.mdev = 2 * rtt  # mdev_us: 4 x the mean deviation, as the kernel keeps it
        self.rttvar = max(self.mdev, RTO_MIN_S)
        self.mdev_max = self.rttvar
        self.rtt_seq = 0
        self.min_rtt = rtt
        self.backoff = 0
        self.state = "open"  # icsk_ca_state: open, recovery, loss
        self.high_seq = 0
        self.prior_cwnd = 0
        self.prr_delivered = self.prr_out = 0
        self.rack_sent = -1.0  # rack.mstamp: when the latest delivered segment was sent
        self.rack_seq = -1  # ... and which it was (rack.end_seq: a burst's segments leave at one instant)
        self.rack_rtt = 0.0
        self._rack_timer_at = INF
        self._rto_at = INF
        self._rto_gen = 0
        self._tlp_at = INF
        self._tlp_gen = 0
        self.tlp_high_seq: int | None = None
        # the RTO's undo (``tcp_try_undo_loss``): the window and ssthresh before the episode
        # (the recovery's, where the RTO fired in one), and when its first retransmission left
        # (``retrans_stamp``); an ACK echoing an earlier timestamp acknowledges an original
        self.undo: tuple[int, float] | None = None
        self.retrans_stamp = INF
        # CUBIC
        self.epoch: float | None = None
        self.last_max = 0.0
        self.origin = 0.0
        self.k = 0.0
        self.ack_cnt = 0
        self.reno_cwnd = 0
        self.cnt = 0
        self.last_cwnd = 0
        self.last_time = -INF
        self.delay_min = rtt  # (the transport's hello, acknowledged before any message: the bare path)
        self.found = False
        self.round_start = self.last_ack = 0.0
        self.end_seq = 0
        self.curr_rtt = INF
        self.sample_cnt = 0
        # the receiver
        self.rcv_nxt = 0
        self.ts_recent: float | None = None  # the timestamp the receiver echoes (TSecr)
        self.ooo: set[int] = set()
        self.rcv_unacked = 0
        self.quick = QUICKACKS
        self.lrcvtime = -INF
        self._delack_gen = 0

    # -- the application -----------------------------------------------------------------
    def write(self, nbytes: int, arrived: Callable[[float], None]) -> None:
        """A slice of ``nbytes`` (header included) written now: queued behind what is unsent
        (a partial segment not yet sent takes the first bytes), sent as the window allows."""
        now = self.sim.now
        if self.restart and self.packets_out == 0 and now - self.lsndtime > self.rto:
            self._cwnd_restart(now - self.lsndtime)
        left = nbytes
        if self.nxt < len(self.segs):  # the unsent tail takes bytes up to a full segment
            tail = self.segs[-1]
            take = min(MSS - tail.size, left)
            tail.size += take
            left -= take
        first = True
        while left > 0:
            # with TCP_NODELAY the header leaves as its own segment if the window has room for it
            alone = first and self.nxt == len(self.segs) and self.in_flight() < self.cwnd
            size = min(SLICE_HEADER_BYTES if alone else MSS, left)
            first = False
            self.segs.append(_Seg(size))
            left -= size
        self.ends.append((len(self.segs) - 1, arrived))
        self._xmit()

    @property
    def rto(self) -> float:
        return (self.srtt + self.rttvar) * (1 << self.backoff)

    def in_flight(self) -> int:
        return self.packets_out - (self.sacked_out + self.lost_out) + self.retrans_out

    def _cwnd_restart(self, delta: float) -> None:
        """``tcp_cwnd_restart``: halve per RTO idle, down to the initial window."""
        self.ssthresh = self._current_ssthresh()
        restart = min(INIT_CWND, self.cwnd)
        cwnd = self.cwnd
        rto = self.rto
        delta -= rto
        while delta > 0 and cwnd > restart:
            cwnd >>= 1
            delta -= rto
        if max(cwnd, restart) < self.cwnd:
            self.counts["restarts"] += 1
        self.cwnd = max(cwnd, restart)
        self.cwnd_stamp = self.sim.now
        self.cwnd_used = 0

    def _current_ssthresh(self) -> float:
        if self.state != "open":
            return self.ssthresh
        return max(self.ssthresh, (self.cwnd >> 1) + (self.cwnd >> 2))

    # -- sending ---------------------------------------------------------------------------
    def _xmit(self) -> None:
        """``tcp_write_xmit``: lost segments again first, then new data, while the window has room."""
        sent_new = False
        limited = False
        if self.lost_out > self.retrans_out:
            for seq in range(self.una, self.nxt):
                if self.in_flight() >= self.cwnd:
                    limited = True
                    break
                s = self.segs[seq]
                if s.lost and not s.in_flight_retrans and not s.sacked:
                    self._transmit(seq, retransmit=True)
                    if self.state == "recovery":
                        self.prr_out += 1
                    if seq == self.una:  # tcp_xmit_retransmit_queue: the head again, the RTO from now
                        self._arm_rto()
        while not limited and self.nxt < len(self.segs):
            if self.in_flight() >= self.cwnd:
                limited = True
                break
            self._send_new()
            sent_new = True
            if self.state == "recovery":
                self.prr_out += 1
        limited = limited or self.in_flight() >= self.cwnd
        if sent_new or limited:
            self._cwnd_validate(limited)
        if self.packets_out and self._rto_at == INF:
            self._arm_rto()
        if sent_new and self.state == "open":
            self._schedule_tlp()

    def _send_new(self) -> None:
        """The next unsent segment leaves (``tcp_event_new_data_sent`` counts it out after it is sent)."""
        seq = self.nxt
        self.nxt += 1
        self._transmit(seq)
        self.packets_out += 1

    def _transmit(self, seq: int, retransmit: bool = False) -> None:
        s = self.segs[seq]
        self._put_on_wire(seq)
        if retransmit:
            self.retrans_stamp = min(self.retrans_stamp, self.sim.now)  # (the episode's first)
            s.retrans = True
            s.in_flight_retrans = True
            self.retrans_out += 1
            self.counts["retransmits"] += 1

    def _put_on_wire(self, seq: int) -> None:
        """Segment ``seq`` leaves now (its TSval, the receiver's echo, is this instant), new or
        again: ``tcp_event_data_sent`` moves CUBIC's epoch by the idle if nothing was in flight
        (CA_EVENT_TX_START) and restarts the idle's clock (``lsndtime``), for any data sent."""
        s = self.segs[seq]
        s.sent_at = now = self.sim.now
        if self.in_flight() == 0 and self.epoch is not None:
            idle = now - self.lsndtime
            if idle > 0:
                self.epoch = min(now, self.epoch + idle)
        self.lsndtime = now
        self.net.send_from(self.host, self.path, s.size + WIRE_OVERHEAD, s.size,
                           lambda t: self._received(seq, now), self.owner)

    def _cwnd_validate(self, is_cwnd_limited: bool) -> None:
        """``tcp_cwnd_validate``."""
        # the strongest signal of the window's use in the current window (Linux 6.1 on): limited,
        # or else the most packets out; a new window from cwnd_usage_seq on
        if (self.una >= self.cwnd_usage_seq or is_cwnd_limited
                or (not self.cwnd_limited and self.packets_out > self.max_packets_out)):
            self.cwnd_limited = is_cwnd_limited
            self.max_packets_out = self.packets_out
            self.cwnd_usage_seq = self.nxt
        if self._is_cwnd_limited():
            self.cwnd_used = 0
            self.cwnd_stamp = self.sim.now
        else:
            self.cwnd_used = max(self.cwnd_used, self.packets_out)
            if self.restart and self.sim.now - self.cwnd_stamp >= self.rto:
                # tcp_cwnd_application_limited
                if self.state == "open":
                    used = max(self.cwnd_used, INIT_CWND)
                    if used < self.cwnd:
                        self.ssthresh = self._current_ssthresh()
                        self.cwnd = (self.cwnd + used) >> 1
                    self.cwnd_used = 0
                self.cwnd_stamp = self.sim.now

    def _is_cwnd_limited(self) -> bool:
        if self.cwnd_limited:
            return True
        if self.cwnd < self.ssthresh:
            return self.cwnd < 2 * self.max_packets_out
        return False

    # -- timers ----------------------------------------------------------------------------
    def _arm_rto(self) -> None:
        self._rto_gen += 1
        gen = self._rto_gen
        self._rto_at = self.sim.now + self.rto
        self.sim.at(self._rto_at, lambda: self._on_rto(gen))

    def _stop_rto(self) -> None:
        self._rto_gen += 1
        self._rto_at = INF

    def _schedule_tlp(self) -> None:
        """``tcp_schedule_loss_probe``: 2 srtt (+200 ms with one segment out), no later than the RTO."""
        if self.tlp_high_seq is not None or self.sacked_out or not self.packets_out:
            return
        timeout = 2 * self.srtt + (RTO_MIN_S if self.packets_out == 1 else 0.008)
        at = min(self.sim.now + timeout, self._rto_at)
        self._tlp_gen += 1
        gen = self._tlp_gen
        self._tlp_at = at
        self._rto_gen += 1  # one retransmission timer: the probe's takes the RTO's place until it fires
        self.sim.at(at, lambda: self._on_tlp(gen))

    def _on_tlp(self, gen: int) -> None:
        if gen != self._tlp_gen:
            return
        self._tlp_at = INF
        if not self.packets_out:
            return
        if self.state != "open":
            self._arm_rto()
            return
        self.counts["probes"] += 1
        if self.nxt < len(self.segs):  # new data (tcp_write_xmit, push_one 2): one segment past a full window
            if self.in_flight() < self.cwnd:
                self._xmit()
            else:
                self._send_new()
                self._cwnd_validate(True)
        else:
            seq = self.nxt - 1  # else the highest segment sent, again
            s = self.segs[seq]
            if not s.sacked:
                s.retrans = True
                self.retrans_stamp = min(self.retrans_stamp, self.sim.now)  # (the episode's first)
                self.counts["retransmits"] += 1
                self._put_on_wire(seq)
        self.tlp_high_seq = self.nxt
        self._tlp_gen += 1  # one probe an episode: the RTO from now takes the timer
        self._tlp_at = INF
        self._arm_rto()

    def _on_rto(self, gen: int) -> None:
        """``tcp_retransmit_timer`` -> ``tcp_enter_loss``: one segment, everything out is lost, go back."""
        if gen != self._rto_gen or not self.packets_out:
            return
        self._rto_at = INF
        self.counts["timeouts"] += 1
        # a new episode (``tcp_enter_loss``): not within a recovery or after an earlier timeout
        # of the same flight, whose ssthresh and undo stand
        if self.state == "open" or self.una >= self.high_seq:
            self.undo = (self.cwnd, self._current_ssthresh())
            self.ssthresh = self._cubic_recalc_ssthresh()
        self.retrans_stamp = min(self.retrans_stamp, self.sim.now)  # (the episode's first)
        self._cubic_reset()
        self._hystart_reset()
        self.state = "loss"
        self.high_seq = self.nxt
        self.cwnd = 1
        self.cnt_ai = 0
        self.tlp_high_seq = None
        self.retrans_out = 0
        self.lost_out = 0
        for seq in range(self.una, self.nxt):
            s = self.segs[seq]
            s.in_flight_retrans = False
            if not s.sacked:
                s.lost = True
                self.lost_out += 1
        self.backoff = min(self.backoff + 1, 6)
        self._xmit()
        self._arm_rto()

    def _undo_loss(self) -> None:
        """``tcp_try_undo_loss``: the ACK echoes a timestamp from before the episode's first
        retransmission (the recovery's, where the RTO fired in one), so an original arrived:
        the timeout was spurious (its segments had waited in a queue, not been lost).  The
        window and ssthresh from before the episode come back, and what was marked lost and not
        yet sent again is not sent again."""
        cwnd, ssthresh = self.undo
        self.cwnd = max(self.cwnd, cwnd)
        self.ssthresh = max(self.ssthresh, ssthresh)
        self.state = "open"
        self.undo, self.retrans_stamp = None, INF
        for seq in range(self.una, self.nxt):
            s = self.segs[seq]
            if s is not None and s.lost and not s.in_flight_retrans:
                s.lost = False
                self.lost_out -= 1
        self.counts["undos"] += 1

    # -- the receiver ----------------------------------------------------------------------
    def _received(self, seq: int, ts: float) -> None:
        """Segment ``seq``, sent at ``ts`` (its TSval), has arrived."""
        now = self.sim.now
        if now - self.lrcvtime > RECEIVER_RTO_S:  # tcp_event_data_recv: idle past the RTO, quick ACKs
            self.quick = QUICKACKS
        self.lrcvtime = now
        if seq < self.rcv_nxt or seq in self.ooo:  # a duplicate: ACK at once (D-SACK)
            self._send_ack()
            return
        if seq > self.rcv_nxt:  # out of order: ACK at once, with SACK
            self.ooo.add(seq)
            self._send_ack()
            return
        filled = bool(self.ooo)
        if self.rcv_unacked == 0 or filled:  # the earliest segment not yet acknowledged (RFC 7323)
            self.ts_recent = ts
        self.rcv_nxt += 1
        while self.rcv_nxt in self.ooo:
            self.ooo.discard(self.rcv_nxt)
            self.rcv_nxt += 1
        while self.ends and self.ends[0][0] < self.rcv_nxt:
            self.ends.pop(0)[1](now)
        self.rcv_unacked += 1
        if filled or self.quick > 0 or self.rcv_unacked >= 2:
            if self.quick > 0:
                self.quick -= 1
            self._send_ack()
        else:
            self._delack_gen += 1
            gen = self._delack_gen
            self.sim.at(now + DELACK_S, lambda: gen == self._delack_gen and self._send_ack())

    def _send_ack(self) -> None:
        self.rcv_unacked = 0
        self._delack_gen += 1
        cum = self.rcv_nxt
        sack = tuple(self.ooo) if self.ooo else ()
        tsecr = self.ts_recent
        self.net.send(self.ack_path, ACK_BYTES, 0, lambda t: self._on_ack(cum, sack, tsecr))

    # -- the sender, on an ACK -------------------------------------------------------------
    def _on_ack(self, cum: int, sack: tuple, tsecr: float | None = None) -> None:
        now = self.sim.now
        if (self.state == "loss" and cum > self.una and tsecr is not None and tsecr < self.retrans_stamp
                and self.undo is not None):
            self._undo_loss()
        prior_in_flight = self.in_flight()
        delivered = 0
        seq_rtt = sack_rtt = ca_rtt = -1.0
        advanced = cum > self.una
        newly_lost = 0
        if advanced:
            oldest_sample = None
            newest_sample = None
            for seq in range(self.una, min(cum, self.nxt)):
                s = self.segs[seq]
                if s.sacked:
                    self.sacked_out -= 1
                else:
                    delivered += 1
                    if not s.retrans:
                        if oldest_sample is None:
                            oldest_sample = s.sent_at
                        newest_sample = s.sent_at
                    self._rack_update(s, seq, now)
                if s.lost:
                    self.lost_out -= 1
                if s.in_flight_retrans:
                    self.retrans_out -= 1
                self.segs[seq] = None  # (acknowledged: nothing is kept)
            self.packets_out -= min(cum, self.nxt) - self.una
            self.una = min(cum, self.nxt)
            if oldest_sample is not None:
                seq_rtt = now - oldest_sample
                ca_rtt = now - newest_sample
        for seq in sack:
            if seq < self.una or seq >= self.nxt:
                continue
            s = self.segs[seq]
            if s.sacked:
                continue
            s.sacked = True
            self.sacked_out += 1
            delivered += 1
            if s.lost:
                self.lost_out -= 1
                s.lost = False
            if s.in_flight_retrans:
                self.retrans_out -= 1
                s.in_flight_retrans = False
            if not s.retrans:
                ca_rtt = now - s.sent_at if ca_rtt < 0 else min(ca_rtt, now - s.sent_at)
                sack_rtt = max(sack_rtt, now - s.sent_at)
            self._rack_update(s, seq, now)
        if self.tlp_high_seq is not None and self.una >= self.tlp_high_seq:
            self.tlp_high_seq = None
        # tcp_ack_update_rtt: the oldest original acknowledged, else the oldest newly SACKed,
        # else, when the ACK advances over retransmitted data only, its timestamp echo (the
        # hole's filler's TSval: the retransmission's own round trip, a full queue's included)
        rtt_sample = seq_rtt if seq_rtt >= 0 else sack_rtt
        if rtt_sample < 0 and advanced and tsecr is not None:
            rtt_sample = ca_rtt = max(now - tsecr, 1e-6)
        if rtt_sample >= 0:
            self._rtt_estimator(rtt_sample)
            self.backoff = 0  # (RFC 6298: the backoff ends on a valid sample)
        if ca_rtt >= 0:
            self._cubic_acked(ca_rtt)
        if self.sacked_out or self.state != "open":
            newly_lost = self._rack_detect(now)
        # the congestion state (tcp_fastretrans_alert)
        if self.state == "recovery" and self.una >= self.high_seq:
            self.state = "open"
            self.undo = None
            if self.ssthresh < INF:
                self.cwnd = max(1, int(self.ssthresh))
            self.cwnd_stamp = now
        elif self.state == "loss" and self.una >= self.high_seq:
            self.state = "open"
            self.undo = None
        if (self.state == "open" and not self.retrans_out
                and (self.una >= self.nxt or not self.segs[self.una].retrans)):
            self.retrans_stamp = INF  # tcp_try_to_open: no retransmission outstanding
        if self.state == "open" and self.lost_out:
            self._enter_recovery(prior_in_flight)
        if self.state == "recovery":
            self._prr(delivered, newly_lost, advanced)
        elif delivered:
            # tcp_cong_control -> tcp_cong_avoid: CUBIC grows a window in use, and the window's stamp
            # is now either way (an unused window decays only after an RTO without an ACK of data)
            if self._is_cwnd_limited():
                self._cong_avoid(delivered, now)
            self.cwnd_stamp = now
        if advanced:  # tcp_set_xmit_timer: the probe (or the RTO) again from now
            if self.packets_out:
                self._arm_rto()
            else:
                self._stop_rto()
            self._tlp_gen += 1
            self._tlp_at = INF
        self._xmit()
        if self.packets_out and self.state == "open" and self._tlp_at == INF:
            self._schedule_tlp()

    def _rack_update(self, s: _Seg, seq: int, now: float) -> None:
        """``tcp_rack_advance``: the latest sent of the segments delivered (``tcp_rack_sent_after``:
        by transmit time, then by sequence).  A retransmitted segment delivered sooner than the
        least round trip seen is its original's delivery, not the retransmission's: it does not
        advance (else a tail-loss probe's original, delivered from a queue, would mark everything
        sent before the probe lost)."""
        if s.retrans and now - s.sent_at < self.min_rtt:
            return
        if s.sent_at > self.rack_sent or (s.sent_at == self.rack_sent and seq > self.rack_seq):
            self.rack_sent, self.rack_seq = s.sent_at, seq
            self.rack_rtt = now - s.sent_at

    def _rack_detect(self, now: float) -> int:
        """``tcp_rack_detect_loss``: a segment sent before the latest delivered one and not
        delivered a reordering window after is lost; a timer for the next that may be."""
        reo = 0.0 if (self.state != "open" or self.sacked_out >= REORDERING) else min(self.min_rtt / 4, self.srtt)
        lost = 0
        wait = INF
        for seq in range(self.una, self.nxt):
            s = self.segs[seq]
            if s.sacked or (s.lost and not s.in_flight_retrans):  # delivered, or known lost and not resent
                continue
            if s.sent_at > self.rack_sent or (s.sent_at == self.rack_sent and seq >= self.rack_seq):
                continue
            remaining = s.sent_at + self.rack_rtt + reo - now
            if remaining <= 0:
                if s.in_flight_retrans:  # a retransmission lost again
                    s.in_flight_retrans = False
                    self.retrans_out -= 1
                if not s.lost:
                    s.lost = True
                    self.lost_out += 1
                lost += 1
            else:
                wait = min(wait, remaining)
        if wait < INF and now + wait < self._rack_timer_at:
            self._rack_timer_at = now + wait

            def fire(at=now + wait):
                if self._rack_timer_at != at:
                    return
                self._rack_timer_at = INF
                if self.packets_out:
                    prior = self.in_flight()
                    n = self._rack_detect(self.sim.now)
                    if n and self.state == "open" and self.lost_out:
                        self._enter_recovery(prior)
                    self._xmit()
            self.sim.at(now + wait, fire)
        return lost

    def _enter_recovery(self, prior_in_flight: int) -> None:
        """``tcp_enter_recovery`` -> ``tcp_init_cwnd_reduction``."""
        self.counts["recoveries"] += 1
        self.undo = (self.cwnd, self._current_ssthresh())  # tcp_enter_recovery: tcp_init_undo
        self.state = "recovery"
        self.high_seq = self.nxt
        self.prior_cwnd = self.cwnd
        self.prr_delivered = self.prr_out = 0
        self.ssthresh = self._cubic_recalc_ssthresh()
        self.tlp_high_seq = None
        self._tlp_gen += 1  # no probe in recovery: the RTO watches the retransmissions
        self._tlp_at = INF
        self._arm_rto()

    def _prr(self, delivered: int, newly_lost: int, advanced: bool) -> None:
        """``tcp_cwnd_reduction`` (RFC 6937)."""
        if delivered <= 0 or not self.prior_cwnd:
            return
        self.prr_delivered += delivered
        delta = self.ssthresh - self.in_flight()
        if delta < 0:
            sndcnt = int((self.ssthresh * self.prr_delivered + self.prior_cwnd - 1) // self.prior_cwnd) - self.prr_out
        else:
            sndcnt = max(self.prr_delivered - self.prr_out, delivered)
            if advanced and not newly_lost:
                sndcnt += 1
            sndcnt = int(min(delta, sndcnt))
        sndcnt = max(sndcnt, 0 if self.prr_out else 1)
        self.cwnd = max(1, self.in_flight() + sndcnt)

    def _rtt_estimator(self, m: float) -> None:
        """``tcp_rtt_estimator`` (mdev kept x 4, as the kernel keeps it) and ``tcp_set_rto``."""
        self.min_rtt = min(self.min_rtt, m)
        err = m - self.srtt
        self.srtt += err / 8
        if err < 0:
            err = -err - self.mdev / 4
            if err > 0:
                err /= 8
        else:
            err -= self.mdev / 4
        self.mdev += err
        if self.mdev > self.mdev_max:
            self.mdev_max = self.mdev
            if self.mdev_max > self.rttvar:
                self.rttvar = self.mdev_max
        if self.una > self.rtt_seq:
            if self.mdev_max < self.rttvar:
                self.rttvar -= (self.rttvar - self.mdev_max) / 4
            self.rtt_seq = self.nxt
            self.mdev_max = RTO_MIN_S

    # -- CUBIC -----------------------------------------------------------------------------
    def _cubic_reset(self) -> None:
        """``bictcp_reset`` (CUBIC entering Loss): the epoch, the last maximum and the least
        delay HyStart and the cubic's clock use are forgotten; the next sample sets the delay."""
        self.epoch = None
        self.delay_min = 0.0
        self.last_max = 0.0
        self.last_cwnd = 0
        self.last_time = -INF
        self.origin = self.k = 0.0
        self.ack_cnt = self.reno_cwnd = 0
        self.found = False

    def _hystart_reset(self) -> None:
        self.round_start = self.last_ack = self.sim.now
        self.end_seq = self.nxt
        self.curr_rtt = INF
        self.sample_cnt = 0

    def _cubic_recalc_ssthresh(self) -> float:
        """``cubictcp_recalc_ssthresh``: beta, with fast convergence."""
        self.epoch = None
        if self.cwnd < self.last_max:
            self.last_max = self.cwnd * (1 + BETA) / 2
        else:
            self.last_max = self.cwnd
        return max(int(self.cwnd * BETA), 2)

    def _cubic_acked(self, rtt: float) -> None:
        """``cubictcp_acked``: the delay sample (none for a second after an epoch starts)."""
        now = self.sim.now
        if self.epoch is not None and now - self.epoch < 1.0:
            return
        if self.delay_min == 0 or self.delay_min > rtt:
            self.delay_min = rtt
        if self.hystart and not self.found and self.cwnd < self.ssthresh:
            self._hystart_update(rtt, now)

    def _hystart_update(self, delay: float, now: float) -> None:
        # the round's reset comes before the low-window test (Linux 6.11, "tcp_cubic: fix incorrect
        # HyStart round start detection", in stable 6.1 and 6.6 too): rounds follow the flights
        # from the first ACK, not from the ACK at which the window reached 16
        if self.una > self.end_seq:
            self._hystart_reset()
        if self.cwnd < HYSTART_LOW_WINDOW:
            return
        if now - self.last_ack <= HYSTART_ACK_DELTA_S:
            self.last_ack = now
            pacing = 2 * self.cwnd * MSS / self.srtt if self.srtt > 0 else 0.0  # sk_pacing_rate in slow start
            ack_delay = min(1e-3, 4 * GSO_MAX_SIZE / pacing) if pacing > 0 else 0.0
            if now - self.round_start > (self.delay_min + ack_delay) / 2:  # unpaced: half
                self._hystart_found("train")
                return
        if self.curr_rtt > delay:
            self.curr_rtt = delay
        if self.sample_cnt < HYSTART_MIN_SAMPLES:
            self.sample_cnt += 1
        elif self.curr_rtt > self.delay_min + min(0.016, max(0.004, self.delay_min / 8)):
            self._hystart_found("delay")

    def _hystart_found(self, how: str) -> None:
        self.found = True
        self.ssthresh = self.cwnd
        self.counts["hystart_" + how] += 1

    def _cong_avoid(self, acked: int, now: float) -> None:
        """``cubictcp_cong_avoid``: slow start, then ``bictcp_update`` and ``tcp_cong_avoid_ai``."""
        if self.cwnd < self.ssthresh:
            new = min(self.cwnd + acked, self.ssthresh)
            acked -= int(new - self.cwnd)
            self.cwnd = int(new)
            if acked <= 0:
                return
        self._bictcp_update(acked, now)
        w = self.cnt
        if self.cnt_ai >= w:
            self.cnt_ai = 0
            self.cwnd += 1
        self.cnt_ai += acked
        if self.cnt_ai >= w:
            d = self.cnt_ai // w
            self.cnt_ai -= d * w
            self.cwnd += d

    def _bictcp_update(self, acked: int, now: float) -> None:
        cwnd = self.cwnd
        self.ack_cnt += acked
        if self.last_cwnd == cwnd and now - self.last_time <= CUBIC_REFRESH_S:
            return
        if not (self.epoch is not None and now == self.last_time):
            self.last_cwnd = cwnd
            self.last_time = now
            if self.epoch is None:
                self.epoch = now
                self.ack_cnt = acked
                self.reno_cwnd = cwnd
                if self.last_max <= cwnd:
                    self.k = 0.0
                    self.origin = cwnd
                else:
                    self.k = ((self.last_max - cwnd) / CUBIC_C) ** (1 / 3)
                    self.origin = self.last_max
            t = now - self.epoch + self.delay_min
            offs = abs(t - self.k)
            delta = CUBIC_C * offs ** 3
            target = self.origin - delta if t < self.k else self.origin + delta
            self.cnt = int(cwnd / (target - cwnd)) if target > cwnd else 100 * cwnd
            if self.last_max == 0 and self.cnt > 20:
                self.cnt = 20
        # tcp_friendliness
        delta = (cwnd * BETA_SCALE) >> 3
        while self.ack_cnt > delta:
            self.ack_cnt -= delta
            self.reno_cwnd += 1
        if self.reno_cwnd > cwnd:
            max_cnt = cwnd // (self.reno_cwnd - cwnd)
            if self.cnt > max_cnt:
                self.cnt = max_cnt
        self.cnt = max(self.cnt, 2)


class PacketChannel:
    """One channel's connections: ``send`` splits a message into one slice a connection
    (``transport.py``: connection i carries bytes [total i / n, total (i + 1) / n)) and calls
    ``arrived(t)`` once every slice is in; the channel is free for the next message at once
    (the transport's writes return when the kernel has the bytes).  ``write_latency``: each
    slice's writer thread starts that long after the message is handed over (a draw per slice;
    ``build.profiled_write_latency`` reads a traced run's)."""

    def __init__(self, sim: Simulator, net: PacketNet, host: str, path: list[Link], ack_path: list[Link],
                 rtt: float, connections: int, restart_after_idle: bool, hystart: bool, counts: dict,
                 owner: str = "", write_latency: Callable[[], float] | None = None):
        self._sim = sim
        # seconds from a message handed to the transport to a slice's first write (its writer
        # thread's wake-up, a draw each; none: at once)
        self._write_latency = write_latency
        self._conns = [_Connection(sim, net, host, path, ack_path, rtt, restart_after_idle, hystart, counts, owner)
                       for _ in range(connections)]

    @property
    def connections(self) -> list[_Connection]:
        return self._conns

    def send(self, size: float, arrived: Callable[[float], None]) -> None:
        n = len(self._conns)
        total = int(round(size))
        left = [n]
        last = [0.0]

        def one(t: float) -> None:
            left[0] -= 1
            last[0] = max(last[0], t)
            if left[0] == 0:
                arrived(last[0])

        for i, conn in enumerate(self._conns):
            lo, hi = total * i // n, total * (i + 1) // n
            wait = self._write_latency() if self._write_latency is not None else 0.0
            if wait > 0:
                self._sim.at(self._sim.now + wait, lambda conn=conn, b=SLICE_HEADER_BYTES + hi - lo: conn.write(b, one))
            else:
                conn.write(SLICE_HEADER_BYTES + hi - lo, one)


def new_counts() -> dict[str, int]:
    """The run's packet-level tallies (``PacketChannel``'s ``counts``)."""
    return {"restarts": 0, "retransmits": 0, "timeouts": 0, "probes": 0, "recoveries": 0, "undos": 0,
            "hystart_delay": 0, "hystart_train": 0}
