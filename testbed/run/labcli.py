"""The lab commands of ``testbed``: ``up``, ``status``, ``down``, ``exec``, ``shell``, ``link``,
``record`` and ``torchrun``.

How it fits: ``cli.py`` calls ``register(app, open_job_lab, cluster_errors)``; each command is
a thin layer over ``labserver`` (a lab that stays up: start it, find it, ask it), ``lab.Lab``
(a lab for one ``torchrun`` job, in this process) and ``torchrun.run_job``.  ``torchrun
--inventory`` runs the job across machines on the lab that ``open_job_lab`` opens
(``cluster.jobs``: this layer sits below ``cluster`` and is handed the function), after
copying the script's folder to each machine with a rank (``ship``).  ``exec`` and ``shell`` enter the
host themselves (``mnexec -a`` the host shell's PID, recorded in the registry first) and
replace this process, so stdin, stdout and the exit code are the command's own.  Errors the
user can fix print one line and exit 2; a job exits with its own exit code.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer
from rich.console import Console
from rich.table import Table

from testbed.cliutil import fail, fail_interrupted, on_sigterm

console = Console(stderr=True)
out = Console()


def _errors():
    from testbed.extension import ExtensionError
    from testbed.net.kernel import BackendUnavailable
    from testbed.net.network import NetworkError
    from testbed.registry import Busy, CleanError
    from testbed.run.lab import LabError
    from testbed.spec.topology import SpecError

    return (LabError, SpecError, BackendUnavailable, NetworkError, Busy, CleanError, ExtensionError)


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        fail(f"testbed {what} must run as root (network namespaces)")


def _target(text: str) -> tuple[str, int]:
    dc, _, index = text.partition(":")
    if index and not index.isdigit():
        fail(f"host {text!r}: DC or DC:INDEX, INDEX a whole number (0 is the DC's first host)")
    return dc, int(index or 0)


def _client(lab: Optional[str]):
    from testbed.run.labserver import LabClient

    try:
        return LabClient.find(lab)
    except _errors() as exc:
        fail(str(exc))


def _print_hosts(info: dict) -> None:
    by_dc: dict[str, list[dict]] = {}
    for h in info["hosts"]:
        by_dc.setdefault(h["dc"], []).append(h)
    for dc, hosts in by_dc.items():
        out.print(f"  {dc}: " + ", ".join(f"{dc}:{h['index']} {h['name']} {h['ip']}" for h in hosts), highlight=False)


def _links_table(info: dict) -> Table:
    table = Table(title=f"lab {info['name']}: WAN links", title_justify="left")
    for col in ("link", "delay ms", "jitter ms", "loss", "rate Mbit/s", "queue bytes"):
        table.add_column(col, justify="right")
    for x in info["links"]:
        table.add_row(f"{x['src']}->{x['dst']}", f"{x['delay_ms']:g}", f"{x['jitter_ms']:g}", f"{x['loss']:g}",
                      f"{x['rate_mbps']:g}", str(x["queue_bytes"]))
    return table


def register(app: typer.Typer, open_job_lab: Optional[Callable[..., Any]] = None,
             cluster_errors: Callable[[], tuple] = tuple) -> None:
    """Add the lab commands to ``app``.  ``open_job_lab(topo, inventory, machines, delay_backend,
    progress)``: a torchrun lab across machines (``cluster.jobs.open_job_lab``, which this layer
    does not import), with ``cluster_errors()`` the errors it raises that a user can fix."""

    @app.command()
    def up(topology: str = typer.Argument(..., help="topology file or name in topologies/"),
           name: Optional[str] = typer.Option(None, help="the lab's name (default: the topology's)"),
           delay_backend: str = typer.Option("auto", help="auto, netem or tun")) -> None:
        """Build TOPOLOGY as a lab that stays up (until testbed down), check its WAN, print its hosts."""
        from testbed.run.lab import check_lab_name
        from testbed.run.labserver import start_detached
        from testbed.spec.topology import load_topology, resolve_topology

        _need_root("up")
        try:
            path = resolve_topology(topology)
            topo = load_topology(path)
            lab_name = check_lab_name(name or topo.name)
            with console.status(f"lab {lab_name}: starting") as status:
                info = start_detached(path.resolve(), lab_name, delay_backend,
                                      progress=lambda m: status.update(f"lab {lab_name}: {m}"))
        except _errors() as exc:
            fail(str(exc))
        except KeyboardInterrupt as exc:
            fail_interrupted(exc)
        out.print(f"lab [bold]{info['name']}[/] up ({info['topology']}, built in {info['startup_s']:.1f} s, "
                  f"delay: {info['backends']['delay']}); hosts:")
        _print_hosts(info)
        ok = sum(1 for c in info["wan_check"] if c["ok"])
        out.print(f"WAN check: {ok}/{len(info['wan_check'])} directions within tolerance")
        for w in info["warnings"]:
            console.print(f"[bold yellow]warning:[/] {w}", highlight=False)
        out.print(f"next: testbed exec {info['hosts'][0]['dc']} -- CMD; testbed status; testbed down {info['name']}")

    @app.command()
    def status(as_json: bool = typer.Option(False, "--json", help="print JSON (a list, one object per lab)")) -> None:
        """The labs that are up: hosts (dc, index, name, ip) and WAN links with their settings."""
        from testbed.run.labserver import read_labs

        labs = read_labs()
        if as_json:
            out.print_json(json.dumps(labs))
            return
        if not labs:
            out.print("no lab is up")
            return
        for info in labs:
            state = "[green]up[/]" if info["state"] == "up" else \
                f"[red]gone[/] (its process died: testbed down {info['name']} removes what it left)"
            out.print(f"lab [bold]{info['name']}[/]: {info['topology']}, {state}, pid {info['pid']}")
            _print_hosts(info)
            out.print(_links_table(info))

    @app.command()
    def down(name: Optional[str] = typer.Argument(None, help="the lab (default: the one up)")) -> None:
        """Take a lab down: every process in it ends, everything it made is removed."""
        from testbed.run.labserver import find_lab, stop_lab

        _need_root("down")
        try:
            info = find_lab(name)
            stop_lab(info["name"])
        except _errors() as exc:
            fail(str(exc))
        out.print(f"lab {info['name']} down")

    @app.command("exec", context_settings={"allow_interspersed_args": False})
    def exec_(target: str = typer.Argument(..., metavar="DC[:INDEX]", help="the host (INDEX from 0; default 0)"),
              command: List[str] = typer.Argument(..., metavar="-- COMMAND...", help="what to run there"),
              lab: Optional[str] = typer.Option(None, help="the lab (default: the one up)")) -> None:
        """Run COMMAND in a host of a lab (stdin, stdout and the exit code are COMMAND's)."""
        _need_root("exec")
        _enter(lab, target, command)

    @app.command()
    def shell(target: str = typer.Argument(..., metavar="DC[:INDEX]", help="the host (INDEX from 0; default 0)"),
              lab: Optional[str] = typer.Option(None, help="the lab (default: the one up)")) -> None:
        """An interactive shell in a host of a lab."""
        _need_root("shell")
        _enter(lab, target, ["bash", "--norc", "-i"], shell=True)

    @app.command()
    def link(src: str = typer.Argument(..., help="one end (DC)"), dst: str = typer.Argument(..., help="the other end"),
             lab: Optional[str] = typer.Option(None, help="the lab (default: the one up)"),
             delay_ms: Optional[float] = typer.Option(None, help="one-way delay"),
             jitter_ms: Optional[float] = typer.Option(None, help="uniform +- jitter"),
             loss: Optional[float] = typer.Option(None, help="fraction of packets dropped"),
             rate_mbps: Optional[float] = typer.Option(None, help="rate"),
             queue_bytes: Optional[int] = typer.Option(None, help="bottleneck queue"),
             one_way: bool = typer.Option(False, "--one-way", help="only SRC -> DST (default: both directions, "
                                                                  "as a link in a topology file)")) -> None:
        """Change a WAN link of a running lab in place (both directions unless --one-way)."""
        _need_root("link")
        changes = {k: v for k, v in (("delay_ms", delay_ms), ("jitter_ms", jitter_ms), ("loss", loss),
                                     ("rate_mbps", rate_mbps), ("queue_bytes", queue_bytes)) if v is not None}
        if not changes:
            fail("testbed link: nothing to change (--delay-ms, --jitter-ms, --loss, --rate-mbps or --queue-bytes)")
        client = _client(lab)
        try:
            done = [client.set_link(a, b, **changes) for a, b in ([(src, dst)] if one_way else [(src, dst), (dst, src)])]
        except _errors() as exc:
            fail(str(exc))
        for x in done:
            out.print(f"{x['src']}->{x['dst']}: delay {x['delay_ms']:g} ms, jitter {x['jitter_ms']:g} ms, "
                      f"loss {x['loss']:g}, rate {x['rate_mbps']:g} Mbit/s, queue {x['queue_bytes']} bytes",
                      highlight=False)

    @app.command()
    def record(out_dir: Path = typer.Option(..., "--out", help="counters.csv goes here"),
               lab: Optional[str] = typer.Option(None, help="the lab (default: the one up)"),
               interval_ms: float = typer.Option(100.0, help="sample every this many ms"),
               duration: Optional[float] = typer.Option(None, help="stop after this many seconds (default: Ctrl-C)")) -> None:
        """Sample every WAN link's counters (bytes, packets, drops, queue) into OUT/counters.csv until
        Ctrl-C or --duration."""
        _need_root("record")
        if interval_ms < 1:
            fail(f"--interval-ms {interval_ms:g}: at least 1")
        client = _client(lab)
        signal.signal(signal.SIGTERM, on_sigterm)
        rows = 0
        state: dict = {"t0": None, "prev": None}

        def take(w) -> None:
            nonlocal rows
            sample = client.counter_table()
            if state["t0"] is None:
                state["t0"] = min(c["time"] for c in sample.values())
            prev = state["prev"]
            for key, c in sample.items():
                p = prev.get(key) if prev else None
                mbps = "" if p is None or c["time"] <= p["time"] else \
                    f"{(c['tx_bytes'] - p['tx_bytes']) * 8 / (c['time'] - p['time']) / 1e6:.3f}"
                w.writerow([f"{c['time'] - state['t0']:.4f}", key, c["tx_bytes"], c["tx_packets"], c["drops"],
                            c["backlog_bytes"], mbps])
                rows += 1
            state["prev"] = sample

        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / "counters.csv"
            with open(path, "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(["time_s", "link", "tx_bytes", "tx_packets", "drops", "backlog_bytes", "mbps"])
                end = None if duration is None else time.monotonic() + duration
                try:
                    while end is None or time.monotonic() < end:
                        take(w)
                        fh.flush()
                        time.sleep(interval_ms / 1000)
                except KeyboardInterrupt:
                    take(w)  # Ctrl-C ends it with one last sample: what crossed until then is counted
        except KeyboardInterrupt:
            pass
        except OSError as exc:
            fail(f"--out {out_dir}: {exc.strerror or exc}")
        except _errors() as exc:
            fail(str(exc))
        console.print(f"wrote {rows} rows to {out_dir / 'counters.csv'}", highlight=False)

    @app.command()
    def torchrun(
        items: List[str] = typer.Argument(..., metavar="[TOPOLOGY] -- SCRIPT [ARGS]...",
                                          help="a topology (file or name; not with --lab), then the script and its arguments"),
        ranks: str = typer.Option(..., help="ranks per DC, in order: DC=N,DC=N (rank 0, MASTER_ADDR, on the first)"),
        lab: Optional[str] = typer.Option(None, help="run in this lab (testbed up) instead of building TOPOLOGY"),
        out_dir: Path = typer.Option(Path("results/torchrun"), "--out", help="metrics.json, timeline.json, logs/"),
        connections: int = typer.Option(1, help="NCCL sockets per peer (NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD)"),
        master_port: int = typer.Option(29500, help="MASTER_PORT"),
        nproc_threads: int = typer.Option(1, help="OMP_NUM_THREADS / MKL_NUM_THREADS of each rank"),
        timeout: Optional[float] = typer.Option(None, help="stop the job after this many seconds (exit 124)"),
        sample_ms: float = typer.Option(50.0, help="sample the WAN counters every this many ms (timeline.json)"),
        delay_backend: str = typer.Option("auto", help="auto, netem or tun (building TOPOLOGY)"),
        with_: List[str] = typer.Option([], "--with", metavar="NAME=VALUE",
                                        help="apply extension NAME to the job's network, VALUE its options "
                                             "(e.g. a file); repeatable"),
        inventory: Optional[Path] = typer.Option(None, help="an Ansible inventory: the DCs go to its machines, "
                                                            "SCRIPT's folder is copied to each (README: several "
                                                            "machines)"),
        machines: Optional[str] = typer.Option(None, help="with --inventory: DC=MACHINE,... (default: packed in order)"),
    ) -> None:
        """Run SCRIPT as a torch.distributed job, one rank per host of the DCs in --ranks, across the
        emulated WAN (torchrun's environment; gloo and NCCL on the hosts' emulated interfaces); with
        --inventory, across the inventory's machines."""
        from testbed.run.hooks import job_extensions
        from testbed.run.lab import Lab, LabError
        from testbed.run.torchrun import nccl_sockets, parse_ranks, provenance, run_job
        from testbed.spec.topology import load_topology, resolve_topology

        _need_root("torchrun")
        signal.signal(signal.SIGTERM, on_sigterm)
        command = ["testbed", "torchrun", *sys.argv[2:]]
        try:
            want = parse_ranks(ranks)
            nccl_sockets(connections)
            if lab is None:
                if len(items) < 2:
                    raise LabError("testbed torchrun: give TOPOLOGY and SCRIPT (or --lab NAME and SCRIPT)")
                topo_path = resolve_topology(items[0])
                script, args = Path(items[1]), items[2:]
            else:
                script, args = Path(items[0]), items[1:]
            if not script.is_file():
                raise LabError(f"script {script}: no such file")
            if machines is not None and inventory is None:
                raise LabError("--machines: only with --inventory")
            if inventory is not None and lab is not None:
                raise LabError(f"--inventory: not with --lab (lab {lab} is on this machine)")
            if inventory is not None and with_:
                raise LabError("--with: runs on one machine only, for now (not with --inventory)")
            exts = job_extensions(with_)
            if inventory is not None:
                from testbed.run.torchrun import check_ranks

                if open_job_lab is None:
                    raise LabError("--inventory: this testbed has no runs across machines")

                topo = load_topology(topo_path)
                check_ranks(want, {dc.name: dc.hosts for dc in topo.dcs}, topo.name)
                with console.status(f"{topo.name}: opening the machines") as st:
                    job_lab = open_job_lab(topo, inventory, machines, delay_backend,
                                           progress=lambda m: st.update(f"{topo.name}: {m}"))
                try:
                    for w in job_lab.warnings:
                        console.print(f"[bold yellow]warning:[/] {w}", highlight=False)
                    with console.status(f"{topo.name}: copying {script.resolve().parent}") as st:
                        job_lab.ship(script, [dc for dc, _ in want])
                    prov = provenance(command, topo_path, topo.name, job_lab.name)
                    result = run_job(job_lab, want, script, args, out_dir, connections, master_port, nproc_threads,
                                     timeout, sample_ms, job_lab.wan_check, prov, cluster=job_lab.summary())
                finally:
                    job_lab.down()
            elif lab is not None:
                client = _client(lab)
                prov = provenance(command, Path(client.info["topology_file"]) if client.info.get("topology_file")
                                  else None, client.info["topology"], client.name)
                result = run_job(client, want, script, args, out_dir, connections, master_port, nproc_threads, timeout,
                                 sample_ms, client.info.get("wan_check"), prov, extensions=exts)
            else:
                from testbed.run.labserver import read_labs
                from testbed.run.torchrun import check_ranks

                topo = load_topology(topo_path)
                check_ranks(want, {dc.name: dc.hosts for dc in topo.dcs}, topo.name)
                for info in read_labs():
                    raise LabError(f"lab {info['name']} is up, and this machine holds one network at a time "
                                   f"(testbed torchrun --lab {info['name']} ..., or testbed down {info['name']})")
                with console.status(f"{topo.name}: building the network") as st:
                    job_lab = Lab(topo, progress=lambda m: st.update(f"{topo.name}: {m}"))
                    job_lab.topology_file = topo_path
                    job_lab.up()
                try:
                    for w in job_lab.warnings:
                        console.print(f"[bold yellow]warning:[/] {w}", highlight=False)
                    prov = provenance(command, topo_path, topo.name, job_lab.name)
                    result = run_job(job_lab, want, script, args, out_dir, connections, master_port, nproc_threads,
                                     timeout, sample_ms, job_lab.wan_check, prov, extensions=exts)
                finally:
                    job_lab.down()
        except _errors() + cluster_errors() as exc:
            fail(str(exc))
        except KeyboardInterrupt as exc:
            fail_interrupted(exc)
        except OSError as exc:
            fail(f"--out {out_dir}: {exc.strerror or exc}")
        if result.exit_code:
            console.print(f"[bold red]error:[/] {result.message}", highlight=False, soft_wrap=True)
            raise typer.Exit(result.exit_code)
        console.print(f"{result.message}; {out_dir / 'metrics.json'}, {out_dir / 'timeline.json'}", highlight=False)


def _enter(lab: Optional[str], target: str, command: list[str], shell: bool = False) -> None:
    """Replace this process with ``command`` inside the host (recorded first, for clean)."""
    from testbed.registry import Registry
    from testbed.run.lab import enter_argv, pick_host

    client = _client(lab)
    dc, index = _target(target)
    try:
        host = pick_host(client.host_table(), dc, index, client.name)
    except _errors() as exc:
        fail(str(exc))
    Registry().process(os.getpid(), f"lab:{client.name}:{host['name']}:exec", own_netns=False)
    env = dict(os.environ)
    if shell:
        env["PS1"] = f"[{client.name} {dc}:{index} {host['name']} {host['ip']}] \\w# "
    sys.stdout.flush()
    sys.stderr.flush()
    argv = enter_argv(host["pid"], command)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        fail(f"cannot run {argv[0]}: {exc.strerror}")
