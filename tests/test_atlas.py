"""Atlas without a network: Algorithm 1, the what-if search, the temporal plan, and the
simulator's strict-priority sharing policy (closed forms)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.atlas.plan import TelemetryWindow, make_plan
from agents.atlas.planner import PlanError, assign_stages, search
from testbed import messages as m
from testbed.spec.experiment import parse_experiment
from testbed.results.metrics import summarise
from testbed.sim.build import PAYLOAD_FRACTION, simulate
from testbed.sim.engine import Link, PriorityPolicy, Simulator, TurnPolicy

REPO = Path(__file__).resolve().parent.parent


def test_algorithm_1_fills_the_largest_dcs_first_with_consecutive_stages():
    free = {"a": 8, "b": 32, "c": 16}
    # D=4: b holds 8 stages, c 4, a 2 -> 6 stages need only b
    assert assign_stages(free, 6, 4) == {"b": [0, 1, 2, 3, 4, 5]}
    assert assign_stages(free, 12, 4) == {"b": [0, 1, 2, 3, 4, 5, 6, 7], "c": [8, 9, 10, 11]}
    assert assign_stages(free, 13, 4) == {"b": list(range(8)), "c": [8, 9, 10, 11], "a": [12]}
    with pytest.raises(PlanError, match="15 stages x 4 replicas x TP 1 do not fit"):
        assign_stages(free, 15, 4)
    assert assign_stages(free, 3, 4, tensor_parallel=4) == {"b": [0, 1], "c": [2]}


def test_what_if_search_prefers_fewer_wan_boundaries_and_explains_the_rest():
    exp = parse_experiment({
        "name": "plan", "topology": str(REPO / "topologies" / "aws-4dc-sim.yaml"),
        "model": {"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 2048},
        "training": {"iterations": 2, "microbatches": 16, "microbatch_size": 1, "warmup_iterations": 1},
        "parallel": {"stages": 8, "replicas": 16, "schedule": "1f1b"},
        "sim": {"device_tflops": 989, "tensor_parallel": 4, "dtype_bytes": 2, "intra_dc_gbps": 1600,
                "tcp_window_bytes": 6291456, "wan_link_gbps": 400},
    }, "plan")
    ranked = search(exp, stages=[4, 8], replicas=[16, 32])
    feasible = [c for c in ranked if c.iteration_time_s is not None]
    times = [c.iteration_time_s for c in feasible]
    assert times == sorted(times) and len(feasible) >= 4
    best = feasible[0]
    assert len(best.placement) == 1  # it fits in one DC: no WAN boundary at all
    worst = max(feasible, key=lambda c: len(c.placement))
    assert "WAN boundaries" in worst.why_not and "slower" in worst.why_not
    assert any("do not fit" in c.why_not for c in ranked if c.iteration_time_s is None)


def test_temporal_plan_follows_the_brief_formulas():
    plan = make_plan(replicas=3, compute_s=0.1, message_bytes=1e6, link_bytes_s=2e7)  # t = 50 ms
    assert plan.transfer_s == pytest.approx(0.05)
    assert plan.offsets == {0: 0.0, 1: pytest.approx(0.05), 2: pytest.approx(0.1)}
    assert plan.lockstep_s == pytest.approx(0.1 + 3 * 0.05)
    assert plan.temporal_s == pytest.approx(max(0.1 + 0.05, 3 * 0.05))
    assert make_plan(3, 0.1, 1e6, 2e7, enforced=True).offsets == {0: 0.0, 1: 0.0, 2: 0.0}
    assert not plan.moved(make_plan(3, 0.1, 1.04e6, 2e7), 0.1)
    assert plan.moved(make_plan(3, 0.1, 1.5e6, 2e7), 0.1)


def test_the_order_keeps_its_places_among_pipelines_within_five_percent():
    """Emulated devices' pipelines differ by noise (0.2198-0.2203 s an iteration): the previous
    order stands; a pipeline 10% slower than the rest goes first, the rest keep theirs."""
    noise = {0: 0.22033, 1: 0.21979, 2: 0.21989, 3: 0.21988}
    assert make_plan(4, 0.1, 1e6, 2e7, enforced=True, pipeline_compute=noise,
                     previous=["r2", "r1", "r0", "r3"]).order == ["r2", "r1", "r0", "r3"]
    slow = {**noise, 3: 0.244}
    assert make_plan(4, 0.1, 1e6, 2e7, enforced=True, pipeline_compute=slow,
                     previous=["r2", "r1", "r0", "r3"]).order == ["r3", "r2", "r1", "r0"]


def test_telemetry_window_takes_medians_of_recent_iterations():
    w = TelemetryWindow(keep_iterations=2)
    for it in range(4):
        for name, stage in (("s0r0", 0), ("s1r0", 1)):
            f = 0.010 * (stage + 1) * (10 if it == 0 else 1)  # iteration 0 is slow (warm-up)
            w.add(name, m.Events(it=it, iteration_done=True, end=0.0,
                                 events=[m.Span("forward", 0, 0.0, f, it), m.Span("backward", 0, f, 3 * f, it)],
                                 transfers=[m.Xfer("xfer_act", 0, 0.0, 0.01, 4096, it)]))
    compute, per_stage = w.slowest_stage_compute()
    assert compute == pytest.approx(0.020 + 0.040)  # stage 1: forward 20 ms, backward 40 ms
    assert w.typical_message() == 4096 and w.min_iterations(2) == 4


def test_the_plan_follows_a_link_whose_rate_changes_under_the_run():
    w = TelemetryWindow(keep_iterations=3, transfer_delays={"xfer_act:1": 0.010})
    size = 125_000  # 10 ms at 100 Mbit/s, 20 ms at 50

    def iteration(it, rate_bytes_s, contended=()):
        xfers = []
        for mb in range(6):
            t0 = it + mb * 0.1
            serial = size / rate_bytes_s * (2 if mb in contended else 1)  # shared with the other pipeline
            xfers.append(m.Xfer("xfer_act", mb, t0, t0 + 0.010 + serial, size, it))
        w.add("s1r0", m.Events(events=[m.Span("forward", mb, it, it + 0.05, it) for mb in range(6)],
                               transfers=xfers, iteration_done=True, it=it))

    assert w.link_rate() is None  # nothing measured yet: the controller uses the topology's rate
    for it in range(3):
        iteration(it, 12.5e6, contended=(1, 2, 3))  # half the transfers shared: the uncontended rule
    assert w.link_rate() == pytest.approx(12.5e6, rel=0.01)
    before = make_plan(2, 0.05, size, w.link_rate(), enforced=True)
    for it in range(3, 6):
        iteration(it, 6.25e6)  # the link now runs at half the rate
    assert w.link_rate() == pytest.approx(6.25e6, rel=0.01)
    after = make_plan(2, 0.05, size, w.link_rate(), enforced=True)
    assert after.transfer_s == pytest.approx(2 * before.transfer_s) and after.moved(before, 0.1)


def _assert_a_capped_owner_leaves_the_rest(policy, link: Link) -> None:
    """r0 (first in rank) capped at 0.4 of the link sends 100 kB; r1 sends 60 kB in what it leaves."""
    sim = Simulator(policy)
    done = {}
    sim.transfer([link], 100_000, 4e5, lambda t: done.setdefault("r0", t), owner="r0")
    sim.transfer([link], 60_000, float("inf"), lambda t: done.setdefault("r1", t), owner="r1")
    sim.run()
    assert done["r0"] == pytest.approx(0.25) and done["r1"] == pytest.approx(0.1)


def test_priority_policy_gives_the_owner_the_whole_link_and_the_rest_what_it_leaves():
    sim = Simulator(PriorityPolicy(["r0", "r1"]))
    link = Link("a->b", bandwidth=1e6, delay=0.0)
    done = {}
    sim.transfer([link], 100_000, float("inf"), lambda t: done.setdefault("r1", t), owner="r1")
    sim.transfer([link], 100_000, float("inf"), lambda t: done.setdefault("r0", t), owner="r0")
    sim.run()
    assert done == {"r0": pytest.approx(0.1), "r1": pytest.approx(0.2)}  # fair: both at 0.2
    # work-conserving: an owner capped by its own ceiling leaves the rest to the others
    _assert_a_capped_owner_leaves_the_rest(PriorityPolicy(["r0", "r1"]), link)


def test_turn_policy_hands_a_link_on_per_message_in_rank_and_never_preempts():
    """Turns at the senders in the fluid model: a message that holds the link keeps it
    against a higher-ranked one that comes later; the link then goes to the highest-ranked
    waiting; a holder that cannot fill the link shares it with the next in rank."""
    link = Link("a->b", bandwidth=1e6, delay=0.0)
    sim = Simulator(TurnPolicy(["r0", "r1", "r2"]))
    done = {}
    sim.transfer([link], 100_000, float("inf"), lambda t: done.setdefault("r2", t), owner="r2")
    sim.at(0.05, lambda: sim.transfer([link], 100_000, float("inf"), lambda t: done.setdefault("r1", t), owner="r1"))
    sim.at(0.06, lambda: sim.transfer([link], 100_000, float("inf"), lambda t: done.setdefault("r0", t), owner="r0"))
    sim.run()
    assert done == {"r2": pytest.approx(0.1), "r0": pytest.approx(0.2), "r1": pytest.approx(0.3)}
    _assert_a_capped_owner_leaves_the_rest(TurnPolicy(["r0", "r1"]), link)


def test_turn_policy_gives_the_link_to_as_many_pipelines_as_it_takes_to_fill_it():
    """Three pipelines whose connections can each take half the link: two hold it at once,
    the third waits for them (then sends at its ceiling); at 0.4 each, all three hold it."""
    link = Link("a->b", bandwidth=1e6, delay=0.0)
    for ceiling, expect in ((5e5, {"r0": 0.08, "r1": 0.08, "r2": 0.16}), (4e5, {"r0": 0.1, "r1": 0.1, "r2": 0.15})):
        sim = Simulator(TurnPolicy(["r0", "r1", "r2"]))
        done = {}
        for r in ("r2", "r1", "r0"):  # asked together: in rank
            sim.transfer([link], 40_000, ceiling, lambda t, r=r: done.setdefault(r, t), owner=r)
        sim.run()
        assert done == pytest.approx(expect)


def test_turn_policy_lets_a_senders_next_message_compete_in_its_rank():
    """A message started the instant the holder's ends (its channel's next) takes the link
    back from a lower-ranked one granted that same instant: r0's two messages go back to back."""
    link = Link("a->b", bandwidth=1e6, delay=0.0)
    sim = Simulator(TurnPolicy(["r0", "r1"]))
    done = {}

    def second(t):
        done["r0 first"] = t
        sim.transfer([link], 100_000, float("inf"), lambda t: done.setdefault("r0 second", t), owner="r0")

    sim.transfer([link], 100_000, float("inf"), second, owner="r0")
    sim.transfer([link], 100_000, float("inf"), lambda t: done.setdefault("r1", t), owner="r1")
    sim.run()
    assert done == {"r0 first": pytest.approx(0.1), "r0 second": pytest.approx(0.2), "r1": pytest.approx(0.3)}


