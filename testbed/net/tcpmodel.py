"""What one TCP connection can carry over a path with random loss: Linux's CUBIC, driven by the drops.

How it fits: the simulator (``testbed/sim/build.py``) caps each connection of a channel that
crosses a lossy WAN path at ``loss_limited_rate`` (N connections: N times that, as with
windows), and ``testbed fidelity`` (``fidelity.py``) reports, beside a direction's rate, the
goodput its measuring flow can expect under the direction's loss and round trip and the spread
of a measurement of that length (``expected_goodput``, ``expected_goodput_estimate``).  No
sockets, no kernel: the network code and the simulator both read it.

**The model** (``cubic_goodput``): a seeded Monte Carlo of one bulk flow, round trip by round
trip, over many replicas at once (numpy), as Linux 6.x runs CUBIC (``tcp_cubic.c``; RFC 9438):

* slow start from 10 segments, one segment per segment acknowledged while the window is under
  twice the flight, ended by the first loss or by HyStart's ACK train (the round's ACKs,
  spread by the link, spanning half the round trip: ``hystart_update``);
* after a loss, the window at its detection times beta = 717/1024 (``bictcp_recalc_ssthresh``),
  fast convergence (a window below the last maximum sets it to (1 + beta) / 2 of itself), the
  round of the recovery sending the segments before the detection and beta of the rest (PRR),
  losses among the segments already in flight part of the same recovery; then a new epoch:
  ``W(t) = W_max + C (t - K)^3``, C = 410/1024, K = cbrt((W_max - cwnd) / C), aimed one round
  trip ahead, at most 1.5x a round, never slower than the Reno estimate (+8/15 segment a round
  from the reduced window: the "Reno-friendly region", RFC 9438 section 4.3) and, before the
  first loss, at least 5% a round;
* the window grows only while used: it is held by the receiver's clamp (``window_bytes``: no
  loss) and, on a link of ``link_rate``, a window past its BDP queues (a longer round, the
  link's rate) and past BDP + ``queue_bytes`` overflows (a loss);
* the drops: each *drop unit* is lost with probability p: a segment by default, as on a real
  path, whose NIC puts single segments on the wire.  ``segments_per_drop=None`` models what the
  emulator did until 2026-12-06: a host handed the gateway (veth keeps them whole) GSO packets
  of ``tcp_tso_autosize``'s size, max(2, pacing rate / 1024 / MSS) segments (pacing 1.2 x
  cwnd / srtt, 2x in slow start; at most 45), and both the iptables rule and the delay line
  dropped a whole one: a segment was lost with probability p, as configured (the retransmits
  counted p), but loss *events* came at p / 2 or less per segment.  Measured on Sydney-London
  alone (0.05%, 262 ms, 32.6 Mbit/s, iperf3 ~95 s, iptables): 11.12 and 7.26 Mbit/s with GSO
  packets (this model with GSO drops: 11.3 [8.1-15.0]); 5.65 and 5.93 once the hosts sent
  single segments (``network.py`` does so wherever a link has loss; this model per segment:
  6.5 [4.8-8.3]);
* a loss in a round of fewer than 4 segments waits for the RTO (srtt + max(4 rttvar, 200 ms)),
  doubled while the retransmission is lost, then slow start from one segment.

A measurement of ``seconds`` after ``omit_s`` from the connection's start reads, per replica,
the payload delivered within it over its length; ``GoodputEstimate`` carries the replicas'
mean, standard deviation, 5th/95th percentiles and how often one lands within 10% of the mean.
Without ``seconds``, the long-run mean (10 loss epochs of warm-up, then 40, over 128
replicas).  The first 10-20 s after slow start run well above the long run (the window left at
the clamp by slow start decays over several losses, each cutting W_max to 0.85 of itself), so a
90 s measurement reads 10-30% more than the long run, and the model says so.  Results are
cached (``lru_cache`` on the arguments to 6 significant digits); one call costs 0.05-1 s.

Why not the published response functions (kept below for comparison, ``rfc_loss_limited_rate``):
RFC 9438 section 5's average window ``(C (3 + beta) / (4 (1 - beta)))^(1/4) RTT^(3/4) / p^(3/4)``
and Padhye et al.'s Reno rate (SIGCOMM 1998, b = 1: Linux counts acknowledged segments) assume
evenly spaced losses of single segments.  On aws-longhaul3-lossy (0.05%, 148-262 ms) the
emulator's flows carried 1.4-3.5x their figure; most of that was the drop unit (a GSO packet of
two or more segments halved the loss events, and the window goes as events^-0.75; measured,
above), some the random spacing (a long interval's convex growth), and the rest the
measurement's start and its spread (docs/benchmarks.md has the table).

Not modelled: reordering (the delay line keeps order; netem's jitter would reorder), spurious
retransmissions and their undo, delayed-ACK timing within a round (growth in whole rounds), the
jitter's effect beyond the RTO, losses of ACKs, pacing's smoothing of a round, the time a
recovery spends beyond one round, other flows on the link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

MSS = 1448  # payload bytes per segment (1500-byte MTU, TCP timestamps)
PAYLOAD_FRACTION = MSS / (MSS + 52 + 14)  # MSS / (MSS + TCP/IP headers with timestamps + Ethernet)
RTO_MIN_S = 0.2  # Linux: rto = srtt + max(4 rttvar, 200 ms)
CUBIC_C = 0.4  # Linux's, RFC 9438's
CUBIC_BETA = 0.7
ACKED_PER_ACK = 1  # Padhye's b: Linux counts acknowledged segments, not ACKs (since 4.0, RFC 3465 style)


def path_loss(losses) -> float:
    """The loss of a path whose hops drop independently: 1 - prod(1 - p_i)."""
    keep = 1.0
    for p in losses:
        keep *= 1.0 - p
    return 1.0 - keep


def rto_s(rtt_s: float, rttvar_s: float = 0.0, rto_min_s: float = RTO_MIN_S) -> float:
    """Linux's retransmission timeout on a steady path: srtt + max(4 rttvar, rto_min)."""
    return rtt_s + max(4.0 * rttvar_s, rto_min_s)


