"""Where each call goes: allowed placements, plans, quota-counter realisation, evaluation.

How it fits: ``Options`` works out, per call configuration, the nearest-DC choice over the
WAN and every (DC, route) the latency rule allows (the pruning that keeps the LP sparse).
A ``Plan`` gives, per (configuration, slot), fractions over those placements: the baselines
build theirs by rule (``rule_plan``), the LPs (``lp.py``) by optimisation.  ``realise`` turns
a plan into one placement per call with **quota counters** (largest remainder: each new call
of a (configuration, slot) goes to the placement furthest below its quota of the traffic
placed so far, so every placement stays within one call's traffic of its share; quotas
count traffic because the LP's fractions are fractions of traffic; no random sampling) and counts
**migrations** (a call starts on the plan for its first participant's region alone and moves
when its settled configuration is placed elsewhere).  ``realise_guarded`` keeps the plan's
promise on a day that is not its forecast: each call goes, in start order, to the first
placement (the quota counters' choice first) that keeps the Internet share caps (counted
as greedy counts them) and every WAN link's load within the plan's peak (``PeakGuard``,
carried from day to day); with ``move_at`` it also re-realises at slot boundaries, moving
WAN calls in progress on links near their limit to the Internet where the caps allow
(``PeakGuard.reslot``; each move a migration, in ``Realisation.moves``).  ``evaluate``
measures a realisation (a moved call segment by segment):
per-slot load of every WAN link (kbps, from the calls' actual overlaps with the slots), each
link's peak and their sum, DC load against capacity, per-participant RTT against the bound,
and the share offloaded to the Internet.

Routes: 0 = WAN (the private backbone, entering at the participant's region), 1 = Internet.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from agents.titan.regions import World
from agents.titan.spec import LatencyRule, TitanError
from agents.titan.workload import Calls, Configs, slot_overlaps

WAN, INTERNET = 0, 1
ROUTE_NAMES = ("wan", "internet")


@dataclass
class ConfigOptions:
    regions: tuple[int, ...]  # user indices
    nearest: int  # DC index of the nearest-DC choice
    ref_rtt: np.ndarray  # per region: RTT over the WAN to the nearest DC
    options: list[tuple[int, int]]  # allowed (dc, route), lowest mean latency first
    latency: np.ndarray  # [option, region] RTT ms
    crosses: np.ndarray  # [option] does the placement put any traffic on a WAN link


class Options:
    """Allowed placements per configuration, computed once and cached."""

    def __init__(self, world: World, configs: Configs, rule: LatencyRule):
        self.world = world
        self.configs = configs
        self.rule = rule
        self._cache: dict[int, ConfigOptions] = {}

    def __getitem__(self, k: int) -> ConfigOptions:
        opt = self._cache.get(k)
        if opt is None:
            opt = self._cache[k] = self._compute(self.configs.keys[k])
        return opt

    def _compute(self, regions: tuple[int, ...]) -> ConfigOptions:
        w = self.world
        r = list(regions)
        wan = w.wan_rtt[r, :]  # [region, dc]
        worst = wan.max(axis=0)
        nearest = int(np.lexsort((wan.mean(axis=0), worst))[0])
        ref = wan[:, nearest]
        bound = ref[:, None] + self.rule.delta_ms + 1e-9
        local = w.local[r, :]
        inet = w.inet_rtt[r, :]
        ok_wan = np.all(wan <= bound, axis=0)
        ok_inet = (np.all(inet <= bound, axis=0) & ~local.all(axis=0)
                   & np.all(w.inet_ok[r, :] | local, axis=0))
        if self.rule.max_rtt_ms is not None:
            ok_wan &= worst <= self.rule.max_rtt_ms + 1e-9
            ok_inet &= inet.max(axis=0) <= self.rule.max_rtt_ms + 1e-9
        options = [(int(d), WAN) for d in np.flatnonzero(ok_wan)] + [(int(d), INTERNET) for d in np.flatnonzero(ok_inet)]
        if not options:
            names = ", ".join(w.users[i] for i in r)
            best = float(min(worst.min(), np.where(local.all(axis=0), np.inf, inet.max(axis=0)).min()))
            raise TitanError(f"latency.max_rtt_ms: {self.rule.max_rtt_ms:g} ms is infeasible: a call between "
                             f"{names} gets at best {best:.0f} ms worst-participant RTT (nearest DC "
                             f"{w.dcs[nearest]} over the WAN: {worst[nearest]:.0f} ms)")
        lat = np.array([wan[:, d] if route == WAN else inet[:, d] for d, route in options])
        crosses = np.array([route == WAN and not local[:, d].all() for d, route in options])
        order = np.lexsort((np.arange(len(options)), lat.mean(axis=1)))
        return ConfigOptions(regions, nearest, ref, [options[i] for i in order], lat[order], crosses[order])

    def placement_set(self, k: int) -> tuple[tuple[int, int], ...]:
        """The configuration's allowed placements as a canonical sorted tuple."""
        return tuple(sorted(self[k].options))

    def class_key(self, k: int) -> tuple:
        """What the LP's long tail shares a mix by: the allowed placements (and the media,
        where configurations are told apart by it)."""
        return (self.configs.media[k], self.placement_set(k))

    def option_index(self, k: int, dc: int, route: int) -> int | None:
        try:
            return self[k].options.index((dc, route))
        except ValueError:
            return None

    def check_all(self, config_ids: np.ndarray) -> None:
        """Raise the one-line infeasibility error now, for any configuration that has none."""
        for k in np.unique(config_ids):
            self[int(k)]


