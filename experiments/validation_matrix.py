"""The cells of ``validate_emulated.py``'s matrix: what each one runs, and what it will cost.

How it fits: ``validate_emulated.py`` (the command) asks ``cells`` for the matrix a
selection names, writes each cell's experiment with ``write_experiment``, prints
``estimate_s`` before it runs a cell (and ``--plan`` prints them all), runs the cells on the
emulator and predicts them with the simulator.  This module starts nothing and builds no
network: it is plain data and the simulator (for the estimates).

The matrix (issue #30): two DCs, one WAN link, P = 2 (one stage per DC), 1F1B, 4
microbatches, ``device: emulated`` with exact stage times, one TCP connection a transfer;

* round trips 5, 50, 150, 250 ms (the one-way delay half of it on each direction);
* 1, 4, 8 pipelines on the link;
* a boundary message of 1, 10, 100 times the link's bandwidth-delay product, compute per
  microbatch about one message's transfer time alone (forward a third, backward two);
* hosts with Linux's defaults (``tcp_slow_start_after_idle = 1``) or WAN-tuned (``= 0``);
* fair sharing (TCP's own) or Atlas's temporal sharing (``atlas: {sharing: temporal}``, the
  gateway's strict priority by the controller's plan).

144 cells.  The link's rate: 100 Mbit/s up to a 20 ms round trip, above that 2000 / RTT
Mbit/s (40 at 50 ms, 13.3 at 150, 8 at 250), so that the BDP stays 250 kB (170 segments:
windows with room to grow and restart, as on a real long haul) while the delay line carries
no more than a 2-core machine's share; a message's time alone, x BDP / rate = x RTT, does not
depend on the rate.  The queue is the topology's default (one BDP, at least 128 KiB).

The 12 cells of the earlier matrix (4.2 ms, 100 Mbit/s, 10x and 100x BDP, fair, 2026-12-03
figures in docs/benchmarks.md) are the cells ``rtt 4.2`` of this one, built exactly as before
(``--rtt 4.2 --message-bdp 10,100 --sharing fair``); their old run folders
(``d4-x10-default``) are read as theirs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

RTTS_MS = (5.0, 50.0, 150.0, 250.0)
PIPELINES = (1, 4, 8)
MESSAGE_BDP = (1.0, 10.0, 100.0)
HOSTS = ("default", "tuned")
SHARING = ("fair", "temporal")

MICROBATCHES = 4
STAGES = 2
HIDDEN = 128
DTYPE_BYTES = 4
MAX_SEQ = 2048  # a message beyond one sequence of this length takes several (microbatch_size)
STARTUP_S = 15.0  # a run's start-up before the go (network, WAN check, workers): measured 3-9 s
STARTUP_PER_WORKER_S = 0.5  # ... and a little more per worker (bench_emulated: 3.1 s at 16, 8.6 s at 64)
PAYLOAD_FRACTION = 1448 / 1514  # TCP payload of a full-size frame (testbed.net.tcpmodel's)


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: everything its run and its prediction depend on."""

    rtt_ms: float
    pipelines: int
    message_bdp: float  # nominal: the message is this many BDPs, to a whole 64-token sequence
    hosts: str  # default | tuned
    sharing: str  # fair | temporal

    @property
    def name(self) -> str:
        return (f"rtt{self.rtt_ms:g}-d{self.pipelines}-x{self.message_bdp:g}-{self.hosts}-{self.sharing}")

    @property
    def legacy_name(self) -> str | None:
        """The earlier matrix's folder name for this cell, where it was one of its 12."""
        if self.rtt_ms == 4.2 and self.sharing == "fair" and self.message_bdp in (10.0, 100.0):
            return f"d{self.pipelines}-x{self.message_bdp:g}-{self.hosts}"
        return None

    @property
    def rate_mbps(self) -> float:
        return rate_mbps(self.rtt_ms)

    @property
    def shape(self) -> tuple[int, int]:
        """(seq_len, microbatch_size) of a message of ``message_bdp`` BDPs at hidden 128, fp32."""
        units = self.message_bdp * self.rate_mbps * 1e6 / 8 * self.rtt_ms / 1000 / (HIDDEN * DTYPE_BYTES)
        mb = max(1, round(units / MAX_SEQ))
        seq = max(64, round(units / mb / 64) * 64)
        return seq, mb

    @property
    def message_bytes(self) -> int:
        seq, mb = self.shape
        return seq * mb * HIDDEN * DTYPE_BYTES

    @property
    def transfer_s(self) -> float:
        """One message alone on the link (what the stage times are made of)."""
        return self.message_bytes / (self.rate_mbps * 1e6 / 8 * PAYLOAD_FRACTION)

    def row(self) -> dict:
        """The cell's settings as the CSV states them."""
        bdp = self.rate_mbps * 1e6 / 8 * self.rtt_ms / 1000
        return asdict(self) | {"cell": self.name, "rate_mbps": self.rate_mbps, "message_bytes": self.message_bytes,
                               "message_bdp_actual": round(self.message_bytes / bdp, 3),
                               "microbatches": MICROBATCHES}


