"""Titan-Next's linear program (and its WAN-only, Switchboard-like variant), solved by HiGHS.

The formulation (the paper's exact one is not public; this is the brief's, stated in full).
For one day of slots t, call configurations k with forecast demand, and the placements
o = (DC d, route r) the latency rule allows for k (``placement.Options``: the pruning):

    variables  x[k,t,o] in [0,1]   fraction of configuration k's traffic in slot t placed at o
               y[u,d,t] >= 0        WAN traffic (kbps) from user region u to DC d, and
               z[u,d,t] >= 0        from d back to u, in slot t
               P[l] >= 0            the peak load of WAN link l (directed) over the day
    minimise   sum_l P[l]
    subject to sum_o x[k,t,o] = 1                                   every configuration placed
               y[u,d,t] = sum_{k,o=(d,WAN)} up[k,t,u] x[k,t,o]       (z: with down[k,t,u])
               sum_{(u,d): l on path u->d} y[u,d,t]
                 + sum_{(u,d): l on path d->u} z[u,d,t] <= P[l]     every link, every slot
               sum_{k,o at d} participants[k,t] x[k,t,o] <= C[d]    DC capacity, every slot
               sum_{k,o=(d,Internet)} part[k,t,u] x[k,t,o]
                 <= cap[u,d] sum_{k,o at d} part[k,t,u] x[k,t,o]    Internet share per path

``cap[u,d]`` is Titan's offload limit on the Internet path between u and d (the largest
share of u's participants at d that may ride the Internet: what Titan's controller allows
where quality holds; 0 where the path misses Teams' targets).  Our reading of how the two
systems fit: Titan-Next places calls, Titan's guardrail bounds how much of each path it may
offload; every policy here respects the same caps.
``up``/``down`` are the forecast kbps of k's participants in region u (``workload.Demand``);
paths are the backbone's fixed routes (the provider routes its WAN, not the conferencing
service).  Every configuration with a forecast gets variables.  The ``max_configs`` with the
most forecast traffic get their own mix per slot; the long tail (here tens of thousands of
configurations: large calls spanning many regions, each seen a few times, together a third
of the traffic) is grouped by allowed placement set: configurations the latency rule allows
exactly the same (DC, route) placements share one mix per slot, their demands summed per
region (where configurations are told apart by media, ``workload.Configs(by_media=True)``,
a class is one medium's: the caps count participants and the peaks kbps, so the LP sends
HD and video participants over the Internet before audio ones).  That restriction (same
placements, same mix) is the only approximation; it keeps
the LP at a few hundred thousand variables without leaving the tail unplanned, and a
configuration first seen on the day itself still finds its class.  The y/z variables keep
the matrix sparse: a placement touches one y per participant region instead of every link
on every path.

Tie-break: HiGHS returns some optimal vertex, often needlessly far; the brief re-solves with
``sum_l P[l] <= (1+eps) P*`` added, minimising participants' total RTT.  Here each link's
peak is held at (1+eps) times its optimal value instead (a subset of that set: each link
keeps its own peak), which makes the re-solve separate by slot: 24-96 small LPs, one per
slot, each minimising RTT under the link limits.  Re-solving the whole day took longer
than the peaks LP itself (a WAN-only day at 96 slots: 118 s for the peaks, 70 s more for
the re-solve).  ``tie_break="headroom"`` minimises instead each slot's WAN traffic summed
over the links it crosses (RTT second, weighted 1e-3): the same peaks, but no link filled
up to its peak off the peak, so a day above its forecast finds room (the study's default).

Billing period: a link is billed for its peak over a period, not a day.  With
``DayProblem.paid`` (each link's realised peak in the period so far) the objective is
``sum_l E[l]`` with ``P[l] - E[l] <= paid[l]``, ``E >= 0``: only the excess over what the
period has paid costs, and the tie-break may fill a link up to ``paid + E``.

Solving: HiGHS's interior point method, without crossover to a vertex for the peaks LP
(only its peaks are used; each slot's placement comes from its tie-break LP), with crossover
only where IPM alone ends without a certified optimum, and dual simplex where IPM with
crossover still ends without one (IPM ended "Infeasible" on feasible 8-region days).  Measured here
(2 shared cores), the peaks LP of a day over 54 user regions and 21 DCs took 383 s at 96
slots of 15 minutes, 34 s at 24 slots of an hour; dual simplex took 413 s on just 8 slots
(the peak columns, each in every slot's link row, make the LP very degenerate), IPM 10 s.
So the study plans hourly by default.  Each link's peak is one column per slot chained
equal (P[l,s] = P[l,s+1]), which keeps IPM's normal equations sparse.  ``solve_day`` can
also start from a few busy slots and add the slots that do not fit under the peaks found
(slot generation; exact, since a slot that fits needs no peak raised), which pays off only
where few slots bind; with links in every time zone most do, so by default every slot is
in from the start.  The WAN-only variant (``routes=(WAN,)``) is the same LP without
Internet placements: peak-aware DC selection over the private WAN, as Switchboard does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from agents.titan.placement import INTERNET, WAN, Options, Plan
from agents.titan.regions import World
from agents.titan.spec import TitanError
from agents.titan.workload import Demand

_FRACTION_EPS = 1e-7


@dataclass
class DayProblem:
    """A day's demand (forecast or actual), the configurations planned on their own, capacities."""

    demand: Demand
    head: set[int]  # configurations with their own mix per slot; the rest share one per placement set
    capacity: np.ndarray  # [dc] participants
    paid: np.ndarray | None = None  # [link] kbps: the billing period's peak so far (None: the day is billed alone)


