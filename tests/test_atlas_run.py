"""Atlas in a real run: plan published and enforced, losses unchanged, and a controller or
agent killed mid-run leaves training going under fair sharing with the event in the log."""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from pathlib import Path

import pytest

from testbed import messages as m
from testbed.spec.experiment import parse_experiment
from testbed.run.runner import TrainingRun

pytestmark = pytest.mark.network
REPO = Path(__file__).resolve().parent.parent


def _exp(sharing: str, iterations: int = 7, plan: str = "telemetry", enforce: str = "gateway"):
    return parse_experiment({
        "name": f"atlas-{sharing}", "topology": str(REPO / "tests" / "data" / "atlas2.yaml"),
        "model": {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 64},
        "training": {"iterations": iterations, "microbatches": 4, "microbatch_size": 8, "seed": 3},
        "parallel": {"stages": 2, "replicas": 2, "schedule": "1f1b", "slow_start_after_idle": False},
        "atlas": {"sharing": sharing, "lease_s": 1.0, "plan": plan, "enforce": enforce},
    }, "atlas")


_FAIR: dict = {}


def _fair_losses(tmp_path_factory) -> list:
    """The fair-sharing run's losses, which both enforcements must reproduce: run once per
    module (it is the same run for both)."""
    if "losses" not in _FAIR:
        fair = TrainingRun(_exp("fair"), tmp_path_factory.mktemp("fair") / "fair").run()
        _FAIR["losses"] = [it["loss"] for it in fair["iterations"]]
    return _FAIR["losses"]


@pytest.mark.network(delay="tun")
def test_atlas_plan_is_enforced_and_losses_do_not_change(tmp_path, tmp_path_factory):
    fair_losses = _fair_losses(tmp_path_factory)
    # the fixed plan (rank order): two identical pipelines tie, and a telemetry plan's order
    # then follows the noise (its own tests below check that it follows the workload)
    run = TrainingRun(_exp("temporal", plan="fixed"), tmp_path / "temporal")
    seen = {}

    def watch(worker, msg):  # while training: the scheduler is in the link, with the plan's order
        if isinstance(msg, m.Events) and msg.iteration_done and msg.it == 5 and "sched" not in seen:
            seen["sched"] = run.net.link("dc1", "dc2").delay_line_stats()["sched"]

    run.subscribe(watch)
    result = run.run()
    assert [it["loss"] for it in result["iterations"]] == fair_losses
    plans = run.extension("atlas").plans
    assert plans and plans[0]["order"] == ["r0", "r1"]
    assert plans[0]["transfer_s"] > 0  # enforced: the rank order staggers, no offsets
    assert set(plans[0]["offsets"].values()) == {0.0}
    assert result["summary"]["atlas"]["plans_published"] == len(plans)
    assert seen["sched"] is not None and seen["sched"]["order"] == ["r0", "r1"]
    assert sum(seen["sched"]["bytes_out"].values()) > 0
    assert sum(seen["sched"]["drops"].values()) == 0  # a waiting pipeline is held, never dropped
    assert result["summary"]["atlas"]["gateway_drops"]["dc1->dc2"] == {"r0": 0, "r1": 0}
    logs = (tmp_path / "temporal" / "atlas-logs" / "agent-dc1.log").read_text()
    assert "plan applied on dc1->dc2" in logs
    assert (tmp_path / "temporal" / "atlas-plans.json").exists()


@pytest.mark.network(delay="tun")
def test_turns_at_the_senders_give_each_direction_to_one_pipeline_at_a_time(tmp_path, tmp_path_factory):
    """``enforce: senders``: no scheduler in the delay line; every cross-DC message after the
    plan waits for its pipeline's turn from its DC's agent, the turns on a direction never
    overlap, and the losses are fair sharing's."""
    fair_losses = _fair_losses(tmp_path_factory)
    run = TrainingRun(_exp("temporal", plan="fixed", enforce="senders"), tmp_path / "senders")
    seen = {}

    def watch(worker, msg):
        if isinstance(msg, m.Events) and msg.iteration_done and msg.it == 5 and "sched" not in seen:
            seen["sched"] = run.net.link("dc1", "dc2").delay_line_stats()["sched"]

    run.subscribe(watch)
    result = run.run()
    assert [it["loss"] for it in result["iterations"]] == fair_losses
    assert "sched" in seen and seen["sched"] is None  # nothing of Atlas's in the network
    atlas = result["summary"]["atlas"]
    assert atlas["enforce"] == "senders" and set(atlas["turns"]) == {"dc1->dc2", "dc2->dc1"}
    turns = json.loads((tmp_path / "senders" / "atlas-turns.json").read_text())
    first_plan = run.extension("atlas").plans[0]["published_at_iteration"]
    messages_after = 4 * 2 * (7 - first_plan - 1)  # per direction: microbatches x pipelines x iterations
    for link, data in turns.items():
        exclusive = sorted((t for t in data["turns"] if t[5]), key=lambda t: t[2])
        assert data["order"] == ["r0", "r1"] and len(exclusive) >= messages_after, (link, len(exclusive))
        assert all(b[2] >= a[3] for a, b in zip(exclusive, exclusive[1:])), link  # one holder at a time
        assert {t[0] for t in exclusive} == {"r0", "r1"}


