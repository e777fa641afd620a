"""The netem test variants, run inside the netem VM where this kernel has no netem.

How it fits: the tests that exercise the netem backend are ordinary tests, parametrized
with ``delay_backend="netem"`` (the ``delay_backend`` fixture of ``conftest.py``, or a direct
parametrization; ``_is_netem_variant``); on a kernel with netem they run here as they are.
On a kernel without netem (this machine; ``runs_in_vm``), ``conftest.py``'s network fixture
leaves their capability check to the guest and their call goes to ``pytest_pyfunc_call`` below: the first of them boots the netem VM (``testbed/tools/vm.py``: a
stock Debian kernel, built once and cached in ``/var/cache/geo-testbed/vm``) and runs
*all* the session's netem variants in it in one pytest run on the live project (shared
read-only); each host test then passes, fails or skips as its twin did in the guest, with
the guest's report.  The VM is gone before the first result is reported.

Where no image is cached for the checkout's key (a fresh machine; a change to the
playbook or the dependencies), the image is built in a thread from the end of collection, beside
the tests that build no network (they run first), and the first test that builds a network
waits for the build (3-4 min here, mostly debootstrap, apt and pip at native speed).
``GTB_NETEM_VM_EARLY_BUILD=0`` builds it when the first netem test is reached instead.

With ``GTB_NETEM_VM_EARLY=1`` the VM does not wait for its turn: once the session's tests are
collected it starts in a thread of its own (``pytest_collection_finish``), the tests that
build no network run first, beside it (``pytest_collection_modifyitems`` moves them to the
front in any case), and the first test that builds a network waits for the VM to finish
(``pytest_runtest_setup``), so no timing test on this machine shares its CPUs with the
guest.  It saves most of the VM's four minutes, but it is off by default: the guest's own
timing tests share the machine with the host's tests then, and in one suite run of two
(2026-12-05) the guest's temporal-sharing test read line utilization 0.89 against its 0.9
floor.

``GTB_NETEM_VM``: ``auto`` (default: use the VM where the host has no netem; skip with
the reason where it cannot run), ``required`` (fail instead of skipping: ``setup.sh test``
sets it) or ``off`` (never; the netem variants skip on a kernel without netem).  The guest
runs with ``off`` and ``GTB_VM_REPORT`` naming the file its results go to
(``pytest_runtest_logreport``), and ``GTB_VM_ACCEL`` (``kvm``/``tcg``), which
``conftest.emulation()`` passes on to the tests' tolerances.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

_KEY = pytest.StashKey[dict]()  # the session's VM run, on config.stash
_THREAD = pytest.StashKey[threading.Thread]()  # the VM run started early
_BUILD = pytest.StashKey[dict]()  # the image build started at collection: thread, lines, error
_SAID = pytest.StashKey[list]()  # what the early run would have said, said when it is joined
_CANCEL = threading.Event()  # set when the session ends first: the VM is stopped, not waited for
# The guest's whole pytest run (~4 min under TCG here) gives up after this: CI stays bounded.
_TIMEOUT_S = float(os.environ.get("GTB_NETEM_VM_TIMEOUT_S", 900))


def _is_netem_variant(item: pytest.Item) -> bool:
    spec = getattr(item, "callspec", None)
    return spec is not None and spec.params.get("delay_backend") == "netem"


def _mode() -> str:
    mode = os.environ.get("GTB_NETEM_VM", "auto")
    return mode if mode in ("auto", "required", "off") else "auto"


def _host_has_netem() -> bool:
    from conftest import capabilities

    return os.geteuid() == 0 and bool(capabilities().qdiscs.get("netem"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "netem: a netem variant (runs in the netem VM on a kernel without netem)")


def _builds_networks(item: pytest.Item) -> bool:
    """A network test, a timing test, or one on the fake cluster (its machines are namespaces
    with networks; its module keeps them up, so it carries no ``network`` marker)."""
    return (any(item.get_closest_marker(m) is not None for m in ("network", "fidelity", "chaos", "netem"))
            or "cluster" in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_netem_variant(item):
            item.add_marker(pytest.mark.netem)
    if any(runs_in_vm(item) for item in items):  # the tests that build nothing first, beside the VM
        items[:] = sorted(items, key=_builds_networks)  # stable: each group keeps its order


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the image now, in a thread, when some test's body runs in the VM and no
    image is cached (or, with ``GTB_NETEM_VM_EARLY=1``, the whole VM run)."""
    if session.config.option.collectonly or _THREAD in session.config.stash or _BUILD in session.config.stash:
        return
    if not any(runs_in_vm(item) for item in session.items):
        return
    if os.environ.get("GTB_NETEM_VM_EARLY") == "1":
        said: list[str] = []
        session.config.stash[_SAID] = said
        thread = threading.Thread(target=_run_now, args=(session, said.append), daemon=True, name="netem-vm")
        session.config.stash[_THREAD] = thread
        thread.start()
        return
    from testbed.tools import vm

    if os.environ.get("GTB_NETEM_VM_EARLY_BUILD", "1") == "0" or vm.missing() or vm.find_image() is not None:
        return
    build: dict = {"lines": [], "error": None, "t0": time.monotonic()}

    def _build() -> None:
        try:
            vm.ensure_image(progress=build["lines"].append, cancel=_CANCEL)
        except Exception as exc:  # noqa: BLE001 - reported by every netem test
            build["error"] = str(exc)
        build["s"] = time.monotonic() - build["t0"]

    build["thread"] = threading.Thread(target=_build, daemon=True, name="netem-vm-build")
    session.config.stash[_BUILD] = build
    _progress(session)("no image for this checkout's key: building it beside the tests that build no network")
    build["thread"].start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session that ends before its netem tests (``-x``, Ctrl-C) stops the VM or the build."""
    for thread in (session.config.stash.get(_THREAD, None), session.config.stash.get(_BUILD, {}).get("thread")):
        if thread is not None and thread.is_alive():
            _CANCEL.set()
            thread.join(30)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The first test that builds a network here waits for the VM to be gone."""
    if _builds_networks(item) and not runs_in_vm(item):
        _join_build(item.session)
        _join(item.session)