def capacities(world: World, options: Options, demand: Demand, headroom: float) -> np.ndarray:
    """DC capacity (concurrent participants): ``headroom`` x the nearest-DC policy's peak on
    ``demand`` (give it the whole horizon's actual demand: capacity is provisioned, not
    forecast), at least ``headroom`` x 5% of the mean DC's peak (so a DC no call is nearest
    to can still take some)."""
    D = len(world.dcs)
    load = np.zeros((D, demand.slots))
    nearest = nearest_of(options, demand.config)
    np.add.at(load, (nearest, demand.slot), demand.participants)
    peak = load.max(axis=1)
    return headroom * np.maximum(peak, 0.05 * peak.mean())


def nearest_of(options: Options, config_ids: np.ndarray) -> np.ndarray:
    """Each row's nearest DC (vectorised over repeated configurations)."""
    uniq, inv = np.unique(config_ids, return_inverse=True)
    if not len(uniq):
        return np.zeros(0, dtype=np.int64)
    return np.array([options[int(k)].nearest for k in uniq], dtype=np.int64)[inv]


def top_configs(demand: Demand, max_configs: int) -> set[int]:
    traffic = np.bincount(demand.config, weights=demand.up_kbps + demand.down_kbps)
    order = np.argsort(-traffic, kind="stable")
    return {int(k) for k in order[:max_configs] if traffic[k] > 0}


