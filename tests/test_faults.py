"""Faults injected into short real runs (testbed/run/chaos.py), and the judge that grades them.

The network tests run ``experiments/chaos.yaml`` (shortened) once per fault, at a point drawn
from a seed that changes every session (``GTB_CHAOS_SEED`` replays one; a failure names it):
SIGKILL and Ctrl-C of ``testbed run`` (at an iteration, or at any moment after it starts,
while it builds the network say), SIGKILL of a worker and a WAN link cut for less than the
receive timeout.  Each must end as ``chaos.DOCUMENTED`` says, keep every finished
iteration once with the single-process run's loss, and leave nothing behind: not when the
run ends (but after a SIGKILL of the orchestrator) and not after ``testbed clean``.  The
whole campaign (every fault, 60 injections: ``testbed chaos``) is docs/benchmarks.md's table.
"""

from __future__ import annotations

import os
import random

import pytest

from testbed.run import chaos
from testbed.registry import NOTHING_LEFT, leftovers

SEED = int(os.environ.get("GTB_CHAOS_SEED") or random.SystemRandom().randrange(1_000_000))
ITERATIONS = 24  # the chaos job, shortened: a run is ~15 s, mostly building and tearing down


# -- the plan and the judge (no network) ----------------------------------------------------
def test_the_plan_is_seeded_and_takes_every_fault_in_turn():
    exp = chaos.chaos_experiment(iterations=ITERATIONS)
    a = chaos.plan(3 * len(chaos.FAULTS), 5, exp)
    assert a == chaos.plan(3 * len(chaos.FAULTS), 5, exp)
    assert [i.fault for i in a] == list(chaos.FAULTS) * 3
    timeout = exp.training.recv_timeout_s
    for inj in a:
        assert inj.at_iteration <= ITERATIONS // 2
        if inj.fault == "link-down-short":
            assert 0 < inj.seconds < timeout
        if inj.fault == "link-down-long":
            assert inj.seconds > timeout
    # the orchestrator is hit at an iteration and, as often, at any moment after it starts
    orch = [i for i in chaos.plan(200, 5, exp, faults=("interrupt-orchestrator",))]
    assert 40 < sum(i.at_iteration == 0 for i in orch) < 160


def _judged(fault: str, **kw) -> chaos.Outcome:
    exp = chaos.chaos_experiment(iterations=ITERATIONS)
    inj = chaos.Injection(0, fault, 5, 0.0, target=kw.pop("target", "s1r0"))
    out = chaos.Outcome(0, fault, inj.target, 5, clean_removed="removed 0 process(es)", **kw)
    ref = [1.0] * ITERATIONS
    losses = kw.get("losses") or {k: 1.0 for k in range(ITERATIONS)}
    return chaos.judge(out, exp, inj, ref, losses)


def test_the_judge_fails_what_did_not_end_as_documented():
    good = dict(ended="error", after_s=5.0,
                message="worker s1r0 (stage 1, replica 0, gtb2h1 in dc2) died (killed by signal 9)")
    assert _judged("kill-worker", **good).documented
    cases = {
        "left behind when the run ended": dict(good, left_at_exit={"netns": ["gtb-dc1"]}),
        "left behind after testbed clean": dict(good, leftovers={"cgroups": ["/sys/fs/cgroup/gtb-x"]}),
        "iterations lost": dict(good, lost=[3]),
        "iterations duplicated": dict(good, duplicated=[4]),
        "more than one line": dict(good, message=good["message"] + "\nTraceback"),
        "bound": dict(good, after_s=chaos.BOUND_S["kill-worker"] + 1),
        "not error": dict(good, ended="completed"),
        "crashed": dict(good, ended="crashed", message="KeyError: 'x'"),
    }
    for needle, kw in cases.items():
        out = _judged("kill-worker", **kw)
        assert not out.documented and needle in out.why, (needle, out.why)
    wrong = chaos.judge(chaos.Outcome(0, "rate-drop", "dc1-dc2", 5, ended="completed", clean_removed="removed"),
                        chaos.chaos_experiment(iterations=3), chaos.Injection(0, "rate-drop", 2, 0.0, "dc1-dc2"),
                        [1.0, 1.0, 1.0], {0: 1.0, 1: 1.5, 2: 1.0})
    assert not wrong.documented and wrong.wrong_loss == [1]
    # a SIGKILLed orchestrator leaves its network for `testbed clean`; nothing may outlive that
    assert _judged("kill-orchestrator", ended="killed", left_at_exit={"netns": ["gtb-dc1"]}).documented
    assert not _judged("kill-orchestrator", ended="killed", leftovers={"processes": [1234]}).documented
    # Ctrl-C: one line, nothing left; silent only when it landed before the command ran
    said = "interrupted (SIGINT); everything the testbed made was removed"
    assert _judged("interrupt-orchestrator", ended="interrupted", message=said, after_s=3.0).documented
    assert _judged("interrupt-orchestrator", ended="interrupted", message="").documented
    assert not _judged("interrupt-orchestrator", ended="interrupted", message="", iterations=3).documented
    assert not _judged("interrupt-orchestrator", ended="interrupted", message=said, after_s=3.0,
                       left_at_exit={"links": ["gtb1s"]}).documented


