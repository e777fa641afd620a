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

from testbed.net.tcpmodel import CUBIC_BETA, MSS, RTO_MIN_S


INIT_SEGMENTS = 10  # Linux's initial congestion window (TCP_INIT_CWND), segments
INITIAL_WINDOW = INIT_SEGMENTS * MSS  # the same in bytes


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
    * Above ssthresh (only where a restart or decay lowered a window below a finite ssthresh)
      a segment a round trip (Reno's congestion avoidance; CUBIC's cubic growth is left out: only
      bulk transfers reach it, and they sit at ``cap``).

    * Losses (only for ``rounds.RoundsChannel``, which finds them at a full queue): known
      lost, CUBIC's multiplicative decrease to 0.7, once a round trip (``lose``, ``_reduce``);
      a retransmission timeout to one segment.  Above ssthresh a round's ACKs add a segment
      per window's worth (``_acknowledged_round``).

    * HyStart only as a given threshold (``ssthresh``, ``sim.tcp_ssthresh_segments``): CUBIC's
      HyStart ends slow start without loss (``hystart_update``: ssthresh = cwnd), which
      ``parallel.tcp_trace`` found on every WAN connection of the long haul (36-120 segments,
      no retransmission); its trigger (the round's RTT over the path's minimum by 4-16 ms, or
      an ACK train) is not modelled, so the threshold is there from the connection's start.

    What it leaves out: loss and its recovery under fair sharing (``cap`` stands in for it;
    random loss is ``loss_cap``'s), HyStart's own trigger, delayed and stretched ACKs (growth in whole
    rounds, each round's ACKs a round trip after it left), pacing, the queueing delay in the
    RTO's srtt."""

    HEADER_SEGMENTS = 1  # the slice header, its own segment (transport.py, TCP_NODELAY)

    def __init__(self, rtt: float, connections: int, cap: float, restart_after_idle: bool,
                 ssthresh: float | None = None):
        self.rtt, self.n = rtt, connections
        self.cap_segs = max(INIT_SEGMENTS, int(cap // MSS))
        self.restart = restart_after_idle
        self.segs = INIT_SEGMENTS  # snd_cwnd
        # snd_ssthresh: infinite until a loss, or where HyStart ends slow start (``sim.tcp_ssthresh_segments``)
        self.ssthresh = float("inf") if ssthresh is None else float(ssthresh)
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
                if len(f) == 2:  # (``end``'s: a message's last round under fair sharing)
                    self._acknowledged(f[1])
                elif f[2] == "lost":  # lost segments, now known lost: the window is cut
                    self._reduce(f[0])
                elif f[2] == "timeout":  # a retransmission timeout: one segment, slow start again
                    self._reduce(f[0], timeout=True)
                else:  # a round (``send_round``)
                    self._acknowledged_round(f[1])
                    self._clocked = (now, (self._clocked[1] if self._clocked[0] == now else 0) + f[1])
        return sum(f[1] for f in self._flights)

    def room(self, now: float) -> int:
        """Segments a connection may send at ``now``: the window less what is in flight."""
        return max(0, self.segs - self.in_flight(now))

    def _acknowledged(self, k: int) -> None:
        """The ACKs of ``k`` segments: in slow start a segment each while the window is used
        (``tcp_slow_start`` under ``tcp_is_cwnd_limited``); above ssthresh a segment a round."""
        if self.segs < self.ssthresh:
            if self._limited():
                self.segs = min(self.cap_segs, max(self.segs, min(self.segs + k, 2 * self.max_out)))
        elif self.segs <= self.max_out:
            self.segs = min(self.cap_segs, self.segs + 1)

    def _acknowledged_round(self, k: int) -> None:
        """The ACKs of a round's ``k`` delivered segments: in slow start as ``_acknowledged``;
        above ssthresh a segment per window's worth of ACKs while the window is used
        (``tcp_cong_avoid_ai``'s ``snd_cwnd_cnt``), however many rounds a round trip holds."""
        if self.segs < self.ssthresh:
            self._acknowledged(k)
        elif self.segs <= self.max_out:
            self._ai += k
            if self._ai >= self.segs:
                self._ai -= self.segs
                self.segs = min(self.cap_segs, self.segs + 1)

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

    def grow(self, acked: float | None = None) -> bool:
        """One round of the current message acknowledged (``acked`` bytes a connection; default
        a full window: it filled the window, so the window is used): slow start doubles it,
        congestion avoidance adds a segment, up to ``cap``; False once the window is at its cap."""
        k = self.segs if acked is None else max(1, min(self.segs, int(round(acked / MSS))))
        self._acked += k
        self.max_out = max(self.max_out, k)
        if self.segs >= self.cap_segs:
            return False
        if self.segs < self.ssthresh:
            self.segs = min(self.cap_segs, self.segs + k, max(int(min(self.ssthresh, 1 << 40)), self.segs + 1))
        else:
            self.segs = min(self.cap_segs, self.segs + 1)
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
        self._flights.append((now + self.rtt, last))  # its ACKs grow the window a round trip on
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

    def served(self, flight: list, now: float) -> None:
        """``flight``'s first byte left the bottleneck at ``now``: its ACKs come back from a
        round trip on, and the window they open sends the next round then (ACK-clocked: in
        slow start two segments an ACK, so the next round leaves the bottleneck right behind
        the ACKs' own; counted at once)."""
        flight[0] = now + self.rtt

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
        if timeout:  # tcp_enter_loss: the loss window, one segment
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