def cubic_window(p: float, rtt_s: float, c: float = CUBIC_C, beta: float = CUBIC_BETA) -> float:
    """CUBIC's average window (segments) under loss rate p: RFC 9438 section 5 (RFC 8312 Eq. 5)."""
    if p <= 0:
        return math.inf
    return (c * (3 + beta) / (4 * (1 - beta))) ** 0.25 * rtt_s ** 0.75 / p ** 0.75


def mathis_rate(p: float, rtt_s: float, mss: int = MSS, b: int = ACKED_PER_ACK) -> float:
    """Reno's rate without timeouts (Mathis et al. 1997): MSS sqrt(3/(2b)) / (RTT sqrt(p)), bytes/s."""
    if p <= 0 or rtt_s <= 0:
        return math.inf
    return mss * math.sqrt(3.0 / (2.0 * b)) / (rtt_s * math.sqrt(p))


def padhye_rate(p: float, rtt_s: float, mss: int = MSS, rto: float | None = None, b: int = ACKED_PER_ACK,
                rto_min_s: float = RTO_MIN_S) -> float:
    """Reno's rate with timeouts (Padhye et al. 1998, full model without the window limit), bytes/s."""
    if p <= 0 or rtt_s <= 0:
        return math.inf
    t0 = rto_s(rtt_s, 0.0, rto_min_s) if rto is None else rto
    denom = (rtt_s * math.sqrt(2.0 * b * p / 3.0)
             + t0 * min(1.0, 3.0 * math.sqrt(3.0 * b * p / 8.0)) * p * (1.0 + 32.0 * p * p))
    return mss / denom


def cubic_rate(p: float, rtt_s: float, mss: int = MSS) -> float:
    """CUBIC's window term alone, W_cubic x MSS / RTT, bytes/s."""
    if p <= 0 or rtt_s <= 0:
        return math.inf
    return cubic_window(p, rtt_s) * mss / rtt_s


