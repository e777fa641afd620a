"""The GPT's shape without torch: vocabulary, layer split across stages, parameter counts.

How it fits: the trainer (``testbed/train/model.py``) builds its modules from these
numbers, and the simulator sizes compute, activations and gradients from the same ones, so
both agree on what each pipeline stage holds.
"""

from __future__ import annotations

VOCAB = 256  # bytes


def layer_split(layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous, as even as possible: stage s owns layers [first, last)."""
    if stages > layers:
        raise ValueError(f"{stages} pipeline stages need at least {stages} layers, the model has {layers}")
    bounds = [round(s * layers / stages) for s in range(stages + 1)]
    return list(zip(bounds, bounds[1:]))


def layer_params(hidden: int) -> int:
    return 12 * hidden * hidden + 13 * hidden


def stage_params(layers: int, hidden: int, seq_len: int, stages: int) -> list[int]:
    """Parameters per stage: the first also holds the embeddings, the last the final norm and head."""
    out = []
    for s, (a, b) in enumerate(layer_split(layers, stages)):
        p = (b - a) * layer_params(hidden)
        if s == 0:
            p += VOCAB * hidden + seq_len * hidden
        if s == stages - 1:
            p += VOCAB * hidden + 2 * hidden
        out.append(p)
    return out