Mix = tuple[np.ndarray, np.ndarray, np.ndarray]  # (dc, route, fraction) arrays


@dataclass
class Plan:
    """Placement mixes per (plan key, slot).

    A plan key is a configuration, or (for the LP's long tail) a class of configurations
    with the same allowed placements: ``class_of`` maps such a class (``Options.class_key``:
    the media, -1 where configurations have none, and the placement set, a sorted tuple of
    (dc, route)) to its key, so a configuration never seen in the forecast still finds its
    class.  ``cells`` maps (key, slot) to a mix; a key missing from ``cells`` uses
    ``default`` (key -> mix); a configuration with neither goes to its nearest DC over the
    WAN (counted as unplanned).
    """

    name: str
    cells: dict[tuple[int, int], Mix] = field(default_factory=dict)
    default: dict[int, Mix] = field(default_factory=dict)
    class_of: dict[tuple, int] = field(default_factory=dict)
    count_by_regions: bool = False  # quota counters per region set (a rule's mix is the same for every medium)
    solve_s: float = 0.0
    stats: dict = field(default_factory=dict)
    _own: set[int] | None = field(default=None, init=False, repr=False)  # keys with mixes, built on first use

    def key(self, k: int, options: "Options") -> int:
        """The plan key a configuration's calls follow: its own, else its placement set's class."""
        if self.class_of:
            if self._own is None:
                self._own = {key for key, _ in self.cells} | set(self.default)
            got = self.class_of.get(options.class_key(k))
            if got is not None and k not in self._own:
                return got
        return k

    def get(self, k: int, slot: int, options: "Options") -> Mix | None:
        key = self.key(k, options)
        got = self.cells.get((key, slot))
        return got if got is not None else self.default.get(key)


def _mix(pairs: list[tuple[int, int]], fracs: list[float]) -> Mix:
    return (np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]), np.array(fracs, dtype=np.float64))


def rule_plan(name: str, options: Options, config_ids: np.ndarray, internet_fraction: float) -> Plan:
    """The rule-based baselines at the nearest DC: ``internet_fraction`` 0 = nearest DC over
    the WAN; f = Titan's fixed fraction of the calls whose Internet placement is allowed."""
    plan = Plan(name, count_by_regions=True)  # configurations told apart by media share their counters
    for k in np.unique(config_ids):
        k = int(k)
        co = options[k]
        i = options.option_index(k, co.nearest, INTERNET)
        if i is None or internet_fraction <= 0:
            plan.default[k] = _mix([(co.nearest, WAN)], [1.0])
        elif internet_fraction >= 1:
            plan.default[k] = _mix([(co.nearest, INTERNET)], [1.0])
        else:
            plan.default[k] = _mix([(co.nearest, WAN), (co.nearest, INTERNET)],
                                   [1 - internet_fraction, internet_fraction])
    return plan


@dataclass
class Realisation:
    dc: np.ndarray  # per call
    route: np.ndarray
    migrated: np.ndarray  # bool per call
    planned: np.ndarray  # bool: the call's configuration had a plan cell or rule (else fallback)
    # calls moved while in progress (``realise_guarded(move_at=...)``): rows (call, at_s, dc, route),
    # the call on (dc, route) from at_s on; dc/route above are where each call started
    moves: np.ndarray = field(default_factory=lambda: np.zeros((0, 4)))


