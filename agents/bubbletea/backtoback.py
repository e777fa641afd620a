"""BubbleTea's headline figures: the same job with BubbleTea off and on, back to back.

How it fits: a run with BubbleTea on cannot measure its own cost (its unserved iterations
still carry the decoding and KV shipping of the served ones), so the training slowdown is
measured against runs of the same experiment (topology, seed, device) with
``bubbletea.enabled: false``, alternated with runs that serve every steady iteration
(``interleave: false``): off, on, off, on, ...  With ``--control`` each pair has a third
run, BubbleTea on with its chunks on devices of their own (``bubbletea.control``): the same
processes, messages and KV shipping, no device shared, so the slowdown splits into the
host's share (control over off) and the device's (on over control).  Each run is a
``testbed.run.runner.TrainingRun`` in ``OUT/off-<i>/``, ``OUT/on-<i>/`` (or ``OUT/control-<i>/``)
with its own metrics.json.  The result
(``OUT/backtoback.json``) holds per run the mean steady-state iteration time, and overall:

* ``training_slowdown``: mean iteration time of the on runs over that of the off runs, less
  1; per pair (on over its own off, less 1), and the pairs' mean with its 95% confidence
  interval (Student's t over the pairs: ``training_slowdown_ci95``; none for one pair);
* ``alignments``: the job settles, per run, into one of a few alignments of its pipelines
  (runs' mean iteration times cluster, 0.74 / 0.79 / 0.83 s for the emulated default here,
  wider apart than BubbleTea's effect); the runs are grouped where their sorted times jump by
  more than 2%, and ``training_slowdown_within_alignments`` is the slowdown inside each group,
  weighted by its runs, with a 95% interval from the pooled spread inside the groups.  It
  assumes BubbleTea does not change which alignment a run falls into; the pairs' figure
  above does not;
* ``utilization``: training busy + prefill busy over device time in the on runs (the
  union per worker and iteration; ``extension.summarise``), and training alone in the off runs;
* the serving figures of the on runs (``extension.serving_figures``): arrivals, admitted,
  completed, rejected with reasons, dropped, TTFT and TBT percentiles over completed
  requests, goodput under the SLO over all arrivals.

    python -m agents.bubbletea.backtoback experiments/bubbletea-emulated.yaml --pairs 2 --out results/bt-b2b
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

SERVING = ("requests_arrived", "requests_admitted", "requests_completed", "requests_rejected",
           "requests_in_flight_after_run", "accounting_exact", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
           "tbt_p50_s", "tbt_p90_s", "tbt_p99_s", "tpot_mean_s", "goodput_within_slo", "goodput_rps",
           "offered_rps", "bubble_time_filled", "bubble_time_filled_by_kind", "prefill_overruns", "prefill_start_after_wait",
           "prefill_dispatched_ahead", "prefill_share_of_device_time", "kv_bytes_mean",
           "kv_transfer_mean_s")


def arm(exp, on: bool, control: bool = False):
    """``exp`` with BubbleTea off, or on and serving every steady iteration (``control``: its
    chunks on devices of their own, ``bubbletea.control``)."""
    e = exp.model_copy(deep=True)
    e._origin, e._topo, e._topo_file, e._slots = exp._origin, exp._topo, exp._topo_file, exp._slots
    e.bubbletea.enabled = on
    e.bubbletea.interleave = False
    e.bubbletea.control = control
    return e


def back_to_back(exp, out: Path, pairs: int = 1, delay_backend: str = "auto",
                 log: Callable[[str], None] | None = None, control: bool = False) -> dict:
    from testbed.run.runner import TrainingRun

    say = log or (lambda m: None)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    arms = ("off", "on", "control") if control else ("off", "on")
    for i in range(pairs):
        for which in arms:
            on = which != "off"
            name = f"{which}-{i}"
            say(f"{exp.name}: BubbleTea {which} (pair {i + 1} of {pairs})")
            result = TrainingRun(arm(exp, on, which == "control"), out / name, delay_backend=delay_backend).run()
            s = result["summary"]
            times = [it["time_s"] for it in result["iterations"] if it["iteration"] in s["steady_state_iterations"]]
            row = {"run": name, "bubbletea": on, "control": which == "control",
                   "mean_iteration_time_s": s["mean_iteration_time_s"],
                   "iteration_times_s": times, "training_busy": s["mean_busy_fraction"],
                   "utilization": s.get("utilization_with_prefill") if on else s["mean_busy_fraction"],
                   "op_timing": (result.get("device") or {}).get("op_timing")}
            if which == "on":
                row.update({k: s.get(k) for k in SERVING})
                row["rejection_reasons"] = s.get("rejection_reasons")
            runs.append(row)
            say(f"  mean iteration {row['mean_iteration_time_s']:.4f} s, utilization {row['utilization']}")
    return summarise(exp, runs, out)


# Student's t, 97.5th percentile, for 1..30 degrees of freedom (a table: no SciPy for one quantile)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def _t975(df: int) -> float:
    """Student's t quantile for a two-sided 95% interval with ``df`` degrees of freedom."""
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.5 / df  # within 0.1% of the quantile past 30


