"""Ring all-reduce of a byte buffer among the DP replicas of one stage, over the transport.

How it fits: an emulated worker (``emulated.py``) has no torch.distributed; it still moves
the bytes a ring all-reduce moves (NCCL's and gloo's pattern inside a DC): the buffer is cut
into D chunks, and in 2 (D - 1) steps each rank sends one chunk to the next rank and
receives one from the previous (reduce-scatter, then all-gather), so each rank sends
2 (D - 1) / D of the buffer.  The arithmetic is the device's, and its time comes from the
profile, not from here.
"""

from __future__ import annotations

from testbed.train.transport import Channel, Endpoint

DP = 2  # the channel kind of the ring


class Ring:
    def __init__(self, ep: Endpoint, names: list[str], ips: list[str], rank: int, port: int):
        self.size = len(names)
        self.rank = rank
        if self.size < 2:
            self.out = self.inp = None
            return
        nxt, prv = (rank + 1) % self.size, (rank - 1) % self.size
        self.out: Channel = ep.connect(names[nxt], ips[nxt], port, DP, 1, 0)
        self.inp: Channel = ep.accept(names[prv], DP, 1, 0)

    def allreduce(self, nbytes: int, timeout: float = 300.0) -> None:
        if self.size < 2 or nbytes <= 0:
            return
        chunk = memoryview(bytes(-(-nbytes // self.size)))
        for _ in range(2 * (self.size - 1)):
            self.out.send(chunk)
            self.inp.recv(timeout=timeout)

    def close(self) -> None:
        for ch in (self.out, self.inp):
            if ch is not None:
                ch.close()
