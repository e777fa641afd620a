"""What a Titan study or emulation is asked to do, validated by pydantic.

How it fits: ``StudySpec`` drives the offline study (``study.py``: a week of synthetic calls
over many Azure regions, every policy, LPs per day); ``EmulationSpec`` drives the emulated
run (``emulate.py``: a few regions and DCs as testbed DCs, real UDP media).  Both share
``LatencyRule`` (the bound every policy respects), ``WorkloadSpec`` (the synthetic calls) and
``Targets`` (Teams' network targets, the Titan controller's thresholds).  Anything a user can
get wrong raises ``TitanError`` with a one-line message naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class TitanError(ValueError):
    """Bad input for Titan (unknown region, infeasible latency bound, bad spec); one line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Targets(_Strict):
    """Teams' network targets, client to Microsoft edge (``data/teams_network_targets.csv``)."""

    rtt_ms: float = Field(100.0, gt=0)
    loss: float = Field(0.01, gt=0, lt=1)
    jitter_ms: float = Field(30.0, gt=0)


class LatencyRule(_Strict):
    """A placement (DC, route) is allowed for a call configuration only if every
    participant's RTT to the media server is within ``delta_ms`` of what the nearest-DC
    choice over the WAN gives that participant, and (if set) the worst participant's RTT is
    at most ``max_rtt_ms``."""

    delta_ms: float = Field(20.0, ge=0, description="slack over the nearest-DC choice's RTT, per participant")
    max_rtt_ms: float | None = Field(None, gt=0, description="absolute bound on the worst participant's RTT")


class WorkloadSpec(_Strict):
    """The synthetic calls (see ``workload.py`` for the model and why it is synthetic)."""

    calls_per_day: int = Field(100_000, ge=1, description="calls a weekday, summed over user regions")
    local_fraction: float = Field(0.7, ge=0, le=1, description="chance that a participant joins from the call's home region")
    gravity_ms: float = Field(40.0, gt=0, description="remote participants' regions weigh exp(-RTT/gravity_ms)")
    audio_video_hd: tuple[float, float, float] = (0.4, 0.5, 0.1)
    median_duration_min: float = Field(30.0, gt=0)
    weekend_factor: float = Field(0.25, ge=0, le=1)
    max_participants: int = Field(250, ge=2, le=1000, description="the heavy tail's cap")
    seed: int = 1

    @model_validator(mode="after")
    def _mix_sums_to_one(self) -> "WorkloadSpec":
        if abs(sum(self.audio_video_hd) - 1.0) > 1e-6 or min(self.audio_video_hd) < 0:
            raise ValueError(f"audio_video_hd: must be three non-negative shares summing to 1, got {self.audio_video_hd}")
        return self


# 21 media-server DCs spread over the four groups (the paper measured 21 DCs)
DEFAULT_DCS = [
    "eastus", "eastus2", "centralus", "southcentralus", "westus2", "westus3", "canadacentral", "brazilsouth",
    "northeurope", "westeurope", "uksouth", "francecentral", "germanywestcentral", "swedencentral",
    "southeastasia", "eastasia", "japaneast", "australiaeast", "centralindia", "uaenorth", "southafricanorth",
]


class _CapMixin:
    @model_validator(mode="after")
    def _titan_within_cap(self):
        if self.titan_fraction is not None and self.titan_fraction > self.internet_cap + 1e-12:
            raise ValueError(f"titan_fraction: {self.titan_fraction} exceeds internet_cap {self.internet_cap}")
        return self

    @property
    def titan_share(self) -> float:
        return self.internet_cap if self.titan_fraction is None else self.titan_fraction


