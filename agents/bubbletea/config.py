"""Configurations of BubbleTea's processes: what ``extension.py`` writes, what they read.

How it fits: ``BubbleTeaExtension.start`` builds a ``ServerConfig`` per training worker, a
``DecodeConfig`` per decode worker and one ``ControllerConfig`` from the experiment's
``bubbletea`` section (``testbed.spec.experiment.BubbleTeaSpec``, where the user-facing defaults
live), and starts the processes with them as JSON.  The defaults here are the processes'
own (how many KV senders, what to calibrate): one place each.

On emulated devices (``device: emulated``) a server and a decode worker get ``device_file``
(the emulated device they occupy: the worker's own for a server) and ``serving_profile``
(``profile.py``'s JSON, read by ``timing.py``) with ``speedup`` (the experiment's
``emulation.speedup``): they then run no model and import no torch.

Clocks: every instant in BubbleTea's messages and results is on the run's clock (the one
telemetry is mapped onto).  Each process gets ``clock_offset_s``, its machine's
CLOCK_MONOTONIC less the run's (``Launcher.clock_offset``: 0 on one machine; across machines
the fake cluster's differ by seconds): it subtracts it from the instants it sends and adds it
to those it is sent.
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
    device_file: str | None = None  # emulated: the worker's device, which prefill chunks occupy
    serving_profile: str | None = None  # emulated: profile.py's JSON (prefill and decode times, KV bytes)
    speedup: float = 1.0  # emulated: the device is this many times as fast as the profiled one
    device: str = "cpu"  # the real model's device: the worker's (cpu, cuda:N)
    clock_offset_s: float = 0.0  # its machine's monotonic clock less the run's (``Launcher.clock_offset``)

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
    name: str = "decode"  # as the controller and the run's log call it (decode-<dc>)
    max_batch: int = 16
    device_file: str | None = None  # emulated: its own device, which decode steps occupy
    serving_profile: str | None = None
    speedup: float = 1.0
    clock_offset_s: float = 0.0  # its machine's monotonic clock less the run's

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
    decoders: dict[str, list]  # decode worker name -> [ip, port]
    decode: dict[str, str]  # worker -> the decode worker its caches go to
    warmup_iterations: int
    interleave: bool
    slo_ttft_s: float
    slo_tbt_s: float | None  # goodput also asks each request's mean time between tokens to be within this
    margin_s: float
    margin_frac: float
    chunk_tokens: int
    max_prompt_tokens: int
    workload: Workload
    max_jobs: int = 8  # requests one dispatch may carry
    dispatch_ahead: bool = True  # jobs for a worker's next wait, sent before it begins
    drain_s: float = 3.0  # after training, prefills and decodes under way may finish this long
    clock_offset_s: float = 0.0  # its machine's monotonic clock less the run's (telemetry comes on the run's)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path) -> "ControllerConfig":
        return _load(cls, path, {"workload": Workload})