def _placement_arrays(calls: Calls, t0: float, slot_s: float) -> tuple:
    """A realisation's empty outputs (DC, route, migrated, planned per call), each call's
    slot and its traffic (participants x kbps, the quota counters' weight)."""
    n = len(calls)
    lens = np.diff(calls.ptr)
    traffic = np.bincount(np.repeat(np.arange(n), lens), weights=calls.count, minlength=n) * (
        calls.up_kbps + calls.down_kbps)
    return (np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.zeros(n, dtype=bool),
            np.ones(n, dtype=bool), np.floor((calls.start_s - t0) / slot_s).astype(np.int64).tolist(),
            traffic.tolist())


def realise(plan: Plan, options: Options, calls: Calls, config_ids: np.ndarray, provisional_ids: np.ndarray,
            t0: float, slot_s: float) -> Realisation:
    """One placement per call by quota counters (largest remainder), calls in start order."""
    n = len(calls)
    dc, route, migrated, planned, slots, weights = _placement_arrays(calls, t0, slot_s)
    counters: dict[tuple, list] = {}

    cfg = config_ids.tolist()
    prov = provisional_ids.tolist()
    for i in range(n):
        d, r, ok = _quota_place(plan, options, counters, cfg[i], slots[i], "final", weights[i])
        dc[i], route[i], planned[i] = d, r, ok
        if prov[i] != cfg[i]:
            pd, pr, _ = _quota_place(plan, options, counters, prov[i], slots[i], "provisional", 1.0)
            migrated[i] = (pd, pr) != (d, r)
    return Realisation(dc, route, migrated, planned)


def _quota_place(plan: Plan, options: Options, counters: dict, k: int, slot: int, tag: str,
                 weight: float) -> tuple[int, int, bool]:
    """The placement furthest below its quota of the traffic placed so far in its (plan key,
    slot) (``counters`` holds each one's [total, per placement]); (dc, route, planned)."""
    got = plan.get(k, slot, options)
    if got is None:
        return options[k].nearest, WAN, False
    dcs, routes, frac = got
    if len(dcs) == 1:
        return int(dcs[0]), int(routes[0]), True
    key = (tag, options.configs.keys[k] if plan.count_by_regions else plan.key(k, options), slot)
    state = counters.get(key)
    if state is None:
        state = counters[key] = [0.0, np.zeros(len(dcs))]
    state[0] += weight
    deficit = frac * state[0] - state[1]
    j = int(np.argmax(deficit))  # ties: the first placement of the mix
    state[1][j] += weight
    return int(dcs[j]), int(routes[j]), True


