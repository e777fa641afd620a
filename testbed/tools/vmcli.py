"""``testbed vm ...``: the netem VM by hand (``vm.py`` does the work).

    testbed vm build [--force]        build the image (cached in /var/cache/geo-testbed/vm)
    testbed vm check-playbook         provision a throwaway copy of it with playbooks/site.yml
    testbed vm test [PYTEST ARGS]     run tests inside the VM (default: every netem variant)
    testbed vm run -- COMMAND...      run a command inside the VM, the project at /mnt/gtb
    testbed vm shell                  an interactive root shell in a throwaway VM
    testbed vm status [--json]        what is cached, which accelerator a run would use
    testbed vm remove                 delete the cache (images, .deb files, KVM probe)

Every VM is removed when its command ends (also on Ctrl-C); only the cache stays.
"""

from __future__ import annotations

import json
import time
import typer
from rich.console import Console

from testbed.cliutil import fail as _fail

vm_app = typer.Typer(no_args_is_help=True, help="A throwaway VM with a stock Debian kernel that has netem.")
console = Console(stderr=True)
out = Console()


def _say(t0: float):
    return lambda msg: console.print(f"[{time.monotonic() - t0:6.1f} s] {msg}", highlight=False, markup=False)


@vm_app.command()
def build(force: bool = typer.Option(False, "--force", help="rebuild even if the image is cached")) -> None:
    """Build the image: debootstrap, Debian's kernel, the playbook's packages, the venv."""
    from testbed.tools import vm

    try:
        if force and vm.find_image() is not None:
            vm.remove_image(vm.find_image())
        img = vm.ensure_image(progress=_say(time.monotonic()))
    except vm.VMError as exc:
        _fail(str(exc), 1)
    meta = img.meta
    out.print(f"image {img.dir}: kernel {meta.get('kernel')}, backends {meta.get('backends')}, "
              f"built in {meta.get('times', {}).get('total_s', '?')} s")


@vm_app.command("check-playbook")
def check_playbook_cmd(as_json: bool = typer.Option(False, "--json", help="print the result as JSON")) -> None:
    """Provision a throwaway copy of the image with playbooks/site.yml (minutes under TCG):
    the playbook on a machine and a kernel that are not this one."""
    from testbed.tools import vm

    try:
        result = vm.check_playbook(progress=_say(time.monotonic()))
    except vm.VMError as exc:
        _fail(str(exc), 1)
    except KeyboardInterrupt:
        _fail("interrupted; the VM was stopped", 130)
    if as_json:
        out.print_json(json.dumps(result))
        return
    out.print(f"playbooks/site.yml provisioned the guest ({result['accel']}) in {result['wall_s']:.0f} s; "
              f"its testbed doctor chose {result['doctor'].get('backends')}", highlight=False)


@vm_app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run_cmd(
    ctx: typer.Context,
    network: bool = typer.Option(False, "--network", help="user-mode networking (the guest reaches what the host does)"),
    timeout: float = typer.Option(1800.0, help="seconds before the VM is stopped"),
) -> None:
    """Run COMMAND (after --) as root inside a throwaway VM, in the project (/mnt/gtb, read-only)."""
    import shlex

    from testbed.tools import vm

    if not ctx.args:
        _fail("give a command after --, e.g. testbed vm run -- testbed doctor")
    script = (f"cd {vm.GUEST_SRC}\nexport PYTHONPATH={vm.GUEST_SRC} PYTHONDONTWRITEBYTECODE=1 "
              f"PATH={vm.GUEST_PROJECT}/.venv/bin:$PATH\n{shlex.join(ctx.args)}\n")
    result = _run(script, network=network, timeout=timeout, echo=True)
    raise typer.Exit(result.rc if result.rc is not None else 1)


@vm_app.command("test", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def test_cmd(ctx: typer.Context, timeout: float = typer.Option(1800.0, help="seconds before the VM is stopped")) -> None:
    """Run pytest inside a throwaway VM (default: the netem variants, -m netem)."""
    from testbed.tools import vm

    result = _run(vm.pytest_job(ctx.args or ["-m", "netem", "tests"]), timeout=timeout, echo=True)
    raise typer.Exit(result.rc if result.rc is not None else 1)


def _run(script: str, network: bool = False, timeout: float = 1800.0, echo: bool = True):
    from testbed.tools import vm

    t0 = time.monotonic()
    try:
        img = vm.ensure_image(progress=_say(t0))
        result = vm.run_job(script, image=img, network=network, timeout_s=timeout,
                            on_line=(lambda line: out.print(line, highlight=False, markup=False)) if echo else None)
    except vm.VMError as exc:
        _fail(str(exc), 1)
    except KeyboardInterrupt:
        _fail("interrupted; the VM was stopped", 130)
    boot = f"{result.boot_s:.1f} s" if result.boot_s else "?"
    console.print(f"VM ({result.accel}): boot {boot}, {result.wall_s:.1f} s in all, exit {result.rc}"
                  + (" (timed out)" if result.timed_out else ""), highlight=False)
    return result


@vm_app.command()
def shell(network: bool = typer.Option(False, "--network", help="user-mode networking")) -> None:
    """An interactive root shell in a throwaway VM (Ctrl-A X quits QEMU; exit stops the VM)."""
    from testbed.tools import vm

    try:
        img = vm.ensure_image(progress=_say(time.monotonic()))
        raise typer.Exit(vm.shell(img, network=network))
    except vm.VMError as exc:
        _fail(str(exc), 1)


@vm_app.command()
def status(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """What is cached and what a run would use (starts nothing)."""
    from testbed.tools import vm

    st = vm.status()
    if as_json:
        out.print_json(json.dumps(st))
        return
    for key, value in st.items():
        out.print(f"{key}: {value}", highlight=False)


@vm_app.command()
def remove() -> None:
    """Delete the VM cache: images, downloaded .deb files, the KVM probe."""
    from testbed.tools import vm

    vm.remove_cache()
    out.print(f"removed {vm.CACHE}")
