"""The pytest plugin as a user meets it: a test folder outside the repository, the installed
package only.

Each test writes test files and a tiny topology into a fresh folder under /tmp and runs
``python -m pytest`` there in a subprocess (working directory that folder, PYTHONPATH
cleared, so only the installed ``testbed`` and its ``pytest11`` entry point are found; an
editable install maps the package, not the checkout's tests).  The outcome of each test in
there is read from its JUnit XML.  As root: a lab from a topology file beside the test file
(marker) and one from an overridden ``lab_topology`` fixture ping across the WAN, see a link
change, read counters, and so does README's example; a test that leaves an interface behind
errs at its teardown, naming it; bad marker arguments, a lab without a topology and a
topology file that is not there are one-line errors.  As ``nobody`` (``setpriv``): the lab
tests skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LEAK = "gtb-leak0"  # a veth pair (gtb-leak0, gtb-leak1) with the testbed's prefix: leftovers() sees it

TINY = """\
name: tiny
dcs:
  - {name: east, hosts: 2}
  - {name: west, hosts: 1}
wan:
  - {a: east, b: west, delay_ms: 10, rate_mbps: 50}
"""

USER_TESTS = '''\
import re
import subprocess
from pathlib import Path

import pytest


def min_rtt(res):  # from ping's summary, to the microsecond (each reply line rounds to 0.1 ms, 1 ms from 100 ms)
    assert res.returncode == 0, res.stderr
    replies = re.findall(r"time=([0-9.]+) ms", res.stdout)
    assert len(replies) >= 4, res.stdout
    return float(re.search(r"min/avg/max/mdev = ([0-9.]+)/", res.stdout).group(1))


@pytest.mark.lab("tiny.yaml")  # beside this file
def test_ping_across_the_wan_and_change_the_link(lab):
    west = lab.host("west").ip
    assert [h.dc for h in lab.hosts()] == ["east", "east", "west"]
    before = lab.counters()[("east", "west")].tx_bytes
    assert abs(min_rtt(lab.exec("east", 0, ["ping", "-n", "-c", "10", "-i", "0.05", west])) - 20.0) <= 1.0
    lab.link("east", "west").set(delay_ms=30)
    assert abs(min_rtt(lab.exec("east", 1, f"ping -n -c 10 -i 0.05 {west}")) - 40.0) <= 1.0
    assert lab.counters()[("east", "west")].tx_bytes - before >= 20 * 98
    assert lab.popen("west", 0, ["sleep", "600"]).poll() is None  # down() ends it


@pytest.mark.lab("tiny.yaml", dleay_backend="tun")
def test_a_misspelt_marker_argument(lab):
    pass


def test_a_lab_without_a_topology(lab):
    pass


@pytest.mark.lab("no-such-topology")
def test_a_lab_of_a_topology_that_is_not_there(lab):
    pass


@pytest.mark.network
def test_that_leaves_an_interface_behind():
    subprocess.run(["ip", "link", "add", "LEAK", "type", "veth", "peer", "name", "LEAK".replace("0", "1")],
                   check=True)
'''.replace("LEAK", LEAK)

OVERRIDE_TESTS = '''\
from pathlib import Path

import pytest


@pytest.fixture
def lab_topology():
    return Path(__file__).parent / "tiny.yaml"


def test_the_lab_of_an_overridden_topology(lab):
    assert lab.topo.name == "tiny" and lab.link("west", "east").params.delay_ms == 10
    assert lab.exec("west", 0, ["ping", "-n", "-c", "1", "-W", "2", lab.host("east", 1).ip]).returncode == 0
'''


def _readme_example() -> str:
    """README's example of the plugin (the Python block after "In your own tests")."""
    text = (REPO / "README.md").read_text()
    return text[text.index("In your own tests"):].split("```python\n", 1)[1].split("```", 1)[0]


def _user_folder() -> Path:
    """A fresh folder outside the repository that ``nobody`` may read and write."""
    folder = Path(tempfile.mkdtemp(prefix="gtb-plugin-user-"))
    assert not folder.resolve().is_relative_to(REPO)
    (folder / "tests").mkdir()
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "tests" / "tiny.yaml").write_text(TINY)
    (folder / "tests" / "test_wan.py").write_text(USER_TESTS)
    (folder / "tests" / "test_override.py").write_text(OVERRIDE_TESTS)
    (folder / "tests" / "test_readme.py").write_text(_readme_example())
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)
    return folder