class PeakGuard:
    """What a realisation that keeps the plan's promise carries from call to call and day to day.

    ``limit`` holds each WAN link's allowed load (kbps): the plan's peak, raised to a load a
    call could not avoid (that peak is then paid, so later calls may use it).  ``load`` is the
    links' load *now* (the calls in progress, instantaneous), ``active`` the calls in
    progress (a heap by end time, so a call that spans midnight still counts the next day).
    Keeping every link's instantaneous load within its limit keeps its slot average, which
    is what is billed, within it too.  ``on_path`` counts, per slot (of the whole horizon)
    and (region, DC) path that crosses regions, the participants of the calls started on it
    and how many of them ride the Internet: with ``keep_caps`` an Internet placement is
    taken only if every such path of the call stays within its Internet share cap, counted
    as greedy counts it.
    """

    def __init__(self, world: World, keep_caps: bool = True):
        self.world = world
        self.keep_caps = keep_caps
        self.limit = [0.0] * world.n_links
        self.load = [0.0] * world.n_links
        self.active: list[tuple[float, int, dict[int, float]]] = []
        self.on_path: dict[tuple[int, int, int], list[int]] = {}  # (slot, user, dc) -> [participants, on the Internet]
        self.raised = 0  # calls that had to raise a link's limit
        self.over_cap = 0  # calls put on the Internet over a cap (no placement within the caps allowed)
        self.moved = 0  # calls moved to the Internet at a slot boundary (``reslot``)
        self.live: dict[int, list] = {}  # seq -> [token, call, members, dc, route, config] of calls in progress
        self._cap = world.inet_cap.tolist()
        self._seq = 0

    def set_limits(self, limits: np.ndarray) -> None:
        """A new plan's peaks (a day's, or raised by what the period has paid already)."""
        if len(limits) != self.world.n_links:
            raise TitanError(f"guard: {len(limits)} link limits for {self.world.n_links} links")
        self.limit = [float(v) for v in limits]

    def _advance(self, now: float) -> None:
        while self.active and self.active[0][0] <= now:
            _, seq, contrib = heapq.heappop(self.active)
            self.live.pop(seq, None)
            for link, v in contrib.items():
                self.load[link] -= v

    def reslot(self, at_s: float, slot: int, move_at: float, token: int, options: "Options",
               moves: list[tuple[int, float, int, int]]) -> None:
        """A slot boundary: the new slot's cap counters start from the calls in progress (each
        path's participants, and those on the Internet); then the calls in progress of this
        realisation (``token``) that are on the WAN and cross a link loaded at or above
        ``move_at`` x its limit move, largest WAN traffic first, to the Internet at the same
        DC where the latency rule allows it and every path of theirs stays within its cap.
        Each move frees the call's WAN load now and is recorded in ``moves`` (a migration)."""
        world = self.world
        for _, _, members, d, r, _ in self.live.values():
            for u, c in members:
                if not world.local[u, d]:
                    a = self.on_path.setdefault((slot, u, d), [0, 0])
                    a[0] += c
                    a[1] += c if r == INTERNET else 0
        contribs = {seq: contrib for _, seq, contrib in self.active}
        hot = [(seq, sum(contribs[seq].values())) for seq, info in self.live.items()
               if info[0] == token and info[4] == WAN and contribs[seq]]
        for seq, _ in sorted(hot, key=lambda x: (-x[1], x[0])):
            _, i, members, d, _, k = self.live[seq]
            contrib = contribs[seq]
            if not any(self.load[l] >= move_at * self.limit[l] for l in contrib):
                continue
            if options.option_index(k, d, INTERNET) is None:
                continue
            if self.keep_caps and any(
                    self.on_path[(slot, u, d)][1] + c > self._cap[u][d] * self.on_path[(slot, u, d)][0] + 1e-9
                    for u, c in members if not world.local[u, d]):
                continue
            for u, c in members:
                if not world.local[u, d]:
                    self.on_path[(slot, u, d)][1] += c
            for link, v in contrib.items():
                self.load[link] -= v
            contrib.clear()  # the heap entry now carries no load
            self.live[seq][4] = INTERNET
            self.moved += 1
            moves.append((i, at_s, d, INTERNET))

    def _within_caps(self, members: list[tuple[int, int]], d: int, slot: int) -> bool:
        """Would an Internet placement at ``d`` keep every crossing path within its cap?"""
        for u, c in members:
            if self.world.local[u, d]:
                continue
            a = self.on_path.get((slot, u, d), (0, 0))
            if a[1] + c > self._cap[u][d] * (a[0] + c) + 1e-9:
                return False
        return True

    def _excess(self, contrib: dict[int, float]) -> float:
        return sum(max(self.load[l] + v - self.limit[l] * (1 + 1e-9) - 1e-6, 0.0) for l, v in contrib.items())

    def _commit(self, end: float, contrib: dict[int, float], members: list[tuple[int, int]], d: int,
                r: int, slot: int, info: tuple | None = None) -> None:
        for u, c in members:
            if not self.world.local[u, d]:
                a = self.on_path.setdefault((slot, u, d), [0, 0])
                a[0] += c
                a[1] += c if r == INTERNET else 0
        over = False
        for link, v in contrib.items():
            self.load[link] += v
            if self.load[link] > self.limit[link]:
                self.limit[link] = self.load[link]
                over = True
        self.raised += over
        self._seq += 1
        if info is not None:  # (token, call, config): a call that a slot boundary may move
            self.live[self._seq] = [info[0], info[1], members, d, r, info[2]]
        heapq.heappush(self.active, (end, self._seq, contrib))


def _wan_contrib(world: World, members: list[tuple[int, int]], d: int, up: float, down: float) -> dict[int, float]:
    out: dict[int, float] = {}
    for u, c in members:
        if world.local[u, d]:
            continue
        for link in world.up_links[u][d]:
            out[link] = out.get(link, 0.0) + c * up
        for link in world.down_links[u][d]:
            out[link] = out.get(link, 0.0) + c * down
    return out