def _two_pipelines(c: float, t: float, d: int = 2, m: int = 8):
    exp = parse_experiment({
        "name": "atlas", "topology": str(REPO / "tests" / "data" / "train3.yaml"),
        "model": {"layers": 4, "hidden": 32, "heads": 2, "seq_len": 16},
        "training": {"iterations": 4, "microbatches": m, "microbatch_size": 1, "warmup_iterations": 1},
        "parallel": {"stages": 2, "replicas": d, "schedule": "gpipe"},
        "placement": {"dc1": [0], "dc2": [1]},
        "sim": {"stage_times": [{"forward_s": c, "backward_s": 0.0}] * 2, "intra_dc_gbps": 1e6},
    }, "atlas")
    size = 16 * 32 * 4  # one activation
    for link in exp.topo.wan:
        link.delay_ms, link.rate_mbps = 0.0, size / t * 8 / 1e6  # one message takes t alone
    fair = summarise(simulate(exp)).summary.mean_iteration_time_s
    plan = make_plan(d, c, size, size / t, enforced=True)
    temporal = summarise(simulate(exp, policy=PriorityPolicy(plan.order), start_offsets=plan.offsets))
    # the senders' stagger, with the transfer time the link really gives (payload, not wire rate)
    paced = summarise(simulate(exp, start_offsets=make_plan(d, c, size, size / t * PAYLOAD_FRACTION).offsets))
    return fair, temporal.summary.mean_iteration_time_s, paced.summary.mean_iteration_time_s


