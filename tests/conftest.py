"""Shared fixtures: what the machine offers, and small topologies built in code.

Tests that build networks need root, Mininet and the kernel features the chosen backend
uses; they skip with the reason where those are missing (CI installs and provides them).
"""

from __future__ import annotations

import os

import pytest

from testbed.kernel import Capabilities, choose_backends, probe, BackendUnavailable
from testbed.spec import Topology, parse_topology

_CAPS: Capabilities | None = None


def capabilities() -> Capabilities:
    global _CAPS
    if _CAPS is None:
        _CAPS = probe()
    return _CAPS


def skip_unless_network(delay_backend: str = "auto", loss_backend: str = "auto") -> Capabilities:
    """Skip the calling test, with the reason, where a network cannot be built here."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, tc)")
    caps = capabilities()
    if not caps.mininet:
        pytest.skip("needs Mininet (apt-get install mininet)")
    if not caps.veth:
        pytest.skip(f"kernel cannot create veth pairs: {caps.errors.get('veth', '')}")
    if not caps.iperf3:
        pytest.skip("needs iperf3")
    try:
        choose_backends(caps, delay_backend, loss_backend)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    return caps


def two_dcs(delay_ms: float = 10.0, rate_mbps: float = 100.0, hosts: int = 1, **extra) -> Topology:
    link = {"a": "east", "b": "west", "delay_ms": delay_ms, "rate_mbps": rate_mbps, **extra}
    return parse_topology(
        {"name": "two", "dcs": [{"name": "east", "hosts": hosts}, {"name": "west", "hosts": hosts}], "wan": [link]}
    )


@pytest.fixture
def caps() -> Capabilities:
    return skip_unless_network()


@pytest.fixture(autouse=True)
def _nothing_left_behind(request):
    """Every test that built a network must leave no interface or namespace behind."""
    yield
    if os.geteuid() == 0 and "network" in request.keywords:
        from testbed.registry import leftovers

        left = leftovers()
        assert left == {"processes": [], "netns": [], "links": []}, f"left behind: {left}"
