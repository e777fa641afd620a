"""Synthetic conferencing calls, and the per-slot demand the planners see.

Call sizes, arrival patterns and the media mix of a real conferencing service are not
public, so everything here is **synthetic** (only the bitrates are Teams' published ones):

* each user region gets a weight drawn once (lognormal, sigma 0.6, seeded): its population;
* calls arrive as a Poisson process per home region whose rate follows a business-day curve
  in the region's *local* time (``_DIURNAL``: a night floor of 3%, a morning ramp, a lunch
  dip, an evening tail), times ``weekend_factor`` on the region's local Saturday and Sunday
  (day 0 of a horizon is a Monday, UTC); ``calls_per_day`` calls arrive on a weekday;
* participants: 2 (45%), 3 (22%), 4 (13%), otherwise 5 + a Pareto tail (alpha 1.5, capped at
  ``max_participants``, 250 by default): mostly 2-4 with a heavy tail;
* the first participant is in the home region; every other one is too with probability
  ``local_fraction``, else in another user region chosen with weight
  ``population x exp(-RTT/gravity_ms)`` (near regions more likely);
* media: audio / video / HD in the ``audio_video_hd`` shares; per participant bitrates from
  ``data/teams_bandwidth_scenarios.csv`` (2-party calls: the peer-to-peer rows; larger:
  the group rows, up/down);
* durations lognormal around ``median_duration_min`` (sigma 0.8, 1 minute to 8 hours).

How it fits: ``generate`` makes ``Calls`` (flat numpy arrays: one row per call, one entry
per (call, participant region)); ``Configs`` maps each call to its configuration (the set of
regions its participants are in: the LP places configurations, and the latency rule depends
only on where participants are; optionally the call's media too, ``Configs(by_media=True)``);
``demand`` turns calls into per-slot ``Demand`` (concurrent
participants and kbps per config, slot and region), ``predict`` averages past days' demand (or plans on a high quantile of it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agents.titan.regions import World
from agents.titan.spec import WorkloadSpec

MEDIA = ("audio", "video", "hd")
DAY_S = 86_400.0
_DIURNAL_KNOTS = (  # local hour -> relative call arrival rate
    (0, 0.03), (6, 0.05), (8, 0.5), (9, 1.0), (12, 0.8), (13, 0.95), (16, 0.9), (18, 0.35), (20, 0.12),
    (22, 0.05), (24, 0.03),
)
_SIZES = (2, 3, 4)
_SIZE_P = (0.45, 0.22, 0.13)
_TAIL_ALPHA = 1.5
_DURATION_SIGMA = 0.8


def diurnal(local_hour: np.ndarray) -> np.ndarray:
    """Relative arrival rate at a local hour (0-24)."""
    hours, rates = zip(*_DIURNAL_KNOTS)
    return np.interp(np.mod(local_hour, 24.0), hours, rates)


@dataclass
class Calls:
    """Calls sorted by start; participants grouped by region in flat entry arrays."""

    start_s: np.ndarray  # seconds since the horizon's start (a Monday, 00:00 UTC)
    duration_s: np.ndarray
    media: np.ndarray  # index into MEDIA
    size: np.ndarray  # participants
    first: np.ndarray  # user index of the first participant (the home region)
    ptr: np.ndarray  # entries of call i are ptr[i]:ptr[i+1]
    region: np.ndarray  # user index per entry (sorted within a call)
    count: np.ndarray  # participants from that region
    up_kbps: np.ndarray  # per participant of call i
    down_kbps: np.ndarray

    def __len__(self) -> int:
        return len(self.start_s)

    @property
    def end_s(self) -> np.ndarray:
        return self.start_s + self.duration_s

    @property
    def entry_call(self) -> np.ndarray:
        return np.repeat(np.arange(len(self)), np.diff(self.ptr))

    def select(self, mask: np.ndarray) -> "Calls":
        return self.take(np.flatnonzero(mask))

    def take(self, idx: np.ndarray) -> "Calls":
        """The calls at ``idx``, in that order (an index may repeat)."""
        idx = np.asarray(idx, dtype=np.int64)
        lens = np.diff(self.ptr)[idx]
        starts = self.ptr[idx]
        ent = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens) + np.arange(lens.sum())
        return Calls(self.start_s[idx], self.duration_s[idx], self.media[idx], self.size[idx], self.first[idx],
                     np.concatenate(([0], np.cumsum(lens))), self.region[ent], self.count[ent],
                     self.up_kbps[idx], self.down_kbps[idx])

    def starting_between(self, t0: float, t1: float) -> "Calls":
        return self.select((self.start_s >= t0) & (self.start_s < t1))


def region_weights(world: World, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 7])
    return rng.lognormal(0.0, 0.6, size=len(world.users))


def generate(world: World, spec: WorkloadSpec, days: int, seed_offset: int = 0) -> Calls:
    """``days`` days of calls (day 0 a Monday) over the world's user regions."""
    rng = np.random.default_rng([spec.seed, seed_offset])
    U = len(world.users)
    w = region_weights(world, spec.seed)
    tz = np.array([world.wan.region(u).utc_offset_h for u in world.users])
    minutes = np.arange(days * 1440)
    local_h = (minutes[None, :] / 60.0 + tz[:, None])  # hours since day 0 local midnight
    local_day = np.floor(local_h / 24.0)
    weekend = np.mod(local_day, 7) >= 5
    shape = diurnal(local_h) * np.where(weekend, spec.weekend_factor, 1.0)
    mean_diurnal = diurnal(np.linspace(0, 24, 24 * 60, endpoint=False)).mean()
    per_minute = spec.calls_per_day * w / (w.sum() * 1440 * mean_diurnal)
    counts = rng.poisson(per_minute[:, None] * shape)
    home = np.repeat(np.repeat(np.arange(U), counts.shape[1]), counts.ravel())
    minute = np.repeat(np.tile(minutes, U), counts.ravel())
    order = np.argsort(minute, kind="stable")
    home, minute = home[order], minute[order]
    n = len(home)
    start = (minute + rng.random(n)) * 60.0
    order = np.argsort(start, kind="stable")
    home, start = home[order], start[order]

    r = rng.random(n)
    cum = np.cumsum(_SIZE_P)
    size = np.where(r < cum[0], 2, np.where(r < cum[1], 3, np.where(r < cum[2], 4, 0)))
    size = np.minimum(size, spec.max_participants)
    tail = size == 0
    u = rng.random(tail.sum())
    size[tail] = np.minimum(spec.max_participants, 5 + np.floor(3.0 * (u ** (-1.0 / _TAIL_ALPHA) - 1.0))).astype(int)
    media = rng.choice(len(MEDIA), size=n, p=np.asarray(spec.audio_video_hd) / sum(spec.audio_video_hd))
    duration = np.clip(rng.lognormal(np.log(spec.median_duration_min * 60.0), _DURATION_SIGMA, n), 60.0, 8 * 3600.0)

    # participants beyond the first: local, or a remote region by gravity
    extra = size - 1
    call_of = np.repeat(np.arange(n), extra)
    local = rng.random(len(call_of)) < spec.local_fraction
    part_region = home[call_of].copy()
    remote = np.flatnonzero(~local)
    if len(remote) and U > 1:
        rtt = world.wan.rtt_sym[np.ix_([world.wan.index(k) for k in world.users],
                                       [world.wan.index(k) for k in world.users])]
        gravity = w[None, :] * np.exp(-rtt / spec.gravity_ms)
        np.fill_diagonal(gravity, 0.0)
        cdf = np.cumsum(gravity, axis=1)
        cdf /= cdf[:, -1:]
        h = home[call_of[remote]]
        draws = rng.random(len(remote))
        picks = np.empty(len(remote), dtype=np.int64)
        for hh in np.unique(h):
            sel = h == hh
            picks[sel] = np.minimum(np.searchsorted(cdf[hh], draws[sel], side="right"), U - 1)
        part_region[remote] = picks
    all_call = np.concatenate((np.arange(n), call_of))
    all_region = np.concatenate((home, part_region))
    key, cnt = np.unique(all_call.astype(np.int64) * U + all_region, return_counts=True)
    e_call, e_region = key // U, key % U
    ptr = np.concatenate(([0], np.cumsum(np.bincount(e_call, minlength=n))))

    up = np.zeros(n)
    down = np.zeros(n)
    for m, name in enumerate(MEDIA):
        for s in np.unique(size[media == m]):
            sel = (media == m) & (size == s)
            up[sel], down[sel] = world.wan.bitrates(name, int(s))
    return Calls(start, duration, media.astype(np.int8), size.astype(np.int32), home.astype(np.int32),
                 ptr.astype(np.int64), e_region.astype(np.int32), cnt.astype(np.int32), up, down)


