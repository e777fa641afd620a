"""Experiment specs: which model to train, how it is parallelised, where stages run.

How it fits: ``load_experiment`` reads ``experiments/*.yaml`` into an ``Experiment`` and
resolves its topology; ``Experiment.workers()`` maps every (stage, replica) onto a host of
the topology.  ``testbed run`` (``runner.py``) launches those workers; the simulator reads
the same file.  A placement that does not fit the topology, or a schedule that cannot run,
fails here with one line before anything is created.

Placement: ``placement: {dc: [stages...]}`` lists which DC holds which pipeline stages;
each stage is replicated ``replicas`` times inside its DC (data parallelism), on distinct
hosts.  Without it, stages are spread over the DCs in file order, contiguously.

Files are read strictly, as topology files are (``spec.py``): wrong types, infinities, keys
given twice are one-line errors.  Names become folder and cgroup names, so they are plain
(letters, digits, ``.``, ``_``, ``-``); sizes that would make the schedule check itself run
for minutes (microbatches, warm-up) are bounded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model

from testbed.extension import device_kinds, extensions
from testbed.spec.schedules import ScheduleError, check
from testbed.spec.topology import (SpecError, SpecErrors, Topology, key_text, load_topology, one_line, path_exists, read_yaml, resolve_topology,
                   validation_error)

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # a results folder and a cgroup are named after it
MAX_MICROBATCHES = 4096


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ModelSpec(_Strict):
    layers: int = Field(6, ge=1, le=512)
    hidden: int = Field(128, ge=8, le=65536)
    heads: int = Field(4, ge=1, le=512)
    seq_len: int = Field(64, ge=2, le=65536)


class TrainingSpec(_Strict):
    iterations: int = Field(10, ge=1, le=10**9)
    microbatches: int = Field(4, ge=1, le=MAX_MICROBATCHES)
    microbatch_size: int = Field(4, ge=1, le=65536)
    lr: float = Field(1e-3, gt=0, le=10)
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="AdamW (weight decay 0) or plain SGD")
    seed: int = Field(0, ge=0, le=2**32 - 1)
    warmup_iterations: int = Field(2, ge=0, description="left out of summary figures (allocator, TCP warm-up)")
    recv_timeout_s: float = Field(300.0, gt=0, le=86400, description="a pipeline peer silent this long ends the run "
                                  "with an error naming the WAN link between them (a link down for less stalls "
                                  "training, which then resumes)")


class ParallelSpec(_Strict):
    stages: int = Field(2, ge=1, le=512)
    replicas: int = Field(1, ge=1, le=100_000)
    schedule: str = "1f1b"
    extra_warmup: int = Field(0, ge=0, le=MAX_MICROBATCHES)
    connections: int = Field(1, ge=1, le=64, description="TCP connections per cross-DC transfer")
    dp_across_dcs: bool = Field(
        False, description="baseline (d): every DC holds whole pipelines (replica r in DC r mod #DCs) and "
                           "gradients are all-reduced over the WAN; excludes placement")
    slow_start_after_idle: bool = Field(
        True, description="Linux's default; false = WAN-tuned hosts (net.ipv4.tcp_slow_start_after_idle=0): "
                          "TCP keeps its window across the idle gaps between microbatches")
    paced: bool = Field(
        False, description="pace every WAN connection at 1.25 x the path's rate / connections (the socket's "
                           "SO_MAX_PACING_RATE): a window leaves spread over the round trip instead of in one "
                           "ACK-clocked burst (with traffic both ways, ACKs queued behind the other direction's "
                           "data made window-bound senders bursty and slow: docs/benchmarks.md)")
    tcp_window_bytes: int | None = Field(
        None, ge=16384, description="every WAN connection's window, to the byte (the transport's receivers clamp "
                                    "it; the worker hosts' other connections are held by their rmem/wmem maximum): "
                                    "a window-bound connection, as a default Linux host's across a long round trip; "
                                    "None: socket buffers of 2 x BDP per connection, 64 MiB at most")
    tcp_trace: bool = Field(
        False, description="record every WAN connection's TCP state (cwnd, ssthresh, RTT, RTO, idle time, "
                           "retransmissions: getsockopt TCP_INFO) as each message's slice is written, into "
                           "tcp-trace/WORKER.jsonl in the results (testbed/net/tcpinfo.py)")


class EmulationSpec(_Strict):
    """Where an emulated device's op times come from (``device: emulated``)."""

    profile: str | None = Field(None, description="timeline.json of an earlier real run of this model and "
                                                  "parallelism; without it, the model's FLOPs at sim.device_tflops "
                                                  "x sim.efficiency (the simulator's model)")
    speedup: float = Field(1.0, gt=0, description="a device this many times faster than the profiled one: every "
                                                  "device time is divided by it")
    message_latency: bool = Field(True, description="with a profile: add the profiled hosts' own per-message "
                                                    "transport latency at the receiver")
    slowdown: dict[int, float] = Field(
        default_factory=dict, description="replica -> factor: that pipeline's devices take this many times "
                                          "longer (an older GPU generation; a heterogeneous job)")
    replay: Literal["draw", "sequence"] = Field(
        "draw", description="draw: each op draws a duration from the profile (seeded); sequence: a worker the "
                            "profile has by name takes its own durations in the order they were measured "
                            "(a replay of that run, correlations included)")