def solve_day(world: World, options: Options, problem: DayProblem, name: str = "titan-next",
              routes: tuple[int, ...] = (WAN, INTERNET), tie_break_eps: float | None = 1e-3,
              solver: str = "ipm", aggregate: bool = True, initial_slots: int | None = None,
              max_rounds: int = 12, log: Callable[[str], None] | None = None, tie_break: str = "latency") -> Plan:
    """Solve one day's LP and return its plan (cells indexed by the day's slots, 0-based).

    The peaks LP over ``initial_slots`` busy slots (None: all), then every slot's latency
    tie-break under the peaks found; a slot that cannot fit joins the peaks LP (slot
    generation) until all fit.  ``solver`` is HiGHS's ``ipm`` or ``simplex`` for the peaks
    LP (slot LPs use simplex); ``aggregate`` uses the y/z variables (else each placement's
    traffic goes straight into the link rows: fewer rows, more nonzeros)."""
    import highspy

    t_start = time.perf_counter()
    dem = problem.demand
    T = dem.slots
    L = world.n_links
    plan = Plan(name)
    rows = _Rows(world, options, problem, routes, plan, aggregate)
    all_slots = sorted(set(rows.slot.tolist()))
    active = set(all_slots) if initial_slots is None else set(rows.busy_slots(initial_slots))
    rounds = []
    peaks = np.zeros(L)
    slot_sol: dict[int, tuple] = {}
    while True:
        t1 = time.perf_counter()
        built = _build(rows, np.isin(rows.slot, sorted(active)), problem.capacity, T, problem.paid)
        h = _highs(built, solver)
        if solver == "ipm":  # only the peaks are used (each slot's placement comes from its tie-break LP):
            h.setOptionValue("run_crossover", "off")  # no need to cross over to a vertex
        h.run()
        fallback = None
        if solver == "ipm" and h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            h.setOptionValue("run_crossover", "on")  # IPM alone could not certify it: finish with crossover
            h.run()
            fallback = "crossover"
        if solver == "ipm" and h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            # IPM can end "Infeasible" on a feasible LP (seen on 8-region days, with and
            # without crossover, that simplex solves): let simplex decide
            h = _highs(built, "simplex")
            h.run()
            fallback = "simplex"
        _check(h, name, "sum of peaks")
        sol = np.asarray(h.getSolution().col_value)
        peaks = np.zeros(L)
        peaks[built.links] = sol[built.P0:built.P0 + len(built.links) * built.S].reshape(len(built.links), built.S)[:, 0]
        if problem.paid is not None:  # what the day may fill: the period's peak so far, plus its excess
            peaks = problem.paid.astype(np.float64).copy()
            peaks[built.links] += sol[built.P0 + len(built.links) * built.S:]
        peak_opt = float(h.getInfo().objective_function_value)
        master_s = time.perf_counter() - t1
        if log:
            log(f"{name}: peaks LP over {len(active)} slots, {built.n_col:,} variables: {master_s:.1f} s")
        # every slot under these peaks (the tie-break needs them all anyway): latency-minimal
        # placement with each link at most (1+eps) its peak; a slot that cannot fit joins
        t2 = time.perf_counter()
        limit = peaks * (1 + (tie_break_eps or 0.0)) + 1e-6
        misfits = []
        for t in all_slots:
            if t in slot_sol and slot_sol[t][0] is not None and np.all(slot_sol[t][1] <= limit):
                continue  # still fits: its earlier solution stands (the limits only grew)
            got = _solve_slot(rows, t, problem.capacity, T, limit, tie_break)
            slot_sol[t] = got
            if got[0] is None:
                misfits.append(t)
        if log:
            log(f"{name}: {len(all_slots)} slot LPs {time.perf_counter() - t2:.1f} s, {len(misfits)} do not fit")
        rounds.append({"active_slots": len(active), "sum_of_peaks_kbps": peak_opt, "master_s": master_s,
                       "fallback": fallback,
                       "slots_s": time.perf_counter() - t2, "misfits": len(misfits), "master_variables": built.n_col})
        if not misfits or len(rounds) >= max_rounds:
            break
        active |= set(misfits)
    if any(slot_sol[t][0] is None for t in all_slots):
        raise TitanError(f"{name}: slot generation did not converge in {max_rounds} rounds")
    for t in all_slots:
        built, x = slot_sol[t][2], slot_sol[t][0]
        for c in range(built.n_cells):
            a, b = built.x_start[c], built.x_start[c + 1]
            f = np.clip(x[a:b], 0.0, 1.0)
            f[f < _FRACTION_EPS] = 0.0
            keep = f > 0
            if not keep.any():
                keep[:] = True
                f = np.ones(b - a)
            plan.cells[(int(built.cell_key[c]), int(built.cell_slot[c]))] = (
                built.x_dc[a:b][keep], built.x_route[a:b][keep], f[keep] / f[keep].sum())
    final = np.zeros(L)
    for t in all_slots:
        final = np.maximum(final, slot_sol[t][1])
    plan.solve_s = time.perf_counter() - t_start
    plan.stats = {
        "variables": int(rows.n_x_total), "rows": int(rows.n_rows_estimate(T)), "cells": int(rows.n_cells_total),
        "configs": int(rows.n_configs), "head_configs": int(rows.n_head), "tail_classes": len(plan.class_of),
        "slots": len(all_slots), "active_slots": len(active), "rounds": rounds,
        "master_variables": rounds[-1]["master_variables"],
        "planned_sum_of_peaks_kbps": (rounds[-1]["sum_of_peaks_kbps"] if problem.paid is None
                                      else float(peaks.sum())),
        "planned_excess_kbps": rounds[-1]["sum_of_peaks_kbps"] if problem.paid is not None else None,
        "peak_limits": peaks,
        "sum_of_peaks_after_tiebreak_kbps": float(final.sum()), "planned_peaks": final,
        "split_cells": int(sum(1 for v in plan.cells.values() if len(v[0]) > 1)),
    }
    return plan


