"""Titan / Titan-Next benchmark: sums of WAN-link peaks against the Internet cap, the
latency slack, the local fraction, the slot length and the region mix, over several
workload seeds, with 95% confidence intervals (prints figures; not a pass/fail test).

    .venv/bin/python experiments/bench_titan.py [--users a,b,..] [--dcs a,b,..] [--days 5]
        [--calls-per-day 100000] [--seeds 1,2,3] [--sweeps cap,delta,local,slot,mix]
        [--out results/bench-titan] [--set key=value ...]

Every cell runs the offline study (``agents/titan/study.py``) once per seed on the same
regions, days and spec, changing one thing: ``cap`` sets ``internet_cap`` (and so Titan's
fixed fraction) to 0.3, 0.5, 0.7; ``delta`` sets ``latency.delta_ms`` to 10, 20, 40;
``local`` sets ``workload.local_fraction`` (the chance a participant is in the call's home
region) to 0.5, 0.7, 0.9; ``slot`` sets ``slot_minutes`` to 30, 60, 120; ``mix`` replaces
the regions (users and DCs both) by each of ``REGION_SETS`` (Americas, Europe, Asia-Pacific,
four continents).  The default regions are the eight Americas regions of the issue's kind
of run (8 user regions that are also the 8 DCs, Monday to Friday).  ``--set`` passes any
other spec field (``--set realisation=quota --set configs_by_media=false`` gives the study
before the realisation and media changes).  The Internet-minus-WAN RTT offsets are the
ones shipped in ``agents/titan/data/internet_vs_wan_offsets.csv``: the five region-group
pairs measured (WonderProxy against Azure's matrix, the only measurement in the project's
data), the other five assumed, as that file says.

Per cell it prints, for Titan-Next, Titan, greedy Internet and the oracle, the mean sum of
peaks over the evaluated days (each link's peak over the days, summed) with its 95%
interval over the seeds (Student's t), Titan-Next's reduction against Titan (per seed, then
the mean and interval), planned against realised per day, and the realised share of
Internet participant-time above the caps; writes ``results.csv`` (one row per cell, seed
and policy), ``summary.csv`` (one row per cell and policy: means with their 95%
intervals, and Titan-Next's reduction against that policy; on its own row, against the
better of Titan and greedy Internet), ``results.json`` and ``titan-sweeps.png`` to
``--out``.  ``--resummarise results.json`` writes ``summary.csv`` and the plot again from
an earlier run's cells, without running anything.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agents.bubbletea.backtoback import ci95  # noqa: E402  (Student's t interval of a mean)
from agents.titan.spec import StudySpec, TitanError, load_spec  # noqa: E402
from agents.titan.study import run_study  # noqa: E402

AMERICAS8 = "eastus,eastus2,centralus,southcentralus,westus2,westus3,canadacentral,brazilsouth"
REGION_SETS = {  # the 8-region sets docs/titan.md reports (users = DCs)
    "americas": AMERICAS8.split(","),
    "europe": "westeurope,northeurope,uksouth,francecentral,germanywestcentral,swedencentral,switzerlandnorth,"
              "italynorth".split(","),
    "asia-pacific": "eastasia,southeastasia,japaneast,japanwest,koreacentral,australiaeast,australiasoutheast,"
                    "centralindia".split(","),
    "four-continents": "eastus,westus2,brazilsouth,westeurope,uksouth,uaenorth,southafricanorth,japaneast".split(","),
}
# sweep -> (the spec field it sets, its values); "mix" sets users and DCs to a region set
SWEEPS = {"cap": ("internet_cap", (0.3, 0.5, 0.7)), "delta": ("latency.delta_ms", (10.0, 20.0, 40.0)),
          "local": ("workload.local_fraction", (0.5, 0.7, 0.9)), "slot": ("slot_minutes", (30, 60, 120)),
          "mix": ("regions", tuple(REGION_SETS))}
SHOWN = ("titan-next", "titan", "greedy-internet", "titan-next-oracle")


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _cell(base: dict, key: str, value: float, seeds: list[int]) -> dict:
    """One cell: the study per seed; per policy the week's sums, the days' planned and realised
    means and the cap excess, and Titan-Next's reduction against Titan per seed."""
    runs, failed = [], []
    change = ({"users": REGION_SETS[value], "dcs": REGION_SETS[value]} if key == "regions" else {key: value})
    for seed in seeds:
        spec = load_spec(StudySpec, None, {**base, **change, "workload.seed": seed})
        t = time.perf_counter()
        try:
            js = run_study(spec)
        except TitanError as exc:  # e.g. an LP HiGHS ends infeasible: say so, keep the other seeds
            failed.append({"seed": seed, "error": str(exc)})
            print(f"  {key} = {value}, seed {seed}: {exc}")
            continue
        runs.append({"seed": seed, "wall_s": time.perf_counter() - t, "policies": {
            name: {"week_gbps": p["sum_of_peaks_week_kbps"] / 1e6,
                   "day_gbps": p["sum_of_peaks_day_mean_kbps"] / 1e6,
                   "planned_day_gbps": (p["planned_sum_of_peaks_day_mean_kbps"] or 0) / 1e6 or None,
                   "cap_excess": p["internet_cap_excess"]}
            for name, p in js["policies"].items()}})
    red = [1 - r["policies"]["titan-next"]["week_gbps"] / r["policies"]["titan"]["week_gbps"] for r in runs]
    best = [1 - r["policies"]["titan-next"]["week_gbps"]
            / min(r["policies"]["titan"]["week_gbps"], r["policies"]["greedy-internet"]["week_gbps"]) for r in runs]
    return {"key": key, "value": value, "runs": runs, "failed": failed, "reduction_vs_titan": red,
            "reduction_mean": statistics.fmean(red) if red else None, "reduction_ci95": ci95(red),
            "reduction_vs_best_rule": best, "reduction_best_mean": statistics.fmean(best) if best else None,
            "reduction_best_ci95": ci95(best)}


