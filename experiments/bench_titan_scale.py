"""Titan-Next's LP: solve time against regions x slots x configurations, one command.

    .venv/bin/python experiments/bench_titan_scale.py [--regions 8,21,54] [--slot-minutes 60,30]
        [--max-configs 100,200,400] [--calls-per-day 100000] [--seed 1] [--out results/bench-titan-scale]

How it fits: for each region count N, the world is N user regions over min(N, 21) DCs (the
first N of the 21 default DCs, users = DCs, for N <= 21; every region in the matrix as users
and the 21 default DCs for N = 54, the study's default), and one week of history plus the
evaluated weekday (a Monday after it) is synthesised once (``workload.generate``).  Then for
each slot length and each ``max_configs`` (configurations planned one by one; the rest share
a mix per allowed-placement class) the weekday's Titan-Next LP on its forecast is solved by
``lp.solve_day`` exactly as ``study.run_study`` solves it (IPM, headroom tie-break, the
shipped spec otherwise), and its wall and CPU time, the peaks LP's and the slot LPs' times,
the peaks LP's columns and the planned sum of peaks are recorded.  Writes ``scale.csv`` and
``scale.png`` (time against peaks-LP columns) to ``--out`` (``scale.csv`` after every
point, so an interrupted run keeps what it measured; ``--replot scale.csv`` draws the plot
from it); prints one line per point.
Timings are the machine's: say which machine, and its load, with them.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agents.titan import lp  # noqa: E402
from agents.titan import workload as wl  # noqa: E402
from agents.titan.placement import INTERNET, WAN, Options  # noqa: E402
from agents.titan.regions import build_world  # noqa: E402
from agents.titan.spec import DEFAULT_DCS, StudySpec, TitanError, load_spec  # noqa: E402

FIELDS = ("regions", "users", "dcs", "slot_minutes", "max_configs", "configs_in_forecast", "head", "tail_classes",
          "peaks_lp_columns", "placements", "wall_s", "cpu_s", "peaks_lp_s", "slot_lps_s", "fallback",
          "planned_sum_of_peaks_gbps", "load_avg_1m")


def _world_for(n: int, spec: StudySpec):
    """N user regions and their DCs: users = DCs = the first N default DCs up to 21; all the
    matrix's regions over the 21 default DCs beyond."""
    if n <= len(DEFAULT_DCS):
        users = dcs = list(DEFAULT_DCS[:n])
    else:
        users, dcs = None, list(DEFAULT_DCS)
    world = build_world(users, dcs, spec.relay_factor, spec.targets, internet_cap=spec.internet_cap)
    if users is None and len(world.users) != n:
        raise TitanError(f"--regions: {n}: the matrix has {len(world.users)} regions (use <= 21 or "
                         f"{len(world.users)})")
    return world


