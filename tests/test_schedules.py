"""Schedules as data: op lists, their checks, and the experiment's placement errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.spec import schedules as sch
from testbed.spec.experiment import parse_experiment
from testbed.spec.topology import SpecError

REPO = Path(__file__).resolve().parent.parent
TOPO = str(REPO / "tests" / "data" / "train3.yaml")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 4), (3, 6), (4, 2), (4, 8)])
def test_every_schedule_runs_each_microbatch_once_without_deadlock(schedule, stages, microbatches):
    programs = sch.check(schedule, stages, microbatches)
    for s, prog in enumerate(programs):
        kinds = [op.kind for op in prog]
        assert kinds.count(sch.FORWARD) == kinds.count(sch.BACKWARD) == microbatches
        assert kinds.count(sch.RECV_ACT) == (microbatches if s > 0 else 0)
        assert kinds.count(sch.SEND_GRAD) == (microbatches if s > 0 else 0)
        assert kinds.count(sch.SEND_ACT) == (microbatches if s < stages - 1 else 0)


def test_1f1b_warms_up_p_minus_s_minus_1_forwards_and_extra_warmup_adds_more():
    order = sch.compute_order("1f1b", 0, 4, 8)
    assert [op.kind for op in order[:4]] == [sch.FORWARD] * 4 and order[4].kind == sch.BACKWARD
    deeper = sch.compute_order("1f1b", 0, 4, 8, extra_warmup=2)
    assert [op.kind for op in deeper[:6]] == [sch.FORWARD] * 6 and deeper[6].kind == sch.BACKWARD
    last = sch.compute_order("1f1b", 3, 4, 8)
    assert [op.kind for op in last[:2]] == [sch.FORWARD, sch.BACKWARD]


def test_gpipe_is_all_forwards_then_all_backwards():
    order = sch.compute_order("gpipe", 1, 3, 4)
    assert [op.kind for op in order] == [sch.FORWARD] * 4 + [sch.BACKWARD] * 4


def test_a_deadlocking_schedule_is_caught_before_it_runs(monkeypatch):
    def backwards_first_on_last_stage(stage, stages, m, extra_warmup=0):
        fwd = [sch.Op(sch.FORWARD, i) for i in range(m)]
        bwd = [sch.Op(sch.BACKWARD, i) for i in range(m)]
        if stage == stages - 1:  # waits for act(1) before sending grad(0) ...
            return [fwd[0], fwd[1], bwd[0], bwd[1]]
        # ... while the stage before waits for grad(0) before sending act(1)
        return [fwd[0], bwd[0], fwd[1], bwd[1]]

    monkeypatch.setitem(sch.SCHEDULES, "broken", backwards_first_on_last_stage)
    with pytest.raises(sch.ScheduleError, match="deadlock"):
        sch.check("broken", 2, 2)


def test_ideal_bubble_fraction():
    assert sch.ideal_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert sch.ideal_bubble_fraction(1, 5) == 0


BASE = {"name": "x", "topology": TOPO, "model": {"layers": 4, "hidden": 32, "heads": 2, "seq_len": 16},
        "parallel": {"stages": 3, "replicas": 2}}


@pytest.mark.parametrize(("change", "message"), [
    ({"placement": {"dc1": [0, 1], "dc3": [2]}}, "placement.dc1: 2 stage(s) x 2 replica(s) = 4 workers, but DC 'dc1' has 2 host(s)"),
    ({"placement": {"dc1": [0], "mars": [1, 2]}}, "placement.mars: no DC 'mars'"),
    ({"placement": {"dc1": [0], "dc2": [1]}}, "placement: stage 2 is not placed in any DC"),
    ({"placement": {"dc1": [0], "dc2": [0], "dc3": [2]}}, "placement.dc2: stage 0 is already placed in 'dc1'"),
    ({"placement": {"dc1": [0], "dc2": [1], "dc3": [5]}}, "placement.dc3: stage 5 is outside 0..2"),
    ({"parallel": {"stages": 3, "replicas": 2, "schedule": "zigzag"}}, "parallel.schedule: unknown schedule 'zigzag'"),
    ({"parallel": {"stages": 9, "replicas": 1}}, "parallel.stages: 9 stages need at least as many layers"),
    ({"parallel": {"stages": 3, "replicas": 3}}, "placement.dc1: 1 stage(s) x 3 replica(s) = 3 workers"),
    ({"model": {"layers": 4, "hidden": 30, "heads": 4}}, "model.heads: hidden (30) must be a multiple of heads (4)"),
    ({"training": {"microbatches": 0}}, "training.microbatches: Input should be greater than or equal to 1"),
    ({"topology": "/nonexistent.yaml"}, "topology: /nonexistent.yaml: no such topology file"),
])
def test_impossible_experiments_fail_in_one_line_before_anything_starts(change, message):
    with pytest.raises(SpecError) as err:
        parse_experiment(BASE | change, "exp.yaml")
    assert "\n" not in str(err.value) and str(err.value).startswith("exp.yaml: ")
    assert message in str(err.value), str(err.value)


def test_default_placement_spreads_stages_over_dcs_in_order():
    exp = parse_experiment(BASE, "exp.yaml")
    assert [(w.stage, w.replica, w.dc, w.host_index) for w in exp.workers()] == [
        (0, 0, "dc1", 0), (0, 1, "dc1", 1), (1, 0, "dc2", 0), (1, 1, "dc2", 1), (2, 0, "dc3", 0), (2, 1, "dc3", 1)]


def test_shipped_experiments_load():
    from testbed.spec.experiment import load_experiment

    paths = sorted((REPO / "experiments").glob("*.yaml"))
    assert len(paths) >= 5
    for path in paths:  # each loads (a bad one raises), names its topology and places every worker
        exp = load_experiment(path)
        assert exp.topo.dcs and len(exp.workers()) == exp.parallel.stages * exp.parallel.replicas, path
