"""The inference side: a small decoder-only LM, chunked prefill into a KV cache, decode.

How it fits: the model is the trainer's GPT (``agents/trainer/model.py``) built from a seed,
so its weights are real and reproducible.  ``prefill`` runs a prompt through it one chunk
at a time, keeping each layer's keys and values (the KV cache); a chunk attends to the cache
of the chunks before it, so a prefill cut at a chunk boundary continues later exactly where
it stopped.  ``decode`` generates tokens one at a time from a received cache (greedy).
``pack``/``unpack`` put a cache on the wire.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from agents.trainer.model import GPT, ModelConfig, build_model


@dataclass
class PrefillState:
    """A prompt part-way through prefill: tokens done so far and their cache."""

    tokens: torch.Tensor  # [1, T] the whole prompt
    done: int = 0
    keys: list = field(default_factory=list)  # per layer [1, heads, done, head_dim]
    values: list = field(default_factory=list)
    logits: torch.Tensor | None = None  # after the last chunk: the first generated token's logits


def load_model(layers: int, hidden: int, heads: int, max_context: int, seed: int = 7) -> GPT:
    model = build_model(ModelConfig(layers=layers, hidden=hidden, heads=heads, seq_len=max_context), seed)
    model.eval()
    return model


def prompt_tokens(rid: int, n: int, seed: int = 7) -> torch.Tensor:
    """A deterministic byte prompt for request ``rid`` (the trace has lengths, not texts)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rid)
    return torch.randint(0, 256, (1, n), generator=g)


@torch.no_grad()
def _forward(model: GPT, x: torch.Tensor, keys: list, values: list, start: int) -> torch.Tensor:
    n = x.shape[1]
    h = model.tok(x) + model.pos(torch.arange(start, start + n))
    for i, blk in enumerate(model.blocks):
        b, t, c = h.shape
        q, k, v = blk.qkv(blk.ln1(h)).split(c, dim=2)
        q, k, v = (z.view(b, t, blk.heads, c // blk.heads).transpose(1, 2) for z in (q, k, v))
        if len(keys) > i:
            keys[i] = torch.cat([keys[i], k], dim=2)
            values[i] = torch.cat([values[i], v], dim=2)
        else:
            keys.append(k)
            values.append(v)
        if start == 0:
            y = F.scaled_dot_product_attention(q, keys[i], values[i], is_causal=True)
        else:  # query j sits at position start + j: it sees keys 0 .. start + j
            mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
            y = F.scaled_dot_product_attention(q, keys[i], values[i], attn_mask=mask)
        h = h + blk.proj(y.transpose(1, 2).reshape(b, t, c))
        h = h + blk.out(F.gelu(blk.fc(blk.ln2(h))))
    return model.head(model.ln_f(h[:, -1]))


def prefill_chunk(model: GPT, state: PrefillState, chunk: int) -> int:
    """Run the next ``chunk`` tokens of the prompt; returns how many were run."""
    total = state.tokens.shape[1]
    n = min(chunk, total - state.done)
    if n <= 0:
        return 0
    x = state.tokens[:, state.done:state.done + n]
    logits = _forward(model, x, state.keys, state.values, state.done)
    state.done += n
    if state.done == total:
        state.logits = logits
    return n


@torch.no_grad()
def decode(model: GPT, keys: list, values: list, first_logits: torch.Tensor, steps: int) -> list[int]:
    """Greedy generation of ``steps`` tokens after a prefill (the first comes from its logits)."""
    out = [int(first_logits.argmax(-1))]
    pos = keys[0].shape[2]
    while len(out) < steps and pos < model.cfg.seq_len:
        logits = _forward(model, torch.tensor([[out[-1]]]), keys, values, pos)
        out.append(int(logits.argmax(-1)))
        pos += 1
    return out


def pack(state: PrefillState) -> bytes:
    buf = io.BytesIO()
    torch.save({"keys": state.keys, "values": state.values, "logits": state.logits}, buf)
    return buf.getvalue()


def unpack(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)