def _arm(run: dict) -> str:
    """Which arm a run of ``back_to_back`` belongs to: off, on, or control."""
    return "control" if run.get("control") else ("on" if run["bubbletea"] else "off")


def ci95(values: list[float]) -> list[float] | None:
    """The 95% confidence interval of the mean of ``values`` (Student's t, two-sided); None
    for fewer than two."""
    n = len(values)
    if n < 2:
        return None
    half = _t975(n - 1) * statistics.stdev(values) / n ** 0.5
    mean = statistics.fmean(values)
    return [round(mean - half, 5), round(mean + half, 5)]


def alignments(times: list[float], gap: float = 0.02) -> list[list[float]]:
    """Runs' mean iteration times split where the sorted times jump by more than ``gap`` of
    their median: the alignments a job settles into (its pipelines' relative phase, fixed for
    a run), each a [low, high] range."""
    xs = sorted(times)
    if not xs:
        return []
    step = gap * statistics.median(xs)
    groups = [[xs[0], xs[0]]]
    for v in xs[1:]:
        if v - groups[-1][1] > step:
            groups.append([v, v])
        else:
            groups[-1][1] = v
    return groups


def within_alignments(runs: list[dict], arm: str, against: str = "off") -> dict:
    """The slowdown of ``arm`` over ``against`` within each alignment (runs grouped by
    ``alignments``), and their mean weighted by the runs in both, with a 95% interval from the
    pooled spread of the runs around their alignment's and arm's mean (Student's t); no interval
    where every cell holds one run."""
    groups = alignments([r["mean_iteration_time_s"] for r in runs])
    rows, resid = [], []
    for lo, hi in groups:
        cell = {k: [r["mean_iteration_time_s"] for r in runs if _arm(r) == k and lo <= r["mean_iteration_time_s"] <= hi]
                for k in ("off", "on", "control")}
        for vals in cell.values():
            if vals:
                mu = statistics.fmean(vals)
                resid += [v - mu for v in vals]
        a, b = cell[against], cell[arm]
        rows.append({"range_s": [round(lo, 4), round(hi, 4)], **{f"n_{k}": len(v) for k, v in cell.items()},
                     **{f"mean_{k}_s": round(statistics.fmean(v), 5) for k, v in cell.items() if v},
                     "slowdown": round(statistics.fmean(b) / statistics.fmean(a) - 1, 5) if a and b else None})
    used = [r for r in rows if r["slowdown"] is not None]
    if not used:
        return {"alignments": rows, "slowdown": None, "ci95": None}
    weights = [r[f"n_{arm}"] + r[f"n_{against}"] for r in used]
    mean = sum(w * r["slowdown"] for w, r in zip(weights, used)) / sum(weights)
    dof = len(resid) - sum(1 for r in rows for k in ("off", "on", "control") if r[f"n_{k}"])
    if dof < 1:  # one run per cell: no spread inside an alignment to judge by
        return {"alignments": rows, "slowdown": round(mean, 5), "ci95": None}
    sd = (sum(x * x for x in resid) / dof) ** 0.5
    var = sum(w * w * (sd / r[f"mean_{against}_s"]) ** 2 * (1 / r[f"n_{arm}"] + 1 / r[f"n_{against}"])
              for w, r in zip(weights, used)) / sum(weights) ** 2
    half = _t975(dof) * var ** 0.5
    return {"alignments": rows, "slowdown": round(mean, 5), "ci95": [round(mean - half, 5), round(mean + half, 5)],
            "pooled_sd_s": round(sd, 5)}


