"""Pipeline-parallel training of a small GPT with ``torch.distributed.pipelining``: a plain torchrun script.

Runs unchanged on a real cluster, on one machine and on the testbed's emulated WAN::

    torchrun --standalone --nproc-per-node 3 examples/pipeline_gpt.py --schedule 1f1b
    torchrun --nnodes 3 --nproc-per-node 1 --rdzv-endpoint HOST:29500 examples/pipeline_gpt.py
    python examples/pipeline_gpt.py --reference          # the same model in one process

How it fits: every rank builds the whole GPT from the same seed and keeps the layers of its
stage(s) (the first stage also keeps the embeddings, the last the final norm and LM head), so
the pipeline starts from exactly the weights the one-process ``--reference`` run starts from.
Each rank wraps its stage(s) in ``PipelineStage`` (``--split trace``: ``pipeline()`` traces the
whole model and splits it before the stages' first blocks, ``build_stage`` makes the stages)
and runs one of PyTorch's schedules
(``--schedule``: ``gpipe``, ``1f1b`` with one stage per rank; ``interleaved1f1b``, ``loopedbfs``
with two stages per rank, stage ``s`` on rank ``s % world``).  Every rank draws the same global
batch of byte windows from the running Python's standard library (text every machine has);
the schedule cuts it into ``--microbatches`` and scales gradients by 1/microbatches, which the
reference reproduces (one backward per microbatch, gradients divided by their count).  The last
rank prints one JSON line per step, ``{"step", "loss", "time_s"}`` (``time_s``: wall time since
the previous step ended there, i.e. the steady-state iteration time), and writes them to
``--out``.  Loss equals the reference's to 1e-5 relative (tests/test_examples.py).
Only torch and the standard library: copy this file anywhere.
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
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2, "loopedbfs": 2}  # name -> stages per rank


# --- model: a GPT whose parts a stage may drop (set to None) -----------------------------------
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
    """Byte-level decoder.  ``blocks`` is a ModuleDict keyed by layer index so a stage keeps the
    original parameter names; a stage without the embeddings takes hidden states as input."""

    def __init__(self, layers: int, hidden: int, heads: int, seq_len: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, hidden), nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleDict({str(i): Block(hidden, heads) for i in range(layers)})
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def build_model(args) -> GPT:
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.hidden, args.heads, args.seq_len)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    return model


def layer_range(layers: int, stage: int, stages: int) -> tuple[int, int]:
    """Layers ``first..last-1`` of stage ``stage``: an even split, the first stages one more."""
    per, extra = divmod(layers, stages)
    first = stage * per + min(stage, extra)
    return first, first + per + (stage < extra)


def stage_model(args, stage: int, stages: int) -> GPT:
    """The whole model from the seed, cut down to stage ``stage`` of ``stages`` by hand."""
    model = build_model(args)
    first, last = layer_range(args.layers, stage, stages)
    for i in list(model.blocks.keys()):
        if not first <= int(i) < last:
            del model.blocks[i]
    if stage != 0:
        model.tok = model.pos = None
    if stage != stages - 1:
        model.ln_f = model.head = None
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


# --- data: byte windows of the standard library's source, the same on every machine ------------
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


class Reporter:
    """One JSON line per step on stdout, and in ``path`` when given."""

    def __init__(self, path: str | None):
        self.file = open(path, "w") if path else None
        self.last = time.perf_counter()

    def step(self, step: int, loss: float, **extra) -> None:
        now = time.perf_counter()  # time_s: since the previous step ended on this rank
        line = json.dumps({"step": step, "loss": loss, "time_s": round(now - self.last, 6), **extra})
        self.last = now
        sys.stdout.write(line + "\n")  # one write: ranks sharing a pipe do not split lines
        sys.stdout.flush()
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


# --- the two modes ----------------------------------------------------------------------------
def run_reference(args) -> None:
    """The whole model in one process, on the pipeline's batches and microbatches."""
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data, out = load_corpus(), Reporter(args.out)
    for step in range(args.steps):
        x, y = get_batch(data, args.seed, step, args.microbatches * args.microbatch_size, args.seq_len)
        losses = []
        for xm, ym in zip(x.tensor_split(args.microbatches), y.tensor_split(args.microbatches)):
            loss = loss_fn(model(xm), ym)
            loss.backward()
            losses.append(loss.detach())
        for p in model.parameters():  # as the schedules' scale_grads does
            p.grad.div_(args.microbatches)
        opt.step()
        opt.zero_grad()
        out.step(step, float(torch.stack([l.detach() for l in losses]).mean()))