def rfc_loss_limited_rate(p: float, rtt_s: float, mss: int = MSS, rttvar_s: float = 0.0,
                          rto_min_s: float = RTO_MIN_S) -> float:
    """The published response functions, kept for comparison (the expectation before
    2026-12-06): max(RFC 9438's CUBIC average window / RTT, Padhye's Reno rate with timeouts,
    b = 1), bytes/s, for evenly spaced losses of single segments."""
    if p <= 0 or rtt_s <= 0:
        return math.inf
    rto = rto_s(rtt_s, rttvar_s, rto_min_s)
    return max(cubic_rate(p, rtt_s, mss), padhye_rate(p, rtt_s, mss, rto=rto))


def loss_limited_rate(p: float, rtt_s: float, mss: int = MSS, rttvar_s: float = 0.0,
                      rto_min_s: float = RTO_MIN_S, link_rate: float | None = None,
                      queue_bytes: float | None = None, window_bytes: float | None = None) -> float:
    """One CUBIC connection's long-run payload rate (bytes/s) under random segment loss ``p``
    on a path of round trip ``rtt_s``: the loss-driven window model's long-run mean
    (``cubic_goodput``), on a bottleneck of ``link_rate`` payload bytes/s with ``queue_bytes``
    of queue and a receiver window of ``window_bytes`` where given.  Unbounded (``inf``)
    without loss: then windows and the link decide."""
    if p <= 0 or rtt_s <= 0:
        return math.inf
    return cubic_goodput(p, rtt_s, link_rate, window_bytes, queue_bytes, mss=mss, rttvar_s=rttvar_s,
                         rto_min_s=rto_min_s).mean


def expected_goodput(rate_bytes_s: float, p: float, rtt_s: float, connections: int = 1,
                     window_bytes: float | None = None, mss: int = MSS, rttvar_s: float = 0.0,
                     rto_min_s: float = RTO_MIN_S, queue_bytes: float | None = None,
                     seconds: float | None = None, omit_s: float = 0.0) -> float:
    """What ``connections`` bulk CUBIC connections together can expect across a link whose payload
    rate is ``rate_bytes_s``: min(the link's payload rate, connections x (window / RTT),
    connections x what one sustains under the loss alone on the link and its queue), bytes/s;
    ``seconds``: the mean of a measurement that long, ``omit_s`` after the start
    (``expected_goodput_estimate``)."""
    out = rate_bytes_s
    if window_bytes is not None and rtt_s > 0:
        out = min(out, connections * window_bytes / rtt_s)
    if p <= 0 or rtt_s <= 0:
        return out
    est = expected_goodput_estimate(rate_bytes_s, p, rtt_s, connections, window_bytes, mss, rttvar_s, rto_min_s,
                                    queue_bytes, seconds, omit_s)
    return min(out, connections * est.mean)


def expected_goodput_estimate(rate_bytes_s: float, p: float, rtt_s: float, connections: int = 1,
                              window_bytes: float | None = None, mss: int = MSS, rttvar_s: float = 0.0,
                              rto_min_s: float = RTO_MIN_S, queue_bytes: float | None = None,
                              seconds: float | None = None, omit_s: float = 0.0) -> GoodputEstimate:
    """One of ``connections`` connections' ``GoodputEstimate``, as if alone on the link
    (``rate_bytes_s``, ``queue_bytes``: the sum is ``expected_goodput``'s to cap), its window
    clamped at ``window_bytes``."""
    link = rate_bytes_s if math.isfinite(rate_bytes_s) else None
    return cubic_goodput(p, rtt_s, link, window_bytes, queue_bytes, seconds, omit_s, mss, rttvar_s, rto_min_s)


# --- the loss-driven window model: Linux's CUBIC, round by round, under random drops -------

