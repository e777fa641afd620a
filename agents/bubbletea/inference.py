"""The inference side: a small decoder-only LM, chunked prefill into a KV cache, decode.

How it fits: the model is the trainer's GPT (``testbed/train/model.py``) built from a seed,
so its weights are real and reproducible.  ``prefill`` runs a prompt through it one chunk
at a time, keeping each layer's keys and values (the KV cache); a chunk attends to the cache
of the chunks before it, so a prefill cut at a chunk boundary continues later exactly where
it stopped.  ``decode`` generates tokens one at a time from a received cache (greedy);
``decode_batch`` does the same for several caches at once (right-padded, masked), as a
decode server batches: one forward per step for the whole batch.
``pack``/``unpack`` put a cache on the wire.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from testbed.train.model import GPT, ModelConfig, build_model


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
    h = model.tok(x) + model.pos(torch.arange(start, start + n, device=x.device))
    for i, blk in enumerate(model.blocks):
        def attend(q, k, v, i=i):
            if len(keys) > i:
                keys[i] = torch.cat([keys[i], k], dim=2)
                values[i] = torch.cat([values[i], v], dim=2)
            else:
                keys.append(k)
                values.append(v)
            if start == 0:
                return F.scaled_dot_product_attention(q, keys[i], values[i], is_causal=True)
            # query j sits at position start + j: it sees keys 0 .. start + j
            mask = torch.ones(n, start + n, dtype=torch.bool, device=x.device).tril(diagonal=start)
            return F.scaled_dot_product_attention(q, keys[i], values[i], attn_mask=mask)

        h = blk(h, attend)
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
        logits = _forward(model, torch.tensor([[out[-1]]], device=keys[0].device), keys, values, pos)
        out.append(int(logits.argmax(-1)))
        pos += 1
    return out


@torch.no_grad()
def decode_batch(model: GPT, caches: list[dict], steps: list[int], step_times: list[float] | None = None
                 ) -> list[list[int]]:
    """``decode`` for several received caches (``unpack``'s dicts) at once: the same tokens,
    one forward per step for the whole batch (caches right-padded to the longest, room for
    the new tokens allocated once, padding masked out of attention).  ``step_times``, when
    given, gets the monotonic time at which each step's tokens exist (the time between
    tokens a request sees)."""
    lens = [c["keys"][0].shape[2] for c in caches]
    batch, longest, limit = len(caches), max(lens), model.cfg.seq_len
    room = longest + max(steps)
    keys, values = [], []
    for i in range(len(caches[0]["keys"])):
        k0 = caches[0]["keys"][i]
        kk = k0.new_zeros(batch, k0.shape[1], room, k0.shape[3])
        vv = kk.clone()
        for j, (c, n) in enumerate(zip(caches, lens)):
            kk[j, :, :n] = c["keys"][i][0]
            vv[j, :, :n] = c["values"][i][0]
        keys.append(kk)
        values.append(vv)
    dev = caches[0]["keys"][0].device
    valid = torch.zeros(batch, room, dtype=torch.bool, device=dev)
    for j, n in enumerate(lens):
        valid[j, :n] = True
    out = [[int(c["logits"].argmax(-1))] for c in caches]
    pos = torch.tensor(lens, device=dev)
    col = longest
    while any(len(o) < n and p < limit for o, n, p in zip(out, steps, pos.tolist())):
        x = torch.tensor([[o[-1]] for o in out], device=dev)
        h = model.tok(x) + model.pos(pos.clamp(max=limit - 1))[:, None, :]
        valid[:, col] = True
        mask = valid[:, None, None, :col + 1]
        for i, blk in enumerate(model.blocks):
            def attend(q, k, v, i=i):
                keys[i][:, :, col:col + 1] = k
                values[i][:, :, col:col + 1] = v
                return F.scaled_dot_product_attention(q, keys[i][:, :, :col + 1], values[i][:, :, :col + 1],
                                                      attn_mask=mask)

            h = blk(h, attend)
        nxt = model.head(model.ln_f(h[:, -1])).argmax(-1).tolist()
        for j, (o, n, p) in enumerate(zip(out, steps, pos.tolist())):
            if len(o) < n and p < limit:
                o.append(nxt[j])
        pos = pos + 1
        col += 1
        if step_times is not None:
            step_times.append(time.monotonic())
    return out


def pack(state: PrefillState) -> bytes:
    """The cache on the wire: its own bytes only (a prompt prefilled in one chunk keeps its keys
    and values as views into the layer's fused q/k/v output, which ``torch.save`` would ship
    whole: 1.5x the cache).  A cache prefilled on a GPU is shipped as host tensors."""
    buf = io.BytesIO()
    torch.save({"keys": [k.contiguous().cpu().clone() for k in state.keys],
                "values": [v.contiguous().cpu().clone() for v in state.values],
                "logits": None if state.logits is None else state.logits.cpu()}, buf)
    return buf.getvalue()


def unpack(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)
