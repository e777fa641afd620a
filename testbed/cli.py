"""The ``testbed`` command (typer + rich).

How it fits: each sub-command is a thin layer over the library: ``doctor`` over
``kernel.probe``, ``fidelity`` over ``network.Network`` and ``fidelity.measure_all``,
``clean`` over ``registry.clean``, ``topology aws`` over ``awsmatrix``.  Errors the user
can fix (a bad file, a missing kernel feature, a busy machine) print one line and exit
non-zero; Ctrl-C and SIGTERM unwind through the network's context manager, which removes
everything it made.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from testbed import __version__
from testbed.cliutil import fail as _fail
from testbed.cliutil import fail_interrupted
from testbed.cliutil import on_sigterm as _on_sigterm
from testbed.extension import commands as _extension_commands

app = typer.Typer(add_completion=True, no_args_is_help=True, help="Geo-distributed training testbed.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"testbed {version('geo-testbed')}")
        except PackageNotFoundError:
            print("testbed (not installed: run from a checkout)")
        raise typer.Exit(0)


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                           help="print the version and exit")) -> None:
    """Geo-distributed training testbed."""
topology_app = typer.Typer(no_args_is_help=True, help="Generate topology files.")
app.add_typer(topology_app, name="topology")

console = Console(stderr=True)
out = Console()


def _user_errors():
    from testbed.net.kernel import BackendUnavailable
    from testbed.cluster.inventory import ClusterError
    from testbed.net.network import NetworkError
    from testbed.registry import Busy
    from testbed.spec.topology import SpecError

    return (SpecError, BackendUnavailable, NetworkError, Busy, ClusterError)


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """What this kernel offers and which backend each feature will use."""
    from testbed.net.kernel import BackendUnavailable, choose_backends, probe

    caps = probe()
    try:
        backends = choose_backends(caps)
        chosen = {"delay": backends.delay, "loss": backends.loss, "rate": backends.rate}
        problem = None
    except BackendUnavailable as exc:
        chosen, problem = None, str(exc)
    if as_json:
        out.print_json(json.dumps({"capabilities": caps.to_dict(), "backends": chosen, "problem": problem}))
        return
    table = Table(title=f"testbed {__version__}: what this machine offers")
    table.add_column("feature")
    table.add_column("available")
    rows = [("root", caps.root), ("mininet + mnexec", caps.mininet), ("brctl", caps.bridge_utils),
            ("veth", caps.veth), ("TUN (vnet hdr, offload)", caps.tun),
            ("iptables statistic", caps.iptables_statistic), ("iperf3", caps.iperf3), ("ping", caps.ping)]
    rows += [(f"qdisc {k}", v) for k, v in sorted(caps.qdiscs.items())]
    rows.append(("cgroup cpu", caps.cgroup_cpu or False))
    for name, ok in rows:
        table.add_row(name, "[green]yes[/]" if ok is True else ("[red]no[/]" if not ok else str(ok)))
    out.print(table)
    if chosen:
        out.print(f"delay: [bold]{chosen['delay']}[/]   loss: [bold]{chosen['loss']}[/]   rate: [bold]htb[/]")
    else:
        out.print(f"[red]cannot build networks:[/] {problem}")


@app.command()
def schema(
    kind: str = typer.Argument("experiment", help="experiment or topology"),
) -> None:
    """Print the JSON Schema of an experiment or a topology file (for editors: yaml-language-server)."""
    from testbed.spec.experiment import Experiment
    from testbed.spec.topology import Topology

    models = {"experiment": Experiment, "topology": Topology}
    if kind not in models:
        _fail(f"schema: {kind!r} is not one of experiment, topology", 2)
    doc = models[kind].model_json_schema()
    doc["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    doc["title"] = f"geo-testbed {kind}"
    print(json.dumps(doc, indent=1))


@app.command()
def fidelity(
    topology: str = typer.Argument(..., help="topology file or name in topologies/"),
    as_json: bool = typer.Option(False, "--json", help="print JSON (a list, one object per link direction)"),
    seconds: float = typer.Option(3.0, help="iperf3 duration per direction"),
    pings: int = typer.Option(20, help="pings per link"),
    delay_backend: str = typer.Option("auto", help="auto, netem or tun"),
    loss_backend: str = typer.Option("auto", help="auto, netem, iptables or delayline"),
    inventory: Optional[Path] = typer.Option(None, help="an Ansible inventory: the DCs go to its machines"),
    machines: Optional[str] = typer.Option(None, help="with --inventory: DC=MACHINE,... (default: packed in order)"),
    time_dilation: float = typer.Option(1.0, "--time-dilation", help="k: the emulated world runs k times slower than "
                                        "the wall clock (delays x k, rates / k on the wire); figures in emulated terms"),
    min_goodput: float = typer.Option(0.90, "--min-goodput", min=0.0, max=1.01,
                                      help="the goodput a direction must reach, as a fraction of its rate"),
    judge_loss: bool = typer.Option(False, "--judge-loss", help="judge a lossy direction's goodput against what "
                                    "TCP can expect under its loss and round trip (within 10%), measured for as "
                                    "long as the model says a measurement needs to land within 10% of its mean 95% "
                                    "of the time (minutes at long round trips; --parallel); without it a lossy "
                                    "direction's goodput is reported only"),
    max_loss_seconds: float = typer.Option(2400.0, "--max-loss-seconds", min=1.0,
                                           help="with --judge-loss: measure a lossy direction for this long at most"),
    parallel: bool = typer.Option(False, "--parallel", help="run the links' goodput flows at once, one direction "
                                  "of each, then the other (delays still measured one at a time): a long "
                                  "--judge-loss measurement takes twice its longest direction; the machine's CPUs "
                                  "must carry the flows' sum"),
    both_ways: bool = typer.Option(False, "--both-ways", help="with --parallel: both directions of a link at once "
                                   "(one wave); right only where loss holds the flows well below their rates, since "
                                   "each flow's ACKs queue behind the other direction's data"),
) -> None:
    """Build TOPOLOGY, measure every WAN link's RTT and goodput, tear down; exit 1 when a
    direction is out of tolerance.  Beside each direction's rate: the goodput its flow can
    expect (the payload rate; under random loss, what one CUBIC connection sustains there)."""

    from testbed.net.fidelity import measure_all
    from testbed.net.network import Network
    from testbed.spec.topology import load_topology, resolve_topology

    if both_ways and not parallel:
        _fail("--both-ways: only with --parallel (it says which flows run together)")
    signal.signal(signal.SIGTERM, _on_sigterm)
    cluster = None
    try:
        topo = load_topology(resolve_topology(topology))
        with console.status("building the network") as status:
            if inventory is not None:
                from testbed.cluster.remote import ClusterNetwork, open_cluster

                cluster = open_cluster(topo, inventory, machines, progress=lambda m: status.update(m))
                net = ClusterNetwork(cluster, topo, time_dilation)
                cluster.check_clocks(net.topo)  # the wire's delays (k times the topology's)
                net.delay_backend = delay_backend
                if time_dilation != 1.0:
                    net.options = {"time_dilation": time_dilation}  # each agent dilates its part
            else:
                net = Network(topo, delay_backend=delay_backend, loss_backend=loss_backend,
                              progress=lambda m: status.update(m), time_dilation=time_dilation)
            with net, (contextlib.closing(cluster) if cluster else contextlib.nullcontext()):
                console.print(f"built {topo.name} in {net.startup_s:.2f} s (delay: {net.backends.delay}, "
                              f"loss: {net.backends.loss})")
                reports = measure_all(net, seconds=seconds, pings=pings,
                                      progress=lambda m: status.update(f"measuring {m}"), judge_loss=judge_loss,
                                      parallel=parallel, both_ways=both_ways,
                                      max_loss_seconds=max_loss_seconds)
    except _user_errors() as exc:
        _fail(str(exc))
    except KeyboardInterrupt as exc:
        fail_interrupted(exc)
    bad = [f"{r.src} -> {r.dst}" for r in reports if not r.within_tolerance(min_goodput, judge_loss)]
    if as_json:
        out.print_json(json.dumps([r.to_dict(min_goodput, judge_loss) for r in reports]))
        raise typer.Exit(1 if bad else 0)  # a direction out of tolerance is a failed check
    dilation = f" (time dilation {time_dilation:g}: emulated terms)" if time_dilation != 1.0 else ""
    table = Table(title=f"{topo.name}: configured vs measured{dilation}")
    for col in ("link", "RTT ms: conf / meas (source)", "one-way ms: conf / meas", "goodput Mbit/s (of rate)",
                "expected Mbit/s [5-95%] (loss)", "retr", "ok"):
        table.add_column(col, justify="right")
    for r in reports:
        source = "" if r.rtt_ms_source is None else f" ({r.rtt_ms_source:g})"
        owd = "-" if r.owd_ms_measured is None else f"{r.owd_ms_measured:.2f}"
        expected = "-" if r.goodput_mbps_expected is None else f"{r.goodput_mbps_expected:.1f}"
        if r.goodput_mbps_expected_low is not None and r.goodput_mbps_expected_high is not None:
            expected += f" [{r.goodput_mbps_expected_low:.1f}-{r.goodput_mbps_expected_high:.1f}]"
        if r.loss_configured > 0:
            expected += f" ({r.loss_configured:.3%})"
        table.add_row(f"{r.src}->{r.dst}", f"{r.rtt_ms_configured:.2f} / {r.rtt_ms_measured:.2f}{source}",
                      f"{r.owd_ms_configured:.2f} / {owd}",
                      f"{r.goodput_mbps_measured:.1f} / {r.rate_mbps_configured:g} ({r.goodput_ratio:.3f})",
                      expected, str(r.retransmits),
                      "[green]yes[/]" if r.within_tolerance(min_goodput, judge_loss) else "[red]no[/]")
    out.print(table)
    lossy = any(r.loss_configured > 0 for r in reports)
    rule = (" (lossy directions: within 10% of the expectation under their loss)" if judge_loss else
            " (lossy directions: goodput reported, not judged; --judge-loss judges it)") if lossy else ""
    out.print(f"RTT within max(0.5 ms, 2%) and goodput {min_goodput:.0%}-101% (steady state, slow start left out)"
              f"{rule}: " + ("every direction" if not bad else f"[red]not {', '.join(bad)}[/]"))
    if bad:
        raise typer.Exit(1)


@app.command()
def run(
    experiment: Path = typer.Argument(..., help="experiment file (experiments/*.yaml)"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="results folder (default results/NAME-TIME)"),
    delay_backend: str = typer.Option("auto", help="auto, netem or tun"),
    inventory: Optional[Path] = typer.Option(None, help="an Ansible inventory: the DCs go to its machines "
                                                        "(README: several machines)"),
    machines: Optional[str] = typer.Option(None, help="with --inventory: DC=MACHINE,... (default: packed in order)"),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help="KEY.PATH=VALUE over the file's own "
                                                  "(repeatable), e.g. --set training.iterations=3"),
    as_json: bool = typer.Option(False, "--json", help="print the run's summary as JSON on stdout (progress "
                                                      "stays on stderr)"),
) -> None:
    """Build the topology, train across it, write metrics.json, timeline.json and plots."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from testbed.spec.experiment import load_experiment
    from testbed.run.runner import RunError, TrainingRun

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        exp = load_experiment(experiment, overrides or ())
        from testbed.extension import device_kind

        device = device_kind(exp.device)
        device(exp).check()  # a bad profile fails before anything is made, variants or not
        out = out_dir or Path("results") / f"{exp.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        site = None
        if inventory is not None:
            from testbed.cluster.inventory import ClusterError
            from testbed.extension import in_use

            for v in [exp.variant(n) for n in exp.compare] if exp.compare else [exp]:
                refused = (f"device: {v.device}" if device_kind(v.device).one_machine_only else
                           ", ".join(e.name for e in in_use(v) if not e.across_machines))
                if refused:
                    raise ClusterError(f"--inventory: {refused} runs on one machine only, for now"
                                       + (f" (variant {v.name})" if exp.compare else ""))
        if exp.compare:
            _run_comparison(exp, out, delay_backend, inventory, machines)
            return
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            if inventory is not None:
                from testbed.cluster.remote import ClusterSite, open_cluster

                cluster = open_cluster(exp.topo, inventory, machines, run=exp.name,
                                       progress=lambda m: progress.console.print(m, highlight=False))
                site = ClusterSite(cluster)
            task = progress.add_task(f"training {exp.name}", total=exp.training.iterations)
            runner = TrainingRun(exp, out, delay_backend=delay_backend, site=site,
                                 progress=lambda done, total: progress.update(task, completed=done),
                                 log=lambda m: progress.console.print(m, highlight=False))
            try:
                result = runner.run()
            finally:
                if site is not None:
                    site.cluster.close()
    except _user_errors() + (RunError,) as exc:
        _fail(str(exc), 1 if isinstance(exc, RunError) else 2)
    except KeyboardInterrupt as exc:
        fail_interrupted(exc)
    s = result.summary
    if as_json:
        out.mkdir(parents=True, exist_ok=True)
        print(json.dumps({"experiment": exp.name, "topology": exp.topo.name, "results": str(out),
                          "summary": s.to_dict()}, default=str))
        return
    table = Table(title=f"{exp.name} on {exp.topo.name}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("mean iteration time", f"{s.mean_iteration_time_s:.3f} s")
    table.add_row("tokens/s", f"{s.tokens_per_s:.0f}")
    table.add_row("mean busy fraction (utilization)", f"{s.mean_busy_fraction:.1%}")
    table.add_row("bubble fraction", f"{s.bubble_fraction:.1%}")
    if s.final_loss is not None:
        table.add_row("loss first -> last", f"{result.iterations[0].loss:.4f} -> {s.final_loss:.4f}")
    else:
        table.add_row("loss", s.get("loss_note", "none"))
    timing = (result.device or {}).get("op_timing")
    if timing and timing.get("median_us_worst_worker") is not None:
        table.add_row("emulated op timing error", f"median {timing['median_us_worst_worker']:.0f} us, "
                                                  f"p99 {timing['p99_us_worst_worker']:.0f} us (worst worker)")
    out.mkdir(parents=True, exist_ok=True)
    table.add_row("results", str(out))
    console.print(table)
    for w in s.get("warnings", []):
        console.print(f"[bold yellow]warning:[/] {w}", highlight=False)


def _run_comparison(exp, out: Path, delay_backend: str, inventory: Path | None = None,
                    machines: str | None = None) -> None:
    """``compare:`` variants back to back (with ``inventory``: each on the cluster, opened for
    it); ``comparison.json`` with measured and predicted times."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from testbed.run.compare import run_comparison

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        say = lambda m: progress.console.print(m, highlight=False)  # noqa: E731

        @contextlib.contextmanager
        def on_cluster(v):
            from testbed.cluster.remote import ClusterSite, open_cluster

            cluster = open_cluster(v.topo, inventory, machines, run=v.name, progress=say)
            try:
                yield ClusterSite(cluster)
            finally:
                cluster.close()

        tasks = {n: progress.add_task(f"variant {n}", total=exp.training.iterations) for n in exp.compare}
        result = run_comparison(exp, out, delay_backend,
                                progress=lambda n, done, total: progress.update(tasks[n], completed=done),
                                log=say, open_site=on_cluster if inventory is not None else None)
    names = list(exp.compare)
    speed = result.get(f"speedup_over_{names[0]}", {})
    table = Table(title=f"{exp.name} on {exp.topo.name}: {len(names)} variants")
    for col in ("variant", "sets", "measured s", "predicted s", "speedup measured", "speedup predicted",
                "WAN drops", "TCP timeouts"):
        table.add_column(col, justify="right" if col not in ("variant", "sets") else "left")
    for n in names:
        r = result[n]
        table.add_row(n, r["settings"], f"{r['measured_s']:.3f}", f"{r['predicted_s']:.3f}",
                      f"{speed[n]['measured']:.3f}x", f"{speed[n]['predicted']:.3f}x",
                      str(r.get("wan_drops", "-")), str(r.get("tcp_timeouts", "-")))
    console.print(table)
    console.print(f"same losses in every variant: {result['same_losses']}; results: {out}/comparison.json")


@app.command()
def sim(
    experiment: Path = typer.Argument(..., help="experiment file (the same files testbed run takes)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (a list with --sweep)"),
    profile: Optional[Path] = typer.Option(None, help="timeline.json of an emulator run: take compute times from it"),
    iterations: int = typer.Option(3, help="iterations to simulate"),
    sweep: list[str] = typer.Option([], help="KEY=V1,V2,... over delay_ms, rate_mbps, connections, replicas, "
                                              "microbatches, stages, schedule; repeat for a grid"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="write metrics.json and timeline.json (or sweep.csv/png)"),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help="KEY.PATH=VALUE over the file's own "
                                                  "(repeatable), e.g. --set parallel.connections=16"),
    write_latency: Optional[Path] = typer.Option(None, "--write-latency", help="with sim.sharing: packets, a "
                                                 "run traced with parallel.tcp_trace on the same hosts: its "
                                                 "writer threads' latency is replayed (default: --profile's own "
                                                 "run, if traced)"),
    seeds: int = typer.Option(1, "--seeds", help="simulate each point this many times (seeds seed, seed+1, ...) "
                              "and give the mean and range; they differ where something is drawn (--profile's op "
                              "times, loss, jitter), most with several pipelines starting together on a link"),
) -> None:
    """Simulate EXPERIMENT (paper scale welcome): iteration time, bubbles, WAN utilization."""
    from testbed.sim.cli import run_sim

    try:
        rows = run_sim(experiment, profile=profile, iterations=iterations, sweep=sweep, out_dir=out_dir,
                       overrides=overrides or (), write_latency=write_latency, seeds=seeds)
    except _user_errors() as exc:
        _fail(str(exc))
    except ValueError as exc:
        _fail(str(exc))
    if as_json:
        out.print_json(json.dumps(rows[0] if not sweep else rows))
        return
    keys = [k for k in rows[0] if k not in ("busy_fraction_per_worker", "model")]
    table = Table(title=f"simulated: {experiment}")
    for k in keys:
        table.add_column(k, justify="right")
    for r in rows:
        table.add_row(*[f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys])
    out.print(table)
    # which parts of the model ran, and a warning per part whose validated range the run leaves
    parts = list(dict.fromkeys(p["part"] for r in rows for p in r["model"]["parts"]))
    sharing = list(dict.fromkeys(r["model"].get("sharing", "fair") for r in rows))
    out.print("model: " + (", ".join(parts) if parts else "no WAN transfer") + f" (sharing: {', '.join(sharing)})",
              highlight=False)
    # whether the TCP window model ran, and why (on by default where the hosts restart after idle)
    windows = list(dict.fromkeys((w["on"], w["why"]) for r in rows if (w := r["model"].get("tcp_window_model"))))
    for on, why in windows:
        out.print(f"tcp window model: {'on' if on else 'off'} ({why})", highlight=False)
    for on, why in dict.fromkeys((h["on"], h["why"]) for r in rows if (h := r["model"].get("tcp_hystart"))):
        out.print(f"tcp hystart: {'on' if on else 'off'} ({why})", highlight=False)
    warned: dict[str, list[str]] = {}
    for r in rows:
        point = ", ".join(f"{k}={r[k]}" for k in (sweep and [s.partition("=")[0] for s in sweep] or []))
        for w in r["model"]["warnings"]:
            warned.setdefault(w, []).append(point)
    for w, points in warned.items():
        where = f" (at {'; '.join(points)})" if sweep and len(points) < len(rows) else ""
        out.print(f"[yellow]{w}[/]{where}", highlight=False)


@app.command()
def provision(
    inventory: Optional[Path] = typer.Option(None, help="Ansible inventory (default: this machine, connection local)"),
    check: bool = typer.Option(False, "--check", help="dry run: report what would change"),
    limit: Optional[str] = typer.Option(None, help="only these hosts or groups"),
) -> None:
    """Run playbooks/site.yml through ansible-runner: progress per task, summary per host."""
    from testbed.tools.provision import ProvisionError, provision as run_playbook

    try:
        result = run_playbook(inventory, check, limit, progress=lambda line: console.print(line, highlight=False))
    except ProvisionError as exc:
        _fail(str(exc), 1)
    table = Table(title="provisioned" + (" (check mode)" if check else ""))
    for col in ("host", "ok", "changed", "failed", "unreachable", "skipped"):
        table.add_column(col, justify="right")
    for host, counts in sorted(result.hosts.items()):
        table.add_row(host, *[str(counts.get(k, 0)) for k in ("ok", "changed", "failed", "unreachable", "skipped")])
    out.print(table)


@app.command()
def clean(force: bool = typer.Option(False, help="also when a run still holds the lock (with --inventory: end "
                                                  "other orchestrators' live runs too)"),
          inventory: Optional[Path] = typer.Option(None, help="clean every machine of this inventory (Ansible)"),
          fake_cluster: bool = typer.Option(False, "--fake-cluster", help="also end the fake cluster")) -> None:
    """Remove every namespace, interface, process and file the testbed made (also after a crash)."""
    from testbed.registry import Busy, CleanError, clean as do_clean

    if not _is_root():
        _fail("testbed clean must run as root")
    if inventory is not None:
        from testbed.cluster.inventory import ClusterError
        from testbed.cluster.plays import clean_machines

        try:
            result = clean_machines(inventory, force=force)
        except ClusterError as exc:
            _fail(str(exc))
        for host, stats in sorted(result["hosts"].items()):
            said = result["said"].get(host, "").strip().splitlines()
            state = "unreachable" if stats.get("unreachable") else said[-1] if said else "cleaned"
            out.print(f"{host}: {state}", highlight=False, soft_wrap=True)
        for f in result["failures"]:
            console.print(f"[bold yellow]warning:[/] {f}", highlight=False)
        if result["failures"]:
            raise typer.Exit(1)
        return
    info = _end_agent(force)
    if info is not None:
        out.print(f"left alone: a live run of {info.get('orchestrator', '?')} (machine agent pid {info.get('pid')}); "
                  f"--force ends it", soft_wrap=True)
        return
    from testbed.cluster.remote import remove_stale_logs

    stale = remove_stale_logs()
    if stale:
        out.print(f"removed {stale} agent log folder(s) of orchestrators that are gone")
    if fake_cluster:
        from testbed.cluster import fake

        ended = fake.destroy()
        out.print(f"fake cluster: ended {len(ended)} process(es)")
    try:
        found = do_clean(force=force)
    except (Busy, CleanError) as exc:
        _fail(str(exc))
    out.print(
        f"removed {len(found['processes'])} process(es), {len(found['netns'])} named namespace(s), "
        f"{len(found['links'])} interface(s), {len(found['cgroups'])} cgroup(s), {len(found['files'])} file(s)",
        soft_wrap=True)


@app.command()
def chaos(
    runs: int = typer.Option(60, help="injections in the campaign (the faults in turn)"),
    seed: int = typer.Option(1, help="where each fault lands (iteration, target, outage) is drawn from this"),
    out_dir: Path = typer.Option(Path("results/chaos"), "--out", help="chaos.jsonl (one outcome a line) goes here"),
    device: str = typer.Option("cpu", help="cpu (a real model: losses are checked) or emulated"),
    faults: Optional[str] = typer.Option(None, help="comma-separated subset of the faults"),
    batch: Optional[int] = typer.Option(None, help="run at most this many injections now (the rest later: "
                                                   "injections already in chaos.jsonl are not run again)"),
    report: bool = typer.Option(False, help="only print the table of what chaos.jsonl holds (markdown)"),
) -> None:
    """Inject one fault at a time into a short real run (testbed/run/chaos.py) and say, per fault,
    whether each run ended as documented, lost no iteration and left nothing behind."""
    from testbed.run.chaos import FAULTS, Outcome, _read_jsonl, campaign, summary_line, table

    chosen = tuple(f.strip() for f in faults.split(",")) if faults else FAULTS
    unknown = [f for f in chosen if f not in FAULTS]
    if unknown:
        _fail(f"--faults: no fault {unknown[0]!r} (known: {', '.join(FAULTS)})")
    from testbed.extension import device_kinds

    if device not in device_kinds():
        _fail(f"--device: no device kind {device!r} (known: {', '.join(sorted(device_kinds()))})")
    if report:
        outcomes = [Outcome(**o) for o in _read_jsonl(out_dir / "chaos.jsonl")]
    else:
        if not _is_root():
            _fail("testbed chaos must run as root (it builds networks)")
        signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            outcomes = campaign(runs, seed, out_dir, device, chosen, batch,
                                log=lambda m: console.print(m, highlight=False, markup=False))
        except _user_errors() as exc:
            _fail(str(exc))
    out.print(table(outcomes), highlight=False, markup=False)
    bad = [o for o in outcomes if not o.documented]
    for o in bad:
        console.print(f"[red]not as documented:[/] #{o.index} {o.fault} {o.target}: {o.why}", highlight=False)
    console.print(summary_line(outcomes), highlight=False)
    if bad:
        raise typer.Exit(1)


@topology_app.command("aws")
def topology_aws(
    regions: str = typer.Option(..., help="comma-separated AWS regions, e.g. Virginia,Ohio,Oregon"),
    name: str = typer.Option(..., help="topology name"),
    scale: float = typer.Option(10.0, help="divide measured bandwidths by this"),
    hosts: int = typer.Option(2, help="worker hosts per DC"),
    cpus: float = typer.Option(0.0, help="CPU cores per host container (0 = unlimited)"),
    description: str = typer.Option("", help="replaces the generated description"),
    output: Optional[Path] = typer.Option(None, "--out", "-o", help="write here instead of stdout"),
) -> None:
    """A full-mesh topology from the measured AWS inter-region matrix."""
    from testbed.spec.awsmatrix import aws_topology
    from testbed.spec.topology import parse_topology

    try:
        data = aws_topology(name, [r.strip() for r in regions.split(",")], scale, hosts, cpus, description)
    except ValueError as exc:
        _fail(str(exc))
    parse_topology(data, name)  # what we write must load
    text = "# Generated by: testbed topology aws --regions " + regions + f" --name {name} --scale {scale:g} " \
           f"--hosts {hosts} --cpus {cpus:g}\n" \
           "# delay_ms is one-way: half the round trip the matrix measured (source_rtt_ms)\n" \
           + yaml.safe_dump(data, sort_keys=False)
    if output:
        output.write_text(text)
        console.print(f"wrote {output}")
    else:
        sys.stdout.write(text)


from testbed.tools.vmcli import vm_app  # noqa: E402  (testbed vm ...: the netem VM)
from testbed.run.labcli import register as _register_lab_commands  # noqa: E402



def _open_job_lab(*args, **kwargs):
    """``cluster.jobs.open_job_lab``, imported when ``testbed torchrun --inventory`` runs."""
    from testbed.cluster.jobs import open_job_lab

    return open_job_lab(*args, **kwargs)


def _cluster_errors() -> tuple:
    from testbed.cluster.inventory import ClusterError

    return (ClusterError,)


# testbed up, status, down, exec, shell, link, record, torchrun (with --inventory: across machines)
_register_lab_commands(app, _open_job_lab, _cluster_errors)

app.add_typer(vm_app, name="vm")


def _is_root() -> bool:
    return os.geteuid() == 0


def _end_agent(force: bool) -> dict | None:
    """The machine agent of this machine, if one runs: ended (it removes its own network on
    SIGTERM) when ``force``; else left alone and returned (another orchestrator's live run)."""
    import time

    from testbed.cluster.agent import live_agent

    info = live_agent()
    if info is None:
        return None
    if not force:
        return info
    pid = int(info["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.path.exists(f"/proc/{pid}"):
        os.kill(pid, signal.SIGKILL)
    return None


@app.command("machine-agent")
def machine_agent(
    lease: float = typer.Option(15.0, help="end, and clean up, after this many seconds without the orchestrator"),
    hello_timeout: float = typer.Option(60.0, help="end when the orchestrator says nothing within this"),
) -> None:
    """One machine's part of a run across machines, on stdin/stdout (the orchestrator starts it over SSH)."""
    from testbed.cluster.agent import serve_stdio

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code = serve_stdio(lease_s=lease, hello_s=hello_timeout)
    except KeyboardInterrupt:
        code = 130
    raise typer.Exit(code)


fake_app = typer.Typer(no_args_is_help=True, help="A fake cluster of machines on this one (for trying --inventory).")
app.add_typer(fake_app, name="fake-cluster")


@fake_app.command("up")
def fake_up(machines: int = typer.Argument(3, help="how many machines"),
            clock_offsets: str = typer.Option("", help="each machine's clock offset in seconds: 5,0,-3"),
            inventory: Path = typer.Option(Path("fake-cluster.ini"), help="where to write its inventory")) -> None:
    """Start MACHINES fake machines (netns + mount + PID + time namespaces, sshd each) on an underlay."""
    from testbed.cluster import fake

    try:
        offsets = [float(x) for x in clock_offsets.split(",") if x.strip()]
    except ValueError:
        _fail(f"--clock-offsets {clock_offsets!r}: seconds, comma-separated")
    try:
        cluster = fake.create(machines, offsets)
    except fake.FakeClusterError as exc:
        _fail(str(exc))
    inventory.write_text(cluster.inventory_text())
    out.print(f"{machines} fake machine(s) up; inventory {inventory}; the orchestrator runs in the head's "
              f"network: nsenter --net=/proc/{cluster.head_pid}/ns/net .venv/bin/testbed run ... --inventory "
              f"{inventory}")


@fake_app.command("down")
def fake_down() -> None:
    """End the fake cluster and everything in it."""
    from testbed.cluster import fake

    out.print(f"fake cluster: ended {len(fake.destroy())} process(es)")


# what extensions add (``testbed.extension``): a typer app is a command group (``testbed titan
# ...``), a function one command (``testbed plan``)
for _name, _load in _extension_commands().items():
    _target = _load()
    if isinstance(_target, typer.Typer):
        app.add_typer(_target, name=_name)
    else:
        app.command(_name)(_target)


# What each optional part of the package needs (pyproject.toml's extras), for the one-line
# error a command gives when its part is not installed.
_EXTRA_OF = {"torch": "train", "highspy": "lp", "ansible_runner": "cluster", "ansible": "cluster"}


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top not in _EXTRA_OF:
            raise
        try:
            _fail(f"{top} is not installed, and this command needs it: pip install 'geo-testbed[{_EXTRA_OF[top]}]'")
        except typer.Exit as end:  # outside the app: exit as it would have
            sys.exit(end.exit_code)


if __name__ == "__main__":
    main()
