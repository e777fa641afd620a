"""The testbed's pytest plugin: a test asks for ``lab`` and gets an emulated WAN that is up.

How it fits: installed with the package as the ``pytest11`` entry point ``testbed``, so every
pytest run in an environment where the testbed is installed loads it (``-p no:testbed``
leaves it out).  It brings:

- the ``lab`` fixture: a ``run.lab.Lab`` built from the test's topology and up (WAN
  self-check included; a direction outside tolerance is a ``LabWarning``), taken down after
  the test.  The topology comes from the marker, ``@pytest.mark.lab("aws-us3")`` (a shipped
  name, a file, relative to the test file or the working directory, or a ``Topology``) or
  ``@pytest.mark.lab(topology=.., delay_backend=.., loss_backend=.., name=.., check=..)``, or
  else from the ``lab_topology`` fixture, which a test file or conftest overrides.  The
  fixture is the ``Lab``: ``exec``, ``popen``, ``hosts``/``host``, ``link(src, dst).set(..)``,
  ``counters()``.
- the ``network`` marker, for a test that builds networks itself (``net.network.Network``,
  ``testbed up`` ...); ``@pytest.mark.network(delay="tun", loss="auto")`` names backends.  A
  test that uses ``lab`` carries it too, so ``-m "not network"`` leaves lab tests out.
- for every ``network`` test: a skip with the reason where this machine cannot build a
  network (not root, no Mininet, no brctl, no veth pairs or network namespaces, no ping, the
  chosen delay or loss backend missing; ``net.kernel.probe`` once per session), and after
  the test the registry's ``leftovers()``: anything the test left (process, namespace,
  link, cgroup, file; what was there before it is not its) is an error at its teardown
  naming what was left.
- ``testbed_caps``: what this machine offers (``net.kernel.Capabilities``).
- the hook ``pytest_testbed_machine(item, delay_backend, loss_backend)`` (first result
  wins): the capabilities a network test runs with, or a skip.  This plugin's own answer
  comes last, so a conftest may answer first (a test whose body runs elsewhere, e.g. in a
  VM) or add a requirement (``pytest.skip``) and return None.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from testbed.net.kernel import Capabilities

LAB_OPTIONS = ("topology", "delay_backend", "loss_backend", "name", "check")
_CAPS: Capabilities | None = None
_CAPS_KEY = pytest.StashKey["Capabilities"]()


class LabWarning(UserWarning):
    """A lab came up, but its WAN self-check found a direction that is not as configured."""


class _Hooks:
    @pytest.hookspec(firstresult=True)
    def pytest_testbed_machine(self, item: pytest.Item, delay_backend: str, loss_backend: str):
        """The ``Capabilities`` a network test runs with, or ``pytest.skip(reason)``; None: ask
        the next implementation (this plugin's, last: the checks of ``machine_problem``)."""


def pytest_addhooks(pluginmanager) -> None:
    pluginmanager.add_hookspecs(_Hooks)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "lab(topology=None, *, delay_backend='auto', loss_backend='auto', name=None, check=True): "
        "the topology (shipped name, file or Topology) and options of the test's `lab` fixture")
    config.addinivalue_line(
        "markers", "network(delay='auto', loss='auto'): builds emulated networks (needs root, Mininet, tc); "
        "skipped where the machine cannot, fails if it leaves anything behind")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that uses a lab is a network test (before ``-m`` selects)."""
    for item in items:
        uses_lab = "lab" in getattr(item, "fixturenames", ()) or item.get_closest_marker("lab") is not None
        if uses_lab and item.get_closest_marker("network") is None:
            item.add_marker(pytest.mark.network)


# -- what this machine offers ----------------------------------------------------------------
def capabilities() -> Capabilities:
    """``net.kernel.probe()``, once per process."""
    global _CAPS
    if _CAPS is None:
        from testbed.net.kernel import probe

        _CAPS = probe()
    return _CAPS


def machine_problem(caps: Capabilities, delay_backend: str = "auto", loss_backend: str = "auto") -> str | None:
    """Why this machine cannot build a network with these backends (one line), or None."""
    from testbed.net.kernel import BackendUnavailable, choose_backends

    if not caps.root:
        return "needs root (network namespaces, tc)"
    if not caps.mininet:
        return "needs Mininet (apt-get install mininet)"
    if not caps.bridge_utils:
        return "needs brctl (apt-get install bridge-utils)"
    if "netns" in caps.errors:
        return f"cannot create a network namespace: {caps.errors['netns']}"
    if not caps.veth:
        return f"kernel cannot create veth pairs: {caps.errors.get('veth', '')}".rstrip(": ")
    if not caps.ping:
        return "needs ping (apt-get install iputils-ping)"
    try:
        choose_backends(caps, delay_backend, loss_backend)
    except BackendUnavailable as exc:
        return str(exc)
    return None


def require_network(delay_backend: str = "auto", loss_backend: str = "auto") -> Capabilities:
    """This machine's capabilities, or ``pytest.skip`` with the reason it cannot build a network."""
    if os.geteuid() != 0:  # before probing: the probe needs root for most of it
        pytest.skip("needs root (network namespaces, tc)")
    caps = capabilities()
    why = machine_problem(caps, delay_backend, loss_backend)
    if why:
        pytest.skip(why)
    return caps


@pytest.hookimpl(trylast=True)
def pytest_testbed_machine(item: pytest.Item, delay_backend: str, loss_backend: str) -> Capabilities:
    return require_network(delay_backend, loss_backend)


