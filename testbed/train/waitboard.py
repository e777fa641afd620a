"""The wait board: a small shared file where a worker shows which wait for a peer it is in.

How it fits: with BubbleTea its run extension names one per worker (a ``Launcher.file`` on
the run's tmpfs state directory, which all namespaces of a machine share); whichever of the
worker and its prefill server opens it first makes it, on their machine (``ensure_board``);
the trainer ``show``s a wait's id
(and when it began) when the wait begins and 0 when its data has arrived, and the prefill server
beside it ``read``s the board between prefill chunks, so a prefill stops as soon as the wait it
was sent for is over, without the round trip through the telemetry stream and the controller
(the controller learns a wait's end only with the iteration's timeline).  A reader handed a
job *ahead* of its wait blocks on the board's doorbell (``await_wait``), a FIFO beside it that
the worker rings as each wait begins: the job starts when the wait does, with no round trip
and no polling.

Layout, three 8-byte integers: the wait under way (0: none), the latest wait shown (ids
only grow), the latest wait's start (``time.monotonic()`` in nanoseconds, a clock every
namespace shares).  Each is one aligned 8-byte store or load, so a reader never sees half a
word; the writer stores the start before the ids, and a reader takes (latest, start) only
when it reads the same latest before and after.
"""

from __future__ import annotations

import errno
import mmap
import os
import select
import time

from testbed.train.device import write_once

_SIZE = 24


def create_board(path: str | os.PathLike) -> None:
    """A new board showing no wait, and its doorbell (``PATH.bell``, a FIFO)."""
    with open(path, "wb") as fh:
        fh.write(bytes(_SIZE))
    bell = f"{os.fspath(path)}.bell"
    if os.path.exists(bell):
        os.unlink(bell)
    os.mkfifo(bell, 0o600)


def ensure_board(path: str | os.PathLike) -> None:
    """The board and its doorbell unless they are there: a new board is written aside and
    linked into place, so a reader never sees a file shorter than the layout."""
    path = os.fspath(path)
    write_once(path, bytes(_SIZE))
    try:
        os.mkfifo(f"{path}.bell", 0o600)
    except FileExistsError:
        pass


def wait_id(iteration: int, n: int) -> int:
    """A nonzero id for the ``n``-th wait of ``iteration`` (ids grow through a run)."""
    return iteration * 10_000 + n + 1


class WaitBoard:
    def __init__(self, path: str):
        ensure_board(path)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("q")
        self._bell = None
        bell = f"{path}.bell"
        if os.path.exists(bell):  # O_RDWR: neither end blocks on open or sees end-of-file
            self._bell = os.open(bell, os.O_RDWR | os.O_NONBLOCK)

    def show(self, wait: int, start: float | None = None) -> None:
        """Show ``wait`` (0: none), begun at ``start`` (default now); a new wait rings the bell."""
        if wait:
            self._words[2] = int(1e9 * (time.monotonic() if start is None else start))
            self._words[1] = wait
        self._words[0] = wait
        if wait and self._bell is not None:
            try:
                os.write(self._bell, b"\1")
            except OSError as exc:  # a full pipe (a reader that stopped reading): the ids still hold
                if exc.errno != errno.EAGAIN:
                    raise

    def read(self) -> int:
        """The wait under way, 0 for none."""
        return self._words[0]

    def latest(self) -> tuple[int, float]:
        """(id, start) of the latest wait shown ((0, 0.0) before the first)."""
        while True:
            before = self._words[1]
            start = self._words[2]
            if self._words[1] == before:
                return before, start / 1e9

    def await_wait(self, wait: int, until: float, also: int | None = None) -> float | str:
        """Block until ``wait`` begins, then return its start; "passed" when a later wait has
        begun (or it has begun and ended already), "timeout" at ``until`` (monotonic), "interrupted"
        when the descriptor ``also`` becomes readable first (it is not read)."""
        fds = [self._bell] if self._bell is not None else []
        if also is not None:
            fds.append(also)
        while True:
            latest, start = self.latest()
            if latest == wait:
                return start if self.read() == wait else "passed"
            if latest > wait:
                return "passed"
            left = until - time.monotonic()
            if left <= 0:
                return "timeout"
            # without a bell (an old board), look again every millisecond
            ready, _, _ = select.select(fds, [], [], min(left, 0.001) if self._bell is None else left)
            if also is not None and also in ready:
                return "interrupted"
            if self._bell is not None and self._bell in ready:
                try:
                    os.read(self._bell, 4096)
                except BlockingIOError:
                    pass

    def close(self) -> None:
        if self._bell is not None:
            os.close(self._bell)
            self._bell = None
