"""Data-parallel training of a small GPT with ``DistributedDataParallel``: a plain torchrun script.

Runs unchanged on a real cluster, on one machine and on the testbed's emulated WAN (one rank
per DC)::

    torchrun --standalone --nproc-per-node 3 examples/ddp.py
    torchrun --nnodes 3 --nproc-per-node 1 --rdzv-endpoint HOST:29500 examples/ddp.py
    python examples/ddp.py --reference --world 3      # one process, the concatenated batch

How it fits: every rank builds the same GPT from the seed (DDP also broadcasts rank 0's weights
at construction), draws the same global batch of ``world x --batch-size`` byte windows of the
standard library's source (a function of seed and step only) and trains on its own rows
``rank x batch-size ..``.  DDP averages the gradients across ranks in its all-reduce, so the
step equals one process training on the whole concatenated batch (``--reference``), losses
within 1e-5 relative (tests/test_examples.py).  Rank 0 prints one JSON line per step,
``{"step", "loss", "time_s", "allreduce_bytes"}``: ``loss`` is the mean over the ranks (one small
all-reduce after the step, outside ``time_s``), ``time_s`` forward + backward with DDP's gradient
all-reduce + optimizer step, ``allreduce_bytes`` the gradient bytes each rank all-reduces per
step.  Gloo on CPU, NCCL when CUDA is there.  Only torch and the standard library.
"""

from __future__ import annotations

import argparse
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


def get_batch(data: torch.Tensor, seed: int, step: int, rows: int, seq_len: int):
    """(inputs, next-byte targets), both (rows, seq_len) int64, a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len - 1, (rows,), generator=gen)
    window = data[starts.unsqueeze(1) + torch.arange(seq_len + 1)].long()
    return window[:, :-1], window[:, 1:]


def emit(out, **fields) -> None:
    line = json.dumps(fields)
    sys.stdout.write(line + "\n")  # one write: ranks sharing a pipe do not split lines
    sys.stdout.flush()
    if out:
        out.write(line + "\n")
        out.flush()


def run_reference(args) -> None:
    """One process, no torch.distributed: the whole ``world x batch-size`` batch each step."""
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data, out = load_corpus(), open(args.out, "w") if args.out else None
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for step in range(args.steps):
        start = time.perf_counter()
        x, y = get_batch(data, args.seed, step, args.world * args.batch_size, args.seq_len)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        emit(out, step=step, loss=float(loss.detach()), time_s=round(time.perf_counter() - start, 6),
             allreduce_bytes=grad_bytes)


def run_ddp(args) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    model = DDP(build_model(args).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    data = load_corpus()
    out = open(args.out, "w") if args.out and rank == 0 else None
    b = args.batch_size
    for step in range(args.steps):
        start = time.perf_counter()
        x, y = get_batch(data, args.seed, step, world * b, args.seq_len)
        x, y = x[rank * b:(rank + 1) * b].to(device), y[rank * b:(rank + 1) * b].to(device)
        loss = loss_fn(model(x), y)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = time.perf_counter() - start
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the report only: the global batch's loss
        if rank == 0:
            emit(out, step=step, loss=float(mean) / world, time_s=round(took, 6), allreduce_bytes=grad_bytes)
    # every rank done before the group goes, and DDP's reducer (which holds the group and its
    # threads) gone before it: destroying the group under a live reducer aborted a rank now and
    # then at exit ("terminate called without an active exception", 2 runs of ~8 under load)
    dist.barrier()
    del model, opt
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reference", action="store_true", help="train on the concatenated batch in one process")
    p.add_argument("--world", type=int, default=3, help="with --reference: how many ranks' batches to concatenate")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4, help="rows per rank and step")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", help="write the JSON lines here too (rank 0)")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        sys.exit(f"ddp: --hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.reference:
        run_reference(args)
    elif "RANK" not in os.environ:
        sys.exit("ddp: no RANK in the environment: start it with torchrun, or pass --reference")
    else:
        run_ddp(args)


if __name__ == "__main__":
    main()
