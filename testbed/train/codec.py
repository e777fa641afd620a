"""Tensors as the bytes a pipeline channel carries (``transport.py`` moves bytes only).

A message is a 64-byte header (dtype code, number of dimensions, up to 6 sizes) and the
tensor's raw data.  ``message_bytes`` gives the size without torch, so an emulated device
(``emulated.py``) sends buffers exactly as large as the real tensors would be.
"""

from __future__ import annotations

import struct

META = struct.Struct("!B7q")  # dtype code, ndim, up to 6 dims
META_SIZE = 64


def message_bytes(numel: int, dtype_bytes: int = 4) -> int:
    """Bytes on the wire for a tensor of ``numel`` elements (float32 by default)."""
    return META_SIZE + numel * dtype_bytes


def _dtypes():
    import torch

    return {0: torch.float32, 1: torch.float16, 2: torch.bfloat16, 3: torch.int64}


def encode(t) -> bytes:
    import torch

    codes = {v: k for k, v in _dtypes().items()}
    t = t.detach().to("cpu").contiguous()
    shape = list(t.shape) + [0] * (6 - t.dim())
    meta = META.pack(codes[t.dtype], t.dim(), *shape).ljust(META_SIZE, b"\0")
    raw = t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
    return meta + raw


def decode(buf: bytearray):
    import numpy as np
    import torch

    code, ndim, *dims = META.unpack_from(buf, 0)
    dtype = _dtypes()[code]
    shape = dims[:ndim]
    body = memoryview(buf)[META_SIZE:]
    if dtype == torch.bfloat16:
        return torch.frombuffer(body, dtype=torch.uint8).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(np.frombuffer(body, dtype=torch.empty(0, dtype=dtype).numpy().dtype).reshape(shape))