def test_temporal_sharing_beats_lockstep_fair_sharing_where_transfers_collide():
    # C = t, D = 2: per microbatch C + D*t = 3t in lockstep against max(C + t, D*t) = 2t
    fair, temporal, paced = _two_pipelines(c=0.1, t=0.1)
    assert fair / temporal >= 1.25, (fair, temporal)
    # the senders' stagger alone, at D*t = C exactly, is knife-edge: the slightest collision
    # and the pipelines fair-share again (the emulator measures the same; docs/benchmarks.md)
    assert paced <= fair * 1.01, (fair, paced)
    # a link that is never contended (t << C): nothing to gain, and nothing lost
    fair, temporal, paced = _two_pipelines(c=0.1, t=0.001)
    assert temporal == pytest.approx(fair, rel=0.01)


def test_the_planner_takes_device_time_from_where_the_run_gets_it(tmp_path):
    """A profiled run's stage times drive the ranking: the candidate of the profiled depth is
    simulated with exactly them (so its prediction is the profiled run's), another depth gets
    the FLOPs split scaled to the same totals; without a profile the plan says it is not this
    machine's device."""
    from agents.atlas.planner import DeviceTimes
    from testbed.results.metrics import write_outputs

    spec = {
        "name": "planned", "topology": str(REPO / "topologies" / "aws-us3.yaml"),
        "model": {"layers": 6, "hidden": 128, "heads": 4, "seq_len": 64},
        "training": {"iterations": 5, "microbatches": 4, "microbatch_size": 4},
        "parallel": {"stages": 3, "replicas": 2, "schedule": "1f1b", "connections": 4},
    }
    times = [{"forward_s": 0.02, "backward_s": 0.04, "optimizer_s": 0.002},
             {"forward_s": 0.015, "backward_s": 0.03, "optimizer_s": 0.002},
             {"forward_s": 0.025, "backward_s": 0.05, "optimizer_s": 0.003}]
    profiled = parse_experiment(spec | {"sim": {"stage_times": times}}, "plan")
    run = simulate(profiled, iterations=5, record=True)
    result = summarise(run)
    write_outputs(run, result, tmp_path)
    exp = parse_experiment(spec, "plan")

    assert "not this machine" in DeviceTimes.of(exp).source
    device = DeviceTimes.of(exp, tmp_path / "timeline.json")
    assert device.machine and "profiled run" in device.source
    same, _ = device.for_candidate(exp)
    for got, want in zip(same, times):
        assert got.forward == pytest.approx(want["forward_s"], rel=1e-6)
        assert got.backward == pytest.approx(want["backward_s"], rel=1e-6)
    deeper = exp.model_copy(update={"parallel": exp.parallel.model_copy(update={"stages": 6})})
    scaled, _ = device.for_candidate(deeper)
    assert len(scaled) == 6
    assert sum(t.forward for t in scaled) == pytest.approx(sum(t["forward_s"] for t in times), rel=1e-6)
    assert sum(t.backward for t in scaled) == pytest.approx(sum(t["backward_s"] for t in times), rel=1e-6)

    best = search(exp, stages=[3], replicas=[2], device=device)[0]
    assert best.iteration_time_s is not None and best.stage_times is not None
    # what the plan file would hold runs (here: simulates) as predicted
    planned = parse_experiment(spec | {"placement": best.placement, "sim": {"stage_times": best.stage_times_spec(),
                                                                     "message_overhead_s": device.overhead}},
                               "plan")
    again = summarise(simulate(planned, iterations=2, record=True)).summary.mean_iteration_time_s
    assert best.iteration_time_s == pytest.approx(again, rel=0.02)
    flops = search(exp, stages=[3], replicas=[2])[0]
    # 4 microbatches of 75 ms forward + backward on the slowest stage: the FLOPs model's 1 TFLOP/s has none of it
    assert best.iteration_time_s - flops.iteration_time_s > 0.25, (best.iteration_time_s, flops.iteration_time_s)


