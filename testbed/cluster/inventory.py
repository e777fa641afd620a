"""What a user writes for a run across machines: the Ansible inventory, and where each DC goes.

A machine is an inventory host with ``gtb_underlay`` (the address its VXLANs use; SSH goes
to ``ansible_host``, with the inventory's user, port, key and SSH arguments, as Ansible's
own connection does), optionally ``gtb_gpus`` (how many GPUs its workers may use),
``gtb_dcs`` (comma-separated DCs it hosts), ``gtb_python`` (the Python there that has the
testbed's dependencies: default the venv ``testbed provision`` made there, from
``testbed_venv`` or ``testbed_root``, else the orchestrator's own path), ``gtb_testbed_root`` (a
folder there that already holds the testbed's packages: no build is installed, and the
agent's build check says whether it is the orchestrator's) and ``gtb_agent_wrap`` (a
command the agent runs under, such as ``nice -n 5``).  The inventory is
read by Ansible's own parser, so groups, ranges and ``:vars`` mean what they mean to
Ansible.  ``place`` maps every DC to one machine (a DC never spans machines): first the
``--machines`` flag (``dc=machine,...``), then ``gtb_dcs``, then the default packing:
the remaining DCs in file order, in contiguous blocks of equal size, one block per
machine in inventory order.  A bad map is a one-line ``ClusterError``.
"""

from __future__ import annotations

import ipaddress
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from testbed.spec.topology import Topology


class ClusterError(RuntimeError):
    """A run across machines cannot go ahead; the message is one line."""


@dataclass
class Machine:
    name: str
    underlay: str
    gpus: int = 0
    dcs: tuple[str, ...] = ()
    ssh: tuple[str, ...] | None = None  # the ssh command that reaches it; None: Ansible's local connection
    python: str = sys.executable
    testbed_root: str | None = None  # provisioned by hand: no build installed
    agent_wrap: str = ""

    sudo: bool = False  # SSH's user is not root: the agent becomes root with sudo -n (as Ansible's become)

    def command(self, remote: str) -> list[str]:
        """The argv that runs shell command ``remote`` on this machine as root (over SSH, or here)."""
        if self.sudo:
            remote = f"sudo -n -- sh -c {shlex.quote(remote)}"
        return [*self.ssh, remote] if self.ssh is not None else ["sh", "-c", remote]


def _python(hv: dict) -> str:
    """The machine's Python: ``gtb_python``, else the venv ``testbed provision`` made there."""
    def plain(key: str) -> str | None:
        v = hv.get(key)
        return str(v) if v and "{{" not in str(v) else None

    if plain("gtb_python"):
        return plain("gtb_python")
    venv = plain("testbed_venv") or (f"{plain('testbed_root')}/.venv" if plain("testbed_root") else None)
    return f"{venv}/bin/python" if venv else sys.executable


def _ssh_argv(hv: dict, name: str) -> tuple[str, ...] | None:
    """What Ansible's ssh connection would run to reach the host (its inventory variables)."""
    if str(hv.get("ansible_connection", "ssh")) == "local":
        return None
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
    for key in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        argv += shlex.split(str(hv.get(key) or ""))
    if hv.get("ansible_port"):
        argv += ["-p", str(hv["ansible_port"])]
    key = hv.get("ansible_ssh_private_key_file") or hv.get("ansible_private_key_file")
    if key:
        argv += ["-i", str(key)]
    if hv.get("ansible_user"):
        argv += ["-l", str(hv["ansible_user"])]
    return (*argv, str(hv.get("ansible_host") or name), "--")


def load_inventory(path: str | Path) -> list[Machine]:
    """The machines of an inventory (hosts with ``gtb_underlay``), in inventory order."""
    path = Path(path)
    if not path.is_file():
        raise ClusterError(f"inventory {path}: no such file")
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.utils.display import Display
    from ansible.vars.manager import VariableManager

    Display().verbosity = 0
    try:
        loader = DataLoader()
        inv = InventoryManager(loader=loader, sources=[str(path)])
        variables = VariableManager(loader=loader, inventory=inv)
    except Exception as exc:
        raise ClusterError(f"inventory {path}: {str(exc).splitlines()[0]}") from None
    machines = []
    for host in inv.get_hosts():
        hv = variables.get_vars(host=host)  # the host's own and its groups' (:vars, group_vars/)
        if "gtb_underlay" not in hv:
            continue
        where = f"inventory {path}: host {host.name}"
        try:
            underlay = str(ipaddress.IPv4Address(str(hv["gtb_underlay"])))
        except ValueError:
            raise ClusterError(f"{where}: gtb_underlay {hv['gtb_underlay']!r} is not an IPv4 address") from None
        try:
            gpus = int(hv.get("gtb_gpus", 0))
        except (TypeError, ValueError):
            raise ClusterError(f"{where}: gtb_gpus {hv.get('gtb_gpus')!r} is not a whole number") from None
        if gpus < 0:
            raise ClusterError(f"{where}: gtb_gpus {gpus} is negative")
        dcs = tuple(d.strip() for d in str(hv.get("gtb_dcs", "")).split(",") if d.strip())
        ssh = _ssh_argv(hv, host.name)
        machines.append(Machine(host.name, underlay, gpus, dcs, ssh, _python(hv),
                                str(hv["gtb_testbed_root"]) if hv.get("gtb_testbed_root") else None,
                                str(hv.get("gtb_agent_wrap") or ""),
                                sudo=ssh is not None and str(hv.get("ansible_user") or "root") != "root"))
    if not machines:
        raise ClusterError(f"inventory {path}: no host has gtb_underlay (the address its WAN tunnels use)")
    seen: dict[str, str] = {}
    for m in machines:
        if m.underlay in seen:
            raise ClusterError(f"inventory {path}: hosts {seen[m.underlay]} and {m.name} have the same "
                               f"gtb_underlay {m.underlay}")
        seen[m.underlay] = m.name
    return machines


def parse_machines_flag(text: str | None) -> dict[str, str]:
    """``virginia=m1,ohio=m2`` -> {dc: machine}."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise ClusterError(f"--machines: {part.strip()!r} is not DC=MACHINE")
        dc, machine = (x.strip() for x in part.split("=", 1))
        out[dc] = machine
    return out


def place(topo: Topology, machines: list[Machine], flag: dict[str, str] | None = None) -> dict[str, str]:
    """Every DC of ``topo`` -> the machine it runs on."""
    names = {m.name for m in machines}
    dcs = [dc.name for dc in topo.dcs]
    out: dict[str, str] = {}
    for source, mapping in (("--machines", flag or {}),
                            ("gtb_dcs", {dc: m.name for m in machines for dc in m.dcs})):
        for dc, machine in mapping.items():
            if dc not in dcs:
                raise ClusterError(f"{source}: DC {dc!r} is not in topology {topo.name} (it has {', '.join(dcs)})")
            if machine not in names:
                raise ClusterError(f"{source}: machine {machine!r} for DC {dc} is not in the inventory "
                                   f"(it has {', '.join(sorted(names))})")
            out.setdefault(dc, machine)
    rest = [dc for dc in dcs if dc not in out]
    if rest:
        per = math.ceil(len(rest) / len(machines))
        for k, dc in enumerate(rest):
            out[dc] = machines[k // per].name
    return {dc: out[dc] for dc in dcs}
