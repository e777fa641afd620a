"""The same training in one process: the yardstick for pipeline loss parity.

How it fits: ``reference_losses`` trains the whole model (every stage composed) on exactly
the samples the pipeline's replicas and microbatches draw (``data.Corpus.batch``), scales
each microbatch's loss by 1/(microbatches x replicas) as the pipeline does, accumulates
gradients, and steps AdamW once per iteration.  Per-iteration losses must match the
pipeline's to 1e-5 relative.
"""

from __future__ import annotations

import torch

from testbed.train.data import Corpus
from testbed.train.model import ModelConfig, build_model, loss_fn, stage_module


def reference_losses(model: dict, training: dict, replicas: int) -> list[float]:
    torch.set_num_threads(1)
    cfg = ModelConfig(**model)
    net = stage_module(build_model(cfg, training["seed"]), 0, 1)
    optim = torch.optim.AdamW(net.parameters(), lr=training["lr"], weight_decay=0.0)
    corpus = Corpus()
    m, size = training["microbatches"], training["microbatch_size"]
    losses = []
    for it in range(training["iterations"]):
        total = 0.0
        for r in range(replicas):
            for i in range(m):
                x, y = corpus.batch(training["seed"], it, r, i, replicas, m, size, cfg.seq_len)
                loss = loss_fn(net(x), y) / (m * replicas)
                loss.backward()
                total += float(loss.detach())
        optim.step()
        optim.zero_grad(set_to_none=False)
        losses.append(total)
    return losses
