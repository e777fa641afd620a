"""Titan's controller: raises step by step while quality holds, backs off within a bounded
number of windows when a path degrades, never raises on a path above its thresholds."""

from __future__ import annotations

import random

import pytest

from agents.titan.controller import BAD, GOOD, MARGINAL, SEVERE, Quality, TitanController
from agents.titan.spec import Targets

GOOD_Q = Quality(rtt_ms=40, loss=0.001, jitter_ms=3, packets=500)
# loss judged by its Wilson lower bound (controller docstring): 2.5% of ~513 sent is 1.6% at
# least, over 1%, under 2% (1.5%, this case until 2026-12-06, is 0.8% at least: not bad)
BAD_Q = Quality(rtt_ms=40, loss=0.025, jitter_ms=3, packets=500)
SEVERE_Q = Quality(rtt_ms=40, loss=0.05, jitter_ms=3, packets=500)
MARGINAL_Q = Quality(rtt_ms=90, loss=0.001, jitter_ms=3, packets=500)  # within target, above margin
PATH = ("uksouth", "westeurope")


def test_verdicts_follow_teams_targets():
    c = TitanController(Targets())
    assert c.judge(GOOD_Q) == GOOD
    assert c.judge(MARGINAL_Q) == MARGINAL
    assert c.judge(BAD_Q) == BAD
    assert c.judge(SEVERE_Q) == SEVERE
    assert c.judge(Quality(rtt_ms=120, loss=0, jitter_ms=0, packets=500)) == BAD
    assert c.judge(Quality(rtt_ms=10, loss=0, jitter_ms=31, packets=500)) == BAD
    assert c.judge(Quality(rtt_ms=10, loss=0, jitter_ms=0, packets=3)) is None  # too few packets to judge


def test_a_loss_count_that_a_healthy_path_gives_is_not_a_fault():
    """2 of 200 packets (1%) is what a path losing 0.2% gives in 6% of its windows: good; 6 of
    200 is not (bad), nor 10 of 200, a 5% fault (severe)."""
    c = TitanController(Targets())
    assert c.judge(Quality(rtt_ms=20, loss=2 / 200, jitter_ms=1, packets=198)) == GOOD
    assert c.judge(Quality(rtt_ms=20, loss=6 / 200, jitter_ms=1, packets=194)) == BAD
    assert c.judge(Quality(rtt_ms=20, loss=10 / 200, jitter_ms=1, packets=190)) == SEVERE


def test_raises_step_by_step_while_quality_holds_up_to_the_cap():
    c = TitanController(step=0.1, max_fraction=0.5)
    seen = [c.update(PATH, GOOD_Q) for _ in range(8)]
    assert seen[:5] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert max(seen) == pytest.approx(0.5)


@pytest.mark.parametrize("start_windows", [1, 4, 10])
def test_backs_off_to_zero_within_the_bound(start_windows):
    c = TitanController(step=0.1, backoff=0.5, floor=0.05)
    for _ in range(start_windows):
        c.update(PATH, GOOD_Q)
    before = c.fraction(PATH)
    steps = 0
    while c.fraction(PATH) > 0:
        c.update(PATH, BAD_Q)
        steps += 1
        assert steps <= c.max_backoff_steps
    assert before > 0
    assert c.max_backoff_steps == 5  # 1.0 -> 0.5 -> 0.25 -> 0.125 -> 0.0625 -> (0.031 < floor) 0


def test_severe_degradation_goes_to_zero_at_once():
    c = TitanController(step=0.2)
    for _ in range(5):
        c.update(PATH, GOOD_Q)
    assert c.fraction(PATH) == pytest.approx(1.0)
    assert c.update(PATH, SEVERE_Q) == 0.0


def test_never_raises_on_a_path_above_its_thresholds_random_sequences():
    rng = random.Random(7)
    choices = [GOOD_Q, MARGINAL_Q, BAD_Q, SEVERE_Q, None, Quality(40, 0.0, 3, packets=5)]
    for trial in range(200):
        c = TitanController(step=rng.choice([0.05, 0.1, 0.3]), hold_windows=rng.choice([1, 2]),
                            recover_windows=rng.choice([1, 3]))
        for _ in range(60):
            q = rng.choice(choices)
            before = c.fraction(PATH)
            after = c.update(PATH, q)
            verdict = c.judge(q)
            if verdict in (BAD, SEVERE):
                assert after < before or before == 0.0
            if verdict != GOOD:
                assert after <= before, (trial, verdict, before, after)


def test_recovery_needs_several_good_windows_after_a_back_off():
    c = TitanController(step=0.1, recover_windows=3)
    for _ in range(5):
        c.update(PATH, GOOD_Q)
    c.update(PATH, BAD_Q)
    low = c.fraction(PATH)
    assert c.update(PATH, GOOD_Q) == low
    assert c.update(PATH, GOOD_Q) == low
    assert c.update(PATH, GOOD_Q) == pytest.approx(low + 0.1)


def test_paths_are_independent():
    c = TitanController(step=0.2)
    other = ("eastus", "westeurope")
    for _ in range(3):
        c.update(PATH, GOOD_Q)
        c.update(other, GOOD_Q)
    c.update(PATH, SEVERE_Q)
    assert c.fraction(PATH) == 0.0 and c.fraction(other) == pytest.approx(0.6)
