"""An emulated device: the schedule's ops take profiled time on a device that computes nothing.

How it fits: with ``device: emulated`` the runner starts ``worker.py`` with this compute
instead of ``torch_compute.py``.  Everything the network sees is real: the same schedule op
list, the same transport with N TCP connections per WAN boundary, messages of the real
tensors' size (``codec.message_bytes``), the DP ring all-reduce of the stage's gradient
bytes (``ring.py``), the same telemetry.  What is emulated is the device: each forward,
backward and optimizer step occupies the worker's ``EmulatedDevice`` (``device.py``) for a
duration drawn (seeded) from the profile the runner passes in (``config.Emulation``:
from an earlier real run's timeline, or from the model's FLOPs at a device's speed;
``testbed/sim/device.py``); so do the hand-offs to and from the transport (a device's copy
to and from host memory) and the all-reduce's arithmetic beyond the bytes moved.  The
worker imports no torch or numpy and holds one message buffer, so dozens fit on two cores.
There is no model, hence no loss.
"""

from __future__ import annotations

import collections
import random
import time

from testbed.train.config import WorkerConfig
from testbed.train.device import EmulatedDevice, timing_report
from testbed.train.ring import Ring

BUSY = ("forward", "backward", "optimizer")
_KEPT_OPS = 4096  # the device intervals of the last this many training ops go in the report


class EmulatedCompute:
    busy_kinds = BUSY

    def __init__(self, cfg: WorkerConfig, endpoint):
        em = cfg.emulation
        if em is None:
            raise ValueError("device: emulated needs an emulation section in the worker's config")
        me = cfg.worker
        self.device = EmulatedDevice(em.device_file)
        # [kind, start, end] of each training op as the device scheduled it (the worker's own
        # spans end when its sleep woke, a wake-up latency later): what a co-tenant's work on
        # the same device is checked against
        self.device_ops: collections.deque = collections.deque(maxlen=_KEPT_OPS)
        self.times = em.times
        self.rng = random.Random(f"{em.seed}:{me.stage}:{me.replica}")
        self.shared_rng = random.Random(f"{em.seed}:{me.stage}")  # the same draws on every rank of the stage
        self.sequence = em.sequence
        self.next_index: dict[str, int] = {}
        self.message = memoryview(bytes(em.message_bytes))
        self.grad_bytes = em.grad_bytes
        self.latency = em.message_latency_s
        self.ring = None
        if cfg.replicas > 1:
            dp = cfg.dp
            names = [f"s{me.stage}r{r}" for r in range(cfg.replicas)]
            self.ring = Ring(endpoint, names, dp.ring, me.replica, cfg.port)

    def _draw(self, kind: str, rng: random.Random | None = None) -> float:
        pool = self.times.get(kind)
        if not pool:
            return 0.0
        if len(pool) == 1:
            return pool[0]
        if self.sequence:  # a recorded run, replayed in order
            n = self.next_index[kind] = self.next_index.get(kind, -1) + 1
            return pool[n % len(pool)]
        return pool[(rng or self.rng).randrange(len(pool))]

    def _occupy(self, kind: str) -> None:
        seconds = self._draw(kind)
        if seconds > 0:
            start, end = self.device.run(seconds)
            if kind in BUSY:
                self.device_ops.append([kind, round(start, 6), round(end, 6)])

    def start_iteration(self, it: int) -> None:
        pass

    def forward(self, it: int, mb: int) -> None:
        self._occupy("forward")

    def backward(self, it: int, mb: int) -> None:
        self._occupy("backward")

    def activation(self, mb: int) -> memoryview:
        self._occupy("send")  # the device's copy to host memory
        return self.message

    def gradient(self, mb: int) -> memoryview:
        self._occupy("send")
        return self.message

    def _received(self, buf: bytearray, arrived: float) -> None:
        if len(buf) != len(self.message):
            raise ValueError(f"received a {len(buf)}-byte message, expected {len(self.message)}")
        # the profiled hosts' own transport latency (their threads waiting for a CPU quota):
        # the message is usable this long after its last byte arrived, as in the simulator
        usable = arrived + self.latency - time.monotonic()
        if usable > 0:
            time.sleep(usable)
        self._occupy("recv")  # the copy into the device

    def take_activation(self, mb: int, buf: bytearray, arrived: float) -> None:
        self._received(buf, arrived)

    def take_gradient(self, mb: int, buf: bytearray, arrived: float) -> None:
        self._received(buf, arrived)

    def allreduce(self) -> None:
        """The ring moves the bytes (and waits for the last rank to enter, as a collective
        does); then the collective's own profiled cost, drawn alike by every rank of the
        stage, so they all leave it together."""
        t0 = time.monotonic()
        if self.ring is not None:
            self.ring.allreduce(self.grad_bytes)
        if self.times.get("allreduce"):
            want = self._draw("allreduce", self.shared_rng)
            left = want - (time.monotonic() - t0)
            if left > 0:
                self.device.run(left)

    def optimizer_step(self) -> None:
        self._occupy("optimizer")
        return None

    def synchronize(self) -> None:
        pass

    def report(self) -> dict:
        return {"op_timing": timing_report(self.device.errors), "device_busy_s": round(self.device.busy_seconds(), 6),
                "device_ops": list(self.device_ops)}

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
        self.device.close()
