"""Shared fixtures: what the machine offers, and small topologies built in code.

Tests that build networks carry the ``network`` marker (``pytestmark = pytest.mark.network``,
or ``@pytest.mark.network(delay="tun")`` where a test needs one backend).  They need root,
Mininet and the kernel features the chosen backend uses, and skip with the reason where
those are missing (CI installs and provides them).  A test that takes the ``delay_backend``
fixture runs once per delay backend (``tun``, ``netem``), as Mininet's tests parametrize
theirs; each variant skips where this kernel lacks its backend.  After every network test
nothing the testbed made may be left: no process, namespace, interface or cgroup.

Tests marked ``fidelity`` assert a timing or throughput tolerance on a machine that is shared
and noisy (CI's measured 0.75-0.88 of a link's rate in single tests that pass here at 0.95):
such a test is measured once more when it misses (pytest-rerunfailures; the rerun shows in
the summary), and a failure carries a section with the machine's load while it ran (CPU busy
and steal over the test, the processes that used the most CPU), so a miss says whether the
link or the machine was short.
"""

from __future__ import annotations

import os
import time

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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("fidelity") and not item.get_closest_marker("flaky"):
            item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=2))


_LOAD_KEY = pytest.StashKey[str]()


def _machine_sample() -> tuple[float, list[int], dict[int, tuple[str, int]]]:
    with open("/proc/stat") as fh:
        cpu = [int(x) for x in fh.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    head, rest = fh.read().rsplit(")", 1)
                fields = rest.split()
                procs[int(name)] = (head.split("(", 1)[1], int(fields[11]) + int(fields[12]))
            except (OSError, IndexError, ValueError):
                continue
    return time.monotonic(), cpu, procs


def _machine_report(before, after) -> str:
    (t0, cpu0, procs0), (t1, cpu1, procs1) = before, after
    delta = [b - a for a, b in zip(cpu0, cpu1)]
    total = sum(delta) or 1
    busy = 1 - (delta[3] + delta[4]) / total
    hz = os.sysconf("SC_CLK_TCK")
    span = max(t1 - t0, 1e-3)
    used = sorted(((ticks - procs0.get(pid, (None, 0))[1]) / hz / span, pid, comm)
                  for pid, (comm, ticks) in procs1.items())[::-1][:6]
    top = ", ".join(f"{comm}[{pid}] {cores:.2f}" for cores, pid, comm in used if cores >= 0.01)
    return (f"{span:.1f} s on {os.cpu_count()} CPUs: busy {busy:.0%}, steal {delta[7] / total:.0%}, "
            f"softirq {delta[6] / total:.0%}; most CPU (cores, living at the end): {top or 'none'}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if item.get_closest_marker("fidelity") is None:
        yield
        return
    before = _machine_sample()
    yield
    item.stash[_LOAD_KEY] = _machine_report(before, _machine_sample())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and _LOAD_KEY in item.stash:
        report.sections.append(("machine while the test ran", item.stash[_LOAD_KEY]))
