"""Training text every machine has offline: the running Python's own standard library.

How it fits: ``Corpus`` reads the standard library's ``.py`` files in sorted order (so the
bytes are the same on every worker of a run) up to a size cap, as one byte string.
``batch`` returns the (inputs, targets) of one microbatch of one DP replica in one
iteration, from a generator seeded by (seed, iteration): every worker and the
single-process reference draw exactly the same samples without talking to each other.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


class Corpus:
    def __init__(self, max_bytes: int = 4_000_000):
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks, size = [], 0
        for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            chunks.append(data)
            size += len(data)
            if size >= max_bytes:
                break
        if size < 100_000:
            raise RuntimeError(f"too little text under {root} ({size} bytes) to train on")
        self.data = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, seed: int, iteration: int, replica: int, microbatch: int, replicas: int, microbatches: int,
              size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, both (size, seq_len) int64."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
        starts = torch.randint(0, len(self.data) - seq_len - 1, (replicas * microbatches * size,), generator=gen)
        first = (replica * microbatches + microbatch) * size
        idx = starts[first:first + size].unsqueeze(1) + torch.arange(seq_len + 1)
        window = self.data[idx].long()
        return window[:, :-1], window[:, 1:]