class _CoreVariantSpec(_Strict):
    """One arm of a comparison: what it changes in the experiment."""

    connections: int | None = Field(None, ge=1, le=64)
    dp_across_dcs: bool | None = None
    description: str = ""
    # + each extension's ``variant_keys`` (``_with_extensions`` below)


class StageTimeSpec(_Strict):
    forward_s: float = Field(ge=0)
    backward_s: float = Field(ge=0)
    optimizer_s: float = Field(0.0, ge=0)


class SimSpec(_Strict):
    """Only the simulator reads these: how fast a device is, how the network behaves."""

    device_tflops: float = Field(1.0, gt=0, description="peak dense FLOP/s of one device, in TFLOP/s")
    efficiency: float = Field(0.5, gt=0, le=1, description="fraction of peak a training step reaches")
    memory_gbps: float = Field(100.0, gt=0, description="device memory bandwidth, GB/s (optimizer step)")
    tensor_parallel: int = Field(1, ge=1, description="devices per pipeline stage replica (one simulated worker)")
    dtype_bytes: int = Field(4, ge=1, le=8, description="bytes per activation element on the wire")
    intra_dc_gbps: float = Field(100.0, gt=0, description="bandwidth of transfers and all-reduce inside a DC")
    allreduce_latency_s: float = Field(0.0, ge=0)
    tcp_window_bytes: int = Field(64 << 20, gt=0, description="per-connection TCP window: caps a flow at window/RTT")
    wan_link_gbps: float | None = Field(
        None, gt=0, description="WAN link capacity; then the topology's rate is one connection's ceiling "
                                "(as in the measured AWS matrix) instead of the link's capacity")
    message_overhead_s: float = Field(0.0, ge=0, description="per-message transport latency: a tensor is usable "
                                      "this long after its last byte is in (`--profile` measures it)")
    stage_times: list[StageTimeSpec] | None = None
    tcp_window_model: bool | None = Field(
        None, description="model each channel's TCP window: slow start from 10 segments, doubling per round "
                           "trip, Linux's cwnd validation, restarted after an idle RTO where the hosts do that "
                           "(parallel.slow_start_after_idle). Unset (the default): on where the hosts run "
                           "Linux's default slow start after idle, off on WAN-tuned hosts, where it changes no "
                           "validation cell (issue #30's matrix: mean |error| 9.5% -> 7.6%, docs/benchmarks.md); "
                           "true: on for every host; false: off (the fluid model alone, the default before "
                           "2026-12-06)")
    tcp_ssthresh_segments: int | None = Field(
        None, ge=2, description="with tcp_window_model: the slow-start threshold, in segments, every WAN "
                                "connection has from its start, standing in for where CUBIC's HyStart ends slow "
                                "start without loss (its trigger is not modelled): above it the window grows a "
                                "segment a round trip, and a restart after idle keeps it (Linux's "
                                "max(ssthresh, 3/4 cwnd)). None (the default): infinite until a loss. Measured on "
                                "the long haul (parallel.tcp_trace): 36-120 segments, no loss (docs/benchmarks.md)")
    tcp_hystart: bool | None = Field(
        None, description="with tcp_window_model: CUBIC's HyStart ends each channel's slow start without loss "
                          "as Linux does (net/ipv4/tcp_cubic.c, its defaults): from a window of 16 segments, "
                          "where a round's first segments meet a queue 4-16 ms deep at the bottleneck "
                          "(clamp(min_rtt / 8)), the other flows' and the channel's own, or its ACKs come "
                          "as one train (<= 2 ms apart) over half the round trip; ssthresh = cwnd, then "
                          "CUBIC's growth (at least 5% a round trip without loss). Unset (the default): "
                          "see testbed/sim/build.py hystart_model; true / false: on / off "
                          "(docs/benchmarks.md, 'HyStart in the window model')")
    tail_loss: bool = Field(
        False, description="a message in flight while its bottleneck FIFO overflows (the windows of the "
                           "channels sending there hold more than its BDP + queue) ends one tail-loss probe late "
                           "(RFC 8985: 2 x the smoothed round trip, the full queue's delay included): lost last "
                           "segments get no duplicate ACKs; validated on one regime only, window-clamped senders "
                           "(docs/benchmarks.md)")
    sharing: Literal["fair", "fifo-bursts", "spread", "packets"] = Field(
        "fair", description="how flows share a WAN link: fair = max-min fair among all flows (TCP's long-run "
                            "sharing); fifo-bursts = a message its channel puts in flight whole (size <= "
                            "connections x window, the window held to the path's BDP + queue) is served first-in "
                            "first-out ahead of the other flows, as a drop-tail FIFO serves a burst, and larger "
                            "messages share what is left max-min fairly (testbed/sim/engine.py FifoBurstPolicy; "
                            "docs/benchmarks.md compares the two); with tcp_window_model every message goes a "
                            "window at a time, each window first-in first-out, into drop-tail queues that lose "
                            "what overflows (testbed/sim/rounds.py; tail_loss is not applied then); spread = fair in "
                            "the long run but unequal over a message, each flow weighted by a lognormal draw "
                            "(share_spread; testbed/sim/engine.py SpreadPolicy; not validated: it reads worse than fair on "
                            "the validation matrix, and a run that uses it is warned); packets = every WAN message as TCP "
                            "segments through the delay lines and drop-tail queues, each connection Linux's "
                            "CUBIC, HyStart, restart after idle and loss recovery (testbed/sim/packets.py). "
                            "Ignored where an extension gives the simulator a policy, but for packets with an "
                            "extension's strict priority: that runs as the gateway's scheduler in the packet model")
    share_spread: float = Field(
        0.3, ge=0, le=2, description="sharing: spread: the sigma of each flow's lognormal weight (0: fair "
                                     "sharing); fitted to experiments/measure_shares.py (docs/benchmarks.md)")
    loss_model: bool = Field(
        True, description="where a WAN path drops packets at random (a link's loss), hold each connection to what "
                          "CUBIC sustains under that loss and round trip (Linux's CUBIC driven by the random drops, a "
                          "seeded Monte Carlo's long-run mean on the connection's share of the link: "
                          "testbed/net/tcpmodel.py), a channel to N times that, and a message its windows "
                          "hold arrives late by the recovery of a segment it loses (RACK, 1.25 round trips; a "
                          "lost last segment, the RTO; seeded draws); on by default (it is what TCP "
                          "does), false for the loss-blind fluid model; a lossless path is unchanged either way; "
                          "compared with 10 emulator measurements (docs/benchmarks.md), not validated")