def run_point(world, spec: StudySpec, calls, slot_minutes: int, max_configs: int) -> dict:
    """One grid point: the evaluated weekday's LP on its forecast; a row of ``FIELDS``."""
    H = spec.history_days
    T = 1440 // slot_minutes
    slot_s = slot_minutes * 60.0
    configs = wl.Configs(by_media=spec.configs_by_media)
    cfg = configs.of_calls(calls)
    opts = Options(world, configs, spec.latency)
    daily = [wl.demand(calls, cfg, d * wl.DAY_S, slot_s, T) for d in range(H + 1)]
    forecast = wl.predict([daily[d] for d in wl.same_kind_days(H, range(H))], H * wl.DAY_S)
    cap = lp.capacities(world, opts, wl.demand(calls, cfg, 0.0, slot_s, T * (H + 1)), spec.capacity_headroom)
    cpu0 = time.process_time()
    plan = lp.solve_day(world, opts, lp.DayProblem(forecast, lp.top_configs(forecast, max_configs), cap),
                        "titan-next", (WAN, INTERNET), spec.tie_break_eps, tie_break=spec.tie_break)
    cpu = time.process_time() - cpu0
    rounds = plan.stats["rounds"]
    return {"regions": len(world.users), "users": len(world.users), "dcs": len(world.dcs),
            "slot_minutes": slot_minutes, "max_configs": max_configs, "configs_in_forecast": plan.stats["configs"],
            "head": plan.stats["head_configs"], "tail_classes": plan.stats["tail_classes"],
            "peaks_lp_columns": plan.stats["master_variables"], "placements": plan.stats["variables"],
            "wall_s": round(plan.solve_s, 2), "cpu_s": round(cpu, 2),
            "peaks_lp_s": round(sum(r["master_s"] for r in rounds), 2),
            "slot_lps_s": round(sum(r["slots_s"] for r in rounds), 2),
            "fallback": ",".join(str(r["fallback"]) for r in rounds if r["fallback"]) or "",
            "planned_sum_of_peaks_gbps": round(plan.stats["planned_sum_of_peaks_kbps"] / 1e6, 4),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def _plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for sm in sorted({r["slot_minutes"] for r in rows}):
        for n in sorted({r["regions"] for r in rows}):
            pts = sorted((r["peaks_lp_columns"], r["wall_s"]) for r in rows
                         if r["slot_minutes"] == sm and r["regions"] == n)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{n} regions, {sm}-min slots")
    ax.axhline(60, color="grey", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("peaks-LP columns")
    ax.set_ylabel("a day's LP, wall (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "scale.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ints(text: str, flag: str) -> list[int]:
    try:
        got = [int(v) for v in text.split(",") if v]
    except ValueError:
        sys.exit(f"error: {flag} {text!r}: expected comma-separated integers")
    if not got:
        sys.exit(f"error: {flag}: none given")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regions", default="8,21,54")
    ap.add_argument("--slot-minutes", default="60,30")
    ap.add_argument("--max-configs", default="100,200,400")
    ap.add_argument("--calls-per-day", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results/bench-titan-scale"))
    ap.add_argument("--replot", type=Path, metavar="SCALE_CSV", help="draw scale.png again from a scale.csv (no runs)")
    a = ap.parse_args()
    if a.replot:
        try:
            with open(a.replot, newline="") as fh:
                rows = [{k: float(v) if k in ("peaks_lp_columns", "wall_s")
                         else int(v) if k in ("regions", "slot_minutes") else v for k, v in r.items()}
                        for r in csv.DictReader(fh)]
        except (OSError, ValueError) as exc:
            sys.exit(f"error: --replot {a.replot}: {exc}")
        a.out.mkdir(parents=True, exist_ok=True)
        print(f"wrote {_plot(rows, a.out)}")
        return
    regions, slots, heads = (_ints(a.regions, "--regions"), _ints(a.slot_minutes, "--slot-minutes"),
                             _ints(a.max_configs, "--max-configs"))
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for n in regions:
            spec = load_spec(StudySpec, None, {"days": 1, "workload.calls_per_day": a.calls_per_day,
                                               "workload.seed": a.seed})
            world = _world_for(n, spec)
            calls = wl.generate(world, spec.workload, spec.history_days + 1)
            for sm in slots:
                for m in heads:
                    rows.append(run_point(world, spec, calls, sm, m))
                    r = rows[-1]
                    print(f"{r['users']} users, {r['dcs']} DCs, {sm}-min slots, {m} configurations alone "
                          f"({r['tail_classes']} tail classes): {r['peaks_lp_columns']:,} columns, "
                          f"{r['wall_s']:.1f} s wall ({r['peaks_lp_s']:.1f} peaks LP + {r['slot_lps_s']:.1f} slot LPs), "
                          f"{r['cpu_s']:.1f} s CPU, load {r['load_avg_1m']}", flush=True)
                    with open(a.out / "scale.csv", "w", newline="") as fh:
                        w = csv.DictWriter(fh, fieldnames=FIELDS)
                        w.writeheader()
                        w.writerows(rows)
    except TitanError as exc:
        sys.exit(f"error: {exc}")
    print(f"wrote {a.out / 'scale.csv'}, {_plot(rows, a.out)}")


if __name__ == "__main__":
    main()