def test_a_compare_arm_sets_atlas_through_the_registry_and_predicts_with_its_plan(tmp_path):
    """``compare:`` reaches Atlas only through its ``Extension``: the arm's ``sharing`` sets
    ``atlas.sharing`` (a variant key), and predicting the temporal arm hands the simulator the
    published plan's order as strict priority (the ``predict`` hook); fair arms get nothing."""
    from agents.atlas.extension import predict_options
    from testbed.extension import extensions, in_use
    from testbed.run.compare import _settings
    from testbed.sim.engine import PriorityPolicy
    from testbed.spec.experiment import load_experiment

    exp = load_experiment(REPO / "experiments" / "atlas-vs-baseline.yaml")
    arms = {n: exp.variant(n) for n in exp.compare}
    assert {n: v.atlas.sharing for n, v in arms.items()} == {"a": "fair", "b": "fair", "c": "temporal", "p": "paced"}
    assert [e.name for e in in_use(arms["c"])] == ["atlas"] and in_use(arms["a"]) == []
    assert _settings(exp, "c") == "connections=4, sharing=temporal"
    assert extensions()["atlas"].load(extensions()["atlas"].predict) is predict_options
    plans = [{"order": ["r1", "r0"], "offsets": {"0": 0.0, "1": 0.05}}]
    (tmp_path / "atlas-plans.json").write_text(json.dumps(plans))
    got = predict_options(arms["c"], tmp_path)
    assert isinstance(got["policy"], PriorityPolicy) and got["policy"].rank == {"r1": 0, "r0": 1}
    assert got["start_offsets"] == {0: 0.0, 1: 0.05}
    assert "priority_plans" not in got  # (a plan file without its basis: the order from the start)
    plans = [{"order": ["r0", "r1"], "offsets": {"0": 0.0, "1": 0.0}, "basis": {"after_iteration": 2}},
             {"order": ["r1", "r0"], "offsets": {"0": 0.0, "1": 0.05}, "basis": {"after_iteration": 3}}]
    (tmp_path / "atlas-plans.json").write_text(json.dumps(plans))
    got = predict_options(arms["c"], tmp_path)  # when each plan reached the gateways
    assert got["priority_plans"] == [(2, ["r0", "r1"]), (3, ["r1", "r0"])] and got["policy"].rank == {"r1": 0, "r0": 1}
    one = arms["c"].model_copy(update={"parallel": arms["c"].parallel.model_copy(update={"replicas": 1})})
    assert "policy" not in predict_options(one, tmp_path)  # one pipeline: the controller leaves the links FIFO
    assert predict_options(arms["b"], tmp_path) == {}
    assert "policy" not in predict_options(arms["p"], tmp_path)  # paced: the stagger only


