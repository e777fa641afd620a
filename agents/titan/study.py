"""The offline study: a week of synthetic calls over Azure regions, every policy, day by day.

How it fits: ``run_study`` builds the world (``study_world``, the one place it is built:
``regions.py``; ``testbed titan backbone`` shows its backbone), synthesises ``history_days``
plus ``days`` days of calls (``workload.py``), and for each evaluated day forecasts its
demand as the mean of the same kind of day (weekday/weekend) in the preceding
``history_days`` (with ``forecast_quantile`` q, the LPs plan on each (slot, region)'s
q-quantile of those days' traffic instead: ``workload.predict``).  Per day it solves Titan-Next's LP on the forecast and on the day's
actual demand (the oracle), and the WAN-only LP (Switchboard-like) on the forecast
(``lp.py``); the rule baselines need no solving.  The LPs plan configurations told apart
by media (``configs_by_media``).  With ``billing: period`` (the default) the evaluated days
are one billing period: each day's LPs count only each link's excess over the peak the
period has already paid (realised, from the days before), and may fill up to it.

Every plan is realised call by call with quota counters (greedy by its own share
counters); the LPs' plans, by default, through ``placement.realise_guarded``
(``realisation: guarded``): each call at the first placement, the quota counters' choice
first, that keeps the Internet share caps (as greedy counts them) and every WAN link within
the plan's peaks; ``capped`` keeps the caps alone, ``quota`` neither.  With ``move_at`` the
guarded realisation also re-realises at every slot boundary: WAN calls in progress that
cross a link near its limit move to the Internet where the caps allow (a migration each).  A plan on the
forecast realised by quota counters alone is overrun on any day busier than the mean.
Each policy's planned sum of peaks (on the demand it planned for: the forecast, or the
day's for the oracle) is reported beside the realised one.  The realisations of all days
are joined, and ``placement.evaluate`` measures them on the calls' real overlaps with the
slots: each WAN link's per-slot load, its peak per day and over the week, and their sums.

Policies (all on the same calls, latency rule, DC capacities and Internet share caps):

* ``nearest-wan``: every call at the DC with the lowest worst-participant RTT (the nearest
  DC for one-region calls, the participants' latency centroid otherwise), over the WAN;
* ``wan-lp``: the LP without Internet placements (peak-aware DC choice over the WAN);
* ``titan``: the nearest DC; a fixed fraction of the calls whose Internet placement is
  allowed go over the Internet (default: the cap);
* ``greedy-internet``: the nearest DC; over the Internet whenever allowed and within the
  paths' share caps, call by call;
* ``titan-next``: the LP on the forecast; ``titan-next-oracle``: on the day's actual demand.

``write_outputs`` puts ``summary.json``, CSVs and plots in a folder.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np

from agents.titan import lp
from agents.titan import workload as wl
from agents.titan.placement import (INTERNET, WAN, Evaluation, Options, PeakGuard, Realisation, evaluate, incidence,
                                    plan_loads, realise, realise_greedy, realise_plan, rule_plan)
from agents.titan.regions import World, build_world
from agents.titan.spec import StudySpec

POLICIES = ("nearest-wan", "wan-lp", "titan", "greedy-internet", "titan-next", "titan-next-oracle")
BASELINES = ("nearest-wan", "wan-lp", "titan", "greedy-internet")
PAPER_REDUCTION = 0.61


def study_world(spec: StudySpec) -> World:
    """The world the study plans and routes over: ``spec``'s users and DCs on the backbone of
    every region in the matrix (``spec.relay_factor``).  ``run_study`` builds it here, and
    ``testbed titan backbone`` shows its backbone from here too."""
    return build_world(spec.users, spec.dcs, spec.relay_factor, spec.targets, internet_cap=spec.internet_cap)


def run_study(spec: StudySpec, log: Callable[[str], None] | None = None, solver: str = "ipm") -> dict:
    """Run the study; returns a JSON-able summary (plus arrays under ``_arrays`` for plots)."""
    log = log or (lambda m: None)
    t_all = time.perf_counter()
    world = study_world(spec)
    H, N = spec.history_days, spec.days
    T = 1440 // spec.slot_minutes
    slot_s = spec.slot_minutes * 60.0
    log(f"{len(world.users)} user regions, {len(world.dcs)} DCs, backbone of {len(world.backbone.edges)} links "
        f"over {len(world.backbone.nodes)} regions")
    calls = wl.generate(world, spec.workload, H + N)
    configs = wl.Configs(by_media=spec.configs_by_media)
    cfg = configs.of_calls(calls)
    prov = configs.provisional_of_calls(calls)
    options = Options(world, configs, spec.latency)
    options.check_all(np.concatenate((cfg, prov)))  # one-line error if the latency bound is infeasible
    log(f"{len(calls)} synthetic calls over {H + N} days, {len(configs)} configurations")
    daily = [wl.demand(calls, cfg, d * wl.DAY_S, slot_s, T) for d in range(H + N)]
    capacity = lp.capacities(world, options, wl.demand(calls, cfg, 0.0, slot_s, T * (H + N)),
                             spec.capacity_headroom)
    t_eval = H * wl.DAY_S
    in_eval = calls.start_s >= t_eval
    ev_calls = calls.select(in_eval)
    ev_cfg, ev_prov = cfg[in_eval], prov[in_eval]
    all_cfg = np.concatenate((ev_cfg, ev_prov))
    real: dict[str, list[Realisation]] = {p: [] for p in POLICIES}
    solves: dict[str, list[dict]] = {p: [] for p in ("titan-next", "titan-next-oracle", "wan-lp")}
    rules = {"nearest-wan": rule_plan("nearest-wan", options, all_cfg, 0.0),
             "titan": rule_plan("titan", options, all_cfg, spec.titan_share)}
    guards = {name: PeakGuard(world, spec.guard_keeps_caps) for name in solves}
    incid = incidence(world)
    billed = {name: np.zeros((world.n_links, T * N)) for name in solves}  # realised so far, for the period's peaks
    planned: dict[str, list[float]] = {p: [] for p in POLICIES if p != "greedy-internet"}
    for e in range(H, H + N):
        t0 = e * wl.DAY_S
        day_mask = (ev_calls.start_s >= t0) & (ev_calls.start_s < t0 + wl.DAY_S)
        day = ev_calls.select(day_mask)
        dcfg, dprov = ev_cfg[day_mask], ev_prov[day_mask]
        past = [daily[d] for d in wl.same_kind_days(e, range(e - H, e))]
        forecast = wl.predict(past, t0)  # the rules' planned figure is on the mean
        plan_on = forecast if spec.forecast_quantile is None else wl.predict(past, t0, spec.forecast_quantile)
        for name, demand, routes in (("titan-next", plan_on, (WAN, INTERNET)),
                                     ("titan-next-oracle", daily[e], (WAN, INTERNET)),
                                     ("wan-lp", plan_on, (WAN,))):
            paid = billed[name][:, : (e - H) * T].max(axis=1) if spec.billing == "period" and e > H else None
            problem = lp.DayProblem(demand, lp.top_configs(demand, spec.max_configs), capacity, paid)
            plan = lp.solve_day(world, options, problem, name, routes, spec.tie_break_eps, solver=solver,
                                tie_break=spec.tie_break)
            stats = {k: v for k, v in plan.stats.items() if k not in ("planned_peaks", "peak_limits")}
            stats["day"] = e - H
            stats["solve_s"] = plan.solve_s
            solves[name].append(stats)
            log(f"day {e - H + 1}/{N}: {name} LP {plan.stats['variables']:,} variables, {plan.solve_s:.1f} s")
            planned[name].append(plan.stats["sum_of_peaks_after_tiebreak_kbps"])
            limits = plan.stats["planned_peaks"] if paid is None else plan.stats["peak_limits"]
            got = realise_plan(plan, options, day, dcfg, dprov, t0, slot_s, spec.realisation, guards[name], limits,
                               routes, spec.move_at)
            real[name].append(got)
            if spec.billing == "period":
                billed[name] += evaluate(world, options, day, dcfg, got, t_eval, slot_s, T * N, incid).link_load
        for name, plan in rules.items():
            planned[name].append(float(plan_loads(world, options, plan, forecast).max(axis=1).sum()))
            real[name].append(realise(plan, options, day, dcfg, dprov, t0, slot_s))
    real["greedy-internet"] = [realise_greedy(options, ev_calls, ev_cfg, ev_prov, t_eval, slot_s)]
    evals: dict[str, Evaluation] = {}
    for name in POLICIES:
        parts = real[name]
        offsets = np.cumsum([0] + [len(r.dc) for r in parts[:-1]])
        moves = np.concatenate([r.moves + np.array([off, 0, 0, 0]) for r, off in zip(parts, offsets)])
        joined = Realisation(*(np.concatenate([getattr(r, f) for r in parts]) for f in
                               ("dc", "route", "migrated", "planned")), moves=moves)
        evals[name] = evaluate(world, options, ev_calls, ev_cfg, joined, t_eval, slot_s, T * N, incid)
    summary = _summarise(spec, world, evals, solves, planned, capacity, len(ev_calls), len(configs), T)
    for name, g in guards.items():
        guarded = spec.realisation != "quota"
        summary["policies"][name]["guard_raised_calls"] = g.raised if guarded else None
        summary["policies"][name]["guard_over_cap_calls"] = g.over_cap if guarded else None
        summary["policies"][name]["moved_calls"] = g.moved if guarded else None
    summary["wall_s"] = time.perf_counter() - t_all
    summary["_arrays"] = {"evals": evals, "world": world, "slots_per_day": T, "slot_minutes": spec.slot_minutes}
    return summary


def _summarise(spec, world, evals, solves, planned, capacity, n_calls, n_configs, T) -> dict:
    out: dict = {
        "spec": json.loads(spec.model_dump_json()),
        "calls": n_calls, "configurations": n_configs, "user_regions": len(world.users), "dcs": len(world.dcs),
        "backbone_links": len(world.backbone.edges), "directed_links": world.n_links,
        "paper_reduction": PAPER_REDUCTION, "policies": {},
    }
    for name, ev in evals.items():
        per_day = ev.sum_of_peaks(T)
        rtt_w = _percentiles(ev, WAN)
        rtt_i = _percentiles(ev, INTERNET)
        out["policies"][name] = {
            "sum_of_peaks_week_kbps": ev.sum_of_peaks(), "sum_of_peaks_per_day_kbps": per_day.tolist(),
            "sum_of_peaks_day_mean_kbps": float(per_day.mean()),
            # what the plan expected on its own demand (the forecast; the oracle: the day's), fractions as
            # they are; greedy has no plan
            "planned_sum_of_peaks_per_day_kbps": planned.get(name),
            "planned_sum_of_peaks_day_mean_kbps": float(np.mean(planned[name])) if name in planned else None,
            "internet_share_calls": ev.internet_share_calls, "internet_share_traffic": ev.internet_share_traffic,
            "migrations": ev.migrations, "unplanned": ev.unplanned, "calls_over_latency_bound": ev.over_bound,
            "internet_cap_excess": ev.cap_excess,
            "dc_peak_utilisation": float((ev.dc_participants.max(axis=1) / capacity).max()),
            "dc_capacity_excess": float(np.maximum(ev.dc_participants - capacity[:, None], 0).sum()
                                        / ev.dc_participants.sum()),
            "rtt_ms_wan": rtt_w, "rtt_ms_internet": rtt_i,
        }
    tn = out["policies"]["titan-next"]
    red = {}
    for b in [p for p in evals if p != "titan-next"]:
        pb = out["policies"][b]
        red[b] = {
            "week": 1 - tn["sum_of_peaks_week_kbps"] / pb["sum_of_peaks_week_kbps"],
            "day_mean": 1 - tn["sum_of_peaks_day_mean_kbps"] / pb["sum_of_peaks_day_mean_kbps"],
            "day_max": float(max(1 - a / b_ for a, b_ in zip(tn["sum_of_peaks_per_day_kbps"],
                                                              pb["sum_of_peaks_per_day_kbps"]))),
        }
    out["titan_next_reduction"] = red
    out["solves"] = solves
    for name, rows in solves.items():
        t = [r["solve_s"] for r in rows]
        out.setdefault("solve_s", {})[name] = {"mean": float(np.mean(t)), "max": float(np.max(t)),
                                                "variables_mean": float(np.mean([r["variables"] for r in rows]))}
    return out


def _percentiles(ev: Evaluation, route: int) -> dict | None:
    sel = ev.latency_route == route
    if not sel.any():
        return None
    lat, w = ev.latency[sel], ev.latency_weight[sel]
    order = np.argsort(lat)
    cw = np.cumsum(w[order]) / w.sum()
    return {f"p{q}": float(lat[order][min(np.searchsorted(cw, q / 100), len(lat) - 1)]) for q in (50, 90, 95, 99)}


def write_outputs(summary: dict, out: Path) -> list[Path]:
    """summary.json, days.csv (each policy's realised and planned sum of peaks per day), peaks.csv,
    link_load_top.csv and the plots."""
    out.mkdir(parents=True, exist_ok=True)
    arrays = summary["_arrays"]
    evals: dict[str, Evaluation] = arrays["evals"]
    world = arrays["world"]
    T = arrays["slots_per_day"]
    written = []
    js = {k: v for k, v in summary.items() if k != "_arrays"}
    (out / "summary.json").write_text(json.dumps(js, indent=1))
    written.append(out / "summary.json")
    with open(out / "days.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["policy", "day", "sum_of_peaks_kbps", "planned_sum_of_peaks_kbps"])
        for name, p in js["policies"].items():
            plan = p["planned_sum_of_peaks_per_day_kbps"]  # greedy has none: empty
            for d, v in enumerate(p["sum_of_peaks_per_day_kbps"]):
                w.writerow([name, d, f"{v:.1f}", "" if plan is None else f"{plan[d]:.1f}"])
    written.append(out / "days.csv")
    with open(out / "peaks.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["policy", "link", "week_peak_kbps"])
        for name, ev in evals.items():
            for link, v in enumerate(ev.peaks()):
                if v > 0:
                    w.writerow([name, world.link_name(link), f"{v:.1f}"])
    written.append(out / "peaks.csv")
    top = np.argsort(-evals["nearest-wan"].peaks())[:8]
    with open(out / "link_load_top.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["policy", "link", "slot", "kbps"])
        for name, ev in evals.items():
            for link in top:
                for s, v in enumerate(ev.link_load[link]):
                    w.writerow([name, world.link_name(link), s, f"{v:.1f}"])
    written.append(out / "link_load_top.csv")
    from agents.titan.plots import study_plots

    written += study_plots(js, evals, world, T, arrays["slot_minutes"], top, out)
    return written