def _run_pytest(folder: Path, as_user: str | None = None) -> tuple[subprocess.CompletedProcess, dict[str, tuple]]:
    """``python -m pytest`` in ``folder``; each test's (outcome, message) from the JUnit XML."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST"))}
    env["HOME"] = str(folder)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "--junitxml", str(folder / "out.xml")]
    if as_user:
        cmd = ["setpriv", f"--reuid={as_user}", "--regid=nogroup", "--clear-groups", *cmd]
    res = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    results: dict[str, tuple] = {}
    for case in ET.parse(folder / "out.xml").iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                # a test that errs in teardown after passing shows both; keep the worst
                if results.get(case.get("name"), ("",))[0] not in ("failure", "error"):
                    results[case.get("name")] = (child.tag, child.get("message") or "")
        results.setdefault(case.get("name"), ("passed", ""))
    return res, results


def test_the_plugin_is_a_pytest11_entry_point(tmp_path):
    """Seen from outside the checkout (inside it, a geo_testbed.egg-info left from an older
    install shadows the installed metadata for ``entry_points()``; pytest reads both)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    code = ("from importlib.metadata import entry_points; "
            "print([ep.value for ep in entry_points(group='pytest11') if ep.name == 'testbed'])")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.stdout.strip() == "['testbed.tools.pytest_plugin']", (res.stdout, res.stderr)


@pytest.mark.network
def test_a_user_test_folder_outside_the_repository(caps):
    folder = _user_folder()
    try:
        res, results = _run_pytest(folder)
        out = res.stdout + res.stderr
        assert "geo-testbed" in out.split("plugins:", 1)[1].splitlines()[0], out[:2000]  # its entry point
        assert results.keys() == {"test_ping_across_the_wan_and_change_the_link", "test_a_misspelt_marker_argument",
                                  "test_a_lab_without_a_topology", "test_that_leaves_an_interface_behind",
                                  "test_a_lab_of_a_topology_that_is_not_there",
                                  "test_the_lab_of_an_overridden_topology",
                                  "test_a_longer_link_reads_longer"}, out[-4000:]
        assert results["test_ping_across_the_wan_and_change_the_link"] == ("passed", ""), out[-4000:]
        assert results["test_a_longer_link_reads_longer"] == ("passed", ""), out[-4000:]  # README's, as written
        assert results["test_the_lab_of_an_overridden_topology"] == ("passed", ""), out[-4000:]
        assert results["test_a_misspelt_marker_argument"] == (
            "error", "failed on setup with \"Failed: @pytest.mark.lab: unknown argument 'dleay_backend' "
            "(choose from topology, delay_backend, loss_backend, name, check)\""), out[-4000:]
        kind, msg = results["test_a_lab_without_a_topology"]
        assert kind == "error" and "the lab fixture needs a topology" in msg, (kind, msg)
        kind, msg = results["test_a_lab_of_a_topology_that_is_not_there"]
        assert kind == "error" and "@pytest.mark.lab: no-such-topology: no such topology file" in msg, (kind, msg)
        kind, msg = results["test_that_leaves_an_interface_behind"]
        assert kind == "error" and msg.startswith("failed on teardown"), (kind, msg)
        assert "left behind by this test: {'links': ['gtb-leak0', 'gtb-leak1']}" in msg, msg
        assert res.returncode == 1
    finally:
        subprocess.run(["ip", "link", "del", LEAK], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_user_who_is_not_root_gets_the_reason():
    if os.geteuid() != 0:
        pytest.skip("needs root to run the user folder as nobody")
    folder = _user_folder()
    try:
        res, results = _run_pytest(folder, as_user="nobody")
        out = res.stdout + res.stderr
        assert res.returncode in (0, 1), out[-4000:]
        for name in ("test_ping_across_the_wan_and_change_the_link", "test_the_lab_of_an_overridden_topology",
                     "test_that_leaves_an_interface_behind", "test_a_longer_link_reads_longer"):
            assert results[name] == ("skipped", "needs root (network namespaces, tc)"), (name, results, out[-3000:])
        assert "SKIPPED [1] tests/test_wan.py:15: needs root (network namespaces, tc)" in res.stdout, res.stdout[-3000:]
        assert results["test_a_misspelt_marker_argument"][0] == "error"  # a bad marker is an error anywhere
    finally:
        shutil.rmtree(folder, ignore_errors=True)