def _print(cell: dict) -> None:
    runs = cell["runs"]
    print(f"{cell['key']} = {cell['value']} ({len(runs)} seeds, {sum(r['wall_s'] for r in runs):.0f} s"
          + (f"; {len(cell['failed'])} failed" if cell["failed"] else "") + ")")
    if not runs:
        return
    for name in SHOWN:
        week = [r["policies"][name]["week_gbps"] for r in runs]
        day = [r["policies"][name]["day_gbps"] for r in runs]
        plan = [r["policies"][name]["planned_day_gbps"] for r in runs]
        cap = [r["policies"][name]["cap_excess"] for r in runs]
        ci = ci95(week)
        ci_s = f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "[-]"
        plan_s = f"{statistics.fmean(plan):6.2f}" if all(p is not None for p in plan) else "     -"
        print(f"  {name:18s} week {statistics.fmean(week):6.2f} {ci_s:16s} day planned {plan_s} "
              f"realised {statistics.fmean(day):6.2f}  above caps {statistics.fmean(cap):.1%}")
    ci = cell["reduction_ci95"]
    print(f"  titan-next lower than titan by {cell['reduction_mean']:.1%}"
          + (f" (95% CI {ci[0]:.1%} to {ci[1]:.1%})" if ci else ""))
    ci = cell["reduction_best_ci95"]
    print(f"  titan-next lower than the better of titan and greedy by {cell['reduction_best_mean']:.1%}"
          + (f" (95% CI {ci[0]:.1%} to {ci[1]:.1%})" if ci else ""))