# -- the lab marker ------------------------------------------------------------------------
def lab_options(item: pytest.Item) -> dict[str, Any]:
    """The ``lab`` markers' arguments, the closest first (a test's over its module's)."""
    opts: dict[str, Any] = {}
    for marker in item.iter_markers("lab"):
        if len(marker.args) > 1:
            pytest.fail(f"@pytest.mark.lab takes one topology, got {len(marker.args)} arguments", pytrace=False)
        unknown = sorted(set(marker.kwargs) - set(LAB_OPTIONS))
        if unknown:
            pytest.fail(f"@pytest.mark.lab: unknown argument {unknown[0]!r} (choose from {', '.join(LAB_OPTIONS)})",
                        pytrace=False)
        given = dict(marker.kwargs)
        if marker.args:
            if "topology" in given:
                pytest.fail("@pytest.mark.lab: the topology is given twice", pytrace=False)
            given["topology"] = marker.args[0]
        for key, value in given.items():
            opts.setdefault(key, value)
    return opts


def _backends(request: pytest.FixtureRequest) -> tuple[str, str]:
    """The delay and loss backends a network test asks for: its ``delay_backend`` /
    ``loss_backend`` fixtures where it uses them, else its ``lab`` marker, else its ``network``
    marker's ``delay`` / ``loss``."""
    lab = lab_options(request.node)
    net = request.node.get_closest_marker("network")
    net_kw = net.kwargs if net is not None else {}
    delay = lab.get("delay_backend", net_kw.get("delay", "auto"))
    loss = lab.get("loss_backend", net_kw.get("loss", "auto"))
    if "delay_backend" in request.fixturenames:
        delay = request.getfixturevalue("delay_backend")
    if "loss_backend" in request.fixturenames:
        loss = request.getfixturevalue("loss_backend")
    return delay, loss


def _leftovers() -> dict[str, list]:
    from testbed.registry import leftovers

    return leftovers()


def _new(before: dict[str, list], after: dict[str, list]) -> dict[str, list]:
    """What is in ``after`` and was not in ``before``, kinds with nothing new left out."""
    new = {kind: [x for x in found if x not in before.get(kind, [])] for kind, found in after.items()}
    return {kind: found for kind, found in new.items() if found}


@pytest.fixture(autouse=True)
def _testbed_network(request: pytest.FixtureRequest):
    """For a ``network`` test: skip where it cannot run; after it, whatever of the testbed's
    it left (and was not there before it: a wider fixture's network is not its) fails it."""
    if request.node.get_closest_marker("network") is None:
        yield
        return
    delay, loss = _backends(request)
    caps = request.config.hook.pytest_testbed_machine(item=request.node, delay_backend=delay, loss_backend=loss)
    request.node.stash[_CAPS_KEY] = caps
    before = _leftovers()
    yield
    left = _new(before, _leftovers())
    if left:  # an error at the test's teardown, as pytest reports a fixture's after-check
        pytest.fail(f"left behind by this test: {left} (testbed clean removes it)", pytrace=False)


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture
def testbed_caps(request: pytest.FixtureRequest) -> Capabilities:
    """What this machine offers (a network test has been skipped already where it cannot run)."""
    return request.node.stash.get(_CAPS_KEY, None) or capabilities()


@pytest.fixture
def lab_topology(request: pytest.FixtureRequest):
    """The topology of the ``lab`` fixture where no ``lab`` marker names one: override it (a
    shipped name, a file or a ``Topology``)."""
    pytest.fail("the lab fixture needs a topology: @pytest.mark.lab(\"aws-us3\") or a lab_topology fixture",
                pytrace=False)


def _resolve(topology: Any, item: pytest.Item) -> Any:
    """A relative path is taken beside the test file first, then as ``Lab`` takes it."""
    if isinstance(topology, (str, Path)) and not Path(topology).is_absolute():
        beside = Path(item.path).parent / topology
        if beside.is_file():
            return beside
    return topology


@pytest.fixture
def lab(request: pytest.FixtureRequest):
    """A ``testbed.run.lab.Lab`` that is up, from the ``lab`` marker's (or ``lab_topology``'s)
    topology; down after the test (then the ``network`` check: nothing left behind)."""
    from testbed.run.lab import Lab, LabError

    opts = lab_options(request.node)
    topology, where = opts.pop("topology", None), "@pytest.mark.lab"
    if topology is None:
        topology, where = request.getfixturevalue("lab_topology"), "lab_topology"
    opts["delay_backend"], opts["loss_backend"] = delay, loss = _backends(request)
    caps = request.node.stash.get(_CAPS_KEY, None)
    if caps is None:  # the network marker was not seen (e.g. the fixture asked for by name at run time)
        caps = request.config.hook.pytest_testbed_machine(item=request.node, delay_backend=delay, loss_backend=loss)
    try:
        the_lab = Lab(_resolve(topology, request.node), caps=caps, **opts)
    except (LabError, ValueError, TypeError) as exc:
        pytest.fail(f"{where}: {str(exc).strip().splitlines()[-1]}", pytrace=False)
    try:
        the_lab.up()
    except (LabError, RuntimeError, OSError) as exc:  # Busy, NetworkError, BackendUnavailable: one line each
        text = str(exc).strip()
        pytest.fail(f"lab {the_lab.name} could not be built: {text.splitlines()[-1] if text else type(exc).__name__}",
                    pytrace=False)
    try:
        for line in the_lab.warnings:
            warnings.warn(LabWarning(f"lab {the_lab.name}: {line}"))
        yield the_lab
    finally:
        the_lab.down()
