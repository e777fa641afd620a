"""The wait board: one 8-byte shared file where a worker shows which wait for a peer it is in.

How it fits: with BubbleTea its run extension creates one per worker (``create_board``, on
the run's tmpfs state directory, which all namespaces share); the trainer ``show``s a wait's id when the wait
begins and 0 when its data has arrived, and the prefill server beside it ``read``s the
board between prefill chunks, so a prefill stops as soon as the wait it was sent for is
over, without the round trip through the telemetry stream and the controller (the
controller learns a wait's end only with the iteration's timeline).  One aligned 8-byte
store or load: a reader never sees half an id.
"""

from __future__ import annotations

import mmap
import os


def create_board(path: str | os.PathLike) -> None:
    """A new board showing no wait."""
    with open(path, "wb") as fh:
        fh.write(bytes(8))


def wait_id(iteration: int, n: int) -> int:
    """A nonzero id for the ``n``-th wait of ``iteration``."""
    return iteration * 10_000 + n + 1


class WaitBoard:
    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 8)
        finally:
            os.close(fd)
        self._view = memoryview(self._map).cast("q")  # one machine word

    def show(self, wait: int) -> None:
        self._view[0] = wait

    def read(self) -> int:
        return self._view[0]
