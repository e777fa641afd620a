"""The Ansible plays of a run across machines (``playbooks/cluster.yml``, through ansible-runner).

``install_build`` copies the orchestrator's own build (``build.archive``) to each machine a
run uses and unpacks it into ``build.BUILDS/<digest>/``, once per build; the orchestrator
then starts each agent from there over SSH (``remote.AgentClient``), so no play starts or
waits for a daemon.  ``clean_machines`` runs ``testbed clean`` on every machine of the
inventory: it removes what a crashed run left and leaves a live run (another orchestrator's
agent) alone unless forced.  Every play ignores unreachable hosts, so one dead machine does
not keep the others from being cleaned; what failed comes back as one line.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Callable

from testbed.spec.shipped import shipped
from testbed.tools.provision import ProvisionError, provision
from testbed.cluster import build
from testbed.cluster.inventory import ClusterError, Machine

PLAYBOOK = shipped("playbooks") / "cluster.yml"
ARCHIVES = Path("/var/cache/geo-testbed/builds")  # on the orchestrator


def _play(inventory: Path, tags: str, extravars: dict, limit: list[str] | None = None,
          progress: Callable[[str], None] | None = None):
    try:
        return provision(Path(inventory), playbook=PLAYBOOK, tags=tags, limit=",".join(limit) if limit else None,
                         extravars=extravars, progress=progress)
    except ProvisionError as exc:
        raise ClusterError(f"Ansible ({tags}): {exc}") from None


def _build_vars() -> dict:
    """What cluster-install.yml takes: this build's archive here and its folder there."""
    return {"gtb_archive": str(build.archive(ARCHIVES)), "gtb_build_dir": str(build.BUILDS / build.digest())}


def install_build(inventory: Path, machines: list[str], progress: Callable[[str], None] | None = None) -> str:
    """The orchestrator's build on ``machines``; its folder there."""
    where = _build_vars()
    if machines:
        result = _play(inventory, "install", where, machines, progress)  # hosts with gtb_testbed_root skip it
        if result.failures:
            raise ClusterError(f"Ansible could not install the build: {result.failures[0]}")
    return where["gtb_build_dir"]


def clean_machines(inventory: Path, force: bool = False, progress: Callable[[str], None] | None = None) -> dict:
    """``testbed clean`` on every machine of the inventory (host with ``gtb_underlay``), with this build (``--force``:
    also ending live runs); per host its play summary and what ``testbed clean`` said."""
    from testbed.cluster.inventory import load_inventory

    machines = load_inventory(inventory)  # its errors, one line each, before Ansible's
    result = _play(inventory, "clean", {**_build_vars(), "gtb_clean_args": "--force" if force else "",
                                        "gtb_pythons": {m.name: m.python for m in machines}},
                   [m.name for m in machines], progress)
    said = {host: tasks.get("End the agent, remove what the testbed made", "")
            for host, tasks in result.outputs.items()}
    return {"hosts": result.hosts, "failures": result.failures, "said": said}


def agent_command(machine: Machine, lease_s: float, build_dir: str) -> list[str]:
    """The argv (ssh ... or local) that starts ``machine``'s agent from the build."""
    root = machine.testbed_root or build_dir
    remote = (f"cd / && exec env PYTHONPATH={shlex.quote(root)} {machine.agent_wrap} {shlex.quote(machine.python)} "
              f"-m testbed.cli machine-agent --lease {lease_s:g}")
    return machine.command(remote)
