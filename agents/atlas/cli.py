"""``testbed plan``: Atlas's planner from the command line.

How it fits: ``plugin.py`` names ``plan`` as a ``testbed`` command; it reads an experiment,
asks ``planner.search`` for every pipeline depth, DP degree and DC subset ranked by
simulated iteration time, prints the ranking (or JSON) and can write the best plan as an
experiment file.  Errors a user can fix print one line and exit 2.  Light imports at the
top: the ``testbed`` command loads this module at start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from testbed.cliutil import fail as _fail
from testbed.spec.topology import SpecError

console = Console(stderr=True)


def plan(
    experiment: Path = typer.Argument(..., help="experiment file: its model, global batch and topology"),
    top: int = typer.Option(8, help="show this many plans"),
    max_dcs: Optional[int] = typer.Option(None, help="consider DC subsets up to this size"),
    out_file: Optional[Path] = typer.Option(None, "--out", help="write the best plan as an experiment file"),
    as_json: bool = typer.Option(False, "--json", help="print the ranking as JSON"),
    profile: Optional[Path] = typer.Option(None, help="timeline.json of a run of this experiment on its real "
                                                      "devices: take device time from it"),
) -> None:
    """Atlas's planner: DC selection and stage assignment (Algorithm 1) for every pipeline depth,
    DP degree (global batch fixed) and DC subset, ranked by simulated iteration time, with
    device time from where the run gets it (emulated devices' profile, or --profile)."""
    from agents.atlas import planner
    from testbed.spec.experiment import load_experiment

    PlanError, search = planner.PlanError, planner.search

    try:
        exp = load_experiment(experiment)
        if profile is not None and not profile.is_file():
            raise PlanError(f"--profile: {profile} is not a file (a run's timeline.json)")
        device = planner.DeviceTimes.of(exp, profile)
        with console.status("simulating candidate plans") as status:
            ranked = search(exp, max_dcs=max_dcs, device=device, progress=lambda done, total: status.update(
                f"simulating candidate plans: {done}/{total}"))
        if not ranked or ranked[0].iteration_time_s is None:
            raise PlanError("no candidate placement fits: " + "; ".join(sorted({c.why_not for c in ranked}))[:300])
    except (SpecError, PlanError) as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps([c.as_dict() for c in ranked[:top]] + [c.as_dict() for c in ranked if c.iteration_time_s
                                                                  is None][:top], indent=1))
    else:
        table = Table(title=f"plans for {exp.name} on {exp.topo.name} (global batch "
                            f"{exp.parallel.replicas * exp.training.microbatches} microbatches)")
        for col in ("#", "plan", "placement", "iteration s", "tokens/s", "bubbles", "WAN busy", "why not first"):
            table.add_column(col)
        for i, c in enumerate(ranked[:top], 1):
            if c.iteration_time_s is None:
                break
            table.add_row(str(i), c.label(), " ".join(f"{dc}:{s[0]}-{s[-1]}" for dc, s in c.placement.items()),
                          f"{c.iteration_time_s:.3f}", f"{c.tokens_per_s:.0f}", f"{c.bubble_fraction:.0%}",
                          f"{c.wan_utilization:.0%}", c.why_not or "best")
        console.print(table)
        console.print(f"device time: {device.source}")
        infeasible = [c for c in ranked if c.iteration_time_s is None]
        if infeasible:
            console.print(f"{len(infeasible)} candidate(s) do not fit, e.g. {infeasible[0].label()}: "
                          f"{infeasible[0].why_not}")
    if out_file is not None:
        best = ranked[0]
        data = yaml.safe_load(Path(experiment).read_text())
        data["topology"] = exp.topology_file
        data.setdefault("parallel", {}).update(stages=best.stages, replicas=best.replicas)
        data.setdefault("training", {})["microbatches"] = best.microbatches
        data["placement"] = best.placement
        data["name"] = f"{exp.name}-planned"
        if exp.device == "emulated" and best.stages != exp.parallel.stages and best.stage_times:
            # the emulated devices draw what the prediction assumed (a profile is of the old depth)
            data.setdefault("sim", {})["stage_times"] = best.stage_times_spec(device.speedup)
            data.get("emulation", {}).pop("profile", None)
        out_file.write_text(f"# written by: testbed plan {experiment} --out {out_file}\n"
                            f"# {best.label()}: predicted {best.iteration_time_s:.3f} s per iteration\n"
                            + yaml.safe_dump(data, sort_keys=False))
        console.print(f"best plan written to {out_file} (testbed run {out_file})")
