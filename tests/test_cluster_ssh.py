"""Runs across machines reach their agents over SSH, with one build everywhere, and map a
drifting clock: the quick checks on the fake cluster (``tests/test_cluster.py``'s fixture).

The orchestrator's side runs in this process, in the fake cluster's head network namespace
(as ``test_site_conformance.py`` does): ``open_cluster`` installs this build on the machines
through Ansible and starts each machine's agent over SSH.  Checked: no process of the
testbed listens on a TCP port of any machine while its network is up (``ss -ltnp`` inside
each); an agent of another build (a copy of the packages with one line changed, run through
``gtb_testbed_root``) is refused with both builds named, and the other machines are left
clean; a second orchestrator on machines that serve a run is told whose run it is, and the
first run's agents go on; an agent whose clock runs 500 ppm fast (libfaketime's rate, ``gtb_agent_wrap``) shows
that drift, and a timestamp taken mid-run on it maps onto the orchestrator's clock within
the samples' uncertainty once the drift is corrected, where the start offset alone is off by
drift x elapsed.  A ``testbed torchrun --inventory`` job (``examples/ddp.py`` imported by a
script beside it, in a folder of this machine's ``/run``, which no machine sees: each has its
own) runs one rank per machine from the copy shipped to each and trains with the losses, bit
for bit, of the same job on one machine; SIGTERM to it ends every rank on every machine and
leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from test_cluster import TESTBED, _missing, _nothing_left_soon, cluster  # noqa: F401  (cluster: the fake cluster fixture)
from test_site_conformance import _in_netns
from testbed.spec.topology import load_topology, resolve_topology

pytestmark = [pytest.mark.network, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]

REPO = Path(__file__).resolve().parent.parent
DRIFT_PPM = 500.0


def _open(fake, inventory: Path, topology: str = "aws-us3"):
    from testbed.cluster.remote import open_cluster

    intern = sys.intern  # Ansible patches sys.intern for the process (see test_site_conformance)
    try:
        with _in_netns(fake.head_pid):
            return open_cluster(load_topology(resolve_topology(topology)), inventory)
    finally:
        sys.intern = intern


def _inventory(fake, path: Path, extra: dict[str, str]) -> Path:
    lines = []
    for line in fake.inventory_text().splitlines():
        name = line.split(" ", 1)[0]
        lines.append(line + (f" {extra[name]}" if name in extra and "gtb_underlay=" in line else ""))
    path.write_text("\n".join(lines) + "\n")
    return path


def _listeners(fake, machine: str) -> list[str]:
    out = subprocess.run(fake.machine_argv(machine, ["ss", "-Hltnp"]), capture_output=True, text=True,
                         timeout=30).stdout
    return [ln for ln in out.splitlines() if ln.strip()]


def test_agents_come_over_ssh_listen_on_no_port_and_run_this_build(cluster):
    from testbed.cluster.build import version
    from testbed.cluster.remote import ClusterNetwork

    opened = _open(cluster, cluster.inventory_path)
    try:
        assert {n: a.hello["build"] for n, a in opened.agents.items()} == {n: version() for n in ("m1", "m2", "m3")}
        with ClusterNetwork(opened, load_topology(resolve_topology("aws-us3"))):  # each machine's DC up, VXLANs and all
            for m in cluster.machines:
                listening = _listeners(cluster, m.name)
                assert listening and all('"sshd"' in ln for ln in listening), (m.name, listening)
    finally:
        opened.close()
    _nothing_left_soon(cluster)


def test_an_agent_of_another_build_is_refused_naming_both(cluster, tmp_path):
    from testbed.cluster import build
    from testbed.cluster.inventory import ClusterError

    alt = tmp_path / "alt"
    for pkg in build.PACKAGES:
        shutil.copytree(REPO / pkg, alt / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    with open(alt / "testbed" / "__init__.py", "a") as fh:
        fh.write("# another build\n")
    theirs, mine = build.digest(alt), build.digest()
    assert theirs != mine
    inv = _inventory(cluster, tmp_path / "inv.ini", {"m2": f"gtb_testbed_root={alt}"})
    with pytest.raises(ClusterError) as err:
        _open(cluster, inv)
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and "m2" in msg and theirs in msg and mine in msg, msg
    _nothing_left_soon(cluster)  # m1 and m3's agents, started, were ended with the run


def test_a_second_orchestrator_on_a_busy_machine_is_told_whose_run_it_is(cluster):
    from testbed.cluster.inventory import ClusterError

    first = _open(cluster, cluster.inventory_path)
    try:
        with pytest.raises(ClusterError) as err:
            _open(cluster, cluster.inventory_path)
        msg = str(err.value)
        assert len(msg.splitlines()) == 1 and "is running a run of" in msg and "machine agent pid" in msg, msg
        assert all(not a.closed for a in first.agents.values())  # the first run's agents are untouched
    finally:
        first.close()
    _nothing_left_soon(cluster)


@pytest.mark.skipif(shutil.which("faketime") is None, reason="needs faketime (apt-get install faketime)")
def test_a_drifting_clock_is_measured_and_mapped_within_its_uncertainty(cluster, tmp_path):
    from testbed.cluster.remote import correct_drift, measure_clock
    from testbed.results.records import Interval, WorkerRecord

    rate = 1 + DRIFT_PPM / 1e6
    inv = _inventory(cluster, tmp_path / "inv.ini", {"m2": f"gtb_agent_wrap='faketime -m -f \"+0 x{rate}\"'"})
    opened = _open(cluster, inv)
    try:
        time.sleep(2.0)
        mid = measure_clock(opened.agents["m2"])  # m2's clock read at orchestrator time mid.at
        time.sleep(2.0)
        report = opened.clock_report()  # the end sample
        start, end = opened.clock["start"], opened.clock["end"]
    finally:
        opened.close()
    span = end["m2"]["at"] - start["m2"]["at"]
    known_ppm = (start["m2"]["uncertainty_ms"] + end["m2"]["uncertainty_ms"]) / 1e3 / span * 1e6
    drift = report["machines"]["m2"]["drift_ppm"]
    assert abs(drift - DRIFT_PPM) <= max(known_ppm, 0.05 * DRIFT_PPM), (drift, known_ppm)
    assert abs(report["machines"]["m1"]["drift_ppm"]) <= max(known_ppm, 0.05 * DRIFT_PPM), report
    # a timestamp m2 took at mid.at, mapped as the hub maps it (the start offset), then corrected
    stamp = mid.at + mid.offset_s - start["m2"]["offset_s"]
    uncorrected_ms = (stamp - mid.at) * 1e3
    elapsed = mid.at - start["m2"]["at"]
    assert uncorrected_ms == pytest.approx(DRIFT_PPM * 1e-6 * elapsed * 1e3, rel=0.25), (uncorrected_ms, elapsed)
    rec = WorkerRecord("w", 0, 0, "dc")
    rec.events = [Interval("forward", 0, stamp, stamp, 0)]
    assert correct_drift({"w": rec}, {"w": "m2"}, lambda n, k: None, start, end)
    error_ms = abs(rec.events[0].start - mid.at) * 1e3
    bound_ms = start["m2"]["uncertainty_ms"] + end["m2"]["uncertainty_ms"] + mid.uncertainty_s * 1e3
    print(f"drift put in {DRIFT_PPM:g} ppm, measured {drift:.1f} ppm; mid-run stamp off by {uncorrected_ms:.3f} ms "
          f"with the start offset, {error_ms:.4f} ms corrected (bound {bound_ms:.4f} ms)")
    assert error_ms <= bound_ms, (error_ms, bound_ms)
    _nothing_left_soon(cluster)


def test_telemetry_drained_by_a_network_check_still_reaches_the_hub():
    """The run's loop checks the network (which drains the agents' events for failures)
    between its telemetry polls: what that drain finds is the hub's, in order.  It once was
    dropped: a worker's iteration end lost, and the run failed in its summary (KeyError) in
    2 of 10 runs across machines."""
    from testbed import messages as m
    from testbed.cluster.remote import Cluster, ClusterHub

    cluster = Cluster(machines=[], placement={}, inventory=Path("none"))
    cluster.offsets = {"m1": 5.0}
    cluster.hub = ClusterHub(cluster, sender_of=lambda name, kind: None)
    ends = [m.Events(it=k, events=[], transfers=[], end=10.0 + k, iteration_done=True) for k in range(3)]
    for k, msg in enumerate(ends):
        cluster.events.put(("m1", m.Telemetry(name="s0r0", msg=msg, t=0.0)))
        if k == 1:
            cluster.drain()  # what ClusterNetwork.check does
    cluster.events.put(("m1", m.Exited(name="other", rc=0)))
    got = cluster.hub.poll(0.0)
    assert [(n, msg.it, msg.end) for n, msg in got] == [("s0r0", k, 5.0 + k) for k in range(3)]  # on the run's clock
    assert cluster.hub.poll(0.0) == []


def test_clean_removes_the_agent_logs_of_orchestrators_that_are_gone(tmp_path, monkeypatch):
    """A SIGKILLed orchestrator never closes its cluster: its agents' log folder stays in the
    temp folder until ``testbed clean`` sees its PID gone; a live one's stays."""
    import os
    import tempfile

    from testbed.cluster.remote import LOGS_PREFIX, remove_stale_logs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = tmp_path / f"{LOGS_PREFIX}{dead.pid}-x1"
    live = tmp_path / f"{LOGS_PREFIX}{os.getpid()}-x2"
    for d in (gone, live):
        d.mkdir()
        (d / "agent-m1.log").write_text("said something\n")
    assert remove_stale_logs() == 1
    assert not gone.exists() and live.exists()