class _CoreExperiment(_Strict):
    """The core's fields; ``Experiment`` adds every registered extension's section."""

    name: str = Field(pattern=NAME_PATTERN)
    topology: str = Field(min_length=1, max_length=4096)
    description: str = ""
    model: ModelSpec = ModelSpec()
    training: TrainingSpec = TrainingSpec()
    parallel: ParallelSpec = ParallelSpec()
    placement: dict[str, list[int]] | None = None
    device: str = Field(
        "auto", description="auto: a GPU per worker where there are GPUs, else a CPU container; emulated: the "
                            "network is real, device time comes from a profile (emulation)")
    emulation: EmulationSpec = EmulationSpec()
    time_dilation: float = Field(
        1.0, ge=1.0, le=100.0, description="k: the emulated world runs k times slower than the wall clock (WAN "
                                           "delays x k and rates / k on the wire, device times x k); every figure "
                                           "is written in emulated seconds.  Needs a device kind whose time "
                                           "dilates (device: emulated)")
    sim: SimSpec = SimSpec()
    # + one section per registered extension (``_with_extensions`` below)
    compare: dict[str, _CoreVariantSpec] | None = Field(
        None, description="run these variants back to back (each a full run) and write comparison.json")
    # filled in by parse_experiment
    _origin: str = PrivateAttr("")
    _topo: Topology | None = PrivateAttr(None)
    _topo_file: str = PrivateAttr("")
    _slots: list = PrivateAttr(default_factory=list)

    @property
    def origin(self) -> str:
        return self._origin

    @property
    def topo(self) -> Topology:
        assert self._topo is not None, "use parse_experiment/load_experiment"
        return self._topo

    def workers(self) -> list["WorkerSlot"]:
        return list(self._slots)

    @property
    def topology_file(self) -> str:
        """The topology file this experiment resolved to (absolute where it was found)."""
        return self._topo_file or self.topology

    def variant(self, name: str) -> "Experiment":
        """This experiment with one ``compare`` arm applied (and no ``compare`` of its own)."""
        v = (self.compare or {})[name]
        data = self.model_dump()
        data["name"] = f"{self.name}-{name}"
        data["compare"] = None
        if v.connections is not None:
            data["parallel"]["connections"] = v.connections
        for key, (section, field) in _VARIANT_KEYS.items():
            if getattr(v, key) is not None:
                data[section][field] = getattr(v, key)
        if v.dp_across_dcs is not None:
            data["parallel"]["dp_across_dcs"] = v.dp_across_dcs
            if v.dp_across_dcs:
                data["placement"] = None
        e = type(self).model_validate(data)
        e._origin, e._topo, e._topo_file = self._origin, self._topo, self._topo_file
        e._slots = _place(e, self._topo, f"{self._origin}: compare.{name}")
        return e

    def with_iterations(self, iterations: int) -> "Experiment":
        """This experiment trained for ``iterations`` (its warm-up at most all but one)."""
        e = self.model_copy(deep=True)
        e._origin, e._topo, e._topo_file, e._slots = self._origin, self._topo, self._topo_file, self._slots
        e.training.iterations = iterations
        e.training.warmup_iterations = min(e.training.warmup_iterations, iterations - 1)
        return e


