"""Atlas in a real run: plan published and enforced, losses unchanged, and a controller or
agent killed mid-run leaves training going under fair sharing with the event in the log."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from testbed.experiment import parse_experiment
from testbed.runner import TrainingRun

pytestmark = pytest.mark.network
REPO = Path(__file__).resolve().parent.parent


def _exp(sharing: str, iterations: int = 7):
    return parse_experiment({
        "name": f"atlas-{sharing}", "topology": str(REPO / "tests" / "data" / "atlas2.yaml"),
        "model": {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 64},
        "training": {"iterations": iterations, "microbatches": 4, "microbatch_size": 8, "seed": 3},
        "parallel": {"stages": 2, "replicas": 2, "schedule": "1f1b", "slow_start_after_idle": False},
        "atlas": {"sharing": sharing, "lease_s": 1.0},
    }, "atlas")


@pytest.mark.network(delay="tun")
def test_atlas_plan_is_enforced_and_losses_do_not_change(tmp_path):
    fair = TrainingRun(_exp("fair"), tmp_path / "fair").run()
    run = TrainingRun(_exp("temporal"), tmp_path / "temporal")
    seen = {}

    def watch(worker, msg):  # while training: the scheduler is in the link, with the plan's order
        if msg.get("iteration_done") and msg["it"] == 5 and "sched" not in seen:
            seen["sched"] = run.net.link("dc1", "dc2").delay_line_stats()["sched"]

    run.subscribe(watch)
    result = run.run()
    assert [it["loss"] for it in result["iterations"]] == [it["loss"] for it in fair["iterations"]]
    plans = run.extension("atlas").plans
    assert plans and plans[0]["order"] == ["r0", "r1"]
    assert plans[0]["transfer_s"] > 0  # enforced: the rank order staggers, no offsets
    assert set(plans[0]["offsets"].values()) == {0.0}
    assert result["summary"]["atlas"]["plans_published"] == len(plans)
    assert seen["sched"] is not None and seen["sched"]["order"] == ["r0", "r1"]
    assert sum(seen["sched"]["bytes_out"].values()) > 0
    assert sum(seen["sched"]["drops"].values()) == 0  # a waiting pipeline is held, never dropped
    logs = (tmp_path / "temporal" / "atlas-logs" / "agent-dc1.log").read_text()
    assert "plan applied on dc1->dc2" in logs
    assert (tmp_path / "temporal" / "atlas-plans.json").exists()


@pytest.mark.parametrize("victim", ["controller", "agent-dc1"])
@pytest.mark.network(delay="tun")
def test_a_killed_atlas_process_leaves_training_running_under_fair_sharing(tmp_path, victim):
    iterations = 14
    run = TrainingRun(_exp("temporal", iterations=iterations), tmp_path / victim)
    state = {"samples": []}

    def watch(worker, msg):  # the link's scheduler at every iteration after the kill
        if not msg.get("iteration_done") or worker != "s1r1":
            return
        if msg["it"] == 2 and "killed" not in state:
            state["killed"] = time.monotonic()
            os.kill(run.pids()[f"atlas-{victim}"], signal.SIGKILL)
        elif "killed" in state:
            sched = run.net.link("dc1", "dc2").delay_line_stats()["sched"]
            state["samples"].append((time.monotonic() - state["killed"], sched))

    run.subscribe(watch)
    result = run.run()
    losses = [it["loss"] for it in result["iterations"]]
    assert len(losses) == iterations and all(loss is not None for loss in losses)  # no hang, no lost iteration
    lease = run.exp.atlas.lease_s
    late = [sched for after, sched in state["samples"] if after > 1.5 * lease]
    assert late, f"the run ended within {1.5 * lease:.1f} s of the kill: {state['samples']}"
    assert all(sched is None for sched in late)  # dc1->dc2 is one FIFO again: fair sharing restored
    log = "\n".join(result["log"])
    assert f"atlas {victim}" in log and "training continues" in log, log
