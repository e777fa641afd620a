"""The Ansible plays of a run across machines (``playbooks/cluster.yml``, through ansible-runner).

``start_agents`` starts a leased machine agent on each machine the run uses and waits until
each listens; ``fetch_logs`` brings their logs into a results folder; ``clean_machines``
ends the agents and removes what the testbed made on every machine of the inventory.
Every play ignores unreachable hosts, so one dead machine does not keep the others from
being cleaned; what failed comes back as one line.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Callable

from testbed.spec.shipped import shipped
from testbed.tools.provision import ProvisionError, provision
from testbed.cluster.inventory import ClusterError

PLAYBOOK = shipped("playbooks") / "cluster.yml"


def testbed_command() -> str:
    """The testbed command the machines run: this checkout's, at the same path there (a real
    cluster provisions the same checkout path on every server: README)."""
    return shlex.join([sys.executable, "-m", "testbed.cli"])


def _play(inventory: Path, tags: str, extravars: dict, limit: list[str] | None = None,
          progress: Callable[[str], None] | None = None):
    try:
        return provision(Path(inventory), playbook=PLAYBOOK, tags=tags, limit=",".join(limit) if limit else None,
                         extravars={"gtb_testbed": testbed_command(), **extravars}, progress=progress)
    except ProvisionError as exc:
        raise ClusterError(f"Ansible ({tags}): {exc}") from None


def start_agents(inventory: Path, machines: list[str], port: int, token: str, lease_s: float,
                 progress: Callable[[str], None] | None = None) -> None:
    result = _play(inventory, "start", {"gtb_port": port, "gtb_token": token, "gtb_lease": lease_s}, machines,
                   progress)
    if result.failures:
        raise ClusterError(f"Ansible could not start the machine agents: {result.failures[0]}")


def fetch_logs(inventory: Path, machines: list[str], dst: Path) -> list[str]:
    dst.mkdir(parents=True, exist_ok=True)
    return _play(inventory, "logs", {"gtb_log_dir": str(dst.resolve())}, machines).failures


def clean_machines(inventory: Path, progress: Callable[[str], None] | None = None) -> dict:
    """``testbed clean`` on every machine of the inventory; per host its play summary."""
    result = _play(inventory, "clean", {}, None, progress)
    return {"hosts": result.hosts, "failures": result.failures}