def rate_mbps(rtt_ms: float) -> float:
    """The link's rate for a round trip: 100 Mbit/s to 20 ms, then 2000 / RTT (a 250 kB BDP)."""
    return 100.0 if rtt_ms <= 20.0 else round(2000.0 / rtt_ms, 1)


def cells(rtts: tuple[float, ...] = RTTS_MS, pipelines: tuple[int, ...] = PIPELINES,
          message_bdp: tuple[float, ...] = MESSAGE_BDP, hosts: tuple[str, ...] = HOSTS,
          sharing: tuple[str, ...] = SHARING) -> list[Cell]:
    """The matrix over the values given (default: all of it, 144 cells), in matrix order."""
    for name, values, allowed in (("hosts", hosts, HOSTS), ("sharing", sharing, SHARING)):
        for v in values:
            if v not in allowed:
                raise ValueError(f"{name}: {v!r} is not one of {', '.join(allowed)}")
    for name, values in (("rtt", rtts), ("message-bdp", message_bdp)):
        for v in values:
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name}: {v!r} is not a positive number")
    for d in pipelines:
        if d < 1:
            raise ValueError(f"pipelines: {d!r} is not a positive whole number")
    return [Cell(float(r), int(d), float(x), h, s)
            for r, d, x, h, s in itertools.product(rtts, pipelines, message_bdp, hosts, sharing)]


def write_experiment(cell: Cell, folder: Path, iterations: int) -> Path:
    """The cell's topology and experiment files in ``folder``; the experiment's path."""
    folder.mkdir(parents=True, exist_ok=True)
    d = cell.pipelines
    topo = folder / f"topo-rtt{cell.rtt_ms:g}-d{d}.yaml"
    topo.write_text(yaml.safe_dump({
        "name": f"v2dc-{d}", "dcs": [{"name": "a", "hosts": d}, {"name": "b", "hosts": d}],
        "wan": [{"a": "a", "b": "b", "delay_ms": cell.rtt_ms / 2, "rate_mbps": cell.rate_mbps}]}))
    seq, mb = cell.shape
    t = cell.transfer_s
    data = {
        "name": cell.name, "topology": str(topo), "device": "emulated",
        "model": {"layers": 2, "hidden": HIDDEN, "heads": 4, "seq_len": seq},
        "training": {"iterations": iterations, "microbatches": MICROBATCHES, "microbatch_size": mb, "seed": 3},
        "parallel": {"stages": STAGES, "replicas": d, "schedule": "1f1b", "connections": 1,
                     "slow_start_after_idle": cell.hosts == "default"},
        "sim": {"stage_times": [{"forward_s": round(t / 3, 5), "backward_s": round(2 * t / 3, 5)}] * STAGES}}
    if cell.sharing == "temporal":
        data["atlas"] = {"sharing": "temporal"}
    path = folder / f"{cell.name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def estimate_s(exp, iterations: int, simulate_options: dict) -> float:
    """The cell's emulated duration, roughly: start-up plus ``iterations`` iterations at the
    simulator's own figure for the experiment (``simulate_options``: what the extensions the
    experiment uses give the simulator).  The emulator runs at the wall clock's pace, so this
    is its wall time too."""
    from testbed.results.metrics import summarise
    from testbed.sim.build import simulate
    from testbed.sim.device import stage_times

    times, latency = stage_times(exp)
    result = simulate(exp, iterations=min(iterations, 4), stage_times=times, message_overhead_s=latency,
                      record=True, **simulate_options)
    per_iteration = summarise(result).summary.mean_iteration_time_s
    workers = STAGES * exp.parallel.replicas
    return STARTUP_S + STARTUP_PER_WORKER_S * workers + iterations * per_iteration