def test_testbed_sim_simulates_atlas_temporal_sharing_through_the_registry():
    """``testbed sim --set atlas.sharing=temporal``: the ``simulate`` hook gives the simulator
    the plan's order as the policy the experiment enforces (turns at the senders or the
    gateway's strict priority), every pipeline simulated; fair sharing gets nothing."""
    from agents.atlas.extension import simulate_options
    from testbed.sim.cli import run_sim
    from testbed.spec.experiment import load_experiment

    path = REPO / "experiments" / "atlas-regime.yaml"
    senders = load_experiment(path, ["atlas.sharing=temporal"])
    gateway = load_experiment(path, ["atlas.sharing=temporal", "atlas.enforce=gateway"])
    assert isinstance(simulate_options(senders)["policy"], TurnPolicy)
    assert isinstance(simulate_options(gateway)["policy"], PriorityPolicy)
    assert simulate_options(senders)["fold_replicas"] is False
    assert simulate_options(load_experiment(path)) == {}
    fair = run_sim(path, iterations=3)[0]["iteration_time_s"]
    turns = run_sim(path, iterations=3, overrides=["atlas.sharing=temporal"])[0]["iteration_time_s"]
    assert turns < fair / 1.3  # the regime's gain, as the sweep simulates it (1.47x)


def test_where_no_link_can_be_contended_turns_are_fair_sharing_and_testbed_sim_folds_them():
    """One 32 KiB connection per transfer: four pipelines want 2.7 of the link's 12 MB/s, so
    every flow runs at its ceiling under any policy; ``simulate_options`` then asks for
    nothing (fair sharing, folded), and the turns simulated pipeline by pipeline agree."""
    from agents.atlas.extension import simulate_options
    from testbed.sim.build import wan_can_contend
    from testbed.spec.experiment import load_experiment

    path = REPO / "experiments" / "atlas-regime.yaml"
    thin = load_experiment(path, ["atlas.sharing=temporal", "parallel.connections=1"])
    assert not wan_can_contend(thin) and simulate_options(thin) == {}
    assert wan_can_contend(load_experiment(path))
    assert not wan_can_contend(load_experiment(REPO / "experiments" / "sim-10k.yaml"))  # 1 connection
    fair = summarise(simulate(thin, iterations=3))["summary"]["mean_iteration_time_s"]
    turns = summarise(simulate(thin, iterations=3, policy=TurnPolicy(["r3", "r2", "r1", "r0"]),
                               fold_replicas=False))["summary"]["mean_iteration_time_s"]
    assert turns == pytest.approx(fair, rel=1e-9)