LINUX_CUBIC_BETA = 717 / 1024  # tcp_cubic.c: beta = 717 (of 1024)
LINUX_CUBIC_C = 41 * 10 / 1024  # tcp_cubic.c: bic_scale = 41, C = bic_scale x 10 / 1024 = 0.4004
RENO_GAIN = 8 / 15  # tcp_cubic.c's Reno estimate: +1 segment per cwnd x beta_scale / 8 acked (beta_scale 15)
SEGMENTS_PER_DROP = 1  # a segment, as on a real path (and on the emulator since 2026-12-06); None: GSO packets
MIN_DROP_SEGMENTS = 2  # tcp_min_tso_segs: the smallest GSO packet a bulk flow sends
GSO_MAX_SEGMENTS = 45  # a GSO packet holds at most 64 KB: 45 segments
DUP_THRESHOLD = 4  # a loss in a round of fewer segments than this waits for the RTO
REPLICAS_MEASURED = 1000  # Monte Carlo replicas for one measurement's spread
REPLICAS_LONG = 128  # ... and for the long-run mean (each for LONG_EPOCHS loss epochs)
LONG_EPOCHS = 40
WARMUP_EPOCHS = 10


@dataclass(frozen=True)
class GoodputEstimate:
    """A CUBIC flow's goodput under random loss (payload bytes/s): the mean over the model's
    replicas of what a measurement of ``seconds`` reads (``seconds`` None: the long-run
    average), its standard deviation and 5th/95th percentiles across replicas, and the loss
    events a replica saw in its measurement (mean)."""

    mean: float
    sd: float
    low: float
    high: float
    seconds: float | None
    replicas: int
    loss_events: float
    within_10pct: float  # the fraction of the replicas' measurements within 10% of the mean

    def relative_band(self) -> tuple[float, float]:
        """(low, high) as fractions of the mean: where 90% of the measurements fall."""
        return (self.low / self.mean, self.high / self.mean) if self.mean > 0 else (math.nan, math.nan)


