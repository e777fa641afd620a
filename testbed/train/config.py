"""A training worker's configuration: what the runner writes, what the worker reads.

How it fits: ``testbed/run/runner.py`` builds one ``WorkerConfig`` per (stage, replica) from the
experiment and the network, and writes it as JSON; ``testbed/train/worker.py`` reads it back
with ``WorkerConfig.load``.  Each default lives here and only here.  Plain dataclasses, not
pydantic: a worker imports as little as it can (64 of them share this machine), and the
runner has validated the experiment already.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Me:
    name: str
    stage: int
    replica: int
    ip: str


@dataclass
class Peer:
    """The neighbouring stage of the same pipeline: ``connections`` TCP connections, each
    with ``buf`` bytes of socket buffer (0: the kernel's autotuning; inside a DC) and, where
    ``window`` is set, a window of exactly that many bytes (``parallel.tcp_window_bytes``);
    ``pace``: each connection's pacing rate (``parallel.paced``); ``wan``: across a DC boundary."""

    name: str
    ip: str
    connections: int = 1
    buf: int = 0
    window: int = 0
    pace: int = 0  # bytes/s each connection is paced at (SO_MAX_PACING_RATE); 0: not paced
    wan: bool = False  # the peer is in another DC


@dataclass
class SendTurns:
    """One outgoing cross-DC channel's turns on the WAN (``testbed/net/sendturns.py``)."""

    server: str  # the turn server's socket (the sending DC's)
    pipeline: str  # this channel's pipeline, as the plan's order names it (r0, r1, ..)
    links: list[str]  # the WAN directions the channel crosses ("src->dst")
    handover_bytes: int  # hand the link on once no more than this is unacknowledged (the path's BDP)
    rate_bytes_s: float  # the path's rate on the wire (paces the polling)
    ceiling_bytes_s: float = 0.0  # what its connections can carry (N x window clamp / RTT); 0: unclamped


@dataclass
class DataParallel:
    master: str  # the address of replica 0 of this stage
    port: int
    backend: str = "gloo"  # nccl on distinct GPUs; "ring": the emulated worker's own ring over the transport
    ring: list[str] = field(default_factory=list)  # every replica's address, in rank order


@dataclass
class Emulation:
    """How an emulated device spends its time (``device: emulated``; ``emulated.py``).

    ``times``: per op kind (forward, backward, optimizer, send, recv, allreduce) the
    durations to draw from, in seconds (one value: always that); ``message_bytes``: one
    activation or gradient on the wire; ``grad_bytes``: this stage's gradients (all-reduced);
    ``message_latency_s``: the transport's own latency on the profiled hosts, added at the
    receiver; ``sequence``: replay the durations in the order given (a recorded run)."""

    device_file: str
    seed: int
    times: dict[str, list[float]]
    message_bytes: int
    grad_bytes: int
    message_latency_s: float = 0.0
    sequence: bool = False  # take the durations in order (cycling) instead of drawing them


@dataclass
class WorkerConfig:
    worker: Me
    stages: int
    replicas: int
    schedule: str
    model: dict  # testbed.train.model.ModelConfig's fields
    training: dict  # testbed.spec.experiment.TrainingSpec's fields
    telemetry: str  # the run's hub (Unix socket path)
    port: int  # this worker's listening port for pipeline channels
    device: str = "cpu"  # cpu, cuda:N, emulated (the device kind's label; torch's device for TorchCompute)
    compute: str = "testbed.train.torch_compute:TorchCompute"  # "module:Class": what computes (the device kind says)
    extra_warmup: int = 0
    next: Peer | None = None
    prev: Peer | None = None
    dp: DataParallel | None = None
    announce_waits: bool = False  # tell the hub when a wait for a peer begins (BubbleTea)
    wait_board: str | None = None  # and show the wait under way in this 8-byte file
    recv_timeout_s: float = 300.0  # a peer silent this long ends the run (names it)
    emulation: Emulation | None = None  # device "emulated": where its op times come from
    turns_next: SendTurns | None = None  # activations wait for their turn on the WAN (Atlas at the senders)
    turns_prev: SendTurns | None = None  # gradients, likewise
    tcp_trace: bool = False  # record each WAN connection's TCP state per message (parallel.tcp_trace)
    extra: dict = field(default_factory=dict)  # options of run extensions the trainer does not read

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "WorkerConfig":
        data = json.loads(Path(path).read_text())
        data["worker"] = Me(**data["worker"])
        for key, kind in (("next", Peer), ("prev", Peer), ("dp", DataParallel), ("emulation", Emulation),
                          ("turns_next", SendTurns), ("turns_prev", SendTurns)):
            if data.get(key) is not None:
                data[key] = kind(**data[key])
        return cls(**data)


def socket_buffer_bytes(rate_mbps: float, rtt_ms: float, connections: int) -> int:
    """Each connection's share of 2x the path's bandwidth-delay product, at least 256 KiB
    (0 = the kernel's autotuning)."""
    if rate_mbps <= 0:
        return 0
    bdp = rate_mbps * 1e6 / 8 * rtt_ms / 1000.0
    return int(max(256 * 1024, 2 * bdp / connections))
