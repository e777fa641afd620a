"""What a user writes for a run across machines: the Ansible inventory, and where each DC goes.

A machine is an inventory host with ``gtb_underlay`` (the address its VXLANs and the
machine agent use; SSH goes to ``ansible_host``), optionally ``gtb_gpus`` (how many GPUs
its workers may use) and ``gtb_dcs`` (comma-separated DCs it hosts).  The inventory is
read by Ansible's own parser, so groups, ranges and ``:vars`` mean what they mean to
Ansible.  ``place`` maps every DC to one machine (a DC never spans machines): first the
``--machines`` flag (``dc=machine,...``), then ``gtb_dcs``, then the default packing:
the remaining DCs in file order, in contiguous blocks of equal size, one block per
machine in inventory order.  A bad map is a one-line ``ClusterError``.
"""

from __future__ import annotations

import ipaddress
import math
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


def load_inventory(path: str | Path) -> list[Machine]:
    """The machines of an inventory (hosts with ``gtb_underlay``), in inventory order."""
    path = Path(path)
    if not path.is_file():
        raise ClusterError(f"inventory {path}: no such file")
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.utils.display import Display

    Display().verbosity = 0
    try:
        inv = InventoryManager(loader=DataLoader(), sources=[str(path)])
    except Exception as exc:
        raise ClusterError(f"inventory {path}: {str(exc).splitlines()[0]}") from None
    machines = []
    for host in inv.get_hosts():
        hv = host.get_vars()
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
        machines.append(Machine(host.name, underlay, gpus, dcs))
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