class _Planning(_Strict):
    """How Titan-Next's LPs plan and how their plans become calls: the same knobs in the
    offline study and the emulator, so the emulator runs the study's realisation."""

    max_configs: int = Field(200, ge=1, description="configurations planned one by one (most forecast traffic); the rest share a mix per allowed-placement set")
    tie_break_eps: float = Field(1e-3, ge=0, description="tie-break re-solve keeps sum of peaks <= (1+eps) x optimum")
    configs_by_media: bool = Field(True, description="the LPs plan audio, video and HD calls of the same regions as configurations of their own (the caps count participants, the peaks kbps: the costly media go over the Internet first)")
    tie_break: Literal["latency", "headroom"] = Field("headroom", description="each slot's placement under the peaks found: the lowest RTT (fills every link up to its peak), or the least WAN traffic (leaves headroom for a day above its forecast; RTT second)")
    realisation: Literal["quota", "capped", "guarded"] = Field("guarded", description="how the LP policies' plans become calls: quota counters alone; capped (the quota counters' order, an Internet placement only within the caps); guarded (capped, and each call at the first such placement that keeps every WAN link within the plan's peaks)")
    forecast_quantile: float | None = Field(None, gt=0, lt=1, description="plan the forecast LPs on this quantile of the past same-kind days' traffic per (slot, region) instead of their mean (the mix of configurations stays the mean's); None: the mean")
    move_at: float | None = Field(None, gt=0, le=1, description="guarded realisation: at every slot boundary, WAN calls in progress that cross a link loaded at or above move_at x its limit move to the Internet at their DC where the latency rule and the caps (counted from the calls in progress) allow; each move is a migration. None: calls stay where they started")
    guard_keeps_caps: bool = Field(True, description="the guarded realisation puts a call on the Internet only within every path's share cap (counted over the calls in progress)")


class StudySpec(_CapMixin, _Planning):
    """The offline study: a week of calls over Azure regions, every policy."""

    name: str = "titan-week"
    users: list[str] | None = Field(None, description="user regions (default: every region in the matrix)")
    dcs: list[str] = Field(default_factory=lambda: list(DEFAULT_DCS), min_length=1)
    days: int = Field(7, ge=1, le=35)
    history_days: int = Field(7, ge=1, le=28, description="days before the first evaluated day that predict it")
    slot_minutes: int = Field(60, ge=1, le=240, description="planning and measurement slot (the LP at 15 minutes took 383 s a day here)")
    relay_factor: float = Field(1.1, ge=1.0, description="drop backbone edge a-b if a relay c has RTT(a,c)+RTT(c,b) <= factor x RTT(a,b)")
    latency: LatencyRule = LatencyRule()
    workload: WorkloadSpec = WorkloadSpec()
    capacity_headroom: float = Field(1.25, ge=1.0, description="DC capacity = headroom x the nearest-DC policy's peak over the horizon")
    internet_cap: float = Field(0.5, gt=0, le=1, description="Titan's guardrail: the largest share of a (region, DC) path's participants on the Internet, where its quality meets the targets")
    titan_fraction: float | None = Field(None, ge=0, le=1, description="Titan baseline: share of eligible calls offloaded (default: internet_cap)")
    billing: Literal["day", "period"] = Field("period", description="what a link's peak is billed over: each day alone, or the study's evaluated days as one period (each day's LP then counts only the excess over the period's realised peak so far)")
    targets: Targets = Targets()

    @model_validator(mode="after")
    def _slots_divide_day(self) -> "StudySpec":
        if 1440 % self.slot_minutes:
            raise ValueError(f"slot_minutes: {self.slot_minutes} does not divide a day (1440 minutes)")
        return self


class InternetPathOverride(_Strict):
    """Emulation: one Internet path's shaping, both directions (user region <-> DC)."""

    user: str
    dc: str
    loss: float | None = Field(None, ge=0, lt=1)
    jitter_ms: float | None = Field(None, ge=0)
    extra_delay_ms: float | None = Field(None, description="added to the modelled one-way Internet delay")


class FaultSpec(_Strict):
    """Emulation: a degradation injected on an Internet path during the Titan controller run."""

    user: str
    dc: str
    at_fraction: float = Field(0.4, gt=0, lt=1, description="when, as a fraction of the run")
    clear_at_fraction: float | None = Field(None, gt=0, lt=1, description="when the path is as it was again "
                                            "(none: the fault lasts the run)")
    loss: float = Field(0.05, ge=0, lt=1)
    extra_delay_ms: float = Field(0.0, ge=0)
    extra_jitter_ms: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _clears_after_it_starts(self):
        if self.clear_at_fraction is not None and self.clear_at_fraction <= self.at_fraction:
            raise ValueError(f"clear_at_fraction {self.clear_at_fraction:g} must be after at_fraction "
                             f"{self.at_fraction:g}")
        return self


