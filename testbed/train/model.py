"""A GPT-style decoder-only transformer with a byte vocabulary, cut into pipeline stages.

How it fits: ``build_model`` makes the whole model from a seed; ``stage_module`` keeps the
contiguous block of layers one pipeline stage owns (stage 0 also owns the embeddings, the
last stage the final norm and the LM head).  Every worker builds the whole model from the
same seed and keeps its slice, so the pipeline starts from exactly the weights a
single-process run (``reference.py``) starts from: that is what makes loss parity testable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from testbed.spec.modelshape import VOCAB, layer_params, layer_split  # noqa: F401  (shared with the simulator)


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 6
    hidden: int = 128
    heads: int = 4
    seq_len: int = 64

    def params(self) -> int:
        return self.layers * layer_params(self.hidden) + VOCAB * self.hidden * 2 + self.seq_len * self.hidden + 2 * self.hidden


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.out = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor, attend=None) -> torch.Tensor:
        """``attend(q, k, v)`` (heads split out) gives the attention output; by default causal
        self-attention over ``x``.  Inference passes one that reads and extends a KV cache."""
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if attend is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = attend(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(VOCAB, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, VOCAB, bias=False)


class Stage(nn.Module):
    """Layers ``first..last-1`` of a GPT; embeds on stage 0, projects to logits on the last."""

    def __init__(self, model: GPT, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.ModuleList(model.blocks[first:last])
        if is_last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok(x) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
    return model


def stage_module(model: GPT, stage: int, stages: int) -> Stage:
    first, last = layer_split(model.cfg.layers, stages)[stage]
    return Stage(model, first, last, stage == 0, stage == stages - 1)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def optimizer(params, training: dict) -> torch.optim.Optimizer:
    """The optimizer ``training`` names (``TrainingSpec.optimizer``; the pipeline's workers and
    the single-process reference make theirs here)."""
    if training.get("optimizer", "adamw") == "sgd":
        return torch.optim.SGD(params, lr=training["lr"])
    return torch.optim.AdamW(params, lr=training["lr"], weight_decay=0.0)


def grad_norm_sq(module: nn.Module) -> float:
    """The squared L2 norm of ``module``'s gradients, summed in float64: what a worker reports
    per iteration (after the all-reduce, before the step) for parity with the reference.  AdamW
    cancels a constant gradient scale, so losses alone miss a gradient divided twice."""
    return float(sum(p.grad.double().pow(2).sum() for p in module.parameters() if p.grad is not None))
