"""DiLoCo-style training of a small GPT (local steps, an outer all-reduce every H): a plain torchrun script.

Runs unchanged on a real cluster, on one machine and on the testbed's emulated WAN (one rank
per DC)::

    torchrun --standalone --nproc-per-node 3 examples/diloco.py --inner-steps 5 --rounds 4
    torchrun --nnodes 3 --nproc-per-node 1 --rdzv-endpoint HOST:29500 examples/diloco.py
    python examples/diloco.py --reference --world 3     # the 3 workers one after another, one process

How it fits (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", 2023): every rank starts from the same GPT (built from the seed) and trains it alone
for H = ``--inner-steps`` AdamW steps on its own stream of byte windows of the standard
library's source (a function of seed, rank and step).  Then the outer step: each rank's
pseudo-gradient (the global weights minus its local weights) is flattened into one buffer and
all-reduced (the only communication, ``payload_bytes`` per rank and round), averaged, and
applied to the global weights by the outer optimizer, SGD with Nesterov momentum (lr 0.7,
momentum 0.9, as in the paper); every rank then continues from the new global weights, keeping
its AdamW state.  Every rank prints one JSON line per inner step, ``{"step", "loss", "time_s",
"rank"}``, its own local loss and the step's compute time; the line of a round's last step also
carries ``round``, ``outer_wait_s`` (a barrier: waiting for the slowest rank), ``outer_comm_s``
(the all-reduce alone, what bandwidth and round trip decide), ``payload_bytes``,
``round_time_s`` (the H steps plus the outer step) and two parameter checksums (sha256 of the
weights' bytes): ``local_checksum`` before the outer step (different on every rank) and
``checksum`` after it (the same on every rank).  ``--out`` gets rank 0's lines.  ``--reference``
runs the ``--world`` workers in turn in one process, with the same arithmetic, and prints every
worker's lines: the losses match the distributed run's to 1e-5 relative (tests/test_examples.py).
Gloo on CPU, NCCL when CUDA is there.  Only torch and the standard library.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256  # bytes
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer Nesterov SGD
INNER_WEIGHT_DECAY = 0.1  # DiLoCo's inner AdamW


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, seq_len: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, hidden), nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(args) -> GPT:
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.hidden, args.heads, args.seq_len)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def load_corpus(max_bytes: int = 1_000_000) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


def get_batch(data: torch.Tensor, seed: int, rank: int, step: int, rows: int, seq_len: int):
    """(inputs, next-byte targets), both (rows, seq_len) int64: rank ``rank``'s own stream."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)
    starts = torch.randint(0, len(data) - seq_len - 1, (rows,), generator=gen)
    window = data[starts.unsqueeze(1) + torch.arange(seq_len + 1)].long()
    return window[:, :-1], window[:, 1:]


def checksum(params) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Worker:
    """One DiLoCo worker's state: its local model and inner AdamW, and the global weights with
    the outer optimizer (every worker holds an identical copy of those)."""

    def __init__(self, model: GPT, args):
        self.model = model
        self.inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=INNER_WEIGHT_DECAY)
        self.glob = [p.detach().clone() for p in model.parameters()]
        self.outer = torch.optim.SGD(self.glob, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)

    def inner_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = loss_fn(self.model(x), y)
        loss.backward()
        self.inner.step()
        self.inner.zero_grad()
        return float(loss.detach())

    def pseudo_gradient(self) -> torch.Tensor:
        """Global minus local weights, flattened into one buffer (the all-reduce's payload)."""
        return torch.cat([(g - p.detach()).reshape(-1) for g, p in zip(self.glob, self.model.parameters())])

    def outer_step(self, mean_delta: torch.Tensor) -> None:
        for g, d in zip(self.glob, mean_delta.split([g.numel() for g in self.glob])):
            g.grad = d.view_as(g)
        self.outer.step()
        with torch.no_grad():
            for p, g in zip(self.model.parameters(), self.glob):
                p.copy_(g)


