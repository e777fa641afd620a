"""Atlas for any job: ``testbed torchrun --with atlas=...`` shares a WAN link among a user's
pipelines in the order the user gave.

Two backlogged pipelines (experiments/pipelines_job.py in stream mode: stage 0 in east sends
1 MB messages back to back to stage 1 in west) on one 12.5 Mbit/s link under strict priority:
while both are backlogged the first of the order gets nearly the whole link (the delay
line's per-pipeline counters), and the job itself sees it (the bytes each stage 1 received
in the window); swapping the order swaps the shares.  After the job the link is plain FIFO
again.  Bad options are one-line errors and build nothing.

The link must be the bottleneck for priority to mean anything (a work-conserving scheduler
leaves an under-driven link to whoever sends): at 50 Mbit/s a slow host's gloo ranks did not
always keep it full (CI, 2026-12-05: 8 of 18.75 MB crossed in the window, both queues mostly
empty); at 25 Mbit/s under 12% CPU steal the owner's messages came at 0.53 and 0.75 of the
link's rate (CI, 2026-12-06, both tries), so it is 12.5 Mbit/s with 1 MB messages: half the
host's work per second, the same number of messages in the window (the owner's pace 0.89-0.90
of the link in 6 runs here, as at 25).  The test judges the link full by the pace of the owner's
messages and says which it was when it fails, with the line's per-pipeline counters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.extension import ExtensionError
from testbed.run.hooks import job_extensions
from testbed.run.lab import Lab
from testbed.run.torchrun import run_job
from testbed.spec.topology import parse_topology

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "experiments" / "pipelines_job.py"
PIPES = "pipelines: {p0: [0, 2], p1: [1, 3]}"
RATE_MBPS, MB = 12.5, 1  # the link and the message: see the docstring


def _topology():
    return parse_topology({"name": "two", "dcs": [{"name": "east", "hosts": 2}, {"name": "west", "hosts": 2}],
                           "wan": [{"a": "east", "b": "west", "delay_ms": 10, "rate_mbps": RATE_MBPS}]})


@pytest.mark.slow  # 20-22 s; test_atlas_run.py's enforced plan keeps the gateway's turns in the quick suite
@pytest.mark.fidelity  # under 16-19% CPU steal the delay line starved and the two shared the link
@pytest.mark.network(delay="tun")
def test_the_owner_gets_the_link_in_the_order_given(tmp_path):
    seen = {}
    with Lab(_topology(), check=False) as lab:
        for order in (["p0", "p1"], ["p1", "p0"]):
            ext = job_extensions([f"atlas={{{PIPES}, order: [{', '.join(order)}], queue: deep}}"])
            report = tmp_path / f"{order[0]}.json"
            res = run_job(lab, [("east", 2), ("west", 2)], JOB,
                          ["--mode", "stream", "--mb", str(MB), "--seconds", "4", "--out", str(report)],
                          tmp_path / order[0], echo=False, extensions=ext, timeout_s=60)
            assert res.exit_code == 0, res.message
            atlas = res.metrics["extensions"]["atlas"]
            assert atlas["problems"] == [] and atlas["mode"] == "priority", atlas
            job = json.loads(report.read_text())
            arrivals = {f"p{r['pipeline']}": r["arrivals_s"] for r in job["ranks"] if r["stage"] == 1}
            seen[order[0]] = (atlas["links"]["east->west"], job["bytes_in_window"], arrivals)
            after = lab.link("east", "west").delay_line_stats()
            assert after["sched"] is None, after  # removed: FIFO again
    for first, second in (("p0", "p1"), ("p1", "p0")):
        link, got, arrivals = seen[first]
        # the owner's messages arrive at the link's pace: its goodput between its first and last
        # arrival in the window (whole messages in the window would judge one message's slow
        # start too: 5 of 2 MB crossed in 4 s here at 25 Mbit/s, 4 on CI, 2026-12-05, one message from the bar)
        mine = [t for t in arrivals[first] if t <= arrivals[first][0] + 4 - 0.5]
        pace = (len(mine) - 1) * MB * 1e6 / (mine[-1] - mine[0]) / (RATE_MBPS * 1e6 / 8)
        # 0.89-0.90 in 6 runs here (2026-12-06, quiet): the TCP payload fraction of the link
        assert pace >= 0.8, (f"the link was not the bottleneck: the owner's messages came at {pace:.2f} of "
                             f"the link's rate (host too slow?)", arrivals, link)
        share = link["owner_share"]
        assert share["n"] >= 50 and share["mean"] >= 0.95 and share["p10"] >= 0.9, link
        # over the whole job, the tail included (the other alone on the link once the owner stops):
        # 14.6 MB against 4.2-6.3 MB in 8 runs here; fair sharing would give about 1:1
        assert link["bytes"][first] > 2 * link["bytes"][second], link
        # the job's own view: the owner's stage 1 received most of what crossed in the window
        # (whole 1 MB messages: 4-5 against 0-1 in 3 runs here, 2026-12-06; fair sharing ~1:1)
        assert got[first] >= 3 * max(got[second], MB * 1e6), got


def test_bad_options_are_one_line_errors(tmp_path):
    bad = {
        "atlas": "NAME=VALUE",
        "nope=x": "'nope' is not installed",
        f"atlas={{{PIPES}, order: [p1]}}": "order ['p1'] must name each pipeline once",
        "atlas={pipelines: {p0: [0, 2]}}": "pipelines: 1 given",
        f"atlas={{{PIPES}, connections: 8}}": "gloo opens one TCP connection per pair of ranks",
        f"atlas={{{PIPES}, turns_ms: 0}}": "turns_ms",
        f"atlas={{{PIPES}, queue: 1000}}": "queue 1000",
        f"atlas={tmp_path / 'missing.yaml'}": "missing.yaml",
    }
    for spec, words in bad.items():
        with pytest.raises(ExtensionError) as err:
            job_extensions([spec])
        assert words in str(err.value) and "\n" not in str(err.value), (spec, str(err.value))
    # through the command line: one line, exit 2, before any network is built
    res = subprocess.run([sys.executable, "-m", "testbed.cli", "torchrun", str(REPO / "topologies" / "chaos2.yaml"),
                          "--ranks", "dc1=2,dc2=2", "--with", "atlas={pipelines: {p0: [0, 2]}}", "--", str(JOB)],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "pipelines: 1 given" in lines[0], res.stderr


@pytest.mark.network(delay="tun")
def test_pipelines_that_name_no_host_or_share_a_host_are_refused_and_leave_fifo(tmp_path):
    with Lab(_topology(), check=False) as lab:
        for spec, words in ((f"atlas={{pipelines: {{p0: [0, 9], p1: [1, 3]}}}}", "rank 9 does not exist"),
                            ("atlas={pipelines: {p0: [east:0, 'west:0'], p1: [east:0, west:1]}}", "is in pipelines"),
                            ("atlas={pipelines: {p0: [0, 2], p1: [1, 3]}, links: ['east->mars']}", "east->mars")):
            with pytest.raises(ExtensionError, match=words.replace("[", r"\[")):
                run_job(lab, [("east", 2), ("west", 2)], JOB, [], tmp_path, echo=False,
                        extensions=job_extensions([spec]))
            assert lab.link("east", "west").delay_line_stats()["sched"] is None