def _join_build(session: pytest.Session) -> None:
    """Wait for the image build started at collection; say what it said."""
    build = session.config.stash.get(_BUILD, None)
    if build is not None:
        _wait_for(session, build["thread"], build["lines"], "the netem VM's image build")


def _join(session: pytest.Session) -> None:
    """Wait for the VM run started early; say what it said."""
    thread = session.config.stash.get(_THREAD, None)
    if thread is not None:
        _wait_for(session, thread, session.config.stash.get(_SAID, []), "the netem VM")


def _wait_for(session: pytest.Session, thread: threading.Thread, lines: list[str], what: str) -> None:
    """Join a background thread of this plugin, then say (once) the lines it collected."""
    say = _progress(session)
    if thread.is_alive():
        say(f"waiting for {what} before the tests that build networks here")
        t0 = time.monotonic()
        thread.join()
        say(f"waited {time.monotonic() - t0:.0f} s")
    for line in lines:
        say(line)
    lines.clear()


def runs_in_vm(item: pytest.Item) -> bool:
    """Whether this test's body runs in the netem VM rather than here."""
    if not _is_netem_variant(item) or _mode() == "off" or os.environ.get("GTB_VM_REPORT"):
        return False
    return os.geteuid() == 0 and not _host_has_netem()  # else it runs (or skips for want of root) here


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """A netem variant on a kernel without netem: its result is its twin's in the VM."""
    if not runs_in_vm(pyfuncitem):
        return None
    run = _run_in_vm(pyfuncitem.session)
    if run.get("unavailable"):
        why = f"this kernel has no netem qdisc and the netem VM cannot run: {run['unavailable']}"
        if _mode() == "required":
            pytest.fail(f"{why} (GTB_NETEM_VM=required)", pytrace=False)
        pytest.skip(why)
    reports = run["results"].get(pyfuncitem.nodeid)
    where = f"in the netem VM ({run['accel']}, kernel {run['kernel']})"
    if not reports and run.get("timed_out"):
        pytest.fail(f"{where}: the guest's pytest run did not finish within {_TIMEOUT_S:.0f} s "
                    f"(GTB_NETEM_VM_TIMEOUT_S); its console ends with:\n{run['tail']}", pytrace=False)
    if not reports:
        pytest.fail(f"{where}: no result for this test; the guest's console ends with:\n{run['tail']}",
                    pytrace=False)
    for phase in ("setup", "call", "teardown"):
        rep = reports.get(phase)
        if rep is None:
            continue
        if rep["outcome"] == "failed":
            pytest.fail(f"{where}, {phase}:\n{rep['longrepr']}", pytrace=False)
        if rep["outcome"] == "skipped":
            pytest.skip(f"{where}: {rep['reason']}")
    return True


