"""One channel's TCP congestion window as Linux runs it (``sim.tcp_window_model``).

How it fits: ``build.simulate`` keeps one ``TcpWindow`` per channel (a worker's connection set
to one peer, for one kind of message).  Under fair sharing it sets the ceiling of each
message's flow round by round (``begin``, ``grow``, ``end``, ``send_time``); under
``sim.sharing: fifo-bursts`` ``rounds.RoundsChannel`` sends each message a window at a time
and asks it what the window has room for (``send_round``), tells it when a round's first
byte left the bottleneck (``served``) and when a loss was detected (``lose``).  Both ways
share the window's state: slow start, Linux's cwnd validation, the restart after idle.
``build.window_model`` says whether a run uses it: ``sim.tcp_window_model`` if set, else on
where the hosts keep Linux's ``tcp_slow_start_after_idle = 1`` (the default since 2026-12-06,
chosen on issue #30's validation matrix) and off on WAN-tuned hosts.
"""

from __future__ import annotations

from typing import Callable

from testbed.net.tcpmodel import CUBIC_BETA, MSS, RTO_MIN_S


INIT_SEGMENTS = 10  # Linux's initial congestion window (TCP_INIT_CWND), segments
INITIAL_WINDOW = INIT_SEGMENTS * MSS  # the same in bytes

# CUBIC's HyStart (net/ipv4/tcp_cubic.c, its module parameters' defaults): slow start ends
# without loss where a round's ACKs come as a train, or its round trips rise over the minimum
HYSTART_LOW_WINDOW = 16  # hystart_low_window: HyStart runs only at this window and above
HYSTART_MIN_SAMPLES = 8  # a round's first 8 samples only set its minimum; the 9th and on test it
HYSTART_DELAY_MIN, HYSTART_DELAY_MAX = 0.004, 0.016  # HYSTART_DELAY_THRESH: clamp(min_rtt / 8, 4 ms, 16 ms)
HYSTART_ACK_DELTA = 0.002  # hystart_ack_delta_us: ACKs this close are one train
ACK_SEGMENTS = 2  # the receiver's delayed ACK: one for every second full segment (__tcp_ack_snd_check)
GSO_MAX_SIZE = 65536  # sk_gso_max_size (GSO_LEGACY_MAX_SIZE): hystart_ack_delay's allowance
# CUBIC's growth above ssthresh (bictcp_update): C = 0.4 (bic_scale 41 x 10 / 1024), segments / s^3;
# with no loss yet (last_max_cwnd 0) at least 5% a round trip (cnt <= 20); at most half a segment an ACK
CUBIC_C = 410 / 1024
CUBIC_CNT_FIRST, CUBIC_CNT_MIN = 20, 2


def hystart_delay_threshold(min_rtt: float) -> float:
    """HYSTART_DELAY_THRESH(min_rtt >> 3): the rise in a round's minimum round trip that ends slow start."""
    return min(HYSTART_DELAY_MAX, max(HYSTART_DELAY_MIN, min_rtt / 8))


