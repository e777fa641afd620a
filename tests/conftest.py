"""Shared fixtures: what the machine offers, and small topologies built in code.

Tests that build networks carry the ``network`` marker (``pytestmark = pytest.mark.network``,
or ``@pytest.mark.network(delay="tun")`` where a test needs one backend).  They need root,
Mininet and the kernel features the chosen backend uses, and skip with the reason where
those are missing (CI installs and provides them).  A test that takes the ``delay_backend``
fixture runs once per delay backend (``tun``, ``netem``), as Mininet's tests parametrize
theirs; each variant skips where this kernel lacks its backend.  After every network test
nothing the testbed made may be left: no process, namespace, interface or cgroup.
"""

from __future__ import annotations

import os

import pytest

from testbed.kernel import BackendUnavailable, Capabilities, choose_backends, probe
from testbed.spec import Topology, parse_topology

DELAY_BACKENDS = ["tun", "netem"]
_CAPS: Capabilities | None = None


def capabilities() -> Capabilities:
    global _CAPS
    if _CAPS is None:
        _CAPS = probe()
    return _CAPS


def _skip_unless_network(delay_backend: str = "auto", loss_backend: str = "auto") -> Capabilities:
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


@pytest.fixture(params=DELAY_BACKENDS)
def delay_backend(request) -> str:
    """Each delay backend in turn (the test is skipped where this kernel lacks it)."""
    return request.param


@pytest.fixture
def loss_backend() -> str:
    return "auto"


@pytest.fixture(autouse=True)
def _network_requirements(request):
    """Skip network tests that cannot run here; check that nothing was left behind after."""
    marker = request.node.get_closest_marker("network")
    if marker is None:
        yield
        return
    delay = marker.kwargs.get("delay", "auto")
    loss = marker.kwargs.get("loss", "auto")
    if "delay_backend" in request.fixturenames:
        delay = request.getfixturevalue("delay_backend")
    if "loss_backend" in request.fixturenames:
        loss = request.getfixturevalue("loss_backend")
    request.node.stash[_CAPS_KEY] = _skip_unless_network(delay, loss)
    yield
    from testbed.registry import NOTHING_LEFT, leftovers

    left = leftovers()
    assert left == NOTHING_LEFT, f"left behind: {left}"


_CAPS_KEY = pytest.StashKey[Capabilities]()


@pytest.fixture
def caps(request) -> Capabilities:
    """What this machine offers (a network test has already been skipped where it cannot run)."""
    return request.node.stash.get(_CAPS_KEY, None) or capabilities()