@pytest.mark.slow
@pytest.mark.network(delay="tun")
def test_a_killed_turn_server_leaves_the_senders_sending_under_fair_sharing(tmp_path):
    iterations = 10
    run = TrainingRun(_exp("temporal", iterations=iterations, plan="fixed", enforce="senders"), tmp_path / "kill")
    killed = {}

    def watch(worker, msg):
        if isinstance(msg, m.Events) and msg.iteration_done and worker == "s1r1" and msg.it == 4 and not killed:
            killed["at"] = True
            os.kill(run.pids()["atlas-agent-dc1"], signal.SIGKILL)

    run.subscribe(watch)
    result = run.run()
    losses = [it["loss"] for it in result["iterations"]]
    assert killed and len(losses) == iterations and all(loss is not None for loss in losses)
    log = "\n".join(result["log"])
    assert "atlas agent-dc1 died" in log and "send without turns" in log and "training continues" in log, log
    worker_logs = "".join(p.read_text() for p in (tmp_path / "kill").rglob("s0r*.log"))
    assert "sending without turns (fair sharing)" in worker_logs


@pytest.mark.parametrize("victim", ["controller", pytest.param("agent-dc1", marks=pytest.mark.slow)])
@pytest.mark.network(delay="tun")
def test_a_killed_atlas_process_leaves_training_running_under_fair_sharing(tmp_path, victim):
    iterations = 14
    run = TrainingRun(_exp("temporal", iterations=iterations), tmp_path / victim)
    state = {"samples": []}

    def watch(worker, msg):  # the link's scheduler at every iteration after the kill
        if not (isinstance(msg, m.Events) and msg.iteration_done) or worker != "s1r1":
            return
        if msg.it == 2 and "killed" not in state:
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


def _emulated(iterations: int, **atlas):
    return parse_experiment({
        "name": "atlas-emulated", "topology": str(REPO / "tests" / "data" / "atlas2.yaml"), "device": "emulated",
        "model": {"layers": 2, "hidden": 256, "heads": 4, "seq_len": 128},
        "training": {"iterations": iterations, "microbatches": 4, "microbatch_size": 2, "seed": 3},
        "parallel": {"stages": 2, "replicas": 2, "schedule": "1f1b", "slow_start_after_idle": False},
        "sim": {"stage_times": [{"forward_s": 0.01, "backward_s": 0.02}] * 2},
        "atlas": {"sharing": "temporal", "lease_s": 1.0, **atlas.pop("atlas", {})}, **atlas,
    }, "atlas")


@pytest.mark.fidelity
@pytest.mark.slow
@pytest.mark.network(delay="tun")
def test_the_enforced_plan_follows_a_link_whose_rate_changes_within_two_iterations(tmp_path):
    run = TrainingRun(_emulated(12), tmp_path)
    state = {}

    def watch(worker, msg):
        if not (isinstance(msg, m.Events) and msg.iteration_done) or worker != "s1r1":
            return
        link = run.net.link("dc1", "dc2")
        if msg.it == 5 and "changed" not in state:
            state["rate"] = link.params.rate_mbps
            link.set(rate_mbps=state["rate"] / 2)
            state["changed"] = msg.it
        elif "changed" in state and msg.it == state["changed"] + 2:
            state["sched"] = link.delay_line_stats()["sched"]

    run.subscribe(watch)
    run.run()
    plans = run.extension("atlas").plans
    before = statistics.median(p["transfer_s"] for p in plans if p["published_at_iteration"] <= state["changed"])
    after = [p for p in plans if state["changed"] < p["published_at_iteration"] <= state["changed"] + 2]
    assert after, [(p["published_at_iteration"], p["transfer_s"]) for p in plans]
    # The plan's transfer grew by what the slower link adds to a message (judged as a
    # difference: each transfer also carries a per-message overhead of these 0.3-core hosts,
    # 30-50 ms, which does not halve with the rate, so after/before read 1.40-2.3 in 9 runs
    # and one CI run missed a 1.6x bar; the growth read +0.07 to +0.24 s against +0.11 s).
    message = after[-1]["basis"]["message_bytes"]
    added = message / (state["rate"] / 2 * 1e6 / 8) - message / (state["rate"] * 1e6 / 8)
    assert after[-1]["transfer_s"] - before >= 0.5 * added, (before, added, after)
    assert state["sched"]["rate_bytes_s"] == pytest.approx(state["rate"] / 2 * 1e6 / 8 * 0.97)  # paced to it


