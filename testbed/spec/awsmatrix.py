"""Topologies from the measured AWS inter-region matrix (Yuan et al., NeurIPS 2022).

How it fits: ``testbed topology aws`` calls ``aws_topology`` to write the
``topologies/aws-*.yaml`` files; the simulator's large scenarios read the same matrix.
Bandwidths are divided by a stated ``scale`` so that a 2-core machine can carry them.
The matrix's ``delay_ms`` is the **round trip** the authors measured between two regions
(London-Frankfurt 14 ms, Sydney-London 262 ms: the familiar ping times; its single-connection
bandwidths are window-limited flows over those round trips).  A WAN link's ``delay_ms`` in a
topology is one-way, so each direction gets half the round trip, and the link records the
matrix's figure as ``source_rtt_ms`` (``testbed fidelity`` measures against both).  The data
file and its attribution are in ``testbed/data``.
"""

from __future__ import annotations

import csv
from importlib import resources
from itertools import combinations

SOURCE = (
    "Measured AWS inter-region delay and single-connection bandwidth: Yuan et al., "
    "'Decentralized Training of Foundation Models in Heterogeneous Environments', NeurIPS 2022"
)


def load_pairs() -> dict[frozenset[str], tuple[float, float]]:
    """(region, region) -> (round-trip time ms, single-connection bandwidth Gbit/s)."""
    text = resources.files("testbed").joinpath("data/aws-inter-region.csv").read_text()
    out = {}
    for row in csv.DictReader(text.splitlines()):
        out[frozenset((row["region_a"], row["region_b"]))] = (float(row["delay_ms"]), float(row["bandwidth_gbps"]))
    return out


def regions() -> list[str]:
    return sorted({r for pair in load_pairs() for r in pair})


def aws_topology(
    name: str,
    region_names: list[str],
    scale: float = 10.0,
    hosts_per_dc: int = 2,
    cpus_per_host: float = 0.0,
    description: str = "",
) -> dict:
    """A full-mesh topology dict over the given regions, bandwidth divided by ``scale``."""
    pairs = load_pairs()
    known = regions()
    for r in region_names:
        if r not in known:
            raise ValueError(f"unknown AWS region {r!r} (known: {', '.join(known)})")
    dcs = [
        {"name": r.lower(), "hosts": hosts_per_dc, "host": {"cpus": cpus_per_host, "gpus": 0}}
        for r in region_names
    ]
    wan = []
    for a, b in combinations(region_names, 2):
        rtt, gbps = pairs[frozenset((a, b))]
        wan.append({"a": a.lower(), "b": b.lower(), "delay_ms": rtt / 2, "source_rtt_ms": rtt,
                    "rate_mbps": round(gbps * 1000 / scale, 1)})
    return {
        "name": name,
        "description": description
        or f"AWS {', '.join(region_names)}: full mesh, measured round trips, bandwidth / {scale:g}",
        "source": f"{SOURCE}. The matrix's delays are round trips (source_rtt_ms); each direction's one-way "
                  f"delay_ms is half of it. "
                  + (f"Bandwidths scaled down by a factor of {scale:g} so this machine's CPUs keep up."
                     if scale != 1 else "Bandwidths as measured."),
        "dcs": dcs,
        "wan": wan,
    }