class _Rows:
    """A day's demand per (plan key, slot, region), and every (row, placement) pairing."""

    def __init__(self, world: World, options: Options, problem: DayProblem, routes: tuple[int, ...], plan: Plan,
                 aggregate: bool = True):
        dem = problem.demand
        self.world, self.routes, self.aggregate = world, routes, aggregate
        U, T = len(world.users), dem.slots
        uniq_cfg, cfg_inv = np.unique(dem.config, return_inverse=True)
        key_of_cfg = np.empty(len(uniq_cfg), dtype=np.int64)
        self.placements: dict[int, list[tuple[int, int]]] = {}
        n_head = 0
        for i, k in enumerate(uniq_cfg.tolist()):
            pset = options.placement_set(k)
            if k in problem.head:
                key = k
                n_head += 1
            else:
                ck = options.class_key(k)
                key = plan.class_of.get(ck)
                if key is None:
                    key = plan.class_of[ck] = -1 - len(plan.class_of)
            key_of_cfg[i] = key
            self.placements[key] = [o for o in pset if o[1] in routes]
            if not self.placements[key]:
                raise TitanError(f"{plan.name}: configuration {k} has no placement on routes {routes}")
        self.n_configs, self.n_head = len(uniq_cfg), n_head
        row_key = key_of_cfg[cfg_inv]
        keys_u, key_idx = np.unique(row_key, return_inverse=True)
        agg = (key_idx.astype(np.int64) * T + dem.slot) * U + dem.region
        agg_u, agg_inv = np.unique(agg, return_inverse=True)
        self.part = np.bincount(agg_inv, weights=dem.participants)
        self.up = np.bincount(agg_inv, weights=dem.up_kbps)
        self.down = np.bincount(agg_inv, weights=dem.down_kbps)
        self.key = keys_u[agg_u // (T * U)]
        self.slot = (agg_u // U) % T
        self.region = agg_u % U
        n_opts = np.array([len(self.placements[int(k)]) for k in self.key])
        cells = np.unique(agg_u // U)
        self.n_cells_total = len(cells)
        self.n_x_total = int(sum(len(self.placements[int(k)]) for k in keys_u[cells // T]))
        self._n_opts = n_opts

    def n_rows_estimate(self, T: int) -> int:
        return self.n_cells_total + self.world.n_links * T

    def busy_slots(self, n: int) -> list[int]:
        """The slots with the most traffic that would cross the WAN at the nearest placement."""
        w = self.world
        traffic = np.zeros(int(self.slot.max()) + 1 if len(self.slot) else 1)
        near = np.array([min(self.placements[int(k)], key=lambda o: o[1])[0] for k in self.key]) if len(self.key) else []
        cross = ~w.local[self.region, near] if len(self.key) else np.zeros(0, dtype=bool)
        np.add.at(traffic, self.slot[cross], (self.up + self.down)[cross])
        return [int(t) for t in np.argsort(-traffic)[:n] if traffic[t] > 0] or [int(self.slot[0])]


@dataclass
class _Built:
    lp: object
    n_col: int
    n_cells: int
    x_start: np.ndarray
    x_dc: np.ndarray
    x_route: np.ndarray
    cell_key: np.ndarray
    cell_slot: np.ndarray
    lat_cost: np.ndarray
    wan_cost: np.ndarray  # per x: the kbps it puts on WAN links, summed over the links (hops)
    links: np.ndarray  # global link ids that have a peak column here
    P0: int
    R_L: int  # first link row
    S: int  # slots in this LP (peak columns per link)


def _build(rows: _Rows, sel: np.ndarray, capacity: np.ndarray, T: int, paid: np.ndarray | None = None) -> _Built:
    """The LP over the selected demand rows (whole cells: select by slot).  With ``paid`` (the
    billing period's peak per link so far) the objective is each link's excess over it:
    columns E[l] >= 0 after the peaks, rows P[l] - E[l] <= paid[l], cost on E only."""
    import highspy

    world, routes = rows.world, rows.routes
    U, D, L = len(world.users), len(world.dcs), world.n_links
    idx = np.flatnonzero(sel)
    key, slot, reg = rows.key[idx], rows.slot[idx], rows.region[idx]
    part, upk, dnk = rows.part[idx], rows.up[idx], rows.down[idx]
    # cells (key, slot) in row order (rows are sorted by key, then slot, then region)
    code = np.stack((key, slot), axis=1)
    new_cell = np.ones(len(idx), dtype=bool)
    new_cell[1:] = np.any(code[1:] != code[:-1], axis=1)
    r_cell = np.cumsum(new_cell) - 1
    n_cells = int(r_cell[-1]) + 1 if len(idx) else 0
    cell_key, cell_slot = key[new_cell], slot[new_cell]
    n_opts = rows._n_opts[idx][new_cell]
    x_start = np.concatenate(([0], np.cumsum(n_opts)))
    n_x = int(x_start[-1])
    x_cell = np.repeat(np.arange(n_cells), n_opts)
    x_dc = np.empty(n_x, dtype=np.int64)
    x_route = np.empty(n_x, dtype=np.int64)
    for c0, c1 in _runs(cell_key):
        opts = rows.placements[int(cell_key[c0])]
        a, b = x_start[c0], x_start[c1]
        x_dc[a:b] = np.tile([o[0] for o in opts], c1 - c0)
        x_route[a:b] = np.tile([o[1] for o in opts], c1 - c0)

    per = n_opts[r_cell]
    e_row = np.repeat(np.arange(len(idx)), per)
    e_x = x_start[r_cell][e_row] + (np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per))
    e_d, e_r, e_u, e_t = x_dc[e_x], x_route[e_x], reg[e_row], slot[e_row]
    e_part = part[e_row]
    e_local = world.local[e_u, e_d]
    rtt = np.where(e_r == WAN, world.wan_rtt[e_u, e_d], world.inet_rtt[e_u, e_d])
    lat_cost = np.bincount(e_x, weights=e_part * rtt, minlength=n_x)

    wan_e = (e_r == WAN) & ~e_local
    ykey = (e_t[wan_e] * U + e_u[wan_e]) * D + e_d[wan_e]
    yuniq, yinv = np.unique(ykey, return_inverse=True)
    n_y = len(yuniq) if rows.aggregate else 0
    y_t, y_u, y_d = yuniq // (U * D), (yuniq // D) % U, yuniq % D
    up_links, dn_links = world_pair_links(world)
    y_pair = y_u * D + y_d
    used = np.zeros(L, dtype=bool)
    for p in np.unique(yuniq % (U * D)):
        used[up_links[p]] = True
        used[dn_links[p]] = True
    links = np.flatnonzero(used)
    link_pos = -np.ones(L, dtype=np.int64)
    link_pos[links] = np.arange(len(links))
    n_p = len(links)
    slots_here = np.unique(slot)
    slot_pos = -np.ones(T, dtype=np.int64)
    slot_pos[slots_here] = np.arange(len(slots_here))
    S = len(slots_here)

    cap = world.inet_cap[e_u, e_d]
    sh_e = ~e_local & (cap < 1.0) & (INTERNET in routes)
    sh_key = (e_t * U + e_u) * D + e_d
    inet_keys = np.unique(sh_key[sh_e & (e_r == INTERNET)])
    sh_e &= np.isin(sh_key, inet_keys)
    sh_uniq, sh_row = np.unique(sh_key[sh_e], return_inverse=True)
    sh_val = e_part[sh_e] * np.where(e_r[sh_e] == INTERNET, 1.0 - cap[sh_e], -cap[sh_e])
    n_sh = len(sh_uniq)

    # columns: x, y, z, P; rows: cells (=1), y/z definitions (=0), links (<=0), DCs (<=C), shares (<=0)
    Y0, Z0, P0 = n_x, n_x + n_y, n_x + 2 * n_y
    # each link's peak is one column per slot, chained equal (P[l,s] = P[l,s+1]): the same LP,
    # but no column touches all of a link's slots, which keeps the interior point method's
    # normal equations sparse (a single P[l] column makes them a dense block per link)
    n_e = n_p if paid is not None else 0
    E0 = P0 + n_p * S
    n_col = E0 + n_e
    R_Y, R_Z, R_L = n_cells, n_cells + n_y, n_cells + 2 * n_y
    R_C = R_L + n_p * S
    R_S = R_C + D * S
    R_E = R_S + n_sh
    R_B = R_E + n_p * (S - 1)
    n_row = R_B + n_e
    r_list, c_list, v_list = [], [], []

    def add(r, c, v):
        r_list.append(np.asarray(r, dtype=np.int64))
        c_list.append(np.asarray(c, dtype=np.int64))
        v_list.append(np.broadcast_to(np.asarray(v, dtype=np.float64), np.shape(r)))

    add(x_cell, np.arange(n_x), 1.0)
    if n_y:
        add(R_Y + yinv, e_x[wan_e], -upk[e_row[wan_e]])
        add(R_Z + yinv, e_x[wan_e], -dnk[e_row[wan_e]])
        add(R_Y + np.arange(n_y), Y0 + np.arange(n_y), 1.0)
        add(R_Z + np.arange(n_y), Z0 + np.arange(n_y), 1.0)
        for lists, col0 in ((up_links, Y0), (dn_links, Z0)):
            lens = np.array([len(lists[p]) for p in y_pair])
            flat = np.concatenate([lists[p] for p in y_pair])
            yrep = np.repeat(np.arange(n_y), lens)
            add(R_L + link_pos[flat] * S + slot_pos[y_t[yrep]], col0 + yrep, 1.0)
    if not rows.aggregate and wan_e.any():
        pair = e_u[wan_e] * D + e_d[wan_e]
        for lists, vals in ((up_links, upk), (dn_links, dnk)):
            lens = np.array([len(lists[p]) for p in pair])
            flat = np.concatenate([lists[p] for p in pair])
            erep = np.repeat(np.flatnonzero(wan_e), lens)
            add(R_L + link_pos[flat] * S + slot_pos[e_t[erep]], e_x[erep], vals[e_row[erep]])
    lrow = np.arange(n_p * S)
    add(R_L + lrow, P0 + lrow, -1.0)
    if S > 1:
        chain = (np.arange(n_p)[:, None] * S + np.arange(S - 1)[None, :]).ravel()
        erow = R_E + np.arange(n_p * (S - 1))
        add(erow, P0 + chain, 1.0)
        add(erow, P0 + chain + 1, -1.0)
    add(R_C + e_d * S + slot_pos[e_t], e_x, e_part)
    if n_e:
        add(R_B + np.arange(n_e), P0 + np.arange(n_p) * S, 1.0)
        add(R_B + np.arange(n_e), E0 + np.arange(n_e), -1.0)
    if n_sh:
        add(R_S + sh_row, e_x[sh_e], sh_val)

    r_all = np.concatenate(r_list)
    c_all = np.concatenate(c_list)
    v_all = np.concatenate(v_list)
    rc = r_all * n_col + c_all  # (row, col) pairs repeat where a cell's regions meet in a DC row
    rc_u, rc_inv = np.unique(rc, return_inverse=True)
    vals = np.bincount(rc_inv, weights=v_all)
    r_all, c_all = rc_u // n_col, rc_u % n_col
    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n_col, n_row
    peak_cost = np.tile(np.eye(1, S).ravel(), n_p) * (0.0 if n_e else 1.0)
    lp.col_cost_ = np.concatenate((np.zeros(n_x + 2 * n_y), peak_cost, np.ones(n_e)))
    lp.col_lower_ = np.zeros(n_col)
    lp.col_upper_ = np.concatenate((np.ones(n_x), np.full(2 * n_y + n_p * S + n_e, inf)))
    lp.row_lower_ = np.concatenate((np.ones(n_cells), np.zeros(2 * n_y), np.full(n_p * S + D * S + n_sh, -inf),
                                    np.zeros(n_p * (S - 1)), np.full(n_e, -inf)))
    lp.row_upper_ = np.concatenate((np.ones(n_cells), np.zeros(2 * n_y), np.zeros(n_p * S),
                                    np.repeat(capacity, S), np.zeros(n_sh), np.zeros(n_p * (S - 1)),
                                    paid[links] if n_e else np.zeros(0)))
    order = np.argsort(c_all, kind="stable")
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.concatenate(([0], np.cumsum(np.bincount(c_all, minlength=n_col)))).astype(np.int32)
    lp.a_matrix_.index_ = r_all[order].astype(np.int32)
    lp.a_matrix_.value_ = vals[order]
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n_col, n_row
    hops_up = np.array([len(v) for v in up_links])
    hops_dn = np.array([len(v) for v in dn_links])
    w_pair = e_u[wan_e] * D + e_d[wan_e]
    wan_cost = np.bincount(e_x[wan_e], weights=upk[e_row[wan_e]] * hops_up[w_pair] + dnk[e_row[wan_e]] * hops_dn[w_pair],
                           minlength=n_x)
    return _Built(lp, n_col, n_cells, x_start, x_dc, x_route, cell_key, cell_slot, lat_cost, wan_cost, links, P0,
                  R_L, S)


def _highs(built: _Built, solver: str):
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("solver", solver)
    h.passModel(built.lp)
    return h


def _solve_slot(rows: _Rows, t: int, capacity: np.ndarray, T: int, limit: np.ndarray, tie_break: str = "latency"):
    """One slot's latency-minimal placement with every link at most ``limit`` (``tie_break``
    "headroom": the one with the least WAN traffic, link by link, latency second); (x, loads,
    built) or (None, None, built) if the slot cannot fit."""
    import highspy

    built = _build(rows, rows.slot == t, capacity, T)
    lp = built.lp
    n_p = built.n_col - built.P0
    cost = np.zeros(built.n_col)
    if tie_break == "headroom":
        lat = built.lat_cost / max(float(built.lat_cost.max(initial=0.0)), 1e-9)
        cost[: len(built.lat_cost)] = built.wan_cost / max(float(built.wan_cost.max(initial=0.0)), 1e-9) + 1e-3 * lat
    else:
        cost[: len(built.lat_cost)] = built.lat_cost
    lp.col_cost_ = cost
    upper = np.asarray(lp.col_upper_).copy()
    upper[built.P0:] = limit[built.links]
    lp.col_upper_ = upper
    h = _highs(built, "simplex")
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None, None, built
    got = h.getSolution()
    sol = np.asarray(got.col_value)
    activity = np.asarray(got.row_value)
    # a link row holds sum(y, z) - P: its activity plus P is the link's load in this slot
    loads = np.zeros(rows.world.n_links)
    loads[built.links] = activity[built.R_L:built.R_L + n_p] + sol[built.P0:]
    return sol[: len(built.lat_cost)], loads, built


def world_pair_links(world: World) -> tuple[list, list]:
    """Per (user, DC) pair (u * D + d): the WAN links up and down, as arrays (cached on the world)."""
    cached = getattr(world, "_pair_links_cache", None)
    if cached is None:
        cached = _pair_links(world)
        world._pair_links_cache = cached
    return cached


def _runs(values: np.ndarray):
    """(start, end) of each run of equal consecutive values."""
    if not len(values):
        return
    cut = np.flatnonzero(np.diff(values)) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(values)]))
    yield from zip(starts.tolist(), ends.tolist())


def _check(h, name: str, stage: str) -> None:
    import highspy

    status = h.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        raise TitanError(f"{name}: the LP ({stage}) ended {h.modelStatusToString(status)}")


def _pair_links(world: World) -> tuple[list, list]:  # noqa: D401
    U, D = len(world.users), len(world.dcs)
    up = [np.asarray(world.up_links[p // D][p % D], dtype=np.int64) for p in range(U * D)]
    dn = [np.asarray(world.down_links[p // D][p % D], dtype=np.int64) for p in range(U * D)]
    return up, dn
