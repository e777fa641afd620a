"""The real device: a stage of the GPT in PyTorch, on a CPU or a GPU.

How it fits: ``worker.py`` runs the schedule and asks this class to compute each op.  It
builds the stage (``model.py``) from the seed every worker shares, reads the global batch
(``data.py``: the same examples whatever the parallelism, so the loss equals a single
process's), turns tensors into the bytes the channels carry (``codec.py``), all-reduces
gradients inside the DC with torch.distributed (gloo, or NCCL on distinct GPUs), and steps
AdamW.  On a GPU an op's interval ends when the device is done (``synchronize``).
"""

from __future__ import annotations

from testbed.train.codec import decode, encode
from testbed.train.config import WorkerConfig

BUSY = ("forward", "backward", "optimizer")


class TorchCompute:
    busy_kinds = BUSY

    def __init__(self, cfg: WorkerConfig, endpoint=None):
        import torch
        import torch.distributed as dist

        from testbed.train.data import Corpus
        from testbed.train.model import ModelConfig, build_model, grad_norm_sq, loss_fn, optimizer, stage_module

        torch.set_num_threads(1)
        self.torch = torch
        me = cfg.worker
        self.stage, self.replica, self.stages, self.replicas = me.stage, me.replica, cfg.stages, cfg.replicas
        self.device = torch.device(cfg.device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.device)
        self.mcfg = ModelConfig(**cfg.model)
        self.tr = cfg.training
        self.model = stage_module(build_model(self.mcfg, self.tr["seed"]), self.stage, self.stages).to(self.device)
        self.optim = optimizer(self.model.parameters(), self.tr)
        self._grad_norm_sq, self.grad_norms_sq = grad_norm_sq, []  # per iteration, this stage's
        self.corpus = Corpus() if self.stage in (0, self.stages - 1) else None
        self.loss_fn = loss_fn
        self.M, self.mb_size = self.tr["microbatches"], self.tr["microbatch_size"]
        self.inputs: dict[int, object] = {}
        self.outputs: dict[int, object] = {}
        self.losses: list = []
        self.it = 0
        self.group = None
        if self.replicas > 1:
            dp = cfg.dp
            dist.init_process_group(dp.backend, init_method=f"tcp://{dp.master}:{dp.port}",
                                    rank=self.replica, world_size=self.replicas)
            self.group = dist.group.WORLD
        self.dist = dist

    def start_iteration(self, it: int) -> None:
        self.it = it
        self.inputs, self.outputs, self.losses = {}, {}, []

    def _batch(self, mb: int):
        return self.corpus.batch(self.tr["seed"], self.it, self.replica, mb, self.replicas, self.M, self.mb_size,
                                 self.mcfg.seq_len)

    def forward(self, it: int, mb: int) -> None:
        if self.stage == 0:
            x, _ = self._batch(mb)
            self.inputs[mb] = x.to(self.device)
        out = self.model(self.inputs[mb])
        if self.stage == self.stages - 1:
            _, y = self._batch(mb)
            out = self.loss_fn(out, y.to(self.device)) / (self.M * self.replicas)
            self.losses.append(out.detach())
        self.outputs[mb] = out

    def backward(self, it: int, mb: int) -> None:
        if self.stage == self.stages - 1:
            self.outputs[mb].backward()
        else:
            out, g = self.outputs[mb]
            out.backward(g)
        self.outputs.pop(mb)

    def activation(self, mb: int) -> bytes:
        return encode(self.outputs[mb].detach())

    def gradient(self, mb: int) -> bytes:
        return encode(self.inputs.pop(mb).grad)

    def take_activation(self, mb: int, buf: bytearray, arrived: float) -> None:
        self.inputs[mb] = decode(buf).to(self.device).requires_grad_(True)

    def take_gradient(self, mb: int, buf: bytearray, arrived: float) -> None:
        self.outputs[mb] = (self.outputs[mb], decode(buf).to(self.device))

    def allreduce(self) -> None:
        torch = self.torch
        grads = [p.grad for p in self.model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.dist.all_reduce(flat, group=self.group)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    def optimizer_step(self) -> float | None:
        self.grad_norms_sq.append(self._grad_norm_sq(self.model))
        self.optim.step()
        self.optim.zero_grad(set_to_none=False)
        return float(self.torch.stack(self.losses).sum()) if self.losses else None

    def synchronize(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def report(self) -> dict:
        return {"grad_norm_sq": self.grad_norms_sq}

    def close(self) -> None:
        if self.group is not None:
            self.dist.destroy_process_group()