class EmulationSpec(_CapMixin, _Planning):
    """The emulated run: a few regions and DCs, hundreds of calls, a day compressed into seconds."""

    name: str = "titan-emu"
    users: list[str] = Field(default_factory=lambda: ["uksouth", "westeurope", "northeurope", "eastus", "centralus"])
    dcs: list[str] = Field(default_factory=lambda: ["westeurope", "northeurope", "eastus"])
    hosts_per_region: int = Field(1, ge=1, le=8)
    history_days: int = Field(7, ge=1, le=28, description="synthetic days before the emulated one; their mean is the forecast")
    day_seconds: float = Field(16.0, gt=1, le=3600, description="one emulated day lasts this long")
    slots: int = Field(16, ge=2, le=288, description="planning/measurement slots per day")
    bitrate_scale: float = Field(0.2, gt=0, le=1, description="Teams bitrates are multiplied by this")
    packets_per_s: float = Field(25.0, gt=0, le=500, description="per media stream (Teams audio sends 50)")
    wan_rate_mbps: float = Field(100.0, gt=0)
    internet_loss: float = Field(0.002, ge=0, lt=1)
    internet_jitter_ms: float = Field(2.0, ge=0)
    internet: list[InternetPathOverride] = []
    relay_factor: float = Field(1.1, ge=1.0)
    latency: LatencyRule = LatencyRule()
    workload: WorkloadSpec = WorkloadSpec(calls_per_day=1000, median_duration_min=30.0, max_participants=6)
    capacity_headroom: float = Field(1.25, ge=1.0)
    internet_cap: float = Field(0.5, gt=0, le=1)
    titan_fraction: float | None = Field(None, ge=0, le=1)
    policies: list[str] = Field(default_factory=lambda: ["nearest-wan", "wan-lp", "titan", "greedy-internet", "titan-next"])
    targets: Targets = Targets()
    controller_seconds: float = Field(0.0, ge=0, description="also run Titan's controller live this long (0: not)")
    controller_window_s: float = Field(1.0, gt=0)
    controller_policy: Literal["titan", "titan-next"] = Field(
        "titan-next", description="who places the calls under the live controller: titan (each call at its nearest "
        "DC, on the Internet at its home path's current fraction) or titan-next (each call where Titan-Next's plan "
        "put it, on the Internet only while every path of it stays within the controller's current fraction)")
    faults: list[FaultSpec] = Field(default_factory=list, description="degradations injected on Internet paths "
                                    "during the controller run (one per path)")
    fault: FaultSpec | None = Field(None, description="one fault: the same as faults: [it]")
    latency_allowance_ms: float = Field(1.5, ge=0, description="emulator overhead allowed over a call's latency bound")

    @field_validator("move_at")
    @classmethod
    def _no_planned_moves(cls, v):
        if v is not None:  # the policy runs play each call on one route from start to end
            raise ValueError("the emulator does not move calls at slot boundaries (the offline study does)")
        return v

    @model_validator(mode="after")
    def _one_fault_per_path(self):
        if self.fault is not None:
            if self.faults:
                raise ValueError("give fault or faults, not both")
            self.faults = [self.fault]
            self.fault = None
        seen = set()
        for f in self.faults:
            for r, what in ((f.user, "users"), (f.dc, "dcs")):
                if r not in getattr(self, what):
                    raise ValueError(f"faults: {r} is not one of the {what}")
            key = frozenset((f.user, f.dc))
            if key in seen:
                raise ValueError(f"faults: the path {f.user}<->{f.dc} is named twice")
            seen.add(key)
        return self


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out or "(top level)"


def _parse(model: type[BaseModel], data: Any, origin: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TitanError(f"{origin}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise TitanError(f"{origin}: {_where(tuple(err['loc']))}: {err['msg'].removeprefix('Value error, ')}") from None


def load_spec(model: type[BaseModel], path: str | Path | None, overrides: dict[str, Any] | None = None) -> Any:
    """A spec from a YAML file (or the defaults), with dotted-key overrides (``latency.delta_ms``)."""
    data: dict[str, Any] = {}
    origin = "<defaults>"
    if path is not None:
        origin = str(path)
        if not Path(path).exists():  # a shipped spec by name or relative path, from any folder
            from testbed.spec.shipped import find_shipped

            path = find_shipped("experiments", path) or path
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise TitanError(f"{path}: cannot read: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise TitanError(f"{path}: invalid YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise TitanError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return _parse(model, data, origin)
