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
region.  That restriction (same placements, same mix) is the only approximation; it keeps
the LP at a few hundred thousand variables without leaving the tail unplanned, and a
configuration first seen on the day itself still finds its class.  The y/z variables keep
the matrix sparse: a placement touches one y per participant region instead of every link
on every path.

Tie-break: HiGHS returns some optimal vertex, often needlessly far; the LP is re-solved with
``sum_l P[l] <= (1+eps) P*`` added, minimising participants' total RTT.  The WAN-only variant
(``routes=(WAN,)``) is the same LP without Internet placements: peak-aware DC selection over
the private WAN, as Switchboard does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .placement import INTERNET, WAN, Options, Plan
from .regions import World
from .spec import TitanError
from .workload import Demand

_FRACTION_EPS = 1e-7


@dataclass
class DayProblem:
    """A day's demand (forecast or actual), the configurations planned on their own, capacities."""

    demand: Demand
    head: set[int]  # configurations with their own mix per slot; the rest share one per placement set
    capacity: np.ndarray  # [dc] participants


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
              solver: str = "ipm") -> Plan:
    """Solve one day's LP and return its plan (cells indexed by the day's slots, 0-based).

    ``solver``: HiGHS's ``ipm`` (interior point, then crossover to a vertex) or ``simplex``.
    Measured here on a WAN-only day (110 k variables): dual simplex 84 s, IPM 16 s."""
    import highspy

    t_start = time.perf_counter()
    dem = problem.demand
    U, D, T = len(world.users), len(world.dcs), dem.slots
    L = world.n_links
    plan = Plan(name)

    # plan keys: head configurations are their own key; the tail shares keys by placement set
    uniq_cfg, cfg_inv = np.unique(dem.config, return_inverse=True)
    key_of_cfg = np.empty(len(uniq_cfg), dtype=np.int64)
    placements: dict[int, list[tuple[int, int]]] = {}
    for i, k in enumerate(uniq_cfg.tolist()):
        pset = options.placement_set(k)
        allowed = [o for o in pset if o[1] in routes]
        if k in problem.head:
            key = k
        else:
            key = plan.class_of.get(pset)
            if key is None:
                key = plan.class_of[pset] = -1 - len(plan.class_of)
        key_of_cfg[i] = key
        placements[key] = allowed
    row_key = key_of_cfg[cfg_inv]
    # demand rows summed per (key, slot, region)
    keys_u, key_idx = np.unique(row_key, return_inverse=True)
    agg = (key_idx.astype(np.int64) * T + dem.slot) * U + dem.region
    agg_u, agg_inv = np.unique(agg, return_inverse=True)
    part = np.bincount(agg_inv, weights=dem.participants)
    upk = np.bincount(agg_inv, weights=dem.up_kbps)
    dnk = np.bincount(agg_inv, weights=dem.down_kbps)
    r_key = keys_u[agg_u // (T * U)]
    r_slot = (agg_u // U) % T
    r_reg = agg_u % U
    # cells: (key, slot); x per (cell, placement of the key)
    cell_code = (agg_u // U)  # key index * T + slot, sorted
    cells_u, r_cell = np.unique(cell_code, return_inverse=True)
    cell_key = keys_u[cells_u // T]
    cell_slot = cells_u % T
    n_opts = np.array([len(placements[int(k)]) for k in cell_key])
    if n_opts.min(initial=1) == 0:
        raise TitanError(f"{name}: a configuration has no placement on routes {routes}")
    x_start = np.concatenate(([0], np.cumsum(n_opts)))
    n_x = int(x_start[-1])
    n_cells = len(cells_u)
    x_cell = np.repeat(np.arange(n_cells), n_opts)
    x_pos = np.arange(n_x) - x_start[x_cell]
    x_dc = np.empty(n_x, dtype=np.int64)
    x_route = np.empty(n_x, dtype=np.int64)
    for c0, c1 in _runs(cell_key):
        opts = placements[int(cell_key[c0])]
        a, b = x_start[c0], x_start[c1]
        x_dc[a:b] = np.tile([o[0] for o in opts], c1 - c0)
        x_route[a:b] = np.tile([o[1] for o in opts], c1 - c0)

    # expand demand rows over their cell's placements: one entry per (row, x)
    per = n_opts[r_cell]
    e_row = np.repeat(np.arange(len(agg_u)), per)
    e_x = x_start[r_cell][e_row] + (np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per))
    e_d, e_r, e_u, e_t = x_dc[e_x], x_route[e_x], r_reg[e_row], r_slot[e_row]
    e_part = part[e_row]
    e_local = world.local[e_u, e_d]
    rtt = np.where(e_r == WAN, world.wan_rtt[e_u, e_d], world.inet_rtt[e_u, e_d])
    lat_cost = np.bincount(e_x, weights=e_part * rtt, minlength=n_x)

    # y/z: WAN traffic per (slot, user, DC)
    wan_e = (e_r == WAN) & ~e_local
    ykey = (e_t[wan_e] * U + e_u[wan_e]) * D + e_d[wan_e]
    yuniq, yinv = np.unique(ykey, return_inverse=True)
    n_y = len(yuniq)
    y_t, y_u, y_d = yuniq // (U * D), (yuniq // D) % U, yuniq % D
    up_links, dn_links = _pair_links(world)
    y_pair = y_u * D + y_d
    used = np.zeros(L, dtype=bool)
    for p in np.unique(y_pair):
        used[up_links[p]] = True
        used[dn_links[p]] = True
    links = np.flatnonzero(used)
    link_pos = -np.ones(L, dtype=np.int64)
    link_pos[links] = np.arange(len(links))
    n_p = len(links)

    # Internet share rows per (slot, user, DC), where some Internet placement exists
    cap = world.inet_cap[e_u, e_d]
    sh_e = ~e_local & (cap < 1.0) & ((e_r == INTERNET) | (INTERNET in routes))
    sh_key = (e_t * U + e_u) * D + e_d
    inet_keys = np.unique(sh_key[sh_e & (e_r == INTERNET)])
    sh_e &= np.isin(sh_key, inet_keys)
    sh_uniq, sh_row = np.unique(sh_key[sh_e], return_inverse=True)
    sh_val = e_part[sh_e] * np.where(e_r[sh_e] == INTERNET, 1.0 - cap[sh_e], -cap[sh_e])
    n_sh = len(sh_uniq)

    # columns: x, y, z, P; rows: cells (=1), y-def and z-def (=0), links (<=0), DCs (<=C), shares (<=0)
    X0, Y0, Z0, P0 = 0, n_x, n_x + n_y, n_x + 2 * n_y
    n_col = P0 + n_p
    R_Y, R_Z = n_cells, n_cells + n_y
    R_L = n_cells + 2 * n_y
    R_C = R_L + n_p * T
    R_S = R_C + D * T
    n_row = R_S + n_sh
    r_list, c_list, v_list = [], [], []

    def add(rows, cols, vals):
        r_list.append(np.asarray(rows, dtype=np.int64))
        c_list.append(np.asarray(cols, dtype=np.int64))
        v_list.append(np.broadcast_to(np.asarray(vals, dtype=np.float64), np.shape(rows)))

    add(x_cell, X0 + np.arange(n_x), 1.0)
    if n_y:
        add(R_Y + yinv, X0 + e_x[wan_e], -upk[e_row[wan_e]])
        add(R_Z + yinv, X0 + e_x[wan_e], -dnk[e_row[wan_e]])
        add(R_Y + np.arange(n_y), Y0 + np.arange(n_y), 1.0)
        add(R_Z + np.arange(n_y), Z0 + np.arange(n_y), 1.0)
        for lists, col0 in ((up_links, Y0), (dn_links, Z0)):
            lens = np.array([len(lists[p]) for p in y_pair])
            flat = np.concatenate([lists[p] for p in y_pair])
            yrep = np.repeat(np.arange(n_y), lens)
            add(R_L + link_pos[flat] * T + y_t[yrep], col0 + yrep, 1.0)
    lrow = np.arange(n_p * T)
    add(R_L + lrow, P0 + lrow // T, -1.0)
    add(R_C + e_d * T + e_t, X0 + e_x, e_part)
    if n_sh:
        add(R_S + sh_row, X0 + e_x[sh_e], sh_val)

    rows = np.concatenate(r_list)
    cols = np.concatenate(c_list)
    vals = np.concatenate(v_list)
    # (row, col) pairs repeat where several demand rows of one cell meet in one DC row: sum them
    rc = rows * n_col + cols
    rc_u, rc_inv = np.unique(rc, return_inverse=True)
    vals = np.bincount(rc_inv, weights=vals)
    rows, cols = rc_u // n_col, rc_u % n_col
    inf = highspy.kHighsInf
    row_lo = np.concatenate((np.ones(n_cells), np.zeros(2 * n_y), np.full(n_p * T + D * T + n_sh, -inf)))
    row_hi = np.concatenate((np.ones(n_cells), np.zeros(2 * n_y), np.zeros(n_p * T),
                             np.repeat(problem.capacity, T), np.zeros(n_sh)))
    col_hi = np.concatenate((np.ones(n_x), np.full(2 * n_y + n_p, inf)))
    cost = np.concatenate((np.zeros(n_x + 2 * n_y), np.ones(n_p)))

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("solver", solver)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n_col, n_row
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, np.zeros(n_col), col_hi
    lp.row_lower_, lp.row_upper_ = row_lo, row_hi
    order = np.argsort(cols, kind="stable")  # rc_u is sorted by row: stable keeps rows ascending
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.concatenate(([0], np.cumsum(np.bincount(cols, minlength=n_col)))).astype(np.int32)
    lp.a_matrix_.index_ = rows[order].astype(np.int32)
    lp.a_matrix_.value_ = vals[order]
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n_col, n_row
    build_s = time.perf_counter() - t_start
    h.passModel(lp)
    t1 = time.perf_counter()
    h.run()
    _check(h, name, "sum of peaks")
    peak_opt = float(h.getInfo().objective_function_value)
    solve1 = time.perf_counter() - t1
    t2 = time.perf_counter()
    if tie_break_eps is not None:
        p_idx = np.arange(P0, n_col, dtype=np.int32)
        h.addRow(-inf, peak_opt * (1 + tie_break_eps) + 1e-6, len(p_idx), p_idx, np.ones(len(p_idx)))
        h.changeColsCost(n_col, np.arange(n_col, dtype=np.int32),
                         np.concatenate((lat_cost, np.zeros(2 * n_y + n_p))))
        h.run()
        _check(h, name, "latency tie-break")
    solve2 = time.perf_counter() - t2
    sol = np.asarray(h.getSolution().col_value)
    x = np.clip(sol[:n_x], 0.0, 1.0)
    x[x < _FRACTION_EPS] = 0.0
    planned_peaks = np.zeros(L)
    planned_peaks[links] = sol[P0:]
    peaks_after = float(sol[P0:].sum())

    for c in range(n_cells):
        a, b = x_start[c], x_start[c + 1]
        f = x[a:b]
        keep = f > 0
        if not keep.any():
            keep[:] = True
            f = np.ones(b - a)
        plan.cells[(int(cell_key[c]), int(cell_slot[c]))] = (x_dc[a:b][keep], x_route[a:b][keep],
                                                            f[keep] / f[keep].sum())
    plan.solve_s = time.perf_counter() - t_start
    plan.stats = {
        "variables": int(n_col), "x_variables": int(n_x), "rows": int(n_row), "share_rows": int(n_sh),
        "nonzeros": int(len(vals)), "cells": int(n_cells), "configs": int(len(uniq_cfg)),
        "head_configs": int(sum(1 for k in uniq_cfg.tolist() if k in problem.head)),
        "tail_classes": len(plan.class_of), "links": int(n_p),
        "build_s": build_s, "solve_peaks_s": solve1, "solve_tiebreak_s": solve2,
        "planned_sum_of_peaks_kbps": peak_opt, "sum_of_peaks_after_tiebreak_kbps": peaks_after,
        "planned_peaks": planned_peaks,
        "split_cells": int(sum(1 for v in plan.cells.values() if len(v[0]) > 1)),
    }
    return plan


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


def _pair_links(world: World) -> tuple[list, list]:
    U, D = len(world.users), len(world.dcs)
    up = [np.asarray(world.up_links[p // D][p % D], dtype=np.int64) for p in range(U * D)]
    dn = [np.asarray(world.down_links[p // D][p % D], dtype=np.int64) for p in range(U * D)]
    return up, dn
