"""Titan's controller: per (user region, DC) Internet path, the share of calls offloaded.

The paper's Titan raises the offloaded fraction step by step per region while call quality
holds and backs off when it degrades; its exact rules are not public.  These are ours:

* every window the path's measured quality (what the receivers report over the window: median
  RTT, loss, RFC 3550 jitter) is judged against Teams' targets (RTT < 100 ms, loss < 1%,
  jitter < 30 ms): **bad** if any metric exceeds its target, **severe** if any exceeds
  ``severe_factor`` x its target, **good** if every metric is within ``margin`` x its
  target, else **marginal**.  Loss is judged by the lowest rate its count is consistent
  with (the Wilson score bound, one-sided 95%), not the count over the packets: a window
  of 200 packets that lost 2 reads 1% but is what a path with 0.2% loss gives in 6% of its
  windows (a point estimate backed off a healthy path in 8 of 23 windows in one emulated
  run); 6 of 200 (bound 1.6%) is bad, 10 of 200 (5%: bound 2.8%) severe;
* good for ``hold_windows`` windows in a row: raise by ``step`` (up to ``max_fraction``);
* marginal, or no measurement: hold;
* bad: multiply by ``backoff`` (fractions below ``floor`` go to 0); severe: straight to 0;
* after any back-off the path needs ``recover_windows`` good windows before it is raised
  again.

So a path above its thresholds is never raised (bad or severe never raises, and a marginal
window resets the good streak), and the back-off reaches 0 from any fraction within
``max_backoff_steps`` bad windows: floor(log(floor / max_fraction) / log(backoff)) + 1.
Measurements keep coming at fraction 0 because Titan probes every Internet path (the
emulator sends a low-rate probe stream on each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from agents.titan.spec import Targets

GOOD, MARGINAL, BAD, SEVERE = "good", "marginal", "bad", "severe"


@dataclass(frozen=True)
class Quality:
    """One window's measurement of one path (both directions)."""

    rtt_ms: float
    loss: float
    jitter_ms: float
    packets: int = 0


_Z95 = 1.6449  # one-sided 95%


def loss_lower_bound(q: Quality, z: float = _Z95) -> float:
    """The Wilson score lower bound of ``q``'s loss rate: lost = loss x sent, sent = packets / (1 - loss)."""
    if q.loss <= 0:
        return 0.0
    n = q.packets / max(1e-12, 1.0 - q.loss)
    p = q.loss
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - spread) / (1 + z * z / n))


@dataclass
class _PathState:
    fraction: float = 0.0
    good_streak: int = 0
    need: int = 1  # good windows needed before the next raise
    history: list[tuple[float, str, float]] = field(default_factory=list)  # (time, verdict, fraction)


class TitanController:
    """AIMD-style offload control per path; ``update`` once per window per path."""

    def __init__(self, targets: Targets | None = None, step: float = 0.1, max_fraction: float = 1.0,
                 backoff: float = 0.5, floor: float = 0.05, margin: float = 0.8, severe_factor: float = 2.0,
                 hold_windows: int = 1, recover_windows: int = 3, min_packets: int = 20):
        if not 0 < backoff < 1:
            raise ValueError("backoff must be in (0, 1)")
        if not 0 < floor <= max_fraction <= 1:
            raise ValueError("need 0 < floor <= max_fraction <= 1")
        self.targets = targets or Targets()
        self.step, self.max_fraction, self.backoff, self.floor = step, max_fraction, backoff, floor
        self.margin, self.severe_factor = margin, severe_factor
        self.hold_windows, self.recover_windows, self.min_packets = hold_windows, recover_windows, min_packets
        self._paths: dict[tuple[str, str], _PathState] = {}

    @property
    def max_backoff_steps(self) -> int:
        """Bad windows that take any fraction to 0."""
        return math.floor(math.log(self.floor / self.max_fraction) / math.log(self.backoff)) + 1

    def judge(self, q: Quality | None) -> str | None:
        if q is None or q.packets < self.min_packets:
            return None
        t = self.targets
        ratios = (q.rtt_ms / t.rtt_ms, loss_lower_bound(q) / t.loss, q.jitter_ms / t.jitter_ms)
        worst = max(ratios)
        if worst > self.severe_factor:
            return SEVERE
        if worst > 1.0:
            return BAD
        if worst <= self.margin:
            return GOOD
        return MARGINAL

    def fraction(self, path: tuple[str, str]) -> float:
        return self._paths.get(path, _PathState()).fraction

    def fractions(self) -> dict[tuple[str, str], float]:
        return {p: s.fraction for p, s in self._paths.items()}

    def history(self, path: tuple[str, str]) -> list[tuple[float, str, float]]:
        return list(self._paths.get(path, _PathState()).history)

    def update(self, path: tuple[str, str], quality: Quality | None, now: float = 0.0) -> float:
        """Judge one window of ``path`` and return its new offload fraction."""
        st = self._paths.setdefault(path, _PathState())
        verdict = self.judge(quality)
        if verdict in (BAD, SEVERE):
            st.fraction = 0.0 if verdict == SEVERE else st.fraction * self.backoff
            if st.fraction < self.floor:
                st.fraction = 0.0
            st.good_streak = 0
            st.need = self.recover_windows
        elif verdict == GOOD:
            st.good_streak += 1
            if st.good_streak >= st.need:
                st.fraction = min(self.max_fraction, st.fraction + self.step)
                st.good_streak = 0
                st.need = self.hold_windows
        else:  # marginal or unmeasured: hold, and a marginal window breaks the streak
            if verdict == MARGINAL:
                st.good_streak = 0
        st.history.append((now, verdict or "none", st.fraction))
        return st.fraction