def _simulate(p: float, rtt: float, seg_rate: float, clamp: float, limit: float, hystart: bool, rto: float,
              omit: float, duration: float, replicas: int, seed: int,
              segments_per_drop: float) -> tuple[np.ndarray, np.ndarray]:
    """``replicas`` independent CUBIC flows, round by round, for ``omit + duration`` seconds;
    returns each one's segments delivered per second within [omit, omit + duration] and its
    loss events there.  Windows in segments, ``seg_rate`` the link's segments a second (inf:
    no link), ``clamp`` the receiver's window (holds the window, never loses), ``limit`` the
    window past which the link's queue overflows (a loss).  See ``cubic_goodput``."""
    rng = np.random.default_rng(seed)
    n = replicas
    beta, c = LINUX_CUBIC_BETA, LINUX_CUBIC_C
    tso = not segments_per_drop  # drops of the host's GSO packets, sized as Linux sizes them
    hy_w = seg_rate * rtt / 2 if hystart and math.isfinite(seg_rate) else math.inf
    cwnd = np.full(n, 10.0)
    ssthresh = np.full(n, np.inf)
    ss = np.ones(n, bool)
    rec = np.zeros(n, bool)
    rec_send = np.zeros(n)
    skip = np.zeros(n)
    wmax, k_t, origin, te, tcpc = (np.zeros(n) for _ in range(5))
    left = rng.geometric(p, n) - 1.0  # eligible drop units (GSO packets) before the next dropped one
    t = np.zeros(n)
    delivered = np.zeros(n)
    events = np.zeros(n)
    end = omit + duration
    while True:
        active = t < end
        if not active.any():
            break
        w = np.maximum(np.where(rec, rec_send, np.minimum(np.floor(cwnd), clamp)), 1.0)
        rt = np.maximum(rtt, w / seg_rate)
        frac = np.clip((np.minimum(t + rt, end) - np.maximum(t, omit)) / rt, 0.0, 1.0)
        # losses: the next random drop among this round's eligible segments, or the queue's
        if tso:  # tcp_tso_autosize: max(2, pacing rate / 1024 / MSS); pacing 2x (slow start) or 1.2x cwnd / srtt
            ratio = np.where(cwnd < ssthresh / 2, 2.0, 1.2)
            g = np.clip(np.floor(ratio * np.minimum(cwnd, w + 1) / (rt * 1024.0)), 2.0, GSO_MAX_SEGMENTS)
        else:
            g = segments_per_drop
        elig = np.maximum(w - skip, 0.0) / g
        rnd = left < elig
        over = w > limit
        kpos = np.minimum(np.where(rnd, skip + left * g, np.inf), np.where(over, limit, np.inf))
        lost = rnd | over
        left = np.where(rnd, rng.geometric(p, n) - 1.0, left - elig)
        good = w * (1.0 - p) - np.where(over, w - limit, 0.0)
        delivered += np.where(active, frac * np.maximum(good, 0.0), 0.0)
        events += np.where(active & lost, frac, 0.0)
        t = t + rt
        # growth: slow start (acked segments, while cwnd < 2 x in flight) ...
        ca = ~ss & ~rec
        grown_ss = np.minimum(cwnd + w, np.maximum(cwnd, 2.0 * w))
        hy = ss & ~rec & (w > hy_w)  # HyStart's ACK train: the round's ACKs span RTT/2
        grown_ss = np.where(hy, np.minimum(grown_ss, w + hy_w), np.minimum(grown_ss, np.maximum(ssthresh, cwnd)))
        # ... and congestion avoidance: the cubic target one RTT ahead, at most 1.5x a round,
        # never slower than the Reno estimate (tcp_cubic.c's bictcp_update)
        target = origin + c * (te + rtt - k_t) ** 3
        inc = np.where(target > cwnd, np.minimum(target - cwnd, cwnd / 2), 0.01 * w / np.maximum(cwnd, 1.0))
        inc = np.where(wmax == 0, np.maximum(inc, np.minimum(cwnd / 20, cwnd / 2)), inc)
        tcpc = np.where(ca, tcpc + RENO_GAIN * w / np.maximum(cwnd, 1.0), tcpc)
        gap = tcpc - cwnd
        inc = np.where(gap > 0, np.maximum(inc, np.minimum(gap, cwnd / 2)), inc)
        inc = np.where(cwnd <= clamp + 0.5, inc, 0.0)  # grown only while the window is used
        grown = np.where(ss & ~rec, grown_ss, np.where(ca, cwnd + inc, cwnd))
        te = np.where(ca, te + rt, te)
        # a loss: the reduction from the window at its detection (bictcp_recalc_ssthresh)
        f = np.where(lost, np.minimum(np.where(np.isfinite(kpos), kpos, 0.0) / w, 1.0), 0.0)
        at_loss = np.where(rec, ssthresh, cwnd + (grown - cwnd) * f)
        kk = np.where(lost, np.minimum(np.where(np.isfinite(kpos), kpos, 0.0), w), 0.0)
        rec_end = rec & ~lost
        wmax = np.where(lost, np.where(at_loss < wmax, at_loss * (1 + beta) / 2, at_loss), wmax)
        ssthresh = np.where(lost, np.maximum(at_loss * beta, 2.0), ssthresh)
        timeout = lost & (w < DUP_THRESHOLD)
        to_rec = lost & ~timeout
        # the next round is the recovery round: k segments before detection, then PRR at beta
        rec_send = np.where(to_rec, kk + beta * (w - kk), rec_send)
        skip = np.where(to_rec, kk, 0.0)  # losses there belong to this recovery
        cwnd = np.where(lost, at_loss, grown)
        # an epoch starts where a recovery ends, or slow start does (HyStart, ssthresh)
        ss_exit = ss & ~rec & ~lost & (hy | (grown >= ssthresh))
        ssthresh = np.where(ss_exit & hy, grown, ssthresh)
        start = rec_end | ss_exit
        cwnd = np.where(rec_end, ssthresh, np.where(ss_exit, np.minimum(grown, ssthresh), cwnd))
        k_t = np.where(start, np.cbrt(np.maximum(wmax - cwnd, 0.0) / c), k_t)
        origin = np.where(start, np.maximum(wmax, cwnd), origin)
        tcpc = np.where(start, cwnd, tcpc)
        te = np.where(start, 0.0, te)
        ss = np.where(lost | ss_exit, False, ss)
        rec = to_rec
        if timeout.any():  # RTO, doubled while the retransmission is lost; slow start from 1
            tries = rng.geometric(1.0 - p, n) if p < 1 else np.ones(n)
            t = np.where(timeout, t + rto * (2.0 ** tries - 1.0), t)
            cwnd = np.where(timeout, 1.0, cwnd)
            ss = ss | timeout
    return delivered / duration, events