def _run_in_vm(session: pytest.Session) -> dict:
    """The session's VM run: the early one's (waited for), else one now."""
    _join_build(session)
    _join(session)
    stash = session.config.stash
    if _KEY in stash:
        return stash[_KEY]
    return _run_now(session, _progress(session))


def _run_now(session: pytest.Session, say) -> dict:
    """Boot the VM once per session and run every selected netem variant in it."""
    stash = session.config.stash
    from testbed.tools import vm

    run: dict = {"results": {}, "accel": "?", "kernel": "?", "tail": ""}
    stash[_KEY] = run
    why = vm.missing()
    if why:
        run["unavailable"] = why
        return run
    nodeids = [item.nodeid for item in session.items if _is_netem_variant(item)]
    t0 = time.monotonic()
    build = stash.get(_BUILD, {})
    try:
        if build.get("error"):
            raise vm.VMError(build["error"])
        image = vm.ensure_image(progress=say)
    except vm.VMError as exc:
        run["unavailable"] = f"building its image failed: {exc}"
        return run
    run["build_s"] = build.get("s", 0.0) + time.monotonic() - t0
    run["kernel"] = image.meta.get("kernel", "?")
    say(f"running {len(nodeids)} netem test(s) in the netem VM")
    verbose = os.environ.get("GTB_NETEM_VM_VERBOSE")
    try:
        result = vm.run_job(vm.pytest_job(nodeids), image=image, timeout_s=_TIMEOUT_S,
                            on_line=(lambda line: say(f"  vm: {line}")) if verbose else None, cancel=_CANCEL)
    except Exception as exc:  # noqa: BLE001 - every netem test then fails with this
        run["tail"] = f"the VM did not run: {type(exc).__name__}: {exc}"
        return run
    run.update(accel=result.accel, tail=result.tail(40), boot_s=result.boot_s, wall_s=result.wall_s,
               rc=result.rc, timed_out=result.timed_out, count=len(nodeids))
    for line in result.files.get("results.jsonl", b"").decode(errors="replace").splitlines():
        rep = json.loads(line)
        run["results"].setdefault(rep["nodeid"], {})[rep["when"]] = rep
    return run


def _progress(session: pytest.Session):
    """A line on the terminal, also from a test's setup or call (where pytest captures the
    process's stdout: said plainly, it showed only with a failure)."""
    import contextlib

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    capman = session.config.pluginmanager.get_plugin("capturemanager")

    def say(msg: str) -> None:
        if reporter is None:
            return
        with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
            reporter.write_line(f"[netem VM] {msg}")

    return say


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In the guest: one JSON line per test phase, for the host to read back."""
    path = os.environ.get("GTB_VM_REPORT")
    if not path:
        return
    reason = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "duration": round(report.duration, 3), "reason": reason,
            "longrepr": report.longreprtext if report.failed else ""}
    with open(path, "a") as fh:
        fh.write(json.dumps(line) + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    run = config.stash.get(_KEY, None)
    if not run or run.get("unavailable") or "count" not in run:
        return
    terminalreporter.write_sep("-", "netem VM")
    boot = f"{run['boot_s']:.1f} s" if run.get("boot_s") else "?"
    terminalreporter.write_line(
        f"{run['count']} netem test(s) ran in a VM (kernel {run['kernel']}, {run['accel']}): boot {boot}, "
        f"VM {run['wall_s']:.0f} s in all, image build/check {run.get('build_s', 0):.0f} s"
        + (", TIMED OUT" if run.get("timed_out") else ""))
    spent = sorted(((sum(r.get("duration", 0.0) for r in phases.values()), nodeid)
                    for nodeid, phases in run["results"].items()), reverse=True)
    for seconds, nodeid in spent:  # what the one host test's time is made of (CI's budget)
        terminalreporter.write_line(f"  {seconds:6.1f} s  {nodeid}")