def emit(out, **fields) -> None:
    line = json.dumps(fields)
    sys.stdout.write(line + "\n")  # one write: ranks sharing a pipe do not split lines
    sys.stdout.flush()
    if out:
        out.write(line + "\n")
        out.flush()


def run_reference(args) -> None:
    """The ``--world`` workers one after another in one process; the all-reduce is a sum here."""
    base = build_model(args)
    workers = [Worker(copy.deepcopy(base), args) for _ in range(args.world)]
    data, out = load_corpus(), open(args.out, "w") if args.out else None
    for rnd in range(args.rounds):
        lines = {}
        for rank, w in enumerate(workers):
            for h in range(args.inner_steps):
                step = rnd * args.inner_steps + h
                start = time.perf_counter()
                loss = w.inner_step(*get_batch(data, args.seed, rank, step, args.batch_size, args.seq_len))
                lines[rank, h] = dict(step=step, loss=loss, time_s=round(time.perf_counter() - start, 6), rank=rank)
        local = [checksum(w.model.parameters()) for w in workers]
        deltas = [w.pseudo_gradient() for w in workers]
        mean = torch.stack(deltas).sum(0) / args.world
        for w in workers:
            w.outer_step(mean)
        for rank, w in enumerate(workers):
            lines[rank, args.inner_steps - 1].update(
                round=rnd, payload_bytes=mean.numel() * mean.element_size(),
                local_checksum=local[rank], checksum=checksum(w.model.parameters()))
        for rank in range(args.world):
            for h in range(args.inner_steps):
                emit(out, **lines[rank, h])


def run_diloco(args) -> None:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    dist.init_process_group(backend)
    worker = Worker(build_model(args).to(device), args)
    data = load_corpus()
    out = open(args.out, "w") if args.out and rank == 0 else None
    for rnd in range(args.rounds):
        round_start = time.perf_counter()
        for h in range(args.inner_steps):
            step = rnd * args.inner_steps + h
            start = time.perf_counter()
            x, y = get_batch(data, args.seed, rank, step, args.batch_size, args.seq_len)
            loss = worker.inner_step(x.to(device), y.to(device))
            sync()
            line = dict(step=step, loss=loss, time_s=round(time.perf_counter() - start, 6), rank=rank)
            if h < args.inner_steps - 1:
                emit(out, **line)
        # the outer step
        local = checksum(worker.model.parameters())
        delta = worker.pseudo_gradient()
        sync()
        start = time.perf_counter()
        dist.barrier()
        waited = time.perf_counter() - start
        start = time.perf_counter()
        dist.all_reduce(delta)  # sum of the pseudo-gradients
        sync()
        comm = time.perf_counter() - start
        worker.outer_step(delta / world)
        sync()
        emit(out, **line, round=rnd, outer_wait_s=round(waited, 6), outer_comm_s=round(comm, 6),
             payload_bytes=delta.numel() * delta.element_size(),
             round_time_s=round(time.perf_counter() - round_start, 6),
             local_checksum=local, checksum=checksum(worker.model.parameters()))
    # every rank done before the group goes, as examples/ddp.py: rank 0 destroyed the group while
    # its peers were still finishing the last all-reduce and aborted at exit ("terminate called
    # without an active exception", CI 2026-12-06, once in ~20 runs)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reference", action="store_true", help="run the --world workers in turn in one process")
    p.add_argument("--world", type=int, default=3, help="with --reference: how many workers")
    p.add_argument("--inner-steps", type=int, default=10, help="H: local AdamW steps between outer steps")
    p.add_argument("--rounds", type=int, default=5, help="outer steps")
    p.add_argument("--batch-size", type=int, default=4, help="rows per rank and step")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3, help="the inner AdamW's")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", help="write rank 0's JSON lines here too")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        sys.exit(f"diloco: --hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.inner_steps < 1 or args.rounds < 1:
        sys.exit("diloco: --inner-steps and --rounds must be at least 1")
    if args.reference:
        run_reference(args)
    elif "RANK" not in os.environ:
        sys.exit("diloco: no RANK in the environment: start it with torchrun, or pass --reference")
    else:
        run_diloco(args)


if __name__ == "__main__":
    main()
