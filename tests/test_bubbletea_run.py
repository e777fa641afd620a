"""BubbleTea in a real run (default topology and training, short): prefills land in the
bubbles, every request is accounted for, an overload degrades to rejections with reasons,
the loss curve is the training's own, and a killed controller leaves training running; on
emulated devices the prefills occupy the workers' own device streams, a killed decode
worker takes exactly its requests with it (rejected, with the reason the run's log gives),
and a burst far above capacity becomes rejections, not slower training."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from testbed import messages as m
from testbed.spec.experiment import load_experiment
from testbed.run.runner import TrainingRun

pytestmark = pytest.mark.network
REPO = Path(__file__).resolve().parent.parent
FINAL_REASONS = {"TTFT SLO", "run ended while queued", "run ended while prefilling", "run ended while decoding"}


def _exp(iterations: int, file: str = "bubbletea.yaml", **bubbletea):
    exp = load_experiment(REPO / "experiments" / file)
    exp.training.iterations = iterations
    for key, value in bubbletea.items():
        setattr(exp.bubbletea, key, value)
    return exp


def _exact(s: dict) -> None:
    assert s["accounting_exact"], s
    assert s["requests_in_flight_after_run"] == 0
    assert s["requests_arrived"] == s["requests_completed"] + s["requests_rejected"]
    assert sum(s["rejection_reasons"].values()) == s["requests_rejected"]
    assert s["requests_completed"] <= s["requests_admitted"] <= s["requests_arrived"]


@pytest.mark.network(delay="tun")
@pytest.mark.fidelity
def test_prefills_fill_bubbles_and_every_request_is_accounted_for(tmp_path):
    from testbed.train.reference import reference_losses

    exp = _exp(8, rate_scale=200.0)  # far above what the bubbles can serve: an overload
    result = TrainingRun(exp, tmp_path).run()
    s = result["summary"]
    assert s["requests_arrived"] > 100
    _exact(s)
    # an overload: most arrivals are rejected, at the SLO or still queued at the run's end (a
    # rejection at the SLO needs a 3 s wait first: 87-1669 of them in an 8-iteration run here on
    # 2026-12-06, once fewer than the ~200 completed; ~2900-6500 more were queued at the end)
    assert s["requests_completed"] > 0 and s["rejection_reasons"].get("TTFT SLO", 0) > 0
    assert s["requests_rejected"] > 2 * s["requests_completed"], s
    assert set(s["rejection_reasons"]) <= FINAL_REASONS, s["rejection_reasons"]
    assert s["ttft_p99_s"] <= exp.bubbletea.slo_ttft_s and s["tbt_p50_s"] > 0
    assert s["goodput_within_slo"] <= s["requests_completed"] / s["requests_arrived"] + 1e-4  # rounded to 4 places
    assert s["utilization_with_prefill"] > s["utilization_without_prefill"] + 0.05
    assert s["bubble_time_filled"] > 0.1
    # the overload costs training little: within the run-to-run noise of this machine
    assert s["training_slowdown_interleaved"] < 0.15, s
    want = reference_losses(exp.model.model_dump(), exp.training.model_dump(), exp.parallel.replicas)
    got = [it["loss"] for it in result["iterations"]]
    assert got == pytest.approx(want, rel=1e-5)
    for name in ("metrics.json", "bubbletea.json", "ttft_cdf.png", "gantt.png"):
        assert (tmp_path / name).exists()


@pytest.mark.slow
@pytest.mark.network(delay="tun")
def test_a_killed_controller_leaves_training_unaffected(tmp_path):
    run = TrainingRun(_exp(7), tmp_path)
    state = {}

    def watch(worker, msg):
        if isinstance(msg, m.Events) and msg.iteration_done and msg.it == 3 and "killed" not in state:
            state["killed"] = True
            os.kill(run.pids()["bubbletea-controller"], signal.SIGKILL)

    run.subscribe(watch)
    result = run.run()
    assert state.get("killed")
    assert len(result["iterations"]) == 7 and all(it["loss"] is not None for it in result["iterations"])
    log = "\n".join(result["log"])
    assert "bubbletea controller died" in log and "training continues unaffected" in log, log


@pytest.mark.network(delay="tun")
def test_on_emulated_devices_a_killed_decode_worker_takes_exactly_its_requests(tmp_path):
    """Prefill chunks queue on the worker's own device stream (no chunk overlaps a training
    op's device time), the caches have the real size, no BubbleTea process loads torch; the
    decode worker of Ohio is killed mid-run: its requests end rejected with the reason the
    run's log names, the other DCs' keep completing, and training goes on."""
    import json

    from agents.bubbletea.timing import ServingTimes

    exp = _exp(9, "bubbletea-emulated.yaml")
    run = TrainingRun(exp, tmp_path)
    state: dict = {}

    def watch(worker, msg):
        if isinstance(msg, m.Events) and msg.iteration_done and msg.it == 4 and "killed" not in state:
            pids = run.pids()
            state["maps"] = {n: open(f"/proc/{pid}/maps").read() for n, pid in pids.items()
                             if n.startswith("bubbletea-")}
            state["killed"] = msg.end
            os.kill(pids["bubbletea-decode-ohio"], signal.SIGKILL)

    run.subscribe(watch)
    result = run.run()
    s = result["summary"]
    assert "killed" in state and len(state["maps"]) == 6 + 3 + 1
    assert not [n for n, maps in state["maps"].items() if "libtorch" in maps]
    reason = "decode worker decode-ohio died (killed by signal 9)"
    assert s["rejection_reasons"].get(reason, 0) >= 1, s["rejection_reasons"]
    log = "\n".join(result["log"])
    assert f"bubbletea: {reason} at iteration" in log and "training continues unaffected" in log, log
    _exact(s)
    data = json.loads((tmp_path / "bubbletea.json").read_text())
    reqs = data["requests"]
    ohio = {w for w in ("s1r0", "s1r1")}  # stage 1 runs in Ohio
    for r in reqs:  # every request that ended at the dead decode worker says so; none elsewhere
        if r.get("reason") == reason:
            assert r["server"] in ohio
    late = [r for r in reqs if r["status"] == "completed" and r["server"] in ohio
            and r["completed_s"] + data["t0"] > state["killed"] + 1.0]
    assert not late  # nothing of Ohio's completed after its decode worker was gone
    assert any(r["status"] == "completed" and r["server"] not in ohio and
               r["completed_s"] + data["t0"] > state["killed"] + 1.0 for r in reqs)
    assert len(result["iterations"]) == 9
    times = ServingTimes.load(exp.bubbletea.serving_profile or
                              REPO / "agents" / "bubbletea" / "data" / "serving-profile-cpu.json",
                              exp.emulation.speedup)
    for r in reqs:
        if r["status"] == "completed":
            assert r["kv_bytes"] == times.kv_bytes(r["prompt_tokens"])
    # one stream per device: a prefill chunk never runs during a training op's device time, as
    # the device scheduled both (the worker's own spans end when its sleep woke, up to ~2 ms
    # later on this VM: checked against those, 2 of 12 runs here read a false overlap)
    durations = {s_: {k: t / exp.emulation.speedup for k, t in zip(("forward", "backward", "optimizer"),
                                                                    (st.forward_s, st.backward_s, st.optimizer_s))}
                 for s_, st in enumerate(exp.sim.stage_times)}
    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    for name, chunks in data["prefill_intervals"].items():
        spans = [e for e in events if e.get("tid") == name and e.get("cat") in ("forward", "backward", "optimizer")]
        ops = run.workers[name].report["device_ops"]
        assert [k for k, _s, _e in ops] == [e["cat"] for e in spans]  # the same ops as the timeline's
        stage = int(name[1])
        assert all(abs((e - s_) - durations[stage][k]) < 2e-6 for k, s_, e in ops)
        assert chunks
        for cs, ce, _rid in chunks:
            assert not any(cs < oe - 2e-6 and ce > os_ + 2e-6 for _k, os_, oe in ops), (name, cs, ce)
    # Ohio's servers get no more prefills once its decode worker is gone: a third of the devices
    assert s["utilization_with_prefill"] > s["utilization_without_prefill"] + 0.15
    # jobs go to idle servers ahead of their worker's next wait, and few are handed back
    # (measured 2026-12-07: 3-6% quiet over 8 runs, 6-13% with one core kept busy over 3; before
    # the controller stopped re-sending for a wait found passed, 68-87% with that core busy)
    ahead = s["prefill_dispatched_ahead"]
    assert ahead["sent"] > 0 and ahead["handed_back"] < 0.3 * ahead["sent"], ahead


@pytest.mark.slow
@pytest.mark.network(delay="tun")
def test_on_emulated_devices_a_burst_far_above_capacity_becomes_rejections_not_slower_training(tmp_path):
    """20 times the default arrival rate: most requests are rejected at the TTFT SLO, those
    served keep their TTFT within it, and the served iterations are as fast as the unserved
    ones of the same run (interleaved; on emulated devices decoding runs on devices of its
    own, so an unserved iteration is training alone)."""
    exp = _exp(12, "bubbletea-emulated.yaml", rate_scale=400.0, interleave=True)
    s = TrainingRun(exp, tmp_path).run()["summary"]
    _exact(s)
    assert s["requests_rejected"] > 2 * s["requests_completed"] > 0
    assert set(s["rejection_reasons"]) <= FINAL_REASONS, s["rejection_reasons"]
    assert s["ttft_p99_s"] <= exp.bubbletea.slo_ttft_s
    assert abs(s["training_slowdown_interleaved"]) < 0.03, s
    # saturated, the bubbles fill: 0.44 -> 0.79-0.83 here and on CI (0.795); the bar is the gain
    assert s["utilization_with_prefill"] > s["utilization_without_prefill"] + 0.25, s


@pytest.mark.slow
@pytest.mark.fidelity
@pytest.mark.network(delay="tun")
def test_on_emulated_devices_bubbletea_reads_the_same_at_k_1_and_k_2(tmp_path):
    """Under time dilation BubbleTea's inputs go on the wall clock (profile, SLOs, margin,
    arrivals x k) and its results come back in emulated seconds: the same requests arrive,
    the same share of the bubbles fills, and TTFT, TBT and the iteration times read alike at
    k = 1 and 2 (a missing conversion reads 2 or 0.5)."""
    import json

    s = {}
    for k in (1, 2):
        exp = _exp(9, "bubbletea-emulated.yaml", interleave=True)
        exp.time_dilation = k
        s[k] = TrainingRun(exp, tmp_path / f"k{k}").run()["summary"]
        _exact(s[k])
    data = json.loads((tmp_path / "k2" / "bubbletea.json").read_text())
    assert data["time_dilation"] == 2 and s[2]["time_dilation"] == 2
    assert s[2]["ttft_p99_s"] <= exp.bubbletea.slo_ttft_s
    # bands from 3 pairs here (2026-12-06): iteration 0.979-1.046, TTFT P50 0.875-1.109, TBT P50
    # 0.966-1.000, offered load 1.009-1.014; utilization and bubble fill within 0.03
    bands = {"mean_iteration_time_s": (0.9, 1.1), "iteration_time_served_s": (0.9, 1.1),
             "ttft_p50_s": (0.75, 1.3), "tbt_p50_s": (0.9, 1.1), "offered_rps": (0.95, 1.05)}
    ratios = {key: s[2][key] / s[1][key] for key in bands}
    assert all(lo < ratios[key] < hi for key, (lo, hi) in bands.items()), (ratios, s)
    for key in ("utilization_with_prefill", "utilization_without_prefill", "bubble_time_filled"):
        assert abs(s[2][key] - s[1][key]) < 0.06, (key, s[1][key], s[2][key])
