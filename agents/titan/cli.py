"""``testbed titan ...``: the offline study, the emulated run, the backbone.

How it fits: ``testbed/cli.py`` mounts ``app`` as its ``titan`` sub-command.  Each command is
a thin layer over ``study.run_study``, ``emulate.run`` and the worlds they build (``backbone``
takes the study's spec and options and shows the backbone of ``study.study_world``, the
world ``run_study`` builds; with ``--emulated`` that of ``emulate.emulated_world``); errors a
user can fix (unknown region, infeasible latency bound, a bad spec, a busy machine) print one
line and exit 2; Ctrl-C and SIGTERM unwind through the network's clean-up.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from testbed.cliutil import fail as _fail
from testbed.cliutil import fail_interrupted
from testbed.cliutil import on_sigterm as _on_sigterm

app = typer.Typer(no_args_is_help=True, help="Titan and Titan-Next: conferencing traffic offloaded to Internet paths.")
console = Console(stderr=True)
out = Console()


def _user_errors() -> tuple:
    from testbed.net.kernel import BackendUnavailable
    from testbed.net.network import NetworkError
    from testbed.registry import Busy
    from testbed.run.lab import LabError
    from testbed.run.procs import ProcessError
    from testbed.spec.topology import SpecError

    from agents.titan.spec import TitanError

    return (TitanError, SpecError, BackendUnavailable, NetworkError, Busy, LabError, ProcessError)


def _split(text: Optional[str]) -> Optional[list[str]]:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


@app.command("study")
def study(
    spec: Optional[Path] = typer.Argument(None, help="study spec (YAML); default: the built-in week"),
    days: Optional[int] = typer.Option(None, help="days evaluated"),
    users: Optional[str] = typer.Option(None, help="comma-separated user regions (default: all in the matrix)"),
    dcs: Optional[str] = typer.Option(None, help="comma-separated media-server DCs"),
    calls_per_day: Optional[int] = typer.Option(None, help="synthetic calls on a weekday"),
    delta_ms: Optional[float] = typer.Option(None, help="latency slack over the nearest DC, per participant"),
    max_rtt_ms: Optional[float] = typer.Option(None, help="absolute bound on a call's worst participant RTT"),
    internet_cap: Optional[float] = typer.Option(None, help="largest Internet share per (region, DC) path"),
    max_configs: Optional[int] = typer.Option(None, help="configurations planned one by one"),
    forecast_quantile: Optional[float] = typer.Option(None, help="plan on this quantile of the past days' "
                                                      "traffic per (slot, region), not their mean"),
    move_at: Optional[float] = typer.Option(None, help="re-realise at slot boundaries: move WAN calls in progress "
                                            "on links at or above this share of their limit to the Internet"),
    seed: Optional[int] = typer.Option(None, help="workload seed"),
    solver: str = typer.Option("ipm", help="HiGHS solver: ipm or simplex"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="results folder (default results/NAME)"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """A week of synthetic calls over Azure regions: every policy, the LP per day, reductions."""
    from agents.titan.spec import StudySpec, load_spec
    from agents.titan.study import BASELINES, run_study, write_outputs

    try:
        s = load_spec(StudySpec, spec, {"days": days, "users": _split(users), "dcs": _split(dcs),
                                        "workload.calls_per_day": calls_per_day, "latency.delta_ms": delta_ms,
                                        "latency.max_rtt_ms": max_rtt_ms, "internet_cap": internet_cap,
                                        "max_configs": max_configs, "workload.seed": seed,
                                        "forecast_quantile": forecast_quantile, "move_at": move_at})
        if solver not in ("ipm", "simplex"):
            raise _user_errors()[0](f"solver: {solver!r} is not ipm or simplex")
        with console.status("running the study") as status:
            summary = run_study(s, log=lambda m: status.update(m), solver=solver)
        folder = out_dir or Path("results") / s.name
        write_outputs(summary, folder)
    except _user_errors() as exc:
        _fail(str(exc))
    js = {k: v for k, v in summary.items() if k != "_arrays"}
    if as_json:
        out.print_json(json.dumps(js))
        return
    table = Table(title=f"{s.name}: {js['calls']:,} calls, {js['user_regions']} user regions, {js['dcs']} DCs, "
                        f"{s.days} days")
    for col in ("policy", "sum of peaks, week (Gbit/s)", "mean day (Gbit/s)", "planned day (Gbit/s)",
                "Titan-Next saves (week)",
                "Internet share", "above caps", "migrations", "over bound"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    red = js["titan_next_reduction"]
    for name, p in js["policies"].items():
        plan = p["planned_sum_of_peaks_day_mean_kbps"]
        table.add_row(name, f"{p['sum_of_peaks_week_kbps'] / 1e6:.2f}", f"{p['sum_of_peaks_day_mean_kbps'] / 1e6:.2f}",
                      "-" if plan is None else f"{plan / 1e6:.2f}",
                      f"{red[name]['week']:.1%}" if name in red else "-", f"{p['internet_share_traffic']:.1%}",
                      f"{p['internet_cap_excess']:.1%}",
                      f"{p['migrations']:.1%}", str(p["calls_over_latency_bound"]))
    console.print(table)
    solve = js["solve_s"]
    console.print("LP per day: " + ", ".join(f"{n} mean {v['mean']:.1f} s (max {v['max']:.1f} s, "
                                               f"{v['variables_mean']:,.0f} variables)" for n, v in solve.items()))
    console.print(f"paper: up to {js['paper_reduction']:.0%} lower sum of peaks; here against "
                  + ", ".join(f"{b} {red[b]['week']:.0%}" for b in BASELINES) + f"; results: {folder}")


@app.command("emulate")
def emulate(
    spec: Optional[Path] = typer.Argument(None, help="emulation spec (YAML); default: the built-in one"),
    policies: Optional[str] = typer.Option(None, help="comma-separated policies to play"),
    day_seconds: Optional[float] = typer.Option(None, help="one emulated day lasts this long"),
    controller_seconds: Optional[float] = typer.Option(None, help="also run Titan's controller live this long"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="results folder (default results/NAME)"),
    as_json: bool = typer.Option(False, "--json", help="print the result (without per-slot arrays) as JSON"),
) -> None:
    """Build the dual-path network, play a day of real UDP calls under each policy, measure."""
    from agents.titan import emulate as emu
    from agents.titan.plots import emulation_plots
    from agents.titan.spec import EmulationSpec, load_spec

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        s = load_spec(EmulationSpec, spec, {"policies": _split(policies), "day_seconds": day_seconds,
                                            "controller_seconds": controller_seconds})
        folder = out_dir or Path("results") / s.name
        with console.status("emulating") as status:
            result = emu.run(s, folder, log=lambda m: status.update(m))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "emulation.json").write_text(json.dumps(result, indent=1))
        emulation_plots(result, folder)
    except _user_errors() as exc:
        _fail(str(exc))
    except KeyboardInterrupt as exc:
        fail_interrupted(exc)
    if as_json:
        slim = {k: v for k, v in result.items() if k != "policies"}
        slim["policies"] = {n: {k: v for k, v in p.items() if not k.endswith("slot_load_kbps")
                                and k != "participant_rtt"} for n, p in result["policies"].items()}
        out.print_json(json.dumps(slim))
        return
    table = Table(title=f"{s.name}: one day in {s.day_seconds:g} s, real UDP calls")
    for col in ("policy", "sum of peaks measured (Mbit/s)", "model", "over bound", "route violations",
                "misrouted pkts", "loss", "Internet share"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    for name, p in result["policies"].items():
        table.add_row(name, f"{p['sum_of_peaks_kbps'] / 1e3:.2f}", f"{p['model_sum_of_peaks_kbps'] / 1e3:.2f}",
                      f"{p['participants_over_bound']}/{p['participants_measured']}", str(p["route_violations"]),
                      str(p["misrouted_packets"]), f"{p['loss']:.2%}", f"{p['internet_share_calls']:.0%}")
    console.print(table)
    ctl = result.get("controller")
    if ctl:
        console.print(f"controller ({ctl['policy']} placing): Internet share of calls "
                      f"{ctl['internet_share_calls']:.0%}, {len(ctl['moves'])} calls moved to the WAN")
        for f in ctl["faults"]:
            ttm = f["time_to_mitigate_s"]
            console.print(f"  fault on {f['path']} at {f['at_s']:.1f} s: calls off it after "
                          + (f"{ttm:.1f} s" if ttm is not None else "never")
                          + f" (bound {f['mitigate_bound_s']:.1f} s, {f['calls_moved']} moved)"
                          + (f"; cleared at {f['cleared_at_s']:.1f} s, calls back at "
                             + (f"{f['used_again_at_s']:.1f} s" if f["used_again_at_s"] is not None else "never")
                             if f["cleared_at_s"] is not None else ""))
    console.print(f"results: {folder}")


@app.command("backbone")
def backbone(
    spec: Optional[Path] = typer.Argument(None, help="the study spec (YAML) as `titan study` takes it; with --emulated "
                                                     "the emulation spec as `titan emulate` takes it; default: the "
                                                     "built-in one"),
    users: Optional[str] = typer.Option(None, help="comma-separated user regions, as `titan study --users` "
                                                   "(default: the spec's)"),
    dcs: Optional[str] = typer.Option(None, help="comma-separated media-server DCs, as `titan study --dcs` "
                                                 "(default: the spec's)"),
    relay_factor: Optional[float] = typer.Option(None, help="the spec's relay_factor: drop a-b if a relay c has "
                                                            "RTT(a,c)+RTT(c,b) <= factor x RTT(a,b) (default 1.1)"),
    emulated: bool = typer.Option(False, "--emulated", help="the emulator's backbone instead of the study's: pruned "
                                                            "among the listed users and DCs only, as `titan "
                                                            "emulate` builds it"),
    crossed: bool = typer.Option(False, "--crossed", help="list only the links that traffic between the users and "
                                                          "the DCs crosses"),
    as_json: bool = typer.Option(False, "--json", help="print the edges as JSON"),
) -> None:
    """The WAN backbone a study (or with ``--emulated`` an emulation) routes over.

    Takes the spec and the ``--users``/``--dcs`` options ``titan study`` takes and shows the
    backbone of the very world the study builds (``study.study_world``: every region in the
    matrix, pruned by the relay rule), whatever the users and DCs; it also says which of
    those links the users' traffic to and from the DCs crosses (``--crossed`` lists only
    those).  ``--emulated`` reads an emulation spec instead and shows the backbone pruned
    among its users and DCs alone (``emulate.emulated_world``), which ``titan emulate``
    builds."""
    overrides = {"users": _split(users), "dcs": _split(dcs), "relay_factor": relay_factor}
    try:
        from agents.titan.spec import load_spec

        if emulated:
            from agents.titan.emulate import emulated_world
            from agents.titan.spec import EmulationSpec

            world = emulated_world(load_spec(EmulationSpec, spec, overrides))
        else:
            from agents.titan.spec import StudySpec
            from agents.titan.study import study_world

            world = study_world(load_spec(StudySpec, spec, overrides))
    except _user_errors() as exc:
        _fail(str(exc))
    bb = world.backbone
    used = world.crossed_edges()
    listed = set(world.users) | set(world.dcs)
    via = sorted({r for a, b, _ in used for r in (a, b)} - listed)
    edges = used if crossed else bb.edges
    kind = "emulated" if emulated else "study"
    if as_json:
        used_set = {e[:2] for e in used}
        out.print_json(json.dumps({"backbone": kind, "relay_factor": bb.relay_factor,
                                   "backbone_regions": len(bb.nodes), "backbone_links": len(bb.edges),
                                   "users": world.users, "dcs": world.dcs, "crossed_links": len(used),
                                   "relays": via, "edges_shown": "crossed" if crossed else "all",
                                   "edges": [{"a": a, "b": b, "rtt_ms": r, "crossed": (a, b) in used_set}
                                             for a, b, r in edges]}))
        return
    n = len(bb.nodes)
    what = (f"the emulator's backbone (pruned among the {n} listed regions only, as `titan emulate` builds it; "
            "not the study's)" if emulated else
            "the study's backbone (every region in the matrix, as `titan study` routes over it)")
    console.print(f"{what}: {len(bb.edges)} links over {n} regions (of {n * (n - 1) // 2} pairs), "
                  f"relay factor {bb.relay_factor:g}")
    nu, nd = len(world.users), len(world.dcs)
    console.print(f"traffic between the {nu} user region{'s' * (nu != 1)} and {nd} DC{'s' * (nd != 1)} crosses "
                  f"{len(used)} of them" + (f", through {', '.join(via)}" if via else "")
                  + ("; listed below" if crossed else ""))
    for a, b, r in edges[:40]:
        out.print(f"{a:>22} - {b:<22} {r:6.1f} ms")
    if len(edges) > 40:
        out.print(f"... and {len(edges) - 40} more (--json for all)")