def _key(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(f"{x:.6g}")


def cubic_goodput(p: float, rtt_s: float, link_rate: float | None = None, window_bytes: float | None = None,
                  queue_bytes: float | None = None, seconds: float | None = None, omit_s: float = 0.0,
                  mss: int = MSS, rttvar_s: float = 0.0, rto_min_s: float = RTO_MIN_S,
                  segments_per_drop: float | None = SEGMENTS_PER_DROP, hystart: bool = True,
                  replicas: int | None = None, seed: int = 1) -> GoodputEstimate:
    """One bulk CUBIC flow's payload goodput (bytes/s) under random loss ``p`` (of segments,
    dropped ``segments_per_drop`` at a time) on a path of round trip ``rtt_s``: Linux's CUBIC
    driven by the losses, a seeded Monte Carlo (module docstring).  ``link_rate`` (payload
    bytes/s) is the bottleneck: the window past its BDP queues, and past its BDP plus
    ``queue_bytes`` overflows; ``window_bytes`` is the receiver's clamp.  ``seconds``: what a
    measurement of that length, after ``omit_s`` from the connection's start, reads (mean and
    spread over ``replicas``, 1000 by default); None: the long-run average (128 replicas of 40
    loss epochs each after 10 of warm-up).  Cached: equal arguments cost one run."""
    if p <= 0 or rtt_s <= 0:
        return GoodputEstimate(math.inf, 0.0, math.inf, math.inf, seconds, 0, 0.0, 1.0)
    return _cubic_goodput(_key(p), _key(rtt_s), _key(link_rate), _key(window_bytes), _key(queue_bytes),
                          _key(seconds), _key(omit_s) or 0.0, mss, _key(rto_s(rtt_s, rttvar_s, rto_min_s)),
                          _key(segments_per_drop), hystart, replicas, seed)


@lru_cache(maxsize=512)
def _cubic_goodput(p, rtt, link_rate, window_bytes, queue_bytes, seconds, omit, mss, rto, segments_per_drop,
                   hystart, replicas, seed) -> GoodputEstimate:
    seg_rate = link_rate / mss if link_rate else math.inf
    clamp = max(window_bytes / mss, 1.0) if window_bytes else math.inf
    limit = (seg_rate * rtt + queue_bytes / mss) if (link_rate and queue_bytes is not None) else math.inf
    if seconds is None:  # long run: many epochs after a warm-up, on the estimated epoch length
        pe = p / (segments_per_drop or 2)
        w = max(cubic_window(pe, rtt), math.sqrt(1.5 / pe))
        w = min(w, seg_rate * rtt, clamp, limit)
        epoch = max(1.0 / (pe * max(w, 1.0) / rtt), rtt)
        omit, duration = omit + WARMUP_EPOCHS * epoch, LONG_EPOCHS * epoch
        replicas = replicas or REPLICAS_LONG
    else:
        duration = seconds
        replicas = replicas or REPLICAS_MEASURED
    rates, events = _simulate(p, rtt, seg_rate, clamp, limit, hystart, rto, omit, duration, replicas, seed,
                              segments_per_drop)
    rates = rates * mss
    mean = float(rates.mean())
    return GoodputEstimate(mean, float(rates.std()), float(np.percentile(rates, 5)), float(np.percentile(rates, 95)),
                           seconds, replicas, float(events.mean()), float(np.mean(np.abs(rates / mean - 1) <= 0.10)))
