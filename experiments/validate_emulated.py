"""The simulator against emulated-device runs: issue #30's validation matrix, resumable.

    .venv/bin/python experiments/validate_emulated.py [--out DIR] [--plan | --reuse]
        [--rtt 5,50,150,250] [--pipelines 1,4,8] [--message-bdp 1,10,100]
        [--hosts default,tuned] [--sharing fair,temporal] [--max-cell-seconds S]
        [--iterations N] [--model default|no-window|fair-window|fifo-window|packets]
        [--repeats R] [--profile] [--seeds K]

How it fits: ``validation_matrix.py`` says what each cell is (the matrix, its link rates and
messages, its experiment file) and what it will cost; this command plans, runs and reports.
Each cell runs once (``--repeats``: R times) on the emulator (``TrainingRun``, ``device:
emulated``: the devices' times are the experiment's, late only by the host's wake-ups, so what
differs is mostly the network's model) into ``DIR/<cell>/``, and the simulator predicts the
same experiment (the devices' own times, or with ``--profile`` the run's; with temporal
sharing, the plan the run's Atlas controller published, through the extension's ``predict``
hook).

* Resumable: a cell whose folder holds ``metrics.json`` is finished and is not run again (a
  folder without it, a run cut short, is run afresh); ``--reuse`` runs nothing and predicts
  the finished cells again (after a change to the simulator, say).
* ``--plan`` runs nothing: it prints each selected cell's estimated emulated duration (the
  simulator's own iteration time x iterations, plus start-up) and the total.
* ``--max-cell-seconds S`` leaves out the cells whose estimate exceeds S, and says which.
* Before each run it prints the cell's estimate; at the end the mean and the largest
  |error| over the finished cells against the bar (mean <= 3%, max <= 6%, Phantora's
  figures), and writes ``DIR/validate_emulated.csv`` and ``DIR/validate_emulated.md`` (every
  selected cell: its settings, the link's rate, its estimate, and its figures or why it has
  none).
* ``--model`` picks the simulator's network model: ``default`` is the experiment as it stands,
  i.e. the simulator's default, which since 2026-12-06 runs the window model
  (``sim.tcp_window_model``: slow start, cwnd validation, the restart after idle) on hosts
  with Linux's ``tcp_slow_start_after_idle = 1`` and not on WAN-tuned ones (this matrix chose
  that: ``build.window_model``); ``no-window`` turns the window model off everywhere (the
  fluid model alone, the default before); ``fair-window`` keeps the experiment's sharing and
  turns the window model on for every host (on WAN-tuned hosts it changes nothing here, so
  it reads as ``default``); ``fifo-window`` predicts with ``sim.sharing: fifo-bursts`` and the
  window model instead of the experiment's own (fair sharing); ``spread[=SIGMA]`` predicts with
  ``sim.sharing: spread`` (flows weighted by lognormal draws, unequal over a message); temporal
  cells keep Atlas's policy.

* Noise, on both sides: ``--repeats R`` runs each cell R times (``DIR/<cell>.run<k>`` beside
  the first) and compares the simulator with their mean, the runs' range beside it; with
  several pipelines sharing a link from a cold start the runs differ (slow starts end by
  HyStart's delay test or by loss depending on how the first bursts met at the queue, and
  CUBIC carries that into later iterations).  ``--profile`` predicts each run from its own
  profile (``testbed sim --profile``: op times drawn from what the run measured, its first
  iterations replayed, its per-message latency); ``--seeds K`` simulates each run K times
  and takes the mean (the seeds differ where ops are drawn or links have loss or jitter).
  Every run is simulated for as many iterations as it had, and averaged over the iterations
  its own figure counted (``compare.predict_seeds``).  With several runs each cell's error comes
  with an interval, +- 2 standard errors of the two means (``error_se`` in the CSV), and the
  last line says how many cells lie within the 6% bar all the way, beyond it all the way, and
  undecided: a cell whose runs differ by several percent (default hosts' restarts after idle
  near the RTO, pipelines that meet at a gateway in another order) misses or meets the bar
  on a few runs by chance, and more runs decide it.

The earlier 12-cell matrix (4.2 ms, 100 Mbit/s, fair) is ``--rtt 4.2 --message-bdp 10,100
--sharing fair``: the same experiments, its old run folders read as those cells'.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import math
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import validation_matrix as vm  # noqa: E402

BAR_MEAN, BAR_MAX = 0.03, 0.06
CSV_NAME, MD_NAME = "validate_emulated.csv", "validate_emulated.md"


def _numbers(text: str, kind: type, flag: str) -> tuple:
    try:
        return tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"validate_emulated: {flag} {text!r}: give {kind.__name__}s separated by commas") from None


def _words(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _with_model(exp, model: str, ssthresh: int | None = None, hystart: bool | None = None):
    if hystart is not None:  # --hystart: CUBIC's HyStart in the window model (sim.tcp_hystart)
        exp = exp.model_copy(update={"sim": exp.sim.model_copy(update={"tcp_hystart": hystart})})
    if ssthresh is not None:  # --ssthresh: HyStart's threshold as a given (sim.tcp_ssthresh_segments)
        exp = exp.model_copy(update={"sim": exp.sim.model_copy(update={"tcp_ssthresh_segments": ssthresh})})
    if model == "default":
        return exp
    if model in ("no-window", "fair-window"):
        window = model == "fair-window"
        return exp.model_copy(update={"sim": exp.sim.model_copy(update={"tcp_window_model": window})})
    if model == "packets":  # every WAN message as TCP segments (sim.sharing: packets; testbed/sim/packets.py)
        return exp.model_copy(update={"sim": exp.sim.model_copy(update={"sharing": "packets"})})
    if model.startswith("spread"):  # spread[=SIGMA]: fair sharing unequal over a message (SpreadPolicy)
        update = {"sharing": "spread"}
        if "=" in model:
            update["share_spread"] = float(model.split("=", 1)[1])
        return exp.model_copy(update={"sim": exp.sim.model_copy(update=update)})
    sim = exp.sim.model_copy(update={"sharing": "fifo-bursts", "tcp_window_model": True})
    return exp.model_copy(update={"sim": sim})


def _run_dir(out: Path, cell: vm.Cell, repeat: int = 1) -> Path:
    """The cell's run folder: its own, or the earlier matrix's where that one is finished;
    ``repeat`` k > 1: ``<cell>.run<k>`` (``--repeats``)."""
    if repeat > 1:
        return out / f"{cell.name}.run{repeat}"
    legacy = cell.legacy_name
    if legacy and (out / legacy / "metrics.json").exists() and not (out / cell.name / "metrics.json").exists():
        return out / legacy
    return out / cell.name


def _predict(exp, run_dir: Path, iterations: int, profile: bool = False, seeds: int = 1) -> list[float]:
    """The simulated mean steady iteration of the run in ``run_dir``, once per seed (the
    experiment's own seed first), over the iterations the run's figure counted
    (``compare.predict_seeds``; ``iterations`` where the run kept no metrics).  ``profile``: the
    devices' times and the per-message latency are the run's own, as ``testbed sim --profile``
    reads them, so seeds differ; otherwise the experiment's exact device times."""
    from testbed.run.compare import predict_seeds

    return predict_seeds(exp, run_dir, iterations, seeds, profile)


def _plan(selected: list[vm.Cell], out: Path, iterations: int) -> dict[str, float]:
    """Each cell's estimated emulated duration (s), by name."""
    from testbed.extension import simulator_options
    from testbed.spec.experiment import load_experiment

    specs = out / "specs"
    estimates = {}
    for cell in selected:
        exp = load_experiment(vm.write_experiment(cell, specs, iterations))
        estimates[cell.name] = vm.estimate_s(exp, iterations, simulator_options(exp))
    return estimates


def _fmt_s(s: float) -> str:
    return f"{s:.0f} s" if s < 3600 else f"{s / 3600:.1f} h"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/validate_emulated"))
    ap.add_argument("--plan", action="store_true", help="print each cell's estimated duration and the total; run nothing")
    ap.add_argument("--reuse", action="store_true", help="run nothing: predict the finished cells in --out again")
    ap.add_argument("--rtt", default=",".join(f"{v:g}" for v in vm.RTTS_MS), help="round trips, ms")
    ap.add_argument("--pipelines", default=",".join(map(str, vm.PIPELINES)))
    ap.add_argument("--message-bdp", default=",".join(f"{v:g}" for v in vm.MESSAGE_BDP))
    ap.add_argument("--hosts", default=",".join(vm.HOSTS))
    ap.add_argument("--sharing", default=",".join(vm.SHARING))
    ap.add_argument("--max-cell-seconds", type=float, default=None,
                    help="leave out cells whose estimated emulated duration exceeds this")
    ap.add_argument("--iterations", type=int, default=5, help="per run (the first 2 are warm-up)")
    ap.add_argument("--model", default="default",
                    help="the simulator's network model for the predictions: default (the simulator's own, the "
                         "window model on hosts with Linux's slow start after idle), no-window (the window model "
                         "off, the default before 2026-12-06), fair-window, fifo-window, packets (sim.sharing: "
                         "packets, a packet-level TCP), or spread[=SIGMA] (sim.sharing: spread, sim.share_spread: SIGMA)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="emulator runs per cell (the first in DIR/<cell>, the others in DIR/<cell>.run<k>): the "
                         "cell's measured figure is their mean, its spread beside it")
    ap.add_argument("--profile", action="store_true",
                    help="predict each run from its own profile (its devices' times drawn from what it measured "
                         "and its per-message latency, as `testbed sim --profile`), not the experiment's exact times")
    ap.add_argument("--seeds", type=int, default=1,
                    help="simulations per run with seeds seed, seed+1, ...: the prediction is their mean, their "
                         "range beside it (they differ where ops are drawn: --profile, or links with loss or jitter)")
    ap.add_argument("--ssthresh", type=int, default=None,
                    help="sim.tcp_ssthresh_segments for the predictions (the window model's slow-start threshold "
                         "from the start, standing in for HyStart's exit; default: infinite)")
    ap.add_argument("--hystart", choices=("on", "off"), default=None,
                    help="sim.tcp_hystart for the predictions (CUBIC's HyStart ends the window model's slow "
                         "start; default: the simulator's own)")
    args = ap.parse_args(argv)
    if args.model not in ("default", "no-window", "fair-window", "fifo-window", "packets") and not \
            re.fullmatch(r"spread(=[0-9.]+)?", args.model):
        raise SystemExit(f"validate_emulated: --model {args.model!r}: choose default, no-window, fair-window, "
                         f"fifo-window, packets or spread[=SIGMA]")
    if args.plan and args.reuse:
        raise SystemExit("validate_emulated: --plan and --reuse exclude each other")
    if args.repeats < 1 or args.seeds < 1:
        raise SystemExit("validate_emulated: --repeats and --seeds must be at least 1")
    if args.iterations < 3:
        raise SystemExit("validate_emulated: --iterations must be at least 3 (2 are warm-up)")
    try:
        selected = vm.cells(_numbers(args.rtt, float, "--rtt"), _numbers(args.pipelines, int, "--pipelines"),
                            _numbers(args.message_bdp, float, "--message-bdp"), _words(args.hosts),
                            _words(args.sharing))
    except ValueError as e:
        raise SystemExit(f"validate_emulated: --{e}") from None
    if not selected:
        raise SystemExit("validate_emulated: the selection is empty")
    if not args.plan:
        args.out.mkdir(parents=True, exist_ok=True)

    if args.plan:  # (nothing written to --out)
        with tempfile.TemporaryDirectory() as tmp:
            estimates = _plan(selected, Path(tmp), args.iterations)
    else:
        estimates = _plan(selected, args.out, args.iterations)
    finished = {c.name for c in selected if (_run_dir(args.out, c) / "metrics.json").exists()}
    skipped = {c.name: f"estimated {_fmt_s(estimates[c.name])} > --max-cell-seconds {args.max_cell_seconds:g}"
               for c in selected if args.max_cell_seconds is not None and estimates[c.name] > args.max_cell_seconds
               and c.name not in finished}
    todo = [c for c in selected if c.name not in skipped]
    missing = [(c, k) for c in sorted(todo, key=lambda c: estimates[c.name]) for k in range(1, args.repeats + 1)
               if not (_run_dir(args.out, c, k) / "metrics.json").exists()]
    print(f"{len(selected)} cell(s) selected, {len(finished)} finished, {len(skipped)} left out by "
          f"--max-cell-seconds; estimated emulated time of the rest to run: "
          f"{_fmt_s(sum(estimates[c.name] for c, _ in missing))} "
          f"(all selected: {_fmt_s(sum(estimates.values()) * args.repeats)})", flush=True)
    for name, why in skipped.items():
        print(f"  skipped {name}: {why}")
    if args.plan:
        for c in sorted(selected, key=lambda c: estimates[c.name]):
            state = "finished" if c.name in finished else ("skipped" if c.name in skipped else "to run")
            print(f"  {c.name:<36} {c.rate_mbps:>5g} Mbit/s {c.message_bytes:>10} B  estimated "
                  f"{_fmt_s(estimates[c.name]):>8}  {state}")
        return 0

    from testbed.spec.experiment import load_experiment

    failed: dict[str, str] = {}
    if not args.reuse:
        from testbed.cliutil import on_sigterm
        from testbed.run.runner import TrainingRun

        # SIGTERM unwinds as Ctrl-C does, so the run under way removes its network and processes
        # (killed outright, it left its delay lines and Atlas agents for `testbed clean`)
        signal.signal(signal.SIGTERM, on_sigterm)
        for c, k in missing:
            if c.name in failed:
                continue
            run_dir = args.out / c.name if k == 1 else _run_dir(args.out, c, k)
            if run_dir.exists():  # a run cut short: its folder has no metrics.json
                shutil.rmtree(run_dir)
            print(f"  running {c.name}{f' (run {k} of {args.repeats})' if args.repeats > 1 else ''} "
                  f"({c.rate_mbps:g} Mbit/s, {c.message_bytes} B messages): estimated "
                  f"{_fmt_s(estimates[c.name])}", flush=True)
            exp = load_experiment(vm.write_experiment(c, args.out / "specs", args.iterations))
            t0 = time.monotonic()
            try:
                TrainingRun(exp, run_dir).run()
            except Exception as e:  # noqa: BLE001 (one cell's failure is reported, the others run)
                failed[c.name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
                print(f"    failed: {failed[c.name]}", flush=True)
                continue
            if k == 1:
                finished.add(c.name)
            print(f"    done in {time.monotonic() - t0:.0f} s", flush=True)

    rows = []
    for c in selected:
        row = c.row() | {"estimated_s": round(estimates[c.name], 1), "status": "", "runs": 0, "measured_s": None,
                         "measured_min_s": None, "measured_max_s": None, "predicted_s": None,
                         "predicted_min_s": None, "predicted_max_s": None, "error": None, "error_se": None}
        if c.name in finished:
            exp = _with_model(load_experiment(vm.write_experiment(c, args.out / "specs", args.iterations)), args.model, args.ssthresh,
                             None if args.hystart is None else args.hystart == "on")
            run_dirs = [d for d in (_run_dir(args.out, c, k) for k in range(1, args.repeats + 1))
                        if (d / "metrics.json").exists()]
            measured = [json.loads((d / "metrics.json").read_text())["summary"]["mean_iteration_time_s"]
                        for d in run_dirs]
            # without --profile every run of the cell is predicted alike but for what its
            # extensions published (Atlas's plans), so each run is predicted on its own
            predicted = [p for d in run_dirs for p in _predict(exp, d, args.iterations, args.profile, args.seeds)]
            m, p = sum(measured) / len(measured), sum(predicted) / len(predicted)
            row |= {"status": "finished", "runs": len(measured), "measured_s": round(m, 4),
                    "measured_min_s": round(min(measured), 4), "measured_max_s": round(max(measured), 4),
                    "predicted_s": round(p, 4), "predicted_min_s": round(min(predicted), 4),
                    "predicted_max_s": round(max(predicted), 4), "error": round(p / m - 1, 4),
                    "error_se": _error_se(measured, predicted)}
            spread = (f" [runs {min(measured):.3f}-{max(measured):.3f}]" if len(measured) > 1 else "") + (
                f" [simulated {min(predicted):.3f}-{max(predicted):.3f}]" if len(predicted) > 1 else "")
            noise = f" +- {2 * row['error_se']:.1%}" if row["error_se"] is not None else ""
            print(f"  {c.name:<36} measured {m:.3f} s, predicted {p:.3f} s ({row['error']:+.1%}{noise}){spread}")
        else:
            row["status"] = (failed.get(c.name) and f"failed: {failed[c.name]}") or (
                f"skipped: {skipped[c.name]}" if c.name in skipped else "not run")
        rows.append(row)
    _write(rows, args.out, args.model + (", profiled" if args.profile else ""), args.seeds)
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    if errors:
        mean, worst = sum(errors) / len(errors), max(errors)
        verdict = "meets" if mean <= BAR_MEAN and worst <= BAR_MAX else "misses"
        print(f"{len(errors)} finished cell(s): mean |error| {mean:.1%}, max |error| {worst:.1%} ({verdict} the bar: "
              f"mean <= {BAR_MEAN:.0%}, max <= {BAR_MAX:.0%}); within 5%: {sum(e <= 0.05 for e in errors)}/"
              f"{len(errors)}; {args.out / CSV_NAME}, {args.out / MD_NAME}")
        noisy = [r for r in rows if r["error_se"] is not None]
        if noisy:
            beyond = [r["cell"] for r in noisy if abs(r["error"]) - 2 * r["error_se"] > BAR_MAX]
            within = [r["cell"] for r in noisy if abs(r["error"]) + 2 * r["error_se"] <= BAR_MAX]
            print(f"  with the runs' own noise (error +- 2 standard errors, {len(noisy)} cell(s) of several runs): "
                  f"{len(within)} within {BAR_MAX:.0%} all the way, {len(beyond)} beyond it all the way"
                  + (f" ({', '.join(beyond)})" if beyond else "") + f", {len(noisy) - len(within) - len(beyond)} "
                  f"undecided (more runs would tell)")
    else:
        print(f"no finished cell; {args.out / CSV_NAME}, {args.out / MD_NAME}")
    return 1 if failed else 0


def _error_se(measured: list[float], predicted: list[float]) -> float | None:
    """The standard error of ``mean(predicted) / mean(measured) - 1`` from the spread of each
    side (the runs; the simulations, every seed of every run): sqrt(a^2 + b^2) with a and b each
    side's standard error over its mean.  None with one run: the emulator's own noise unknown."""
    if len(measured) < 2:
        return None
    a = statistics.stdev(measured) / math.sqrt(len(measured)) / statistics.fmean(measured)
    b = (statistics.stdev(predicted) / math.sqrt(len(predicted)) / statistics.fmean(predicted)
         if len(predicted) > 1 else 0.0)
    return round(math.hypot(a, b), 4)


def _write(rows: list[dict], out: Path, model: str, seeds: int = 1) -> None:
    with open(out / CSV_NAME, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [f"Simulator ({model} model) against emulated-device runs, {time.strftime('%Y-%m-%d')}; "
             f"`experiments/validate_emulated.py`.", "",
             "| RTT ms | pipelines | x BDP | hosts | sharing | rate Mbit/s | message B | estimated | measured s "
             "| predicted s | error (+- 2 standard errors) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    def spread(low, high, n, what):
        return f" ({low:.3f}-{high:.3f}, {n} {what})" if n > 1 else ""
    for r in rows:
        figures = (f"{r['measured_s']:.3f}{spread(r['measured_min_s'], r['measured_max_s'], r['runs'], 'runs')} | "
                   f"{r['predicted_s']:.3f}{spread(r['predicted_min_s'], r['predicted_max_s'], seeds * r['runs'], 'simulations')} | "
                   f"{r['error']:+.1%}" + (f" +- {2 * r['error_se']:.1%}" if r["error_se"] is not None else "")
                   if r["error"] is not None else f"| | {r['status']}")
        lines.append(f"| {r['rtt_ms']:g} | {r['pipelines']} | {r['message_bdp']:g} | {r['hosts']} | {r['sharing']} | "
                     f"{r['rate_mbps']:g} | {r['message_bytes']} | {_fmt_s(r['estimated_s'])} | {figures} |")
    (out / MD_NAME).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM, after the run under way removed what it made
        print(f"validate_emulated: interrupted ({exc.args[0] if exc.args else 'SIGINT'}); the run under way "
              f"removed what it made, finished runs are kept (go on with the same command)", file=sys.stderr)
        sys.exit(130)