class Configs:
    """Call configurations: the sorted tuple of regions a call's participants are in (and,
    with ``by_media``, the call's media: audio, video and HD calls of the same regions are
    then configurations of their own, so a plan can send the costly ones over the Internet
    and keep the cheap ones on the WAN within the same participant caps).

    ``keys[k]`` is always configuration k's regions; ``media[k]`` its media (-1: any)."""

    def __init__(self, by_media: bool = False) -> None:
        self.by_media = by_media
        self.keys: list[tuple[int, ...]] = []
        self.media: list[int] = []
        self._ids: dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def id(self, key: tuple[int, ...], media: int = -1) -> int:
        m = int(media) if self.by_media else -1
        i = self._ids.get((key, m))
        if i is None:
            i = self._ids[(key, m)] = len(self.keys)
            self.keys.append(key)
            self.media.append(m)
        return i

    def of_calls(self, calls: Calls) -> np.ndarray:
        regions = calls.region.tolist()
        ptr = calls.ptr.tolist()
        media = calls.media.tolist()
        return np.fromiter((self.id(tuple(regions[ptr[i]:ptr[i + 1]]), media[i]) for i in range(len(calls))),
                           dtype=np.int64, count=len(calls))

    def provisional_of_calls(self, calls: Calls) -> np.ndarray:
        """The configuration known when a call starts: its first participant's region alone
        (and its media, which the call declares when it starts)."""
        return np.fromiter((self.id((int(f),), m) for f, m in zip(calls.first.tolist(), calls.media.tolist())),
                           dtype=np.int64, count=len(calls))