def run_pipeline(args) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleLoopedBFS, SplitPoint, pipeline)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    per_rank = SCHEDULES[args.schedule]
    stages = world * per_rank
    if args.layers < stages:
        sys.exit(f"pipeline_gpt: --layers {args.layers} < {stages} stages ({world} ranks x {per_rank} for {args.schedule})")
    if args.microbatches < world:
        sys.exit(f"pipeline_gpt: --microbatches {args.microbatches} < {world} ranks ({args.schedule} needs one per rank)")
    dist.init_process_group(backend)

    mine = list(range(rank, stages, world))  # stage s lives on rank s % world
    if args.split == "manual":  # each rank cuts its own stage modules, PipelineStage wraps them
        modules = [stage_model(args, s, stages).to(device) for s in mine]
        pipe_stages = [PipelineStage(m, s, stages, device) for m, s in zip(modules, mine)]
    else:  # pipeline() traces the whole model on one microbatch and splits it before the given blocks
        import warnings  # torch 2.13's tracer warns about its own use of a deprecated pytree class
        warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)
        x, _ = get_batch(load_corpus(), args.seed, 0, args.microbatch_size, args.seq_len)
        splits = {f"blocks.{layer_range(args.layers, s, stages)[0]}": SplitPoint.BEGINNING for s in range(1, stages)}
        pipe = pipeline(build_model(args), mb_args=(x,), split_spec=splits)
        for s in mine:
            pipe.get_stage_module(s).to(device)  # build_stage fixes traced device constants, moves no weights
        pipe_stages = [pipe.build_stage(s, device) for s in mine]
        modules = [st.submod for st in pipe_stages]
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=args.lr, weight_decay=0.0)
    if per_rank == 1:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
        schedule = cls(pipe_stages[0], args.microbatches, loss_fn=loss_fn)
    else:
        cls = {"interleaved1f1b": ScheduleInterleaved1F1B, "loopedbfs": ScheduleLoopedBFS}[args.schedule]
        schedule = cls(pipe_stages, args.microbatches, loss_fn=loss_fn)
    has_first, has_last = 0 in mine, stages - 1 in mine

    data = load_corpus()
    out = Reporter(args.out if has_last else None)
    for step in range(args.steps):
        x, y = get_batch(data, args.seed, step, args.microbatches * args.microbatch_size, args.seq_len)
        x, y = x.to(device), y.to(device)
        losses: list[torch.Tensor] = []
        inputs = (x,) if has_first else ()
        if has_last:
            schedule.step(*inputs, target=y, losses=losses, return_outputs=False)
        else:
            schedule.step(*inputs, return_outputs=False)
        opt.step()
        opt.zero_grad()
        if has_last:
            out.step(step, float(torch.stack([l.detach() for l in losses]).mean()))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    p.add_argument("--split", choices=["manual", "trace"], default="manual",
                   help="manual: cut the model by hand into PipelineStage; trace: torch.distributed.pipelining.pipeline()")
    p.add_argument("--reference", action="store_true", help="train the same model in one process, no torch.distributed")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=6)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", help="write the JSON lines here too (on the rank that prints them)")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        sys.exit(f"pipeline_gpt: --hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.reference:
        run_reference(args)
    elif "RANK" not in os.environ:
        sys.exit("pipeline_gpt: no RANK in the environment: start it with torchrun, or pass --reference")
    else:
        run_pipeline(args)


if __name__ == "__main__":
    main()