class _Line:
    """A delay line that refuses one kind of change (or, ``broken``, every request)."""

    def __init__(self, refuse: str, broken: bool = False):
        self.refuse, self.broken, self.lanes = refuse, broken, {}

    def request(self, msg):
        from testbed import messages as m

        given = {k: v for k, v in vars(msg).items() if v is not m.UNSET}  # a LaneSet's fields set
        if self.broken or self.refuse in given:
            from testbed.net.network import NetworkError

            raise NetworkError(f"delay line: cannot set {self.refuse}")
        self.lanes.update(given)
        return m.Ok()


class _Shaper:
    def __init__(self):
        self.rate_mbps, self.queue_bytes, self.netem = 100.0, 250_000, None

    def set_rate(self, rate):
        self.rate_mbps = rate

    def set_queue(self, queue):
        self.queue_bytes = queue


def _direction(line):
    from testbed.net.kernel import Backends
    from testbed.net.network import WanDirection
    from testbed.spec.topology import Direction

    return WanDirection("dc1", "dc2", Direction(delay_ms=5, rate_mbps=100, queue_bytes=250_000), "gtb-w0", None,
                        _Shaper(), Backends(delay="tun", loss="delayline"), lane="dc1-dc2", delay_client=line)


def test_a_link_change_the_delay_line_refuses_is_undone_whole():
    from testbed.net.network import NetworkError

    link = _direction(_Line(refuse="delay_ms"))
    with pytest.raises(NetworkError, match=r"^dc1->dc2: setting delay failed \(.*\); nothing was changed$"):
        link.set(rate_mbps=10, queue_bytes=100_000, delay_ms=50)
    assert (link.shaper.rate_mbps, link.shaper.queue_bytes) == (100.0, 250_000)  # rolled back
    assert (link.params.rate_mbps, link.params.delay_ms, link.params.queue_bytes) == (100, 5, 250_000)
    assert link.delay_client.lanes["rate_mbps"] == 100  # the line's own copy of the rate, too
    link.delay_client.refuse = "nothing"
    assert link.set(rate_mbps=10, delay_ms=50).rate_mbps == 10 and link.shaper.rate_mbps == 10
    # a step that cannot be undone either is named, and params says what the link now has
    link = _direction(_Line(refuse="delay_ms"))
    link.shaper.set_rate = lambda r, s=link.shaper: (_ for _ in ()).throw(OSError("tc gone")) \
        if r == 100 else setattr(s, "rate_mbps", r)
    with pytest.raises(NetworkError, match="could not be undone"):
        link.set(rate_mbps=10, delay_ms=50)
    assert link.params.rate_mbps == 10 and link.params.delay_ms == 5


# -- the faults, injected into real runs ------------------------------------------------------
@pytest.fixture(scope="module")
def chaos_job():
    exp = chaos.chaos_experiment(iterations=ITERATIONS)
    return exp, chaos.reference(exp)


@pytest.mark.chaos
@pytest.mark.network(delay="tun")
@pytest.mark.parametrize("fault", [pytest.param("kill-orchestrator", marks=pytest.mark.slow),
                                   pytest.param("interrupt-orchestrator", marks=pytest.mark.slow),
                                   pytest.param("kill-worker", marks=pytest.mark.slow),  # test_trainer kills one too
                                   "link-down-short"])
def test_a_fault_at_a_random_point_ends_as_documented_and_leaves_nothing(fault, chaos_job, tmp_path):
    exp, ref = chaos_job
    inj = chaos.plan(1, SEED, exp, faults=(fault,))[0]
    out = chaos.run_one(exp, inj, tmp_path, ref)
    said = f"GTB_CHAOS_SEED={SEED} {inj}: {out.ended}: {out.message} ({out.why})"
    assert out.documented, said
    assert out.leftovers == {} and leftovers() == NOTHING_LEFT, said
    assert not (out.lost or out.duplicated or out.wrong_loss), said
    if fault == "kill-orchestrator" and inj.at_iteration:  # it died mid-training: clean had work, and did it
        assert out.left_at_exit.get("processes") and out.left_at_exit.get("links"), said  # no named netns: hosts hold theirs
        assert out.clean_removed.startswith("removed") and not out.clean_removed.startswith("removed 0 "), said
        assert out.iterations >= inj.at_iteration, said
    if fault != "kill-orchestrator":  # the run's own exit removed everything
        assert out.left_at_exit == {}, said
    if fault == "link-down-short":  # it stalled for the outage, resumed, and lost nothing
        assert out.ended == "completed" and out.iterations == ITERATIONS, said
        assert out.stall_s >= 0.8 * inj.seconds, said
