"""Bubble prediction from the trainer's live timeline, and prefill time from measurements.

How it fits: bubbles repeat every iteration (the schedule is fixed, transfer and compute
times barely move), so the next iteration's bubbles of a worker are predicted from its last
few: the bubbles of the latest iteration (offset from the iteration's start, length), each
shortened to the shortest matching bubble of the iterations before (same position within a
tolerance): a conservative prediction.  A wait that outlasts that prediction is then
predicted to last as long as the next shortest of those it lasted before (``window``'s later
ends): conservative again, given how long it has lasted.  ``PrefillProfile`` fits prefill seconds against
prompt tokens (least squares, a + b * tokens) on this worker's device.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from testbed.messages import Events, Wait
from testbed.results.metrics import worker_iteration


def is_peer_wait(kind: str, mb: int) -> bool:
    """Whether a timeline interval is a wait for a peer the worker announces: a microbatch's
    receive, or the data-parallel all-reduce."""
    return (kind == "recv" and mb >= 0) or kind == "allreduce"


def bubbles_of(events: list, start: float, end: float) -> list[tuple[float, float]]:
    """Maximal non-busy runs of one iteration's intervals, as (offset from start, length):
    the run's own bubble accounting (``metrics.worker_iteration``), relative to ``start``."""
    return [(s - start, d) for s, d in worker_iteration(events, start, end)["bubbles"]]


@dataclass
class WorkerBubbles:
    """One worker's bubbles.  The schedule fixes where they are: the n-th wait for a peer of
    an iteration (a receive, or the data-parallel all-reduce at its end) is the same wait
    every iteration.  The worker announces each wait as it
    begins (live); its length is predicted as the shortest that wait lasted in the last
    ``keep`` iterations (conservative: a prefill sized to it ends before training resumes)."""

    keep: int = 4
    history: deque = field(default_factory=lambda: deque(maxlen=4))  # per iteration: [wait lengths]
    pending: list = field(default_factory=list)  # this iteration's intervals so far
    last_end: float | None = None  # when the latest complete iteration ended
    period: float | None = None  # the latest complete iteration's length
    current: tuple | None = None  # (iteration, n, start) of the wait under way

    def add(self, msg: Events) -> None:
        self.pending.extend(msg.events)
        if msg.iteration_done:
            waits = [ev.end - ev.start for ev in sorted(self.pending, key=lambda ev: ev.start)
                     if is_peer_wait(ev.kind, ev.mb)]
            self.history.append(waits)
            self.pending = []
            if self.last_end is not None:
                self.period = msg.end - self.last_end
            self.last_end = msg.end

    def on_wait(self, msg: Wait) -> None:
        self.current = (msg.it, msg.n, msg.t)

    def predict(self, n: int) -> float:
        """The n-th wait's predicted length (0 when it has not been seen in every recent iteration)."""
        lengths = self.lengths(n)
        return lengths[0] if lengths else 0.0

    def lengths(self, n: int) -> list[float]:
        """The n-th wait's lengths in the recent iterations, shortest first (none unless seen in each)."""
        if len(self.history) < min(2, self.history.maxlen):
            return []
        lengths = [h[n] for h in self.history if len(h) > n]
        return sorted(lengths) if len(lengths) == len(self.history) else []

    def next_wait(self) -> tuple[int, int] | None:
        """(iteration, n) of the wait after the one announced last: the next in its iteration,
        or the next iteration's first (the schedule fixes how many waits an iteration has)."""
        if self.current is None or not self.history:
            return None
        it, n, _start = self.current
        return (it, n + 1) if n + 1 < len(self.history[-1]) else (it + 1, 0)

    def usable(self, n: int, margin_s: float, margin_frac: float) -> list[float]:
        """The n-th wait's usable lengths from its start (each length it lasted recently, less
        the margin), shortest first: what a job sent ahead of the wait may fill."""
        return [x for x in (length - max(margin_s, margin_frac * length) for length in self.lengths(n)) if x > 0]

    def window(self, now: float, margin_s: float, margin_frac: float) -> tuple[float, float] | None:
        """(start, usable end) of the wait under way, if its predicted end is still ahead."""
        ends = self.ends(now, margin_s, margin_frac)
        return (self.current[2], ends[0]) if ends else None

    def ends(self, now: float, margin_s: float, margin_frac: float) -> list[float]:
        """The usable ends still ahead for the wait under way, earliest first: each a length it
        lasted in a recent iteration, less the margin.  A prefill stops at the first; it may go
        on to the next only while the wait is seen to last (the server reads the wait board)."""
        if self.current is None:
            return []
        _it, n, start = self.current
        return [start + x for x in self.usable(n, margin_s, margin_frac) if start + x > now]


class PrefillProfile:
    """Prefill seconds against prompt tokens: a + b * tokens, refitted as measurements come."""

    def __init__(self, points: list[tuple[int, float]] | None = None):
        self.points: deque = deque(maxlen=200)
        self.a, self.b = 0.0, 1e-4
        for n, t in points or []:
            self.add(n, t)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self.points.append((tokens, seconds))
        xs, ys = [p[0] for p in self.points], [p[1] for p in self.points]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        if var > 0:
            self.b = max(1e-7, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var)
            self.a = max(0.0, my - self.b * mx)
        else:
            self.a, self.b = 0.0, my / mx

    def seconds(self, tokens: int) -> float:
        return self.a + self.b * tokens

    def tokens_within(self, seconds: float) -> int:
        return max(0, int((seconds - self.a) / self.b))