def summarise(exp, runs: list[dict], out: Path | None = None) -> dict:
    off, on, control = ([r for r in runs if _arm(r) == k] for k in ("off", "on", "control"))
    t_off = statistics.fmean(r["mean_iteration_time_s"] for r in off)
    t_on = statistics.fmean(r["mean_iteration_time_s"] for r in on)
    per_pair = [b["mean_iteration_time_s"] / a["mean_iteration_time_s"] - 1 for a, b in zip(off, on)]
    result = {
        "experiment": exp.name, "device": exp.device, "pairs": len(on),
        "time_dilation": getattr(exp, "time_dilation", 1.0),
        "mean_iteration_off_s": round(t_off, 5), "mean_iteration_on_s": round(t_on, 5),
        "training_slowdown": round(t_on / t_off - 1, 5),
        "training_slowdown_per_pair": [round(x, 5) for x in per_pair],
        "training_slowdown_pair_mean": round(statistics.fmean(per_pair), 5),
        "training_slowdown_ci95": ci95(per_pair),
        "utilization_off": round(statistics.fmean(r["utilization"] for r in off), 4),
        "utilization_on": round(statistics.fmean(r["utilization"] for r in on), 4),
        "runs": runs,
    }
    if control:  # the host's share (control over off) and the device's (on over control), per pair
        host = [c["mean_iteration_time_s"] / a["mean_iteration_time_s"] - 1 for a, c in zip(off, control)]
        device = [b["mean_iteration_time_s"] / c["mean_iteration_time_s"] - 1 for b, c in zip(on, control)]
        result.update({
            "mean_iteration_control_s": round(statistics.fmean(r["mean_iteration_time_s"] for r in control), 5),
            "host_slowdown_per_pair": [round(x, 5) for x in host], "host_slowdown_pair_mean": round(statistics.fmean(host), 5),
            "host_slowdown_ci95": ci95(host),
            "device_slowdown_per_pair": [round(x, 5) for x in device],
            "device_slowdown_pair_mean": round(statistics.fmean(device), 5), "device_slowdown_ci95": ci95(device)})
    # the job settles into one of a few alignments per run (its pipelines' relative phase):
    # the slowdown within an alignment, apart from which alignment a run fell into
    aligned = within_alignments(runs, "on")
    result.update({"alignments": aligned["alignments"], "training_slowdown_within_alignments": aligned["slowdown"],
                   "training_slowdown_within_alignments_ci95": aligned["ci95"]})
    if control:
        host_aligned = within_alignments(runs, "control")
        result.update({"host_slowdown_within_alignments": host_aligned["slowdown"],
                       "host_slowdown_within_alignments_ci95": host_aligned["ci95"]})
    if out is not None:
        (out / "backtoback.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> int:
    from testbed.spec.experiment import load_experiment

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment")
    ap.add_argument("--pairs", type=int, default=1, help="off/on pairs, alternated")
    ap.add_argument("--out", default="results/bubbletea-backtoback")
    ap.add_argument("--delay-backend", default="auto")
    ap.add_argument("--rate-scale", type=float, help="arrivals x this instead of the experiment's rate_scale")
    ap.add_argument("--control", action="store_true", help="a third arm per pair: BubbleTea on, its chunks on "
                    "devices of their own (the host's share of the slowdown; device: emulated)")
    ap.add_argument("--time-dilation", type=float, help="k instead of the experiment's time_dilation "
                    "(device: emulated; figures in emulated seconds)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the experiment, as testbed run's --set "
                         "(e.g. parallel.slow_start_after_idle=false)")
    args = ap.parse_args()
    overrides = list(args.set) + ([] if args.time_dilation is None else [f"time_dilation={args.time_dilation:g}"])
    exp = load_experiment(args.experiment, overrides)
    if args.rate_scale is not None:
        exp.bubbletea.rate_scale = args.rate_scale
    r = back_to_back(exp, Path(args.out), args.pairs, args.delay_backend, log=lambda m: print(m, flush=True),
                     control=args.control)
    ci = r["training_slowdown_ci95"]
    print(f"off {r['mean_iteration_off_s']:.4f} s, on {r['mean_iteration_on_s']:.4f} s: slowdown "
          f"{100 * r['training_slowdown']:+.2f}% (per pair "
          f"{', '.join(f'{100 * x:+.2f}%' for x in r['training_slowdown_per_pair'])}"
          + (f"; pairs' mean {100 * r['training_slowdown_pair_mean']:+.2f}%, 95% CI "
             f"{100 * ci[0]:+.2f}% to {100 * ci[1]:+.2f}%" if ci else "") + "); "
          f"utilization {r['utilization_off']:.3f} -> {r['utilization_on']:.3f}")
    if r["training_slowdown_within_alignments"] is not None:
        ci = r["training_slowdown_within_alignments_ci95"]
        print(f"within an alignment ({len(r['alignments'])} alignments: "
              + ", ".join(f"{a['range_s'][0]:.3f}-{a['range_s'][1]:.3f} s" for a in r["alignments"])
              + f"): slowdown {100 * r['training_slowdown_within_alignments']:+.2f}%"
              + (f", 95% CI {100 * ci[0]:+.2f}% to {100 * ci[1]:+.2f}%" if ci else " (one run per cell: no interval)"))
    for part in ("host", "device") if args.control else ():
        ci = r[f"{part}_slowdown_ci95"]
        print(f"{part}'s share: pairs' mean {100 * r[f'{part}_slowdown_pair_mean']:+.2f}%"
              + (f", 95% CI {100 * ci[0]:+.2f}% to {100 * ci[1]:+.2f}%" if ci else ""))
    last = [x for x in r["runs"] if x["bubbletea"] and not x["control"]][-1]
    print("serving (last on run): " + ", ".join(f"{k} {last.get(k)}" for k in SERVING))
    print(f"results: {args.out}/backtoback.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
