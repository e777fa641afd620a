"""What one TCP connection can carry over a path with random loss: published response functions.

How it fits: the simulator (``testbed/sim/build.py``) caps each connection of a channel that
crosses a lossy WAN path at ``loss_limited_rate`` (N connections: N times that, as with
windows), and ``testbed fidelity`` (``fidelity.py``) reports, beside a direction's rate, the
goodput its measuring flow can expect under the direction's loss and round trip
(``expected_goodput``).  Pure arithmetic (no sockets, no kernel): the network code and the
simulator both read it.

The model, per connection, in payload bytes per second (``loss_limited_rate``)::

    rate = max(W_cubic x MSS / RTT, B_padhye)

* ``W_cubic`` is CUBIC's average window under random loss, RFC 9438 section 5 (RFC 8312 section
  5, Eq. 5; Ha, Rhee and Xu, "CUBIC: a new TCP-friendly high-speed TCP variant", 2008):
  ``W = (C (3 + beta) / (4 (1 - beta)))^(1/4) x RTT^(3/4) / p^(3/4)`` segments, RTT in seconds;
  Linux's C = 0.4 and beta = 0.7 give ``1.054 x RTT^0.75 / p^0.75`` (RFC 8312 Eq. 7).  Linux
  runs CUBIC by default, and the testbed's hosts run it (``network.py`` sets it).
* CUBIC never does worse than Reno ("Reno-friendly region", RFC 9438 section 4.3: its AIMD
  estimate grows so that it averages Reno's window), so the floor is Reno's response function.
  It is Padhye, Firoiu, Towsley and Kurose, "Modeling TCP throughput: a simple model and its
  empirical validation" (SIGCOMM 1998), the full formula with timeouts::

      B = MSS / (RTT sqrt(2bp/3) + RTO min(1, 3 sqrt(3bp/8)) p (1 + 32 p^2))

  which, as p -> 0, is Mathis et al.'s ``MSS x sqrt(3/(2b)) / (RTT sqrt(p))`` (1997; C = 1.22
  for b = 1) and, as p grows, adds the retransmission timeouts that dominate at a few percent.
  **b = 1**, not the conventional 2: b is the number of segments one ACK makes the window grow
  by, and although a Linux receiver delays ACKs (one per two full segments), a Linux sender has
  counted acknowledged *segments*, not ACKs, since 4.0 (2015, the "stretch ACK" fixes:
  ``tcp_cong_avoid_ai(tp, w, acked)``, in the spirit of RFC 3465's byte counting; slow start
  since 3.9), so its window grows one segment per round trip whatever the ACK ratio: the
  delayed-ACK term of 1998's receivers does not apply.  (b = 2 would lower the
  Reno floor by sqrt(2).)  ``RTO`` is Linux's: ``srtt + max(4 rttvar, rto_min)``, rto_min 200 ms.

The CUBIC term carries no timeouts: it is the larger only where RTT^(1/4) / p^(1/4) is large
(long round trips, loss below ~0.1%), where ``p (1 + 32 p^2)`` makes the timeout term of the
Padhye denominator ~0.2% of its first term (at 0.05% loss, 262 ms).  Both formulas are averages
over many loss epochs (a connection's window between two losses): a transfer of fewer than
~1/p segments sees mostly slow start and the first loss, not this average.

``p`` is the probability that a *segment* is lost.  The emulator drops what passes its drop
point (iptables, netem, the delay line), and with TSO/GSO a packet there may be a GSO
super-packet of several segments; ``loss_limited_rate`` takes the loss event rate per segment.
"""

from __future__ import annotations

import math

MSS = 1448  # payload bytes per segment (1500-byte MTU, TCP timestamps)
PAYLOAD_FRACTION = MSS / (MSS + 52 + 14)  # MSS / (MSS + TCP/IP headers with timestamps + Ethernet)
RTO_MIN_S = 0.2  # Linux: rto = srtt + max(4 rttvar, 200 ms)
CUBIC_C = 0.4  # Linux's, RFC 9438's
CUBIC_BETA = 0.7
ACKED_PER_ACK = 1  # Padhye's b: Linux counts acknowledged segments, not ACKs (module docstring)


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


def loss_limited_rate(p: float, rtt_s: float, mss: int = MSS, rttvar_s: float = 0.0,
                      rto_min_s: float = RTO_MIN_S) -> float:
    """One CUBIC connection's long-run payload rate (bytes/s) under random segment loss ``p``
    on a path of round trip ``rtt_s``: max(CUBIC's average window / RTT, Padhye's Reno rate with
    timeouts, b = 1).  Unbounded (``inf``) without loss: then windows and the link decide."""
    if p <= 0 or rtt_s <= 0:
        return math.inf
    rto = rto_s(rtt_s, rttvar_s, rto_min_s)
    return max(cubic_rate(p, rtt_s, mss), padhye_rate(p, rtt_s, mss, rto=rto))


def expected_goodput(rate_bytes_s: float, p: float, rtt_s: float, connections: int = 1,
                     window_bytes: float | None = None, mss: int = MSS, rttvar_s: float = 0.0,
                     rto_min_s: float = RTO_MIN_S) -> float:
    """What ``connections`` bulk CUBIC connections together can expect across a link whose payload
    rate is ``rate_bytes_s``: min(the link's payload rate, connections x (window / RTT),
    connections x ``loss_limited_rate``), bytes/s."""
    out = rate_bytes_s
    if window_bytes is not None and rtt_s > 0:
        out = min(out, connections * window_bytes / rtt_s)
    return min(out, connections * loss_limited_rate(p, rtt_s, mss, rttvar_s, rto_min_s))