def realise_guarded(plan: Plan, options: Options, calls: Calls, config_ids: np.ndarray,
                    provisional_ids: np.ndarray, t0: float, slot_s: float, guard: PeakGuard,
                    routes: tuple[int, ...] = (WAN, INTERNET), move_at: float | None = None) -> Realisation:
    """One placement per call, in start order, that keeps the plan's peaks where it can.

    Each call's candidates: its plan mix's placements, furthest below their quota first (the
    quota counters of ``realise``), then every other placement the latency rule allows,
    lowest mean latency first (on ``routes`` only: a WAN-only plan stays on the WAN).  With
    ``guard.keep_caps`` an Internet candidate that would take a path over its share cap is
    dropped (unless no candidate is left).  The first candidate that keeps every WAN link's
    load now within ``guard.limit`` is taken; if none does, the one that exceeds the limits least
    (summed over links) is, and the links it overloads have their limits raised (that peak
    is paid).  Migrations are counted as in ``realise``.

    With ``move_at`` (and the Internet among ``routes``), at every slot boundary from ``t0`` up
    to the last call's start the guard re-realises the calls in progress (``PeakGuard.reslot``):
    the new slot's cap counters start from them, and the WAN calls that cross a link at or
    above ``move_at`` x its limit move to the Internet at their DC where the rule and the caps
    allow; the moves are in ``Realisation.moves``."""
    world = options.world
    n = len(calls)
    dc, route, migrated, planned, slots, weights = _placement_arrays(calls, t0, slot_s)
    starts, ends = calls.start_s.tolist(), calls.end_s.tolist()
    ups, downs = calls.up_kbps.tolist(), calls.down_kbps.tolist()
    regions, counts, ptr = calls.region.tolist(), calls.count.tolist(), calls.ptr.tolist()
    counters: dict[tuple, list] = {}

    def candidates(k: int, slot: int, tag: str, weight: float):
        """(placements in preference order, the quota state and mix to book the choice on)."""
        got = plan.get(k, slot, options)
        allowed = [o for o in options[k].options if o[1] in routes]
        if got is None:
            near = (options[k].nearest, WAN)
            return [near] + [o for o in allowed if o != near], None, None, False
        dcs, rts, frac = got
        mix = list(zip(dcs.tolist(), rts.tolist()))
        if len(mix) == 1:
            return mix + [o for o in allowed if o != mix[0]], None, mix, True
        key = (tag, plan.key(k, options), slot)
        state = counters.get(key)
        if state is None:
            state = counters[key] = [0.0, np.zeros(len(mix))]
        state[0] += weight
        deficit = frac * state[0] - state[1]
        order = sorted(range(len(mix)), key=lambda j: (-deficit[j], j))
        pref = [mix[j] for j in order]
        return pref + [o for o in allowed if o not in pref], state, mix, True

    cfg, prov = config_ids.tolist(), provisional_ids.tolist()
    moves: list[tuple[int, float, int, int]] = []
    reslot = move_at is not None and INTERNET in routes
    guard._seq += 1
    token = guard._seq  # this realisation's calls (a boundary moves only those)
    boundary = np.ceil(t0 / slot_s) * slot_s
    for i in range(n):
        while reslot and boundary <= starts[i]:
            guard._advance(boundary)
            guard.reslot(boundary, int(round(boundary / slot_s)), move_at, token, options, moves)
            boundary += slot_s
        guard._advance(starts[i])
        abs_slot = int(starts[i] // slot_s)
        members = list(zip(regions[ptr[i]:ptr[i + 1]], counts[ptr[i]:ptr[i + 1]]))
        cands, state, mix, ok = candidates(cfg[i], slots[i], "final", weights[i])
        if guard.keep_caps:
            within = [o for o in cands if o[1] == WAN or guard._within_caps(members, o[0], abs_slot)]
            if within:
                cands = within
            else:
                guard.over_cap += 1
        best, best_excess, best_contrib = None, np.inf, None
        for d, r in cands:
            contrib = _wan_contrib(world, members, d, ups[i], downs[i]) if r == WAN else {}
            excess = guard._excess(contrib)
            if excess < best_excess:
                best, best_excess, best_contrib = (d, r), excess, contrib
            if excess <= 0:
                break
        d, r = best
        guard._commit(ends[i], best_contrib, members, d, r, abs_slot, (token, i, cfg[i]) if reslot else None)
        if state is not None and (d, r) in mix:
            state[1][mix.index((d, r))] += weights[i]
        dc[i], route[i], planned[i] = d, r, ok
        if prov[i] != cfg[i]:
            pd, pr, _ = _quota_place(plan, options, counters, prov[i], slots[i], "provisional", 1.0)
            migrated[i] = (pd, pr) != (d, r)
    return Realisation(dc, route, migrated, planned, np.array(moves, dtype=np.float64).reshape(-1, 4))


def realise_plan(plan: Plan, options: Options, calls: Calls, config_ids: np.ndarray, provisional_ids: np.ndarray,
                 t0: float, slot_s: float, how: str, guard: PeakGuard, limits: np.ndarray,
                 routes: tuple[int, ...] = (WAN, INTERNET), move_at: float | None = None) -> Realisation:
    """An LP's plan as calls, the way ``how`` says (the specs' ``realisation``): ``quota``
    counters alone (``realise``); ``capped``, the guard with no peak limits (the caps alone);
    ``guarded``, the guard holding the WAN links to ``limits`` (the plan's peaks, or those the
    billing period allows), with moves at slot boundaries from ``move_at``.  The offline study
    and the emulator both realise through here."""
    if how == "quota":
        return realise(plan, options, calls, config_ids, provisional_ids, t0, slot_s)
    if how == "capped":
        guard.set_limits(np.full(options.world.n_links, np.inf))
        return realise_guarded(plan, options, calls, config_ids, provisional_ids, t0, slot_s, guard, routes)
    if how != "guarded":
        raise TitanError(f"realisation: {how!r} is not quota, capped or guarded")
    guard.set_limits(limits)
    return realise_guarded(plan, options, calls, config_ids, provisional_ids, t0, slot_s, guard, routes, move_at)


def realise_greedy(options: Options, calls: Calls, config_ids: np.ndarray, provisional_ids: np.ndarray,
                   t0: float, slot_s: float) -> Realisation:
    """Greedy Internet-whenever-eligible: each call, in start order, at its nearest DC, over
    the Internet if that placement is allowed and every participant's path stays within its
    Internet share cap (counted over the participants placed at that DC in the slot so far),
    else over the WAN."""
    w = options.world
    cap = w.inet_cap
    n = len(calls)
    dc = np.empty(n, dtype=np.int64)
    route = np.empty(n, dtype=np.int64)
    migrated = np.zeros(n, dtype=bool)
    slots = np.floor((calls.start_s - t0) / slot_s).astype(np.int64).tolist()
    placed: dict[tuple[int, int, int], list[float]] = {}  # (slot, user, dc) -> [all, internet]
    regions, counts, ptr = calls.region.tolist(), calls.count.tolist(), calls.ptr.tolist()

    def place(k: int, slot: int, members: list[tuple[int, int]], commit: bool) -> tuple[int, int]:
        co = options[k]
        d = co.nearest
        r = WAN
        if options.option_index(k, d, INTERNET) is not None:
            ok = True
            for u, c in members:
                if w.local[u, d]:
                    continue
                a = placed.get((slot, u, d), [0.0, 0.0])
                if a[1] + c > cap[u, d] * (a[0] + c) + 1e-9:
                    ok = False
                    break
            r = INTERNET if ok else WAN
        if commit:
            for u, c in members:
                a = placed.setdefault((slot, u, d), [0.0, 0.0])
                a[0] += c
                a[1] += c if r == INTERNET else 0
        return d, r

    cfg, prov = config_ids.tolist(), provisional_ids.tolist()
    first = calls.first.tolist()
    for i in range(n):
        members = list(zip(regions[ptr[i]:ptr[i + 1]], counts[ptr[i]:ptr[i + 1]]))
        if prov[i] != cfg[i]:
            pd, pr = place(prov[i], slots[i], [(first[i], 1)], commit=False)
        d, r = place(cfg[i], slots[i], members, commit=True)
        dc[i], route[i] = d, r
        if prov[i] != cfg[i]:
            migrated[i] = (pd, pr) != (d, r)
    return Realisation(dc, route, migrated, np.ones(n, dtype=bool))


def plan_loads(world: World, options: Options, plan: Plan, demand) -> np.ndarray:
    """[link, slot] kbps a plan puts on the WAN for a demand, fractions taken as they are
    (the planned load, before realisation rounds them to calls)."""
    U, D = len(world.users), len(world.dcs)
    T = demand.slots
    up = np.zeros((U * D, T))
    dn = np.zeros((U * D, T))
    for i in range(len(demand.config)):
        k, t, u = int(demand.config[i]), int(demand.slot[i]), int(demand.region[i])
        got = plan.get(k, t, options)
        dcs, routes, frac = got if got is not None else _mix([(options[k].nearest, WAN)], [1.0])
        for d, r, f in zip(dcs, routes, frac):
            if r == WAN and not world.local[u, d]:
                up[u * D + d, t] += f * demand.up_kbps[i]
                dn[u * D + d, t] += f * demand.down_kbps[i]
    inc_up, inc_dn = incidence(world)
    return inc_up @ up + inc_dn @ dn


@dataclass
class Evaluation:
    link_load: np.ndarray  # [link, slot] kbps, averaged over the slot
    dc_participants: np.ndarray  # [dc, slot] concurrent participants
    internet_share_calls: float  # of calls
    internet_share_traffic: float  # of traffic that would cross the WAN at its placement's DC
    migrations: float  # share of calls
    unplanned: float  # share of calls placed by the nearest-DC fallback
    latency: np.ndarray  # per entry (call x region): RTT ms
    latency_route: np.ndarray  # per entry: route
    latency_weight: np.ndarray  # per entry: participants
    over_bound: int  # calls with a participant over its latency bound
    cap_excess: float  # share of Internet participant-time above the paths' caps (per slot)
    cross_kbps: np.ndarray  # [slot] traffic of participants not local to their call's DC
    internet_kbps: np.ndarray  # [slot] the part of it on the Internet

    def peaks(self, slots_per_period: int | None = None) -> np.ndarray:
        """Each link's peak, over the whole horizon or per period ([period, link])."""
        if slots_per_period is None:
            return self.link_load.max(axis=1)
        L, S = self.link_load.shape
        return self.link_load[:, : S - S % slots_per_period].reshape(L, -1, slots_per_period).max(axis=2).T

    def sum_of_peaks(self, slots_per_period: int | None = None) -> np.ndarray | float:
        p = self.peaks(slots_per_period)
        return float(p.sum()) if slots_per_period is None else p.sum(axis=1)


def incidence(world: World) -> tuple[np.ndarray, np.ndarray]:
    """[link, pair] 0/1 matrices for user -> DC and DC -> user traffic (pair = u * D + d)."""
    U, D, L = len(world.users), len(world.dcs), world.n_links
    up = np.zeros((L, U * D), dtype=np.float32)
    dn = np.zeros((L, U * D), dtype=np.float32)
    for u in range(U):
        for d in range(D):
            up[world.up_links[u][d], u * D + d] = 1.0
            dn[world.down_links[u][d], u * D + d] = 1.0
    return up, dn


def _split_moves(calls: Calls, config_ids: np.ndarray, real: Realisation) -> tuple:
    """Calls moved while in progress as segments: (segment calls, their configurations, their
    realisation, each segment's call).  A call with m moves is m + 1 segments, each on the
    placement it had then; the first keeps the call's migration flag."""
    n = len(calls)
    mv = real.moves
    call = np.concatenate((np.arange(n), mv[:, 0].astype(np.int64)))
    start = np.concatenate((calls.start_s, mv[:, 1]))
    dc = np.concatenate((real.dc, mv[:, 2].astype(np.int64)))
    route = np.concatenate((real.route, mv[:, 3].astype(np.int64)))
    order = np.lexsort((start, call))
    call, start, dc, route = call[order], start[order], dc[order], route[order]
    last = np.ones(len(call), dtype=bool)
    last[:-1] = call[1:] != call[:-1]
    end = np.where(last, calls.end_s[call], np.roll(start, -1))
    first = np.ones(len(call), dtype=bool)
    first[1:] = call[1:] != call[:-1]
    seg = calls.take(call)
    seg.start_s, seg.duration_s = start, end - start
    return (seg, config_ids[call], Realisation(dc, route, real.migrated[call] & first, real.planned[call]), call)


def evaluate(world: World, options: Options, calls: Calls, config_ids: np.ndarray, real: Realisation,
             t0: float, slot_s: float, slots: int, incid: tuple[np.ndarray, np.ndarray] | None = None) -> Evaluation:
    """Measure a realisation (see ``Evaluation``); calls moved while in progress are measured
    segment by segment, and each move counts as a migration of its call."""
    if len(real.moves):
        seg, seg_cfg, seg_real, call = _split_moves(calls, config_ids, real)
        ev = _evaluate(world, options, seg, seg_cfg, seg_real, t0, slot_s, slots, incid, call)
        n = max(len(calls), 1)
        on_inet = np.zeros(len(calls), dtype=bool)
        on_inet[call[seg_real.route == INTERNET]] = True
        ev.internet_share_calls = float(on_inet.sum() / n)  # a call on the Internet for any part of it
        ev.migrations = float((real.migrated.sum() + len(real.moves)) / n)
        ev.unplanned = float((~real.planned).sum() / n)
        return ev
    return _evaluate(world, options, calls, config_ids, real, t0, slot_s, slots, incid, None)


def _evaluate(world: World, options: Options, calls: Calls, config_ids: np.ndarray, real: Realisation,
              t0: float, slot_s: float, slots: int, incid, origin: np.ndarray | None) -> Evaluation:
    """``evaluate`` on whole calls, or on segments (``origin``: each segment's call, so a call
    over its bound in any segment counts once)."""
    U, D = len(world.users), len(world.dcs)
    lens = np.diff(calls.ptr)
    ecall = np.repeat(np.arange(len(calls)), lens)
    eu = calls.region
    ed = real.dc[ecall]
    er = real.route[ecall]
    elocal = world.local[eu, ed]
    # latency per entry, and the bound it must meet
    lat = np.where(er == WAN, world.wan_rtt[eu, ed], world.inet_rtt[eu, ed])
    over = np.zeros(len(calls), dtype=bool)
    for k in np.unique(config_ids):
        sel_calls = config_ids == k
        co = options[int(k)]
        sel = sel_calls[ecall]
        # entries of this configuration's calls come in the configuration's region order
        ref = np.tile(co.ref_rtt, int(sel_calls.sum()))
        bad = lat[sel] > ref + options.rule.delta_ms + 1e-6
        if options.rule.max_rtt_ms is not None:
            bad |= lat[sel] > options.rule.max_rtt_ms + 1e-6
        over[ecall[sel][bad]] = True

    row, slot, frac = slot_overlaps(calls.start_s, calls.end_s, t0, slot_s, slots)
    # expand (call, slot) rows over the call's entries
    per = lens[row]
    ridx = np.repeat(np.arange(len(row)), per)
    ent = np.repeat(calls.ptr[row], per) + (np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per))
    c = row[ridx]
    f = frac[ridx]
    s = slot[ridx]
    part = calls.count[ent] * f
    dcp = np.bincount(real.dc[c] * slots + s, weights=part, minlength=D * slots).reshape(D, slots)
    on_wan = (real.route[c] == WAN) & ~world.local[calls.region[ent], real.dc[c]]
    pair = calls.region[ent] * D + real.dc[c]
    key = pair[on_wan] * slots + s[on_wan]
    up = np.bincount(key, weights=(part * calls.up_kbps[c])[on_wan], minlength=U * D * slots).reshape(U * D, slots)
    dn = np.bincount(key, weights=(part * calls.down_kbps[c])[on_wan], minlength=U * D * slots).reshape(U * D, slots)
    inc_up, inc_dn = incid if incid is not None else incidence(world)
    load = inc_up @ up + inc_dn @ dn
    # Internet share per (path, slot) against the caps
    nonlocal_ = ~world.local[calls.region[ent], real.dc[c]]
    pk = pair[nonlocal_] * slots + s[nonlocal_]
    all_p = np.bincount(pk, weights=part[nonlocal_], minlength=U * D * slots)
    inet_p = np.bincount(pk, weights=(part * (real.route[c] == INTERNET))[nonlocal_], minlength=U * D * slots)
    cap = np.repeat(world.inet_cap.ravel(), slots)
    excess = np.maximum(inet_p - cap * all_p, 0.0).sum()
    kb = part * (calls.up_kbps[c] + calls.down_kbps[c])
    cross_kbps = np.bincount(s[nonlocal_], weights=kb[nonlocal_], minlength=slots)
    inet_kbps = np.bincount(s[nonlocal_], weights=(kb * (real.route[c] == INTERNET))[nonlocal_], minlength=slots)

    cross = ~elocal
    traffic = calls.count * (calls.up_kbps[ecall] + calls.down_kbps[ecall]) * calls.duration_s[ecall]
    tot = traffic[cross].sum()
    inet = traffic[cross & (er == INTERNET)].sum()
    n = max(len(calls), 1)
    return Evaluation(
        link_load=np.asarray(load, dtype=np.float64), dc_participants=dcp,
        internet_share_calls=float((real.route == INTERNET).sum() / n),
        internet_share_traffic=float(inet / tot) if tot > 0 else 0.0,
        migrations=float(real.migrated.sum() / n), unplanned=float((~real.planned).sum() / n),
        latency=lat, latency_route=er, latency_weight=calls.count.astype(np.float64),
        over_bound=int(over.sum() if origin is None else len(np.unique(origin[over]))),
        cap_excess=float(excess / inet_p.sum()) if inet_p.sum() > 0 else 0.0,
        cross_kbps=cross_kbps, internet_kbps=inet_kbps,
    )
