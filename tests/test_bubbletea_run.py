"""BubbleTea in a real run (default topology and training, short): prefills land in the
bubbles, every request is accounted for, an overload degrades to rejections with reasons,
the loss curve is the training's own, and a killed controller leaves training running."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from testbed.experiment import load_experiment
from testbed.runner import TrainingRun

pytestmark = pytest.mark.network
REPO = Path(__file__).resolve().parent.parent


def _exp(iterations: int, **bubbletea):
    exp = load_experiment(REPO / "experiments" / "bubbletea.yaml")
    exp.training.iterations = iterations
    for key, value in bubbletea.items():
        setattr(exp.bubbletea, key, value)
    return exp


@pytest.mark.network(delay="tun")
@pytest.mark.fidelity
def test_prefills_fill_bubbles_and_every_request_is_accounted_for(tmp_path):
    from agents.trainer.reference import reference_losses

    exp = _exp(8, rate_scale=200.0)  # far above what the bubbles can serve: an overload
    result = TrainingRun(exp, tmp_path).run()
    s = result["summary"]
    assert s["requests_admitted"] > 100
    assert s["requests_admitted"] == s["requests_completed"] + s["requests_rejected"]
    assert s["requests_completed"] > 0 and s["requests_rejected"] > 0
    assert set(s["rejection_reasons"]) <= {"TTFT SLO", "run ended while queued", "run ended while prefilling",
                                           "run ended while decoding"}
    assert s["utilization_with_prefill"] > s["utilization_without_prefill"] + 0.05
    assert s["bubble_time_filled"] > 0.1
    # the overload costs training little: within the run-to-run noise of this machine
    assert s["training_slowdown"] < 0.15, s
    want = reference_losses(exp.model.model_dump(), exp.training.model_dump(), exp.parallel.replicas)
    got = [it["loss"] for it in result["iterations"]]
    assert got == pytest.approx(want, rel=1e-5)
    for name in ("metrics.json", "bubbletea.json", "ttft_cdf.png", "gantt.png"):
        assert (tmp_path / name).exists()


@pytest.mark.network(delay="tun")
def test_a_killed_controller_leaves_training_unaffected(tmp_path):
    run = TrainingRun(_exp(7), tmp_path)
    state = {}

    def watch(worker, msg):
        if msg.get("iteration_done") and msg["it"] == 3 and "killed" not in state:
            state["killed"] = True
            os.kill(run.pids()["bubbletea-controller"], signal.SIGKILL)

    run.subscribe(watch)
    result = run.run()
    assert state.get("killed")
    assert len(result["iterations"]) == 7 and all(it["loss"] is not None for it in result["iterations"])
    log = "\n".join(result["log"])
    assert "bubbletea controller died" in log and "training continues unaffected" in log, log