@dataclass(frozen=True)
class WorkerSlot:
    stage: int
    replica: int
    dc: str
    host_index: int  # within the DC

    @property
    def name(self) -> str:
        return f"s{self.stage}r{self.replica}"


def _with_extensions() -> tuple[type[_CoreExperiment], type[VariantSpec], dict[str, tuple[str, str]]]:
    """The experiment schema: the core's fields plus one section per registered extension
    (absent: its defaults), and ``compare:`` arms that may set each extension's variant keys."""
    fields: dict[str, Any] = {}
    variant_fields: dict[str, Any] = {}
    keys: dict[str, tuple[str, str]] = {}
    for name, ext in extensions().items():
        if ext.section is None:
            continue
        if name in _CoreExperiment.model_fields:
            raise SpecError(f"extension {name}: its section would replace the experiment's own {name!r}")
        fields[name] = (ext.section, Field(default_factory=ext.section))
        for key, field in ext.variant_keys.items():
            info = ext.section.model_fields[field]
            variant_fields[key] = (info.annotation | None, None)
            keys[key] = (name, field)
    variant = create_model("VariantSpec", __base__=_CoreVariantSpec, __doc__=_CoreVariantSpec.__doc__,
                           **variant_fields)
    kinds = tuple(sorted(device_kinds()))  # device kinds are plug-ins of the registry too
    info = _CoreExperiment.model_fields["device"]
    fields["device"] = (Literal[kinds] if kinds else str, Field(info.default, description=info.description))
    fields["compare"] = (dict[str, variant] | None, Field(
        None, description="run these variants back to back (each a full run) and write comparison.json"))
    return create_model("Experiment", __base__=_CoreExperiment, __doc__=_CoreExperiment.__doc__,
                        __module__=__name__, **fields), variant, keys