@pytest.mark.fidelity
@pytest.mark.network(delay="tun")
@pytest.mark.parametrize(("plan", "first"), [("telemetry", "r1"), pytest.param("fixed", "r0", marks=pytest.mark.slow)])
def test_the_order_follows_the_workload_a_slow_pipeline_first(tmp_path, plan, first):
    """Pipeline r1's devices are twice as slow: a plan made from telemetry gives it the link
    first (its transfers should never wait: the iteration ends when it does); the fixed
    order does not (the ablation)."""
    exp = _emulated(6, atlas={"plan": plan}, emulation={"slowdown": {1: 2.0}})
    run = TrainingRun(exp, tmp_path)
    applied = []  # what the gateways' schedulers hold, read back at each of the last iterations' ends

    def watch(worker, msg):
        if isinstance(msg, m.Events) and msg.iteration_done and worker == "s1r1" and msg.it >= 3:
            applied.append({f"{wd.src}->{wd.dst}": (wd.delay_line_stats().get("sched") or {}).get("order")
                            for wd in run.net.links()})

    run.subscribe(watch)
    run.run()
    plans = run.extension("atlas").plans
    assert plans and plans[-1]["order"][0] == first, plans[-1]
    # the order as planned is the order in force, on both directions (not only the plan's word)
    orders = [p["order"] for p in plans]
    assert applied and all(o in orders for a in applied for o in a.values()), (applied, orders)
    assert all(o == plans[-1]["order"] for o in applied[-1].values()), (applied[-1], plans[-1])
    if plan == "telemetry":
        compute = plans[-1]["basis"]["pipeline_compute"]
        assert compute["1"] == pytest.approx(2 * compute["0"], rel=0.1)


@pytest.mark.fidelity
@pytest.mark.slow
@pytest.mark.network(delay="tun")
def test_atlas_plans_the_same_under_time_dilation(tmp_path):
    """At k = 2 the controller plans on the wall clock, from dilated telemetry and the wire's
    (dilated) links; the plan it records, in emulated terms, is the one it makes at k = 1, and
    the run's emulated iteration time is k = 1's."""
    got = {}
    for k in (1, 2):
        exp = _emulated(8, atlas={"plan": "telemetry"}, emulation={"slowdown": {1: 2.0}}, time_dilation=k)
        run = TrainingRun(exp, tmp_path / f"k{k}")
        result = run.run()
        got[k] = (run.extension("atlas").plans[-1], result["summary"])
    (p1, s1), (p2, s2) = got[1], got[2]
    assert p1["order"] == p2["order"] == ["r1", "r0"] and p2["basis"]["time_dilation"] == 2
    # measured in 6 pairs (2026-12-05/06, CI's included): compute 45.1-45.3 ms at both k
    assert p2["compute_s"] == pytest.approx(p1["compute_s"], rel=0.05)
    # iteration time k = 2 over k = 1: 0.935-1.021 (0.935 on CI, whose k = 1 run read 1.350 s;
    # k = 1 alone 1.265-1.350 s, sd 0.031, k = 2 alone 1.262-1.292 s, sd 0.012: the host's noise
    # is what dilation divides).  Loosened from 5% to 8% on those figures; a missing
    # conversion reads 2.
    assert s2["mean_iteration_time_s"] == pytest.approx(s1["mean_iteration_time_s"], rel=0.08)
    # the controller's link estimate is the 90th percentile of size / (duration - delay) over a
    # few transfers: k = 1 alone read 1.37-1.73 MB/s in 6 runs, and k = 2 over k = 1 read
    # 0.754-1.178 (the planned transfer 0.849-1.234).  A band of a factor 1.4 either way spans
    # that (loosened from 15%, which CI missed at 0.754); without the conversion (rates x k)
    # the ratio is 0.5, and 2 for the transfer.
    for key, a, b in (("link_bytes_s", p1["basis"]["link_bytes_s"], p2["basis"]["link_bytes_s"]),
                      ("transfer_s", p1["transfer_s"], p2["transfer_s"])):
        assert 1 / 1.4 <= b / a <= 1.4, (key, a, b)
