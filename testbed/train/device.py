"""An emulated device: one stream that several processes may queue work on.

How it fits: with ``device: emulated`` the runner gives each worker a device file (16 bytes
on the run's tmpfs state folder, shared by every namespace of its machine; the first client
to open it makes it, so across machines it is made where the worker runs).  The worker's compute
(``emulated.py``) and any co-tenant of the same device (a BubbleTea prefill server) call
``run(seconds)``: the op starts when the stream is free (``free_at``, read and advanced
under ``flock``, so clients in different processes queue in the order they issue, as on a
GPU stream), and the caller sleeps on the monotonic clock until the op's end.  A second
client's op therefore delays the next training op by exactly its length.

Precision: the caller's timer slack is set to 1 ns (``PR_SET_TIMERSLACK``), so a sleep ends
within the kernel's wake-up latency (measured here: ~60 us median, ~1.5 ms at the 99th
percentile on a loaded 2-core machine), and each sleep aims early by the median lateness of
the recent ops.  Each op's error (actual end minus intended end) is recorded;
``timing_report`` summarises it for metrics.json.  No CPU is used while the device is busy.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
import time
from pathlib import Path

_LAYOUT = struct.Struct("dd")  # free_at (CLOCK_MONOTONIC seconds), busy seconds so far
_PR_SET_TIMERSLACK = 29


def write_once(path: str | os.PathLike, data: bytes) -> None:
    """``data`` at ``path`` unless a file is there: written aside, then linked into place, so
    whichever of several processes (on any machine) comes first makes it and no reader ever
    sees it shorter than ``data``."""
    path = Path(path)
    if path.exists():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    with open(tmp, "wb") as fh:
        fh.write(data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def create_device(path: str | os.PathLike) -> None:
    """An idle device file at ``path`` unless one is there: whichever of a device's clients
    opens it first makes it, on its own machine (``write_once``)."""
    write_once(path, _LAYOUT.pack(0.0, 0.0))


def _fine_timers() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class EmulatedDevice:
    def __init__(self, path: str | os.PathLike):
        create_device(path)
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, _LAYOUT.size)
        self.errors: list[float] = []  # per op: actual end - intended end, seconds
        self._recent: list[float] = []
        self._bias = 0.0
        _fine_timers()

    def run(self, seconds: float) -> tuple[float, float]:
        """Occupy the device for ``seconds`` once it is free; returns (start, end) as
        scheduled.  Blocks until the end."""
        now = time.monotonic()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            free_at, busy = _LAYOUT.unpack_from(self._map, 0)
            start = max(now, free_at)
            end = start + max(0.0, seconds)
            _LAYOUT.pack_into(self._map, 0, end, busy + (end - start))
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        left = end - time.monotonic() - self._bias
        if left > 0:
            time.sleep(left)
        late = time.monotonic() - end
        self.errors.append(late)
        # a sleep ends a wake-up latency late: aim that much early next time (the median of
        # the last 32 ops' lateness with this aim, capped at 0.3 ms)
        self._recent.append(late + self._bias)
        if len(self._recent) > 32:
            del self._recent[0]
        self._bias = min(3e-4, max(0.0, sorted(self._recent)[len(self._recent) // 2]))
        return start, end

    def busy_seconds(self) -> float:
        """Device time all clients have queued so far."""
        return _LAYOUT.unpack_from(self._map, 0)[1]

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


def timing_report(errors: list[float]) -> dict:
    """Per-op timing error (actual end - intended end): count, median, 99th percentile, max, in
    microseconds, of the absolute error."""
    if not errors:
        return {"ops": 0}
    a = sorted(abs(e) for e in errors)
    return {"ops": len(a), "median_us": round(a[len(a) // 2] * 1e6, 1),
            "p99_us": round(a[min(len(a) - 1, int(0.99 * len(a)))] * 1e6, 1), "max_us": round(a[-1] * 1e6, 1),
            "mean_signed_us": round(sum(errors) / len(errors) * 1e6, 1)}
