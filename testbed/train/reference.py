"""The same training in one process: the yardstick for pipeline loss parity.

How it fits: ``reference_losses`` trains the whole model (every stage composed) on exactly
the samples the pipeline's replicas and microbatches draw (``data.Corpus.batch``), scales
each microbatch's loss by 1/(microbatches x replicas) as the pipeline does, accumulates
gradients, and steps the same optimizer once per iteration.  Per-iteration losses must match
the pipeline's to 1e-5 relative, and each stage's squared gradient norm before the step
(``reference_training``: the stages are views of the one model, sharing its parameters) the
one its workers report.
"""

from __future__ import annotations

import torch

from testbed.train.data import Corpus
from testbed.train.model import ModelConfig, build_model, grad_norm_sq, loss_fn, optimizer, stage_module


def reference_losses(model: dict, training: dict, replicas: int) -> list[float]:
    return reference_training(model, training, replicas)[0]


def reference_training(model: dict, training: dict, replicas: int,
                       stages: int = 1) -> tuple[list[float], list[list[float]]]:
    """Per iteration: the loss, and each of ``stages`` stages' squared gradient norm."""
    torch.set_num_threads(1)
    cfg = ModelConfig(**model)
    full = build_model(cfg, training["seed"])
    net = stage_module(full, 0, 1)
    views = [stage_module(full, s, stages) for s in range(stages)]
    optim = optimizer(net.parameters(), training)
    corpus = Corpus()
    m, size = training["microbatches"], training["microbatch_size"]
    losses, norms = [], []
    for it in range(training["iterations"]):
        total = 0.0
        for r in range(replicas):
            for i in range(m):
                x, y = corpus.batch(training["seed"], it, r, i, replicas, m, size, cfg.seq_len)
                loss = loss_fn(net(x), y) / (m * replicas)
                loss.backward()
                total += float(loss.detach())
        norms.append([grad_norm_sq(v) for v in views])
        optim.step()
        optim.zero_grad(set_to_none=False)
        losses.append(total)
    return losses, norms
