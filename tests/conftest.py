"""Shared fixtures and hooks: what the machine offers, small topologies built in code, and
the project's own rules for network tests.

The general part is the testbed's pytest plugin (``testbed/tools/pytest_plugin.py``, loaded
through its entry point): the ``lab`` fixture, the ``network`` marker (``pytestmark =
pytest.mark.network``, or ``@pytest.mark.network(delay="tun")`` where a test needs one
backend), the skip with the reason where this machine cannot build a network, and the check
that nothing the testbed made (process, namespace, interface, cgroup) is left after a network
test.  This project adds, through the plugin's ``pytest_testbed_machine`` hook: its network
tests need iperf3 too, and a netem variant whose body runs in the netem VM leaves its check
to the guest.  A test that takes the ``delay_backend`` fixture runs once per delay backend
(``tun``, ``netem``), as Mininet's tests parametrize theirs; each variant skips where this
kernel lacks its backend, except that the netem variants run in the netem VM on a kernel
without netem (``tests/netem_vm.py``).

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

import netem_vm
from netem_vm import (  # noqa: F401  (hooks: the netem variants run in the netem VM on a kernel without netem)
    pytest_collection_finish, pytest_pyfunc_call, pytest_runtest_logreport, pytest_runtest_setup, pytest_sessionfinish,
    runs_in_vm)
from testbed.net.kernel import Capabilities
from testbed.spec.topology import Topology, parse_topology
from testbed.tools import pytest_plugin
from testbed.tools.pytest_plugin import capabilities  # noqa: F401  (netem_vm asks it)

DELAY_BACKENDS = ["tun", "netem"]


def pytest_configure(config: pytest.Config) -> None:
    netem_vm.pytest_configure(config)
    # The plugin comes through its entry point; in a venv installed before the entry point
    # existed (until ``pip install -e .`` again) it is registered here ("-p no:testbed" still
    # leaves it out).
    pm = config.pluginmanager
    if not pm.is_blocked("testbed") and not pm.is_registered(pytest_plugin):
        pm.register(pytest_plugin, "testbed")


@pytest.hookimpl(optionalhook=True)  # the plugin's hook ("-p no:testbed" leaves the plugin out)
def pytest_testbed_machine(item, delay_backend: str, loss_backend: str) -> Capabilities | None:
    """This project's network tests: a netem variant that runs in the netem VM is checked
    there; every other needs iperf3 as well as what the plugin checks."""
    if runs_in_vm(item):
        return capabilities()  # the guest checks its own (tests/netem_vm.py)
    if os.geteuid() == 0 and not capabilities().iperf3:
        pytest.skip("needs iperf3")
    return None  # the plugin's checks


# Inside the netem VM under TCG (software emulation), measured on this 2-core host while other
# work ran on it: on a 0 ms link the one-way probe reads min 0.75 / median 1.2 / p95 6.9 ms and
# ping 0.3 / 0.5 / 0.8 ms (each packet crosses three emulated network stacks; a Python receiver
# stamps it), and a netem delay's minimum reads 0.7-1.6 ms high, never low.  HTB's timers and
# the guest's CPU run late there: shaped goodput is 0.95 of the rate (0.998 of the payload
# rate) at 5 Mbit/s, 0.885-0.95 at 10, 0.89 at 20, 0.86 at 40.  So under TCG upper bounds on
# minimum delays get TCG_DELAY_SLACK_MS more, upper bounds on a 95th percentile
# TCG_TAIL_SLACK_MS more (lower bounds stay: emulation only adds delay), and links run at
# TCG_RATE_SCALE of their rate (100 -> 5 Mbit/s); bounds on rates stay ratios to the rate, so
# a link that is not shaped still fails (the guest moves 60-70 Mbit/s unshaped).
TCG_DELAY_SLACK_MS = 2.5
TCG_TAIL_SLACK_MS = 8.0
TCG_RATE_SCALE = 0.05


def emulation() -> str | None:
    """'tcg' or 'kvm' inside the netem VM (``tests/netem_vm.py``), None on a real machine."""
    return os.environ.get("GTB_VM_ACCEL") or None


def delay_slack_ms(tail: bool = False) -> float:
    """What an upper bound on a measured minimum (or, with ``tail``, a 95th percentile)
    delay may add here: 0 outside TCG."""
    if emulation() != "tcg":
        return 0.0
    return TCG_TAIL_SLACK_MS if tail else TCG_DELAY_SLACK_MS


def link_rate(rate_mbps: float) -> float:
    """The rate a test's link runs at here: ``rate_mbps`` scaled down under TCG."""
    return rate_mbps * TCG_RATE_SCALE if emulation() == "tcg" else rate_mbps


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


@pytest.fixture
def caps(testbed_caps) -> Capabilities:
    """What this machine offers (a network test has already been skipped where it cannot run)."""
    return testbed_caps


@pytest.hookimpl(tryfirst=True)  # its marks are in place before -m deselects
def pytest_collection_modifyitems(config, items):
    netem_vm.pytest_collection_modifyitems(config, items)  # the netem variants carry the netem marker
    for item in items:
        if item.get_closest_marker("slow_on_netem") and item.get_closest_marker("netem"):
            item.add_marker(pytest.mark.slow)
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


_MISSES_KEY = pytest.StashKey[list]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and _LOAD_KEY in item.stash:
        report.sections.append(("machine while the test ran", item.stash[_LOAD_KEY]))
        # kept for the summary: a miss that passes when measured again leaves no other trace
        crash = getattr(report.longrepr, "reprcrash", None)
        why = crash.message.splitlines()[0][:300] if crash else str(report.longrepr).splitlines()[-1][:300]
        item.config.stash.setdefault(_MISSES_KEY, []).append(f"{item.nodeid}: {why} | {item.stash[_LOAD_KEY]}")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    netem_vm.pytest_terminal_summary(terminalreporter, exitstatus, config)
    misses = config.stash.get(_MISSES_KEY, [])
    if misses:
        terminalreporter.write_sep("-", "fidelity misses (each measured once more)")
        for line in misses:
            terminalreporter.write_line(line)