@dataclass
class Demand:
    """Per-slot demand: for each (config, slot, region) the concurrent participants from the
    region and their kbps up (to the media server) and down, averaged over the slot.

    ``slot`` counts slots from ``t0``; rows are sorted by (slot, config, region).
    """

    t0: float
    slot_s: float
    slots: int
    config: np.ndarray
    slot: np.ndarray
    region: np.ndarray
    participants: np.ndarray
    up_kbps: np.ndarray
    down_kbps: np.ndarray

    def total_participants(self) -> float:
        return float(self.participants.sum())


def slot_overlaps(start: np.ndarray, end: np.ndarray, t0: float, slot_s: float, slots: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, slot, fraction of the slot covered) for intervals [start, end) over the slots."""
    s0 = np.clip(np.floor((start - t0) / slot_s), 0, slots).astype(np.int64)
    s1 = np.clip(np.ceil((end - t0) / slot_s), 0, slots).astype(np.int64)
    span = np.maximum(s1 - s0, 0)
    row = np.repeat(np.arange(len(start)), span)
    slot = np.repeat(s0, span) + (np.arange(span.sum()) - np.repeat(np.cumsum(span) - span, span))
    lo = np.maximum(start[row], t0 + slot * slot_s)
    hi = np.minimum(end[row], t0 + (slot + 1) * slot_s)
    frac = np.maximum(hi - lo, 0.0) / slot_s
    keep = frac > 0
    return row[keep], slot[keep], frac[keep]


def demand(calls: Calls, config_of_call: np.ndarray, t0: float, slot_s: float, slots: int) -> Demand:
    """Demand over ``slots`` slots from ``t0`` from the calls active then."""
    row, slot, frac = slot_overlaps(calls.start_s, calls.end_s, t0, slot_s, slots)
    lens = np.diff(calls.ptr)
    per_row = lens[row]
    r_idx = np.repeat(np.arange(len(row)), per_row)
    ent = np.repeat(calls.ptr[row], per_row) + (np.arange(per_row.sum()) - np.repeat(np.cumsum(per_row) - per_row, per_row))
    call = row[r_idx]
    f = frac[r_idx]
    cnt = calls.count[ent] * f
    return _aggregate(t0, slot_s, slots, config_of_call[call], slot[r_idx], calls.region[ent], cnt,
                      cnt * calls.up_kbps[call], cnt * calls.down_kbps[call])


def _aggregate(t0, slot_s, slots, config, slot, region, part, up, down, scale: float = 1.0) -> Demand:
    R = int(region.max()) + 1 if len(region) else 1
    K = int(config.max()) + 1 if len(config) else 1
    key = (slot.astype(np.int64) * K + config) * R + region
    uniq, inv = np.unique(key, return_inverse=True)
    sums = [np.bincount(inv, weights=v, minlength=len(uniq)) * scale for v in (part, up, down)]
    return Demand(t0, slot_s, slots, (uniq // R) % K, uniq // (R * K), uniq % R, *sums)


def predict(history: list[Demand], t0: float, quantile: float | None = None) -> Demand:
    """The mean of past days' demand, slot by slot of the day, as the forecast for a day at ``t0``.

    With ``quantile`` q, each (slot, region)'s rows are scaled so that the region's traffic in
    the slot (kbps up + down) is the q-quantile of the past days' instead of their mean (a
    forecast a busier day than the mean still fits; the mix of configurations within the
    slot and region stays the mean's).  Scaling per row instead would inflate the long tail
    of configurations seen on one day in five far more than the total."""
    if not history:
        raise ValueError("predict: no history")
    slots = history[0].slots
    parts = [np.concatenate([getattr(h, name) for h in history]) for name in
             ("config", "slot", "region", "participants", "up_kbps", "down_kbps")]
    mean = _aggregate(t0, history[0].slot_s, slots, *parts, scale=1.0 / len(history))
    if quantile is None:
        return mean
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"predict: quantile {quantile} is not in (0, 1)")
    return _scale_to_quantile(mean, history, quantile)


def _scale_to_quantile(mean: Demand, history: list[Demand], q: float) -> Demand:
    """``mean`` with each (slot, region)'s rows scaled to the q-quantile of the days' totals."""
    R = int(max([int(h.region.max()) + 1 for h in history if len(h.region)] + [1]))
    n = mean.slots * R
    totals = np.stack([np.bincount(h.slot * R + h.region, weights=h.up_kbps + h.down_kbps, minlength=n)
                       for h in history])  # [day, slot * R + region]
    avg = totals.mean(axis=0)
    factor = np.divide(np.quantile(totals, q, axis=0), avg, out=np.ones(n), where=avg > 0)
    f = factor[mean.slot * R + mean.region]
    return Demand(mean.t0, mean.slot_s, mean.slots, mean.config, mean.slot, mean.region,
                  mean.participants * f, mean.up_kbps * f, mean.down_kbps * f)


def is_weekend(day: int) -> bool:
    return day % 7 >= 5


def same_kind_days(day: int, history: range | list[int]) -> list[int]:
    """The history days of the same kind (weekday or weekend, UTC) as ``day``; all if none."""
    same = [d for d in history if is_weekend(d) == is_weekend(day)]
    return same or list(history)