Experiment, VariantSpec, _VARIANT_KEYS = _with_extensions()


def _default_placement(topo: Topology, stages: int) -> dict[str, list[int]]:
    dcs = [dc.name for dc in topo.dcs]
    per = [stages // len(dcs) + (1 if i < stages % len(dcs) else 0) for i in range(len(dcs))]
    out, s = {}, 0
    for dc, n in zip(dcs, per):
        if n:
            out[dc] = list(range(s, s + n))
            s += n
    return out


def _place_dp_across_dcs(exp: Experiment, topo: Topology, origin: str) -> list[WorkerSlot]:
    """Baseline (d): whole pipelines inside DCs, replica r in DC r mod #DCs."""
    p = exp.parallel
    if exp.placement is not None:
        raise SpecError(f"{origin}: parallel.dp_across_dcs: whole pipelines go to every DC; drop placement")
    dcs = [dc.name for dc in topo.dcs]
    slots = []
    for r in range(p.replicas):
        dc, j = dcs[r % len(dcs)], r // len(dcs)
        need = (j + 1) * p.stages
        if need > topo.dc(dc).hosts:
            raise SpecError(f"{origin}: parallel.dp_across_dcs: DC {dc!r} needs {need} hosts for its pipelines "
                            f"({p.stages} stages each), it has {topo.dc(dc).hosts}")
        slots += [WorkerSlot(s, r, dc, j * p.stages + s) for s in range(p.stages)]
    return sorted(slots, key=lambda w: (w.stage, w.replica))


def _place(exp: Experiment, topo: Topology, origin: str) -> list[WorkerSlot]:
    p = exp.parallel
    if p.dp_across_dcs:
        return _place_dp_across_dcs(exp, topo, origin)
    placement = exp.placement or _default_placement(topo, p.stages)
    names = {dc.name for dc in topo.dcs}
    seen: dict[int, str] = {}
    for dc, stages in placement.items():
        if dc not in names:
            raise SpecError(f"{origin}: placement.{key_text(dc)}: no DC {dc!r} in topology {topo.name} ({', '.join(sorted(names))})")
        for s in stages:
            if not 0 <= s < p.stages:
                raise SpecError(f"{origin}: placement.{dc}: stage {s} is outside 0..{p.stages - 1}")
            if s in seen:
                raise SpecError(f"{origin}: placement.{dc}: stage {s} is already placed in {seen[s]!r}")
            seen[s] = dc
        need = len(stages) * p.replicas
        have = topo.dc(dc).hosts
        if need > have:
            raise SpecError(
                f"{origin}: placement.{dc}: {len(stages)} stage(s) x {p.replicas} replica(s) = {need} workers, "
                f"but DC {dc!r} has {have} host(s)"
            )
    missing = sorted(set(range(p.stages)) - set(seen))
    if missing:
        raise SpecError(f"{origin}: placement: stage {missing[0]} is not placed in any DC")
    slots = []
    for dc, stages in placement.items():
        for k, s in enumerate(sorted(stages)):
            for r in range(p.replicas):
                slots.append(WorkerSlot(s, r, dc, k * p.replicas + r))
    return sorted(slots, key=lambda w: (w.stage, w.replica))


def parse_experiment(data: Any, origin: str = "<experiment>", base_dir: Path | None = None,
                     strict: bool = False) -> Experiment:
    """Validate already-parsed YAML (and read the topology it names); raise SpecError with a
    one-line message.  ``strict``: no coercion of types (what a file gets)."""
    try:
        return _parse_experiment(data, origin, base_dir, strict)
    except SpecErrors:
        raise  # several, one line each already
    except SpecError as exc:
        raise SpecError(one_line(str(exc))) from None


def _parse_experiment(data: Any, origin: str, base_dir: Path | None, strict: bool) -> Experiment:
    if not isinstance(data, dict):
        raise SpecError(one_line(f"{origin}: expected a mapping at the top level, got {type(data).__name__}"))
    try:
        exp = Experiment.model_validate(data, strict=strict)
    except ValidationError as exc:
        raise validation_error(exc, origin, Experiment) from None
    exp._origin = origin
    for variant in exp.compare or {}:
        if not re.match(NAME_PATTERN, f"{exp.name}-{variant}"):
            raise SpecError(f"{origin}: compare.{key_text(variant)}: a variant's name must be letters, digits, "
                            f"'.', '_' or '-', at most {63 - len(exp.name)} characters (it names a results folder)")
    m = exp.model
    if m.hidden % m.heads:
        raise SpecError(f"{origin}: model.heads: hidden ({m.hidden}) must be a multiple of heads ({m.heads})")
    if exp.parallel.stages > m.layers:
        raise SpecError(f"{origin}: parallel.stages: {exp.parallel.stages} stages need at least as many layers "
                        f"(model.layers = {m.layers})")
    try:
        check(exp.parallel.schedule, exp.parallel.stages, exp.training.microbatches, exp.parallel.extra_warmup)
    except ScheduleError as exc:
        raise SpecError(f"{origin}: parallel.schedule: {exc}") from None
    topo_path = Path(exp.topology)
    if base_dir is not None and not topo_path.is_absolute() and path_exists(base_dir / topo_path):
        topo_path = base_dir / topo_path
    try:
        topo_file = resolve_topology(str(topo_path), near=base_dir)
        topo = load_topology(topo_file)
    except SpecError as exc:
        raise SpecError(f"{origin}: topology: {exc}") from None
    exp._topo = topo
    exp._topo_file = str(Path(topo_file).resolve())
    exp._slots = _place(exp, topo, origin)
    for ext in extensions().values():
        if ext.check is not None:
            ext.check(exp, origin)
    if exp.time_dilation != 1.0:
        _check_dilation(exp, origin)
    return exp


def _check_dilation(exp: "Experiment", origin: str) -> None:
    """Refuse what would report wrong figures under time dilation, in one line."""
    from testbed.extension import device_kind, in_use

    k = exp.time_dilation
    if not device_kind(exp.device).dilates:
        raise SpecError(f"{origin}: time_dilation: {k:g} needs device: emulated (a {exp.device} device computes at "
                        f"the wall clock's speed, so its op times would be reported {k:g} times too short)")
    undilated = [ext.name for ext in in_use(exp) if not ext.dilates]
    if undilated:
        raise SpecError(f"{origin}: time_dilation: {k:g}: {', '.join(undilated)} does not read the dilated clock "
                        f"yet (its timers are wall-clock), so it runs only at time_dilation 1")


def resolve_experiment(name_or_path: str | Path) -> Path:
    """An experiment given by path, or by the name of a shipped one (``default``, or
    ``experiments/default.yaml`` from any folder)."""
    from testbed.spec.shipped import find_shipped

    p = Path(name_or_path)
    return p if path_exists(p) else (find_shipped("experiments", p) or p)  # read_yaml names a missing file


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...], origin: str) -> dict:
    """``KEY.PATH=VALUE`` overrides (``training.iterations=3``, ``parallel.schedule=gpipe``), the
    value read as YAML, into a copy of ``data``; validation then judges the result as if the
    file said it.  A malformed one is a one-line SpecError."""
    import copy

    import yaml

    out = copy.deepcopy(data)
    for text in overrides:
        key, sep, raw = text.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise SpecError(f"{origin}: --set {text!r}: expected KEY.PATH=VALUE (for example training.iterations=3)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part) if isinstance(node, dict) else None
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise SpecError(f"{origin}: --set {text!r}: {'.'.join(parts[:i + 1])} is not a mapping")
            node = nxt
        node[parts[-1]] = value
    return out


def load_experiment(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Experiment:
    """Read and validate an experiment YAML file (and the topology it names), with
    ``--set``-style ``overrides`` applied first (``apply_overrides``)."""
    path = resolve_experiment(path)
    data = read_yaml(path)
    if overrides:
        data = apply_overrides(data, overrides, str(path))
    return parse_experiment(data, str(path), Path(path).parent, strict=True)