def _plot(cells: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({c["key"] for c in cells})
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        mine = [c for c in cells if c["key"] == key and c["runs"]]
        for name in SHOWN:
            xs, ys, err = [], [], []
            for i, c in enumerate(mine):
                week = [r["policies"][name]["week_gbps"] for r in c["runs"]]
                ci = ci95(week)
                xs.append(i if key == "regions" else c["value"])
                ys.append(statistics.fmean(week))
                err.append(0.0 if ci is None else (ci[1] - ci[0]) / 2)
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
        if key == "regions":
            ax.set_xticks(range(len(mine)), [c["value"] for c in mine], fontsize=7)
        ax.set_xlabel(key)
        ax.set_ylabel("sum of WAN-link peaks over the days (Gbit/s)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = out / "titan-sweeps.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _write_summary(cells: list[dict], path: Path) -> None:
    """One row per cell and policy: seeds, the sum of peaks over the days (mean, 95% interval),
    planned and realised per day, the share above the caps, and Titan-Next's reduction
    against that policy (per seed, then mean and interval); Titan-Next's own row has in
    their place its reduction against the better of Titan and greedy Internet."""
    def fmt(v):
        return "" if v is None else f"{v:.4f}"

    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["key", "value", "policy", "seeds", "week_gbps", "week_ci_lo", "week_ci_hi", "planned_day_gbps",
                    "realised_day_gbps", "cap_excess", "titan_next_below", "below_ci_lo", "below_ci_hi"])
        for c in cells:
            if not c["runs"]:
                continue
            tn = [r["policies"]["titan-next"]["week_gbps"] for r in c["runs"]]
            for name in c["runs"][0]["policies"]:
                ps = [r["policies"][name] for r in c["runs"]]
                week = [p["week_gbps"] for p in ps]
                ci = ci95(week) or [None, None]
                plan = [p["planned_day_gbps"] for p in ps]
                below = (c["reduction_vs_best_rule"] if name == "titan-next"
                         else [1 - a / b for a, b in zip(tn, week)])
                bci = ci95(below) or [None, None]
                w.writerow([c["key"], c["value"], name, len(ps), fmt(statistics.fmean(week)), fmt(ci[0]), fmt(ci[1]),
                            fmt(statistics.fmean(plan)) if all(p is not None for p in plan) else "",
                            fmt(statistics.fmean(p["day_gbps"] for p in ps)),
                            fmt(statistics.fmean(p["cap_excess"] for p in ps)),
                            fmt(statistics.fmean(below)), fmt(bci[0]), fmt(bci[1])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", default=AMERICAS8)
    ap.add_argument("--dcs", default=None, help="default: the user regions")
    ap.add_argument("--days", type=int, default=5)
    ap.add_argument("--calls-per-day", type=int, default=100_000)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--sweeps", default="cap,delta,local,slot,mix")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other spec field")
    ap.add_argument("--out", type=Path, default=Path("results/bench-titan"))
    ap.add_argument("--resummarise", type=Path, metavar="RESULTS_JSON",
                    help="write summary.csv and the plot again from an earlier run's results.json (no runs)")
    a = ap.parse_args()
    if a.resummarise:
        try:
            cells = json.loads(a.resummarise.read_text())["cells"]
        except (OSError, ValueError, KeyError) as exc:
            sys.exit(f"error: --resummarise {a.resummarise}: {exc}")
        for c in cells:
            c.setdefault("reduction_vs_best_rule", [
                1 - r["policies"]["titan-next"]["week_gbps"]
                / min(r["policies"]["titan"]["week_gbps"], r["policies"]["greedy-internet"]["week_gbps"])
                for r in c["runs"]])
        a.out.mkdir(parents=True, exist_ok=True)
        _write_summary(cells, a.out / "summary.csv")
        print(f"wrote {a.out / 'summary.csv'}, {_plot(cells, a.out)}")
        return
    users = [u for u in a.users.split(",") if u]
    base = {"users": users, "dcs": [d for d in (a.dcs or a.users).split(",") if d], "days": a.days,
            "workload.calls_per_day": a.calls_per_day}
    for item in a.set:
        key, sep, value = item.partition("=")
        if not sep:
            sys.exit(f"error: --set {item!r}: expected KEY=VALUE")
        base[key] = _value(value)
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s]
    except ValueError:
        sys.exit(f"error: --seeds {a.seeds!r}: expected comma-separated integers")
    unknown = [s for s in a.sweeps.split(",") if s not in SWEEPS]
    if unknown or not seeds:
        sys.exit(f"error: --sweeps: unknown {', '.join(unknown)} (known: {', '.join(SWEEPS)})" if unknown
                 else "error: --seeds: none given")
    a.out.mkdir(parents=True, exist_ok=True)
    cells = []
    try:
        for sweep in a.sweeps.split(","):
            key, values = SWEEPS[sweep]
            for v in values:
                cells.append(_cell(base, key, v, seeds))
                _print(cells[-1])
    except TitanError as exc:
        sys.exit(f"error: {exc}")
    with open(a.out / "results.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["key", "value", "seed", "policy", "week_gbps", "day_gbps", "planned_day_gbps", "cap_excess"])
        for c in cells:
            for r in c["runs"]:
                for name, p in r["policies"].items():
                    w.writerow([c["key"], c["value"], r["seed"], name, f"{p['week_gbps']:.4f}", f"{p['day_gbps']:.4f}",
                                "" if p["planned_day_gbps"] is None else f"{p['planned_day_gbps']:.4f}",
                                f"{p['cap_excess']:.5f}"])
    _write_summary(cells, a.out / "summary.csv")
    (a.out / "results.json").write_text(json.dumps({"base": base, "seeds": seeds, "cells": cells}, indent=1))
    print(f"wrote {a.out / 'results.csv'}, {a.out / 'summary.csv'}, {a.out / 'results.json'}, "
          f"{_plot(cells, a.out)}")


if __name__ == "__main__":
    main()