# the job: 3 ranks, one per DC of aws-us3 (one DC per fake machine), a small GPT, 4 steps
RANKS = "virginia=1,ohio=1,oregon=1"
DDP_ARGS = ["--steps", "4", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "2"]
_JOB = """import os, sys
print("script " + os.path.abspath(__file__), flush=True)
import ddp  # beside it: shipped with it
ddp.main()
"""


@pytest.fixture
def job_folder():
    """``job.py`` and the ``ddp.py`` it imports, in a folder under this machine's /run: the
    fake machines each mount a /run of their own, so a rank there finds them only if shipped."""
    folder = Path(tempfile.mkdtemp(prefix="geo-torchrun-test-", dir="/run"))
    shutil.copy(REPO / "examples" / "ddp.py", folder / "ddp.py")
    (folder / "job.py").write_text(_JOB)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _losses(out: Path) -> list[float]:
    text = (out / "logs" / "rank0.log").read_text()
    return [json.loads(ln)["loss"] for ln in text.splitlines() if ln.startswith("{")]


@pytest.mark.slow  # 30-33 s; the suite reached 15.5 min on a slow evening (2026-12-06 20:52 UTC)
def test_a_torchrun_job_across_machines_trains_as_on_one_machine(cluster, job_folder, tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    job = [str(job_folder / "job.py"), *DDP_ARGS]
    t0 = time.monotonic()
    r1 = subprocess.run([*TESTBED, "torchrun", "aws-us3", "--ranks", RANKS, "--out", str(one), "--", *job],
                        capture_output=True, text=True, cwd=REPO, timeout=300)
    t1 = time.monotonic()
    assert r1.returncode == 0, (r1.stdout[-2000:], r1.stderr[-2000:])
    r2 = subprocess.run(cluster.head_argv([*TESTBED, "torchrun", "aws-us3", "--ranks", RANKS, "--inventory",
                                           str(cluster.inventory_path), "--out", str(many), "--", *job]),
                        capture_output=True, text=True, cwd=REPO, timeout=300)
    t2 = time.monotonic()
    assert r2.returncode == 0, (r2.stdout[-3000:], r2.stderr[-3000:])
    print(f"one machine {t1 - t0:.1f} s, three machines {t2 - t1:.1f} s")
    want, got = _losses(one), _losses(many)
    assert len(want) == 4 and got == want, (got, want)  # bit for bit: the same floats, printed the same
    metrics = json.loads((many / "metrics.json").read_text())
    ranks = metrics["ranks"]
    assert [(x["dc"], x["machine"], x["exit_code"]) for x in ranks] == \
        [("virginia", "m1", 0), ("ohio", "m2", 0), ("oregon", "m3", 0)], ranks
    assert metrics["cluster"]["placement"] == {"virginia": "m1", "ohio": "m2", "oregon": "m3"}
    for x in ranks:  # each rank ran the copy on its machine, not this machine's file
        first = (many / x["log"]).read_text().splitlines()[0]
        assert first.startswith("script /run/gtb/") and first.endswith("/job.py"), first
        assert str(job_folder) not in first, first
    # gloo crossed the emulated WAN (the VXLANs between machines): each WAN direction's gateway
    # counted the bytes it counts on one machine (3.3 MB in all; measured within 6 KB a direction,
    # the rendezvous and the headers of MTU 1450 against 1500)
    alone = json.loads((one / "metrics.json").read_text())["links"]
    assert sum(x["bytes"] for x in alone.values()) > 2_000_000, alone
    for key, x in alone.items():
        assert abs(metrics["links"][key]["bytes"] - x["bytes"]) <= 0.05 * x["bytes"] + 20_000, \
            (key, metrics["links"][key]["bytes"], x["bytes"])
    _nothing_left_soon(cluster)


@pytest.mark.slow  # 18 s; README's test command (CI) read 14 min 8 s with it, against its 15 min budget
def test_sigterm_ends_a_torchrun_job_on_every_machine(cluster, job_folder, tmp_path):
    out = tmp_path / "job"
    proc = subprocess.Popen(cluster.head_argv([*TESTBED, "torchrun", "aws-us3", "--ranks", RANKS, "--inventory",
                                               str(cluster.inventory_path), "--out", str(out), "--",
                                               str(job_folder / "job.py"), *DDP_ARGS[:1], "100000", *DDP_ARGS[2:]]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        seen = []
        for line in proc.stdout:  # until the job trains: rank 0's first loss
            seen.append(line)
            if '"loss"' in line:
                break
        assert any('"loss"' in ln for ln in seen), "".join(seen[-30:])
        busy = [m.name for m in cluster.machines
                if "job.py" in subprocess.run(cluster.machine_argv(m.name, ["ps", "-ww", "-eo", "args"]),
                                              capture_output=True, text=True, timeout=30).stdout]
        assert busy == ["m1", "m2", "m3"], busy  # a rank on each machine
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "interrupted (SIGTERM)" in rest, (proc.returncode, rest[-2000:])
    _nothing_left_soon(cluster)  # no rank, no network, no copy of the script on any machine