class TcpWindow:
    """One channel's congestion window per connection, as Linux runs it for messages that come
    and go (CUBIC, no loss).  Every connection of the channel carries an equal slice of each
    message (``testbed/train/transport.py``), so one window stands for all of them.  The window
    is counted in segments, as the kernel counts it: a slice of s bytes is ceil(s / MSS)
    segments plus one for its header (the transport writes the header on its own, and with
    TCP_NODELAY it leaves as its own segment); ``cwnd`` is the window in bytes (segments x MSS).

    What it models, with the kernel function that does it:

    * A new connection starts at 10 segments (``tcp_init_cwnd``) with an infinite ssthresh.
    * Growth only while the window is used (``tcp_is_cwnd_limited``, checked by
      ``cubictcp_cong_avoid`` on every ACK): the flight filled the window (``is_cwnd_limited``,
      set in ``tcp_write_xmit``), or, in slow start, the window is under twice the most in
      flight in the current window (``max_packets_out``, reset once a window is all
      acknowledged; ``tcp_cwnd_validate``).  In slow start every segment acknowledged then grows
      the window by one (``tcp_slow_start``), so a channel whose messages fit its window holds
      about twice its largest flight, not the path's BDP, however many messages it has sent.
      A message larger than the window goes in rounds, the window doubling each (``grow``), up
      to ``cap`` (the path's BDP plus its queue, past which a real flow loses packets).
    * Application-limited decay (``tcp_cwnd_validate`` -> ``tcp_cwnd_application_limited``,
      RFC 2861; Linux runs it only with ``tcp_slow_start_after_idle``): a window not used for an
      RTO, checked as the next message is sent, becomes (cwnd + the most used, at least 10) / 2,
      ssthresh = max(ssthresh, 3/4 cwnd) (``tcp_current_ssthresh``).
    * Restart after idle (``tcp_slow_start_after_idle_check`` -> ``tcp_cwnd_restart``, with
      ``restart_after_idle``: Linux's default ``tcp_slow_start_after_idle = 1``): a message that
      finds nothing in flight and the channel idle (since its last segment left) longer than
      the RTO (RTT + 200 ms) halves the window (``>>= 1``) once per RTO idle, down to 10 segments
      (or the window, if smaller); ssthresh = max(ssthresh, 3/4 cwnd).  A message larger than
      the restarted window pays a round trip per doubling it needs.
    * Above ssthresh, no loss yet: CUBIC (``bictcp_update``): origin + C t^3 from the window the
      epoch began at (the idle time left out, CA_EVENT_TX_START), at least 5% a round trip
      (``last_max_cwnd`` 0: cnt <= 20), counted per ACK as ``tcp_cong_avoid_ai`` counts.

    * Losses (only for ``rounds.RoundsChannel``, which finds them at a full queue): known
      lost, CUBIC's multiplicative decrease to 0.7, once a round trip (``lose``, ``_reduce``);
      a retransmission timeout to one segment.  Above ssthresh a round's ACKs add a segment
      per window's worth (``_acknowledged_round``).

    * CUBIC's HyStart (``hystart``, ``sim.tcp_hystart``, on by default with the window model since
      2026-12-06): ``_hystart`` runs Linux's ``hystart_update`` on each round's ACKs (one every
      second segment) from a window of 16 segments: delay (from the 9th sample, the round's
      minimum round trip over the path's by clamp(min_rtt / 8, 4 ms, 16 ms)) or ACK train (ACKs
      <= 2 ms apart spanning half of min_rtt + 1 ms); then ssthresh = cwnd, once a connection
      (until a timeout).  The caller gives each round's sample (``sample_round``): the queueing
      delay its first segments meet (``build``: what the path's flows hold in its queues, and a
      first flight's half of its siblings' slices; ``rounds``: the FIFO's own wait) and its ACK
      spacing.  ``ssthresh`` (``sim.tcp_ssthresh_segments``) still gives a threshold from the start.

    What it leaves out: loss and its recovery under fair sharing (``cap`` stands in for it;
    random loss is ``loss_cap``'s), quick and stretched ACKs (growth in whole rounds, each
    round's ACKs a round trip after it left), pacing, the queueing delay in the RTO's srtt,
    CUBIC's return to its last maximum after a loss (``rounds``: Reno's segment a window),
    one HyStart per connection (one window stands for all of them: its typical connection's)."""
    HEADER_SEGMENTS = 1  # the slice header, its own segment (transport.py, TCP_NODELAY)

    def __init__(self, rtt: float, connections: int, cap: float, restart_after_idle: bool,
                 ssthresh: float | None = None, hystart: bool = False):
        self.rtt, self.n = rtt, connections
        self.cap_segs = max(INIT_SEGMENTS, int(cap // MSS))
        self.restart = restart_after_idle
        self.segs = INIT_SEGMENTS  # snd_cwnd
        # snd_ssthresh: infinite until a loss, or where HyStart ends slow start (``sim.tcp_ssthresh_segments``)
        self.ssthresh = float("inf") if ssthresh is None else float(ssthresh)
        self.hystart = hystart  # CUBIC's HyStart ends slow start (``_hystart``; ``sim.tcp_hystart``)
        self.found = False  # HyStart has ended slow start (``ca->found``: once a connection, until a timeout)
        self.hystart_exit: tuple[int, str] | None = None  # (the window it set ssthresh to, "delay" or "train")
        # the current round's HyStart sample, from the caller (``sample_round``): (the queueing delay
        # its first segments meet at the bottleneck, s; the spacing of a connection's ACKs, s, or None)
        self._sample: tuple[float, float | None] | None = None
        self._epoch: float | None = None  # CUBIC's epoch_start (congestion avoidance since), None: none yet
        self._origin = 0  # bic_origin_point: the window the epoch began at
        self.last_sent: float | None = None  # when the channel's last segment left (``lsndtime``)
        self.max_out = 0  # the most in flight in the current window (``max_packets_out``)
        self.used = 0  # the most in flight while the window was not used (``snd_cwnd_used``)
        self.stamp: float | None = None  # when the window was last used or changed (``snd_cwnd_stamp``)
        self.restarts = 0  # restarts after idle that cut the window (for reports and tests)
        # (acknowledged at, segments): a message's last round (``end``); [acknowledged at,
        # segments, "round"]: a round (``send_round``; its time is inf until ``served`` dates
        # it); [detected at, segments, "lost"]: dropped and not yet known lost
        self._flights: list = []
        self.losses = 0  # windows cut by a detected loss (``lose``; for reports and tests)
        self._recovery_end = float("-inf")  # a loss detected before this is the same episode
        self._ai = 0  # segments acknowledged towards the next one of congestion avoidance (rounds)
        self._clocked: tuple[float, int] = (float("-inf"), 0)  # (when, segments acknowledged then, not yet taken)
        self._acked = 0  # segments of the current message acknowledged in its full rounds
        self._msg = 0  # the current message's segments a connection

    @property
    def cwnd(self) -> float:
        """The window in bytes a connection."""
        return float(self.segs * MSS)

    @property
    def cap(self) -> float:
        return float(self.cap_segs * MSS)

    @property
    def rto(self) -> float:
        return self.rtt + RTO_MIN_S

    def segments(self, size: float) -> int:
        """Segments a connection for a message of ``size`` bytes (the channel's)."""
        return -(-int(round(size / self.n)) // MSS) + self.HEADER_SEGMENTS if size > 0 else 0

    def holds(self, size: float) -> bool:
        """Whether the window holds a whole message of ``size`` bytes (the channel's) at once."""
        return self.segments(size) <= self.segs

    def in_flight(self, now: float) -> int:
        """Segments a connection has sent and not yet had acknowledged at ``now``; the flights
        acknowledged by then grow the window as their ACKs come in (``_acknowledged``)."""
        if self._flights and min(f[0] for f in self._flights) <= now:
            due = sorted((f for f in self._flights if f[0] <= now), key=lambda f: f[0])  # (stable)
            self._flights = [f for f in self._flights if f[0] > now]
            for f in due:
                if type(f) is tuple:  # (``end``'s: a message's last round under fair sharing)
                    self._acknowledged(f[1], f[2], f[0])
                elif f[2] == "lost":  # lost segments, now known lost: the window is cut
                    self._reduce(f[0])
                elif f[2] == "timeout":  # a retransmission timeout: one segment, slow start again
                    self._reduce(f[0], timeout=True)
                else:  # a round (``send_round``)
                    self._acknowledged_round(f[1], f[3] if len(f) > 3 else None, f[0])
                    self._clocked = (now, (self._clocked[1] if self._clocked[0] == now else 0) + f[1])
        return sum(f[1] for f in self._flights)

    def room(self, now: float) -> int:
        """Segments a connection may send at ``now``: the window less what is in flight."""
        return max(0, self.segs - self.in_flight(now))

    def _acknowledged(self, k: int, sample: tuple | None = None, now: float | None = None) -> None:
        """The ACKs of a round's ``k`` segments (``sample``: its HyStart sample, ``sample_round``):
        in slow start a segment each while the window is used (``tcp_slow_start`` under
        ``tcp_is_cwnd_limited``), HyStart ending it where the round says so (``_hystart``); above
        ssthresh, while the window is used, CUBIC's growth (``_cong_avoid``)."""
        if self.segs < self.ssthresh:
            fire = self._hystart(k, sample, self._ss_after)
            if fire is None:
                self._slow_start(k)
                return
            self._slow_start(fire)
            self._exit(sample)
            k -= fire
        if self.segs <= self.max_out:
            self._cong_avoid(k, now)

    def _acknowledged_round(self, k: int, sample: tuple | None = None, now: float | None = None) -> None:
        """The ACKs of a round's ``k`` delivered segments (``rounds.RoundsChannel``): as
        ``_acknowledged``, however many rounds a round trip holds."""
        self._acknowledged(k, sample, now)

    def _slow_start(self, k: int) -> None:
        """``k`` ACKs in slow start: a segment each while the window is used (``_limited``)."""
        if self._limited():
            self.segs = min(self.cap_segs, max(self.segs, min(self.segs + k, 2 * self.max_out)))

    def _ss_after(self, i: int) -> int:
        """The window after ``i`` ACKs of slow start (``_slow_start``'s growth, ssthresh aside)."""
        if not self.segs < 2 * self.max_out:
            return self.segs
        return min(self.cap_segs, max(self.segs, min(self.segs + i, 2 * self.max_out)))

    def sample_round(self, queue_delay: float, spacing: float | None) -> None:
        """The caller's HyStart sample of the round now sent (``begin``'s first flight, or the
        round a ``grow`` opens): the queueing delay its first segments meet at the bottleneck
        (a round's minimum round trip over the path's), and how far apart one connection's ACKs
        of it come back (None: not a train).  ``grow`` and ``end``'s flight use it."""
        self._sample = (queue_delay, spacing)

    def _hystart(self, k: int, sample: tuple | None, after: Callable[[int], int]) -> int | None:
        """How many of a round's ``k`` segments are acknowledged before the ACK at which CUBIC's
        HyStart ends slow start, or None (``hystart_update``, called for every ACK in slow start
        from ``cubictcp_acked`` while the window is at least ``hystart_low_window``;
        ``after(i)``: the window after i segments acknowledged).  The receiver acknowledges
        every second segment (``__tcp_ack_snd_check``; quick ACKs left out).  The round
        (``bictcp_hystart_reset``) starts at its first ACK, before the test for a window of 16
        (Linux 6.11 on, and stable 6.1/6.6); samples count from the first ACK at 16.  Delay:
        from its 9th sample on,
        the round's minimum round trip over the path's by more than clamp(min_rtt / 8, 4 ms,
        16 ms); the minimum is its first segments' (``sample``'s queueing delay).  ACK train:
        ACKs no more than 2 ms apart spanning more than half of (min_rtt +
        ``hystart_ack_delay``), unpaced (``sample``'s spacing is a connection's segments')."""
        if not self.hystart or self.found or sample is None or self.segs >= self.ssthresh:
            return None
        queue_delay, spacing = sample
        acks = -(-k // ACK_SEGMENTS)
        first = next((m for m in range(min(acks, HYSTART_LOW_WINDOW)) if after(ACK_SEGMENTS * m) >= HYSTART_LOW_WINDOW),
                     None)  # (0-based: the ACK after ``first`` ACKs)
        if first is None:
            return None
        fires = []
        if acks - first > HYSTART_MIN_SAMPLES and queue_delay > hystart_delay_threshold(self.rtt):
            fires.append(first + HYSTART_MIN_SAMPLES)
        gap = None if spacing is None else ACK_SEGMENTS * spacing
        if gap is not None and 0 < gap <= HYSTART_ACK_DELTA and self.rtt > 0:
            pacing = 2 * after(ACK_SEGMENTS * first) * MSS / self.rtt  # sk_pacing_rate in slow start: 200%
            threshold = (self.rtt + min(1e-3, 4 * GSO_MAX_SIZE / pacing)) / 2
            j = int(threshold // gap) + 1  # ACKs after the round's first until the train spans it
            # (the round's first ACK is its last_ack; a train broken before the window reaches 16 is lost)
            if first * gap <= HYSTART_ACK_DELTA and max(first, j) < acks:
                fires.append(max(first, j))
        return min(ACK_SEGMENTS * min(fires), k) if fires else None

    def _exit(self, sample: tuple) -> None:
        """HyStart found the round's end of slow start: ssthresh = cwnd (``hystart_update``)."""
        self.ssthresh = self.segs
        self.found = True
        queue_delay, _ = sample
        how = "delay" if queue_delay > hystart_delay_threshold(self.rtt) else "train"
        self.hystart_exit = (self.segs, how)

    def _cong_avoid(self, k: int, now: float | None) -> None:
        """``k`` ACKs above ssthresh while the window is used (``cubictcp_cong_avoid``).  No loss
        yet (``last_max_cwnd`` 0): CUBIC from the window the epoch began at, origin + C t^3 a
        round trip ahead (``bictcp_update``), at least 5% a round trip (cnt <= 20), at most half a
        segment an ACK, counted as ``tcp_cong_avoid_ai`` counts (``snd_cwnd_cnt``).  After a
        loss (``rounds`` only) Reno's segment per window of ACKs (CUBIC's return to its last
        maximum is left out)."""
        if self.losses:  # (one segment at most a round, as before HyStart was modelled)
            self._ai += k
            if self._ai >= self.segs:
                self._ai -= self.segs
                self.segs = min(self.cap_segs, self.segs + 1)
            return
        else:
            cnt = CUBIC_CNT_FIRST
            if now is not None:
                if self._epoch is None:
                    self._epoch, self._origin = now, self.segs
                target = self._origin + CUBIC_C * (now - self._epoch + self.rtt) ** 3
                if target > self.segs:
                    cnt = min(cnt, int(self.segs / (target - self.segs)))
            cnt = max(CUBIC_CNT_MIN, cnt)
        self._ai += k
        if self._ai >= cnt:
            grown, self._ai = divmod(self._ai, cnt)
            self.segs = min(self.cap_segs, self.segs + grown)

    def _limited(self) -> bool:
        """``tcp_is_cwnd_limited`` in slow start: the window is under twice the most in flight."""
        return self.segs < self.ssthresh and self.segs < 2 * self.max_out

    def begin(self, now: float, size: float = 0.0) -> None:
        """A message of ``size`` bytes (the channel's, all connections) starts at ``now``:
        restart the window if the channel was idle long enough, then account the message's
        first flight as ``tcp_write_xmit`` / ``tcp_cwnd_validate`` do."""
        if self.stamp is None:
            self.stamp = now
        flying = self.in_flight(now)
        if self._epoch is not None and self.last_sent is not None and flying <= 0:
            # CA_EVENT_TX_START (``cubictcp_cwnd_event``): the idle time does not count to CUBIC's epoch
            self._epoch = min(now, self._epoch + (now - self.last_sent))
        if self.restart and self.last_sent is not None and flying <= 0 and now - self.last_sent > self.rto:
            # tcp_cwnd_restart: halve per RTO idle, down to the initial window
            self.ssthresh = max(self.ssthresh, (self.segs >> 1) + (self.segs >> 2))
            floor = min(INIT_SEGMENTS, self.segs)
            cwnd, idle = self.segs, now - self.last_sent
            while idle - self.rto > 0 and cwnd > floor:
                idle -= self.rto
                cwnd >>= 1
            if max(cwnd, floor) < self.segs:
                self.restarts += 1
            self.segs = max(cwnd, floor)
            self.stamp, self.used = now, 0
        self._msg = self.segments(size)
        self._acked = 0
        if not size:
            return
        flight = min(self.segs, flying + self._msg)
        if flying <= 0:  # the previous window is all acknowledged: a new one is tracked
            self.max_out = flight
        else:
            self.max_out = max(self.max_out, flight)
        full = flying + self._msg >= self.segs  # the message fills the window (is_cwnd_limited)
        self._validate(now, flight, full)

    def _validate(self, now: float, flight: int, full: bool) -> None:
        """``tcp_cwnd_validate``: a used window is stamped; one unused for an RTO decays
        (``tcp_cwnd_application_limited``, only where slow start after idle is on)."""
        if full or self._limited():
            self.used, self.stamp = 0, now
            return
        self.used = max(self.used, flight)
        if self.restart and now - self.stamp >= self.rto:
            used = max(self.used, INIT_SEGMENTS)
            if used < self.segs:
                self.ssthresh = max(self.ssthresh, (self.segs >> 1) + (self.segs >> 2))
                self.segs = (self.segs + used) >> 1
            self.used, self.stamp = 0, now

    def rate(self) -> float:
        return self.n * self.cwnd / self.rtt if self.rtt > 0 else float("inf")

    def grow(self, acked: float | None = None, now: float | None = None) -> bool:
        """One round of the current message acknowledged (``acked`` bytes a connection; default
        a full window: it filled the window, so the window is used) at ``now``: slow start
        doubles it (HyStart may end it: ``_hystart``, with the round's ``sample_round``), then
        CUBIC's congestion avoidance (``_cong_avoid``), up to ``cap``; False once the window is
        at its cap."""
        k = self.segs if acked is None else max(1, min(self.segs, int(round(acked / MSS))))
        self._acked += k
        self.max_out = max(self.max_out, k)
        if self.segs >= self.cap_segs:
            return False
        if self.segs < self.ssthresh:
            fire = self._hystart(k, self._sample, lambda i: min(self.cap_segs, self.segs + i))
            if fire is None:
                self.segs = min(self.cap_segs, self.segs + k, max(int(min(self.ssthresh, 1 << 40)), self.segs + 1))
                return True
            self.segs = min(self.cap_segs, self.segs + fire)
            self._exit(self._sample)
            k -= fire
        self._cong_avoid(k, now)
        return True

    def end(self, now: float, size: float = 0.0) -> None:
        """The message has left at ``now``: its last round is in flight for a round trip, and its
        acknowledgements then grow the window while it is used (slow start: up to twice the most
        in flight; ``tcp_is_cwnd_limited``; see ``in_flight``).  ``size`` (the channel's bytes) for a caller that did
        not pass it to ``begin``."""
        self.last_sent = now
        msg = self.segments(size) if size else self._msg
        last = msg - self._acked  # the segments of the last (partial) round
        self._msg = 0
        if last <= 0:
            return
        self._flights.append((now + self.rtt, last, self._sample))  # its ACKs grow the window a round trip on
        if self._acked:  # a new window began with the last round: its flight is what it holds
            self.max_out = last + sum(f[1] for f in self._flights[:-1])

    # -- a message a window at a time (``rounds.RoundsChannel``) ------------------------------
    def send_round(self, now: float, left: int, retransmit: bool = False) -> list | None:
        """The next round of the current message: what the window has room for at ``now``
        (flights due by then acknowledged first, growing the window), at most ``left``
        segments a connection; accounted as ``tcp_write_xmit`` / ``tcp_cwnd_validate``
        account a flight.  ``retransmit``: all ``left`` segments, lost ones sent again as
        recovery sends them, whatever the room (and not new data: ``last_sent`` stays).
        Returns the flight, ``[acknowledged at, segments, "round"]``, in flight until ``served``
        dates it; None when the window has no room (the next acknowledgement makes some).
        Call ``begin(now)`` (no size) before a message's first round."""
        flying = self.in_flight(now)
        k = left if retransmit else min(self.segs - flying, left)
        if k <= 0:
            return None
        flight = [float("inf"), k, "round"]
        self._flights.append(flight)
        if retransmit:
            return flight
        self.last_sent = now  # new data leaves the host (``lsndtime``), whatever the queue then
        self.max_out = k if flying <= 0 else max(self.max_out, flying + k)
        self._validate(now, flying + k, flying + left >= self.segs)
        return flight

    def take_clocked(self, now: float, segments: int) -> int:
        """Of ``segments`` sent at ``now``, how many (a connection) the acknowledgements that
        arrive at ``now`` release, not taken yet: those are ACK-clocked, sent as the ACKs come
        in, not in one piece (the rest stay for the next round sent at ``now``)."""
        if self._clocked[0] != now:
            return 0
        segs = min(segments, self._clocked[1])
        self._clocked = (now, self._clocked[1] - segs)
        return segs

    def served(self, flight: list, now: float, sample: tuple | None = None) -> None:
        """``flight``'s first byte left the bottleneck at ``now``: its ACKs come back from a
        round trip on, and the window they open sends the next round then (ACK-clocked: in
        slow start two segments an ACK, so the next round leaves the bottleneck right behind
        the ACKs' own; counted at once).  ``sample``: the round's HyStart sample (``sample_round``)."""
        flight[0] = now + self.rtt
        if sample is not None:
            flight.append(sample)

    def lose(self, flight: list, segments: int, timeout: bool = False) -> list:
        """``segments`` of ``flight`` (its tail) were dropped at a full queue: they stay in
        flight, unacknowledged, until the loss is known (``detected``); the rest of the round
        is acknowledged as usual.  Returns the lost segments' entry."""
        flight[1] -= segments
        lost = [float("inf"), segments, "timeout" if timeout else "lost"]
        self._flights.append(lost)
        return lost

    @staticmethod
    def detected(lost: list, now: float) -> None:
        """The loss of ``lost`` is known at ``now`` (SACKs of later segments, or a tail-loss
        probe's): the window is cut then (``_reduce``, at the next ``in_flight``)."""
        lost[0] = now

    def _reduce(self, at: float, timeout: bool = False) -> None:
        """A loss detected at ``at``: CUBIC's multiplicative decrease (``bictcp_recalc_ssthresh``,
        beta 0.7; after recovery the window is ssthresh), once per round trip (one episode)."""
        self._epoch = None  # bictcp_recalc_ssthresh: the epoch ends
        if timeout:  # tcp_enter_loss: the loss window, one segment; HyStart again (cubictcp_state)
            self.found = False
            if at >= self._recovery_end:
                self.ssthresh = max(2, int(self.segs * CUBIC_BETA))
            self.segs = 1
            self._recovery_end = at + self.rtt
            self.losses += 1
            return
        if at < self._recovery_end:
            return
        self.ssthresh = max(2, int(self.segs * CUBIC_BETA))
        self.segs = self.ssthresh
        self._recovery_end = at + self.rtt
        self.losses += 1

    def send_time(self, size: float, bandwidth: float) -> float:
        """Seconds to push ``size`` bytes alone through a link of ``bandwidth`` from this window
        (a round trip per window it does not hold, the last round at the link's rate), advancing
        the window as it goes (``end`` then adds the last round's growth).  Call ``begin`` first."""
        t, left, segs = 0.0, float(size), self._msg or self.segments(size)
        while left > 0:
            if self.n * self.cwnd >= bandwidth * self.rtt or self.rtt <= 0 or segs <= self.segs:
                return t + left / bandwidth  # the link's rate binds, or the last round
            sent = self.segs
            left -= self.n * (sent - (self.HEADER_SEGMENTS if segs == self._msg else 0)) * MSS
            segs -= sent
            t += self.rtt
            self.grow()
        return t
