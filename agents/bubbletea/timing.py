"""Serving times on an emulated device, from a profile: prefill chunks, decode steps, KV bytes.

How it fits: ``profile.py`` measures the real inference model once on this machine (or a
GPU) and writes ``data/serving-profile-<device>.json``; with ``device: emulated`` the
extension passes that file and the experiment's ``emulation.speedup`` to every prefill
server and decode worker, which read it here (``ServingTimes.load``) and occupy their
emulated device (``testbed/train/device.py``) for the times it gives: a chunk of ``n``
prompt tokens after ``start`` cached tokens, one decode step of a batch at a context, a
batch's set-up; and ship KV caches of the size ``pack`` gives the real model's caches.
Between measured points times are interpolated linearly (bilinear on the grids), beyond
the last point extrapolated along the last segment.  No torch: an emulated server imports
none.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points; extrapolated along the end segments."""
    if len(points) == 1:
        return points[0][1]
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(points) - 2)
    (x0, y0), (x1, y1) = points[i], points[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class _Grid:
    """y(a, b) from points on a (possibly ragged) grid: linear in ``a`` along each measured
    ``b``, then linear in ``b``."""

    def __init__(self, points: list[list[float]]):
        rows: dict[float, list[tuple[float, float]]] = {}
        for a, b, y in points:
            rows.setdefault(b, []).append((a, y))
        self.rows = [(b, sorted(r)) for b, r in sorted(rows.items())]

    def __call__(self, a: float, b: float) -> float:
        along = [(bb, _interp(r, a)) for bb, r in self.rows]
        return _interp(along, b)


class ServingTimes:
    """One profile (``profile.py``'s JSON) on a device ``speedup`` times as fast as the profiled one."""

    def __init__(self, data: dict, speedup: float = 1.0, source: str = ""):
        self.data = data
        self.speedup = speedup
        self.source = source
        self.model = data["model"]
        self._prefill = _Grid(data["prefill"]["points"])
        self._step = _Grid(data["decode_step"]["points"])
        self._setup = _Grid(data["decode_setup"]["points"])
        self._kv = data["kv_bytes"]["fit"]

    @classmethod
    def load(cls, path: str | Path, speedup: float = 1.0) -> "ServingTimes":
        return cls(json.loads(Path(path).read_text()), speedup, str(path))

    def chunk_s(self, tokens: int, start: int) -> float:
        """One prefill chunk: ``tokens`` prompt tokens after ``start`` already in the cache."""
        return self._prefill(tokens, start) / self.speedup

    def prefill_s(self, tokens: int, chunk: int) -> float:
        """A whole prompt, chunk by chunk."""
        total, done = 0.0, 0
        while done < tokens:
            n = min(chunk, tokens - done)
            total += self.chunk_s(n, done)
            done += n
        return total

    def decode_step_s(self, batch: int, context: int) -> float:
        return self._step(batch, context) / self.speedup

    def decode_setup_s(self, batch: int, context: int) -> float:
        return self._setup(batch, context) / self.speedup

    def kv_bytes(self, tokens: int) -> int:
        """What ``inference.pack`` puts on the wire for a prompt of ``tokens`` (the cache of the
        real model's shape plus the serialisation's own bytes)."""
        a, b = self._kv
        return int(round(a + b * tokens))

    def describe(self) -> dict:
        d = self.data
        return {"source": self.source, "measured": d.get("measured"), "device": d.get("device", {}).get("name"),
                "speedup": self.speedup}
