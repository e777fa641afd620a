"""Configurations of BubbleTea's processes: what ``extension.py`` writes, what they read.

How it fits: ``BubbleTeaExtension.start`` builds a ``ServerConfig`` per training worker, a
``DecodeConfig`` per decode worker and one ``ControllerConfig`` from the experiment's
``bubbletea`` section (``testbed.experiment.BubbleTeaSpec``, where the user-facing defaults
live), and starts the processes with them as JSON.  The defaults here are the processes'
own (how many KV senders, what to calibrate): one place each.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


def _load(cls, path: str | Path, nested: dict | None = None):
    data = json.loads(Path(path).read_text())
    for key, kind in (nested or {}).items():
        if data.get(key) is not None:
            data[key] = kind(**data[key])
    return cls(**data)


@dataclass
class InferenceModel:
    """The served model (``inference.py``)."""

    layers: int
    hidden: int
    heads: int
    max_context: int
    seed: int = 7


@dataclass
class ServerConfig:
    """A prefill server beside one training worker."""

    worker: str
    listen: str  # its datagram socket
    controller: str  # the controller's datagram socket
    model: InferenceModel
    wait_board: str | None = None  # the worker's board: the wait under way
    calibrate: list[int] = field(default_factory=lambda: [16, 64, 128, 256])  # prompt lengths profiled at start
    kv_senders: int = 4  # KV caches shipped at once (a cache takes a few WAN round trips)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "ServerConfig":
        return _load(cls, path, {"model": InferenceModel})


@dataclass
class DecodeConfig:
    """A decode worker (one per DC by default)."""

    model: InferenceModel
    controller: str
    ip: str
    port: int
    max_batch: int = 16

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "DecodeConfig":
        return _load(cls, path, {"model": InferenceModel})


@dataclass
class Workload:
    source: str  # conv | code (Azure traces) | poisson
    duration_s: float
    rate_scale: float
    token_scale: float
    rate_per_s: float
    max_output_tokens: int
    seed: int = 0


@dataclass
class ControllerConfig:
    telemetry: str  # the run's hub
    listen: str  # its datagram socket
    results: str  # where it writes every request's fate
    servers: dict[str, str]  # worker -> its prefill server's socket
    decode: dict[str, list]  # worker -> [ip, port] of the decode worker its caches go to
    warmup_iterations: int
    interleave: bool
    slo_ttft_s: float
    margin_s: float
    margin_frac: float
    chunk_tokens: int
    max_prompt_tokens: int
    workload: Workload
    max_jobs: int = 8  # requests one dispatch may carry
    drain_s: float = 3.0  # after training, prefills and decodes under way may finish this long

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "ControllerConfig":
        return _load(cls, path, {"workload": Workload})
