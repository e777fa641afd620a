"""Titan / Titan-Next offline: data, backbone, workload, latency rule, LP, realisation, study, CLI.

No root and no network: these run everywhere in a few seconds.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from agents.titan import lp
from agents.titan import workload as wl
from agents.titan.placement import (INTERNET, WAN, Options, PeakGuard, Plan, _mix, evaluate, plan_loads, realise,
                                    realise_greedy, realise_guarded, rule_plan)
from agents.titan.regions import Backbone, build_world, load_wan
from agents.titan.spec import EmulationSpec, LatencyRule, StudySpec, TitanError, WorkloadSpec, load_spec
from testbed.spec.topology import parse_topology

EU_US = ["uksouth", "westeurope", "northeurope", "francecentral", "eastus", "centralus", "westus2"]


def test_matrix_regions_groups_and_teams_targets_load():
    wan = load_wan()
    assert len(wan.regions) == 54
    assert wan.key("West Europe") == wan.key("westeurope") == "westeurope"
    assert wan.region("Jio India West").key == "jioindiawest"
    assert {r.group for r in wan.regions} == {"Americas", "Europe", "APAC", "MEA"}
    t = wan.targets()
    assert (t.rtt_ms, t.loss, t.jitter_ms) == (100.0, 0.01, 30.0)
    assert wan.bitrates("video", 3) == (500.0, 1000.0)
    assert wan.bitrates("audio", 2) == (30.0, 30.0)


def test_backbone_keeps_exactly_the_edges_no_relay_explains():
    wan = load_wan()
    bb = Backbone(wan, None, 1.1)
    kept = {frozenset((a, b)) for a, b, _ in bb.edges}
    keys = wan.keys
    for a, b in itertools.combinations(keys, 2):
        relay = any(wan.rtt(a, c) + wan.rtt(c, b) <= 1.1 * wan.rtt(a, b) for c in keys if c not in (a, b))
        assert (frozenset((a, b)) in kept) == (not relay), (a, b)
    assert 0 < len(bb.edges) < len(keys) * (len(keys) - 1) // 2
    assert set(bb.path("brazilsouth", "japaneast")) <= set(keys)  # connected


def test_backbone_routes_like_the_testbed_topology():
    """The plan's paths must be the emulator's: same rule as testbed.spec.topology.Topology."""
    wan = load_wan()
    bb = Backbone(wan, EU_US, 1.1)
    topo = parse_topology({"name": "t", "dcs": [{"name": r, "hosts": 1} for r in EU_US],
                           "wan": [{"a": a, "b": b, "delay_ms": r / 2, "rate_mbps": 10} for a, b, r in bb.edges]})
    for a, b in itertools.permutations(EU_US, 2):
        assert bb.path(a, b) == topo.path(a, b)


def test_backbone_command_shows_the_backbone_the_study_builds(tmp_path):
    """``titan backbone`` takes the study's spec and ``--users``/``--dcs`` and shows the backbone
    of the world the study builds (``study.study_world``): every link of it, however few
    regions are listed (issue #33: it used to prune among the listed regions only); the
    links marked crossed are exactly those in the world's user-DC paths, relays included.
    ``--emulated`` takes an emulation spec and shows the backbone pruned among its regions."""
    from agents.titan.emulate import emulated_world
    from agents.titan.study import study_world

    users = ["eastus", "centralus", "westus2", "brazilsouth", "westeurope", "uksouth", "centralindia", "japaneast"]
    dcs = ["eastus", "westeurope", "japaneast"]
    run = CliRunner().invoke(_cli(), ["titan", "backbone", "--users", ",".join(users), "--dcs", ",".join(dcs),
                                      "--json"])
    assert run.exit_code == 0, run.output
    got = json.loads(run.stdout)
    world = build_world(users, dcs)  # the study's world over these regions, as run_study builds it
    assert [(a, b) for a, b, _ in study_world(load_spec(StudySpec, None, {"users": users, "dcs": dcs}))
            .backbone.edges] == [(a, b) for a, b, _ in world.backbone.edges]
    shown = [(e["a"], e["b"]) for e in got["edges"]]
    assert shown == [(a, b) for a, b, _ in world.backbone.edges]
    assert got["backbone_links"] == len(shown) == len(world.backbone.edges) > 200 and got["backbone_regions"] == 54
    crossed = {frozenset(world.backbone.links[link]) for u in range(len(users)) for d in range(len(dcs))
               for link in world.up_links[u][d] + world.down_links[u][d]}
    assert {frozenset((e["a"], e["b"])) for e in got["edges"] if e["crossed"]} == crossed
    assert got["crossed_links"] == len(crossed)
    assert set(got["relays"]) == set().union(*crossed) - set(users) - set(dcs) != set()
    only = json.loads(CliRunner().invoke(_cli(), ["titan", "backbone", "--users", ",".join(users), "--dcs",
                                                  ",".join(dcs), "--crossed", "--json"]).stdout)
    assert {frozenset((e["a"], e["b"])) for e in only["edges"]} == crossed and only["edges_shown"] == "crossed"
    # the spec (YAML) as `titan study` reads it: its relay factor, users and DCs
    spec = tmp_path / "s.yaml"
    spec.write_text(f"users: [{', '.join(users)}]\ndcs: [{', '.join(dcs)}]\nrelay_factor: 1.05\n")
    wide = json.loads(CliRunner().invoke(_cli(), ["titan", "backbone", str(spec), "--json"]).stdout)
    assert [(e["a"], e["b"]) for e in wide["edges"]] == [(a, b) for a, b, _ in build_world(users, dcs, 1.05)
                                                         .backbone.edges]
    assert wide["backbone_links"] != got["backbone_links"]
    # the world run_study itself routes over (a tiny study, same users and DCs): the same links
    from agents.titan.study import run_study

    tiny = run_study(load_spec(StudySpec, None, {"users": users, "dcs": dcs, "days": 1, "history_days": 1,
                                                 "workload.calls_per_day": 200}))
    assert [e[:2] for e in tiny["_arrays"]["world"].backbone.edges] == shown
    assert tiny["backbone_links"] == got["backbone_links"]
    text = CliRunner().invoke(_cli(), ["titan", "backbone", "--users", ",".join(users), "--dcs", ",".join(dcs)])
    assert "the study's backbone (every region in the matrix" in text.output
    assert f"{len(world.backbone.edges)} links over 54 regions" in text.output
    emu = CliRunner().invoke(_cli(), ["titan", "backbone", "--emulated", "--users", ",".join(users), "--dcs",
                                      ",".join(dcs), "--json"])
    assert emu.exit_code == 0, emu.output
    small = emulated_world(load_spec(EmulationSpec, None, {"users": users, "dcs": dcs}))
    assert small.backbone.nodes == users  # the DCs are among the users
    assert [(e["a"], e["b"]) for e in json.loads(emu.stdout)["edges"]] == [e[:2] for e in small.backbone.edges]
    assert len(small.backbone.edges) < len(crossed)
    emu_text = CliRunner().invoke(_cli(), ["titan", "backbone", "--emulated"]).output
    assert "pruned among the 5 listed regions only" in emu_text and "not the study's" in emu_text


def test_internet_is_comparable_in_europe_and_worse_across_to_apac():
    wan = load_wan()
    eu = wan.internet_rtt("westeurope", "francecentral") - wan.rtt("westeurope", "francecentral")
    apac_mea = wan.internet_rtt("japaneast", "uaenorth") - wan.rtt("japaneast", "uaenorth")
    assert abs(eu) <= 7.5 and apac_mea > 80


def test_unknown_region_is_a_one_line_error_naming_the_field():
    with pytest.raises(TitanError) as e:
        build_world(["uksouth", "Atlantis"], ["westeurope"])
    msg = str(e.value)
    assert msg.startswith("users: unknown Azure region 'Atlantis'") and "\n" not in msg
    result = CliRunner().invoke(_cli(), ["titan", "study", "--dcs", "westeurope,Atlantis", "--days", "1"])
    assert result.exit_code == 2
    assert "dcs: unknown Azure region 'Atlantis'" in result.output
    assert "Traceback" not in result.output


def test_infeasible_latency_bound_is_a_one_line_error():
    world = build_world(["uksouth", "eastus"], ["westeurope"])
    configs = wl.Configs()
    k = configs.id((0, 1))  # a call between London and Virginia, media server in the Netherlands
    opts = Options(world, configs, LatencyRule(delta_ms=20, max_rtt_ms=50))
    with pytest.raises(TitanError) as e:
        opts[k]
    assert str(e.value).startswith("latency.max_rtt_ms: 50 ms is infeasible") and "\n" not in str(e.value)
    result = CliRunner().invoke(_cli(), ["titan", "study", "--users", "uksouth,eastus", "--dcs", "westeurope",
                                         "--days", "1", "--calls-per-day", "200", "--max-rtt-ms", "20"])
    assert result.exit_code == 2 and "latency.max_rtt_ms: 20 ms is infeasible" in result.output
    assert "Traceback" not in result.output


def test_bad_spec_field_is_one_line():
    with pytest.raises(TitanError) as e:
        load_spec(StudySpec, None, {"latency.delta_ms": -5})
    assert str(e.value).startswith("<defaults>: latency.delta_ms:")
    with pytest.raises(TitanError, match="titan_fraction"):
        load_spec(StudySpec, None, {"internet_cap": 0.3, "titan_fraction": 0.5})
    for flag, value, field in (("--move-at", "1.5", "move_at"), ("--forecast-quantile", "1", "forecast_quantile")):
        got = CliRunner().invoke(_cli(), ["titan", "study", "--days", "1", "--users", "uksouth,eastus", "--dcs",
                                          "westeurope", flag, value])
        assert got.exit_code == 2 and f"{field}:" in got.output and len(got.output.strip().splitlines()) == 1
    with pytest.raises(TitanError, match="^<defaults>: move_at: the emulator does not move calls"):
        load_spec(EmulationSpec, None, {"move_at": 0.9})  # its policy runs play a call on one route



def test_shipped_titan_specs_load():
    """experiments/titan/ holds Titan's specs (apart from the training experiments, which
    ``testbed run`` loads): each one validates."""
    from pathlib import Path

    from agents.titan.spec import EmulationSpec

    folder = Path(__file__).resolve().parent.parent / "experiments" / "titan"
    assert load_spec(StudySpec, folder / "week.yaml").days == 7
    assert load_spec(EmulationSpec, folder / "emu.yaml").users

@pytest.fixture(scope="module")
def small():
    """Seven EU/US user regions, three DCs, two days of calls."""
    world = build_world(EU_US, ["westeurope", "eastus", "westus2"], internet_cap=0.5)
    spec = WorkloadSpec(calls_per_day=4000, seed=3)
    calls = wl.generate(world, spec, 2)
    configs = wl.Configs()
    cfg = configs.of_calls(calls)
    prov = configs.provisional_of_calls(calls)
    opts = Options(world, configs, LatencyRule(delta_ms=20))
    opts.check_all(np.concatenate((cfg, prov)))
    return world, calls, configs, cfg, prov, opts


def test_workload_is_diurnal_in_local_time_mostly_small_with_a_tail(small):
    world, calls, *_ = small
    weekday = calls.start_s < wl.DAY_S
    assert 3000 < weekday.sum() < 5000
    sizes = calls.size
    assert np.mean((sizes >= 2) & (sizes <= 4)) > 0.75 and sizes.max() >= 10
    # London calls: local business hours (UTC+0) busier than local night
    home = np.array(world.users)[calls.first]
    hour = (calls.start_s % wl.DAY_S) / 3600
    london = home == "uksouth"
    assert ((hour >= 9) & (hour < 17) & london).sum() > 10 * ((hour >= 0) & (hour < 6) & london).sum()
    # Los Angeles-ish (UTC-8): its business day is later in UTC than London's
    west = home == "westus2"
    assert np.median(hour[west & weekday]) > np.median(hour[london & weekday]) + 4
    assert set(np.unique(calls.media)) == {0, 1, 2}


def test_latency_rule_allows_only_placements_within_the_bound(small):
    world, calls, configs, cfg, prov, opts = small
    for k in np.unique(cfg)[:300]:
        co = opts[int(k)]
        assert (co.nearest, WAN) in co.options
        for (d, r), lat in zip(co.options, co.latency):
            assert np.all(lat <= co.ref_rtt + 20 + 1e-6)
            if r == INTERNET:
                assert world.inet_ok[list(co.regions), d][~world.local[list(co.regions), d]].all()


def test_lp_beats_the_rule_plans_on_the_demand_it_plans_for(small):
    world, calls, configs, cfg, prov, opts = small
    slot_s, T = 1800.0, 48
    demand = wl.demand(calls, cfg, 0.0, slot_s, T)
    cap = lp.capacities(world, opts, demand, 1.25)
    problem = lp.DayProblem(demand, lp.top_configs(demand, 60), cap)  # head + tail classes
    tn = lp.solve_day(world, opts, problem, "titan-next", (WAN, INTERNET), 1e-3, solver="simplex")
    wanlp = lp.solve_day(world, opts, problem, "wan-lp", (WAN,), 1e-3, solver="ipm")
    rules = {f: rule_plan("r", opts, demand.config, f) for f in (0.0, 0.5)}

    def sop(plan):
        return plan_loads(world, opts, plan, demand).max(axis=1).sum()

    assert tn.stats["tail_classes"] > 0
    # the plan's own bookkeeping agrees with its loads (tie-break kept within eps)
    assert sop(tn) == pytest.approx(tn.stats["planned_sum_of_peaks_kbps"], rel=2e-3)
    assert sop(tn) <= sop(rules[0.5]) + 1e-6  # Titan at the cap is one feasible point of the LP
    assert sop(wanlp) <= sop(rules[0.0]) + 1e-6  # nearest over the WAN is one of the WAN LP
    assert sop(tn) < 0.8 * sop(rules[0.0])
    # Internet share per (region, DC, slot) within the cap, DC load within capacity, by the fractions
    inet = np.zeros((len(world.users), len(world.dcs), T))
    allp = np.zeros_like(inet)
    dc_load = np.zeros((len(world.dcs), T))
    for i in range(len(demand.config)):
        k, t, u = int(demand.config[i]), int(demand.slot[i]), int(demand.region[i])
        for d, r, f in zip(*tn.get(k, t, opts)):
            dc_load[d, t] += f * demand.participants[i]
            if not world.local[u, d]:
                allp[u, d, t] += f * demand.participants[i]
                inet[u, d, t] += f * demand.participants[i] * (r == INTERNET)
    assert np.all(inet <= 0.5 * allp + 1e-6)
    assert np.all(dc_load <= cap[:, None] * (1 + 1e-6))


def test_tie_break_lowers_latency_without_raising_the_peaks(small):
    world, calls, configs, cfg, prov, opts = small
    demand = wl.demand(calls, cfg, 0.0, 3600.0, 24)
    cap = lp.capacities(world, opts, demand, 1.25)
    problem = lp.DayProblem(demand, lp.top_configs(demand, 40), cap)
    plain = lp.solve_day(world, opts, problem, "x", (WAN, INTERNET), None, solver="simplex")
    tied = lp.solve_day(world, opts, problem, "x", (WAN, INTERNET), 1e-3, solver="simplex")

    def latency(plan):
        total = 0.0
        for i in range(len(demand.config)):
            k, t, u = int(demand.config[i]), int(demand.slot[i]), int(demand.region[i])
            for d, r, f in zip(*plan.get(k, t, opts)):
                total += f * demand.participants[i] * world.rtt(r)[u, d]
        return total

    assert tied.stats["sum_of_peaks_after_tiebreak_kbps"] <= plain.stats["planned_sum_of_peaks_kbps"] * (1 + 1e-3) + 1e-3
    assert latency(tied) <= latency(plain) + 1e-6


def test_configurations_by_media_send_the_costly_calls_over_the_internet(small):
    """The caps count participants, the peaks kbps: told apart by media, the LP gives the
    Internet share to HD and video participants before audio ones and plans lower peaks."""
    world, calls, *_ = small
    got = {}
    for by_media in (False, True):
        configs = wl.Configs(by_media=by_media)
        cfg = configs.of_calls(calls)
        opts = Options(world, configs, LatencyRule(delta_ms=20))
        demand = wl.demand(calls, cfg, 0.0, 3600.0, 24)
        cap = lp.capacities(world, opts, demand, 1.25)
        plan = lp.solve_day(world, opts, lp.DayProblem(demand, lp.top_configs(demand, 60), cap), "x",
                            (WAN, INTERNET), 1e-3, solver="simplex")
        media = np.array(configs.media)
        assert set(media.tolist()) == ({0, 1, 2} if by_media else {-1})
        got[by_media] = plan.stats["planned_sum_of_peaks_kbps"]
        classes = {key[0] for key in plan.class_of}  # the long tail's classes: one set per medium
        assert classes == ({0, 1, 2} if by_media else {-1})
    inet = np.zeros(3)
    part = np.zeros(3)
    for i in range(len(demand.config)):  # the split plan's Internet share of each medium's crossing participants
        k, t, u = int(demand.config[i]), int(demand.slot[i]), int(demand.region[i])
        for d, r, f in zip(*plan.get(k, t, opts)):
            if not world.local[u, d]:
                part[media[k]] += f * demand.participants[i]
                inet[media[k]] += f * demand.participants[i] * (r == INTERNET)
    audio, video, hd = inet / part
    assert hd > audio + 0.2 and video > audio + 0.2
    assert got[True] < 0.8 * got[False]


def test_titans_fixed_fraction_does_not_change_when_configurations_have_media(small):
    """The rule baselines' mixes are the same for every medium: their quota counters run per
    region set, so telling configurations apart by media leaves Titan's realisation as it was."""
    world, calls, *_ = small
    routes = {}
    for by_media in (False, True):
        configs = wl.Configs(by_media=by_media)
        cfg, prov = configs.of_calls(calls), configs.provisional_of_calls(calls)
        opts = Options(world, configs, LatencyRule(delta_ms=20))
        plan = rule_plan("titan", opts, np.concatenate((cfg, prov)), 0.5)
        routes[by_media] = realise(plan, opts, calls, cfg, prov, 0.0, 3600.0).route
    assert routes[False].mean() > 0.2
    assert np.array_equal(routes[False], routes[True])


def test_peaks_lp_falls_back_to_simplex_when_ipm_ends_without_an_optimum(small, monkeypatch):
    """IPM ended 'Infeasible' on feasible 8-region days (simplex solved them): the study
    then stopped.  An IPM that ends without an optimum is followed by simplex."""
    import highspy

    world, calls, configs, cfg, prov, opts = small
    demand = wl.demand(calls, cfg, 0.0, 3600.0, 24)
    problem = lp.DayProblem(demand, lp.top_configs(demand, 40), lp.capacities(world, opts, demand, 1.25))
    real_highs = lp._highs

    class _FailingIpm:  # HiGHS as it was seen: IPM (and its crossover) ends 'Infeasible'
        def __init__(self, h):
            self._h = h

        def __getattr__(self, name):
            return getattr(self._h, name)

        def getModelStatus(self):
            return highspy.HighsModelStatus.kInfeasible

    monkeypatch.setattr(lp, "_highs", lambda built, solver: _FailingIpm(real_highs(built, solver)) if solver == "ipm"
                        else real_highs(built, solver))
    plan = lp.solve_day(world, opts, problem, "x", (WAN, INTERNET), 1e-3, solver="ipm")
    assert plan.stats["rounds"][-1]["fallback"] == "simplex"
    monkeypatch.setattr(lp, "_highs", real_highs)
    direct = lp.solve_day(world, opts, problem, "x", (WAN, INTERNET), 1e-3, solver="simplex")
    assert plan.stats["planned_sum_of_peaks_kbps"] == pytest.approx(direct.stats["planned_sum_of_peaks_kbps"], rel=1e-6)


def test_headroom_tie_break_puts_less_on_the_wan_within_the_same_peaks(small):
    """The latency tie-break fills links up to their peaks off the peak; the headroom one
    keeps the same peaks and puts less traffic on the WAN in every slot."""
    world, calls, configs, cfg, prov, opts = small
    demand = wl.demand(calls, cfg, 0.0, 3600.0, 24)
    cap = lp.capacities(world, opts, demand, 1.25)
    problem = lp.DayProblem(demand, lp.top_configs(demand, 40), cap)
    plans = {tb: lp.solve_day(world, opts, problem, "x", (WAN, INTERNET), 1e-3, solver="simplex", tie_break=tb)
             for tb in ("latency", "headroom")}
    loads = {tb: plan_loads(world, opts, p, demand) for tb, p in plans.items()}
    peaks = plans["latency"].stats["peak_limits"]
    assert np.all(loads["headroom"].max(axis=1) <= peaks * (1 + 1e-3) + 1e-3)
    assert np.all(loads["headroom"].sum(axis=0) <= loads["latency"].sum(axis=0) + 1e-3)
    assert loads["headroom"].sum() < 0.95 * loads["latency"].sum()


def test_quota_counters_realise_fractions_deterministically_and_count_migrations(small):
    world, calls, configs, cfg, prov, opts = small
    multi = np.flatnonzero(np.diff(calls.ptr) >= 2)
    k = int(np.bincount(cfg[multi]).argmax())  # the commonest multi-region configuration
    sel = np.flatnonzero(cfg == k)
    sub = calls.select(np.isin(np.arange(len(calls)), sel))
    co = opts[k]
    assert len(co.options) >= 2
    (d0, r0), (d1, r1) = co.options[:2]
    plan = Plan("p", default={k: _mix([(d0, r0), (d1, r1)], [0.3, 0.7])})
    sub.up_kbps[:] = 100.0  # equal weights: the counters must hit call counts exactly
    sub.down_kbps[:] = 100.0
    sub.count[:] = 1
    a = realise(plan, opts, sub, cfg[sel], prov[sel], 0.0, 1e9)
    b = realise(plan, opts, sub, cfg[sel], prov[sel], 0.0, 1e9)
    assert np.array_equal(a.dc, b.dc) and np.array_equal(a.route, b.route)
    n = len(sel)
    got1 = np.sum((a.dc == d1) & (a.route == r1))
    assert abs(got1 - 0.7 * n) <= 1
    prefix = np.cumsum((a.dc == d1) & (a.route == r1))
    assert np.all(np.abs(prefix - 0.7 * np.arange(1, n + 1)) <= 1)
    # the provisional placement (first participant's region alone, nearest DC over the WAN)
    # differs from the settled one for some calls: those are migrations
    first_only = {int(p): _mix([(opts[int(p)].nearest, WAN)], [1.0]) for p in np.unique(prov[sel])}
    plan.default.update(first_only)
    m = realise(plan, opts, sub, cfg[sel], prov[sel], 0.0, 1e9)
    moved = np.array([(m.dc[i], m.route[i]) != (opts[int(prov[sel][i])].nearest, WAN) for i in range(n)])
    assert np.array_equal(m.migrated, moved) and m.migrated.any()


def test_greedy_stays_within_the_internet_caps(small):
    world, calls, configs, cfg, prov, opts = small
    real = realise_greedy(opts, calls, cfg, prov, 0.0, 3600.0)
    ev = evaluate(world, opts, calls, cfg, real, 0.0, 3600.0, 48)
    assert real.route.mean() > 0.1
    assert ev.cap_excess < 0.1 and ev.over_bound == 0


@pytest.fixture(scope="module")
def forecast_plans(small):
    """Day 0's demand as the forecast for day 1 (Titan-Next's LP and the WAN-only one), and
    day 1's calls: the realisation meets a day that differs from its plan."""
    world, calls, configs, cfg, prov, opts = small
    demand = wl.demand(calls, cfg, 0.0, 3600.0, 24)
    cap = lp.capacities(world, opts, wl.demand(calls, cfg, 0.0, 3600.0, 48), 1.25)
    problem = lp.DayProblem(demand, lp.top_configs(demand, 40), cap)
    plans = {routes: lp.solve_day(world, opts, problem, "p", routes, 1e-3, solver="simplex")
             for routes in ((WAN, INTERNET), (WAN,))}
    day1 = calls.start_s >= wl.DAY_S
    return plans, calls.select(day1), cfg[day1], prov[day1]


def test_guarded_realisation_keeps_the_plans_peaks(small, forecast_plans):
    """On a day that is not its forecast, quota counters alone overrun the planned peaks; the
    guarded realisation keeps every link within its limit (the plan's peak, or a peak a call
    could not avoid, which it then keeps to), and lowers the day's sum of peaks."""
    world, calls, configs, cfg, prov, opts = small
    plans, day, dcfg, dprov = forecast_plans
    plan = plans[(WAN, INTERNET)]
    t0 = wl.DAY_S
    planned = plan.stats["planned_peaks"]
    quota = evaluate(world, opts, day, dcfg, realise(plan, opts, day, dcfg, dprov, t0, 3600.0), t0, 3600.0, 24)
    guard = PeakGuard(world, keep_caps=False)  # the caps: the next test
    guard.set_limits(planned)
    real = realise_guarded(plan, opts, day, dcfg, dprov, t0, 3600.0, guard)
    ev = evaluate(world, opts, day, dcfg, real, t0, 3600.0, 24)
    assert quota.peaks().sum() > 1.05 * planned.sum()  # the plan's promise broken without a guard
    assert np.all(ev.peaks() <= np.array(guard.limit) + 1e-6)
    assert np.array(guard.limit).sum() < 1.02 * planned.sum() and guard.raised < 0.01 * len(day)
    assert ev.peaks().sum() < quota.peaks().sum()
    assert ev.over_bound == 0 and real.planned.mean() > 0.95
    # a WAN-only plan's guard looks for room on the WAN only
    wan_guard = PeakGuard(world)
    wan_guard.set_limits(plans[(WAN,)].stats["planned_peaks"])
    wan_real = realise_guarded(plans[(WAN,)], opts, day, dcfg, dprov, t0, 3600.0, wan_guard, (WAN,))
    assert np.all(wan_real.route == WAN)


def test_guarded_realisation_keeps_the_internet_caps(small, forecast_plans):
    """Kept at placement (as greedy keeps them): an Internet placement is taken only while
    every path of the call stays within its cap over the calls in progress; without that the
    guard, looking for room off the full WAN links, offloads past the caps."""
    world, calls, configs, cfg, prov, opts = small
    plans, day, dcfg, dprov = forecast_plans
    plan = plans[(WAN, INTERNET)]
    t0 = wl.DAY_S
    got = {}
    for keep in (False, True):
        guard = PeakGuard(world, keep_caps=keep)
        guard.set_limits(plan.stats["planned_peaks"])
        real = realise_guarded(plan, opts, day, dcfg, dprov, t0, 3600.0, guard)
        got[keep] = (evaluate(world, opts, day, dcfg, real, t0, 3600.0, 24), real, guard)
    ev, real, guard = got[True]
    assert got[False][0].cap_excess > 0.02
    assert ev.cap_excess < 0.005 and guard.over_cap == 0
    assert real.route.mean() > 0.1  # it still offloads
    # every path's Internet share within its cap in every slot, over the calls started in it
    for (_, u, d), (n, inet) in guard.on_path.items():
        assert inet <= world.inet_cap[u, d] * n + 1e-9


def test_slot_boundary_moves_free_the_wan_within_the_caps(small, forecast_plans):
    """Re-realising at slot boundaries (``move_at``): WAN calls in progress on links near
    their limit move to the Internet at their DC, within the caps counted from the calls in
    progress and the latency rule; the day's sum of peaks falls, each move is a migration,
    and the moved calls are measured on each placement for the part of the call it held."""
    world, calls, configs, cfg, prov, opts = small
    plans, day, dcfg, dprov = forecast_plans
    plan = plans[(WAN, INTERNET)]
    t0 = wl.DAY_S
    got = {}
    for move_at in (None, 0.5):
        guard = PeakGuard(world)
        guard.set_limits(plan.stats["planned_peaks"])
        real = realise_guarded(plan, opts, day, dcfg, dprov, t0, 3600.0, guard, move_at=move_at)
        got[move_at] = (real, evaluate(world, opts, day, dcfg, real, t0, 3600.0, 24), guard)
    (still, ev0, _), (moved, ev, guard) = got[None], got[0.5]
    assert len(still.moves) == 0 and len(moved.moves) == guard.moved > 0
    assert ev.peaks().sum() < ev0.peaks().sum()
    assert ev.migrations == pytest.approx((moved.migrated.sum() + len(moved.moves)) / len(day))
    greedy = evaluate(world, opts, day, dcfg, realise_greedy(opts, day, dcfg, dprov, t0, 3600.0), t0, 3600.0, 24)
    assert ev.cap_excess < 0.01 and ev.cap_excess <= greedy.cap_excess and ev.over_bound == 0
    for i, at, d, r in moved.moves:  # a WAN call, moved to the Internet at its DC, at a boundary while in progress
        i, d = int(i), int(d)
        assert moved.route[i] == WAN and moved.dc[i] == d and r == INTERNET
        assert at % 3600.0 == 0 and day.start_s[i] < at < day.end_s[i]
        assert opts.option_index(int(dcfg[i]), d, INTERNET) is not None
    # the moved calls measured on both placements: their WAN traffic stops at the move
    i = int(moved.moves[0, 0])
    one = np.zeros(len(day), dtype=bool)
    one[i] = True
    sub = day.select(one)
    whole = evaluate(world, opts, sub, dcfg[one], _placement_of(moved, one, None), t0, 3600.0, 24)
    split = evaluate(world, opts, sub, dcfg[one], _placement_of(moved, one, moved.moves[:1]), t0, 3600.0, 24)
    on_wan_s = moved.moves[0, 1] - day.start_s[i]
    assert split.link_load.sum() == pytest.approx(whole.link_load.sum() * on_wan_s / day.duration_s[i], rel=1e-6)


def _placement_of(real, mask, moves):
    """The realisation of the calls in ``mask`` (renumbered), with ``moves`` (already for them)."""
    from agents.titan.placement import Realisation

    mv = np.zeros((0, 4)) if moves is None else np.array([[0, *m[1:]] for m in moves])
    return Realisation(real.dc[mask], real.route[mask], real.migrated[mask], real.planned[mask], mv)


def test_quantile_forecast_plans_a_busier_day_with_the_means_mix(small):
    """``predict(quantile=q)``: each (slot, region)'s traffic is the q-quantile of the past
    days' (not their mean), the configurations' mix within it the mean's; None is the mean."""
    world, calls, configs, cfg, prov, opts = small
    days = [wl.demand(calls, cfg, d * wl.DAY_S, 3600.0, 24) for d in range(2)]
    mean = wl.predict(days, 2 * wl.DAY_S)
    high = wl.predict(days, 2 * wl.DAY_S, 0.9)
    R = len(world.users)

    def totals(dem):
        return np.bincount(dem.slot * R + dem.region, weights=dem.up_kbps + dem.down_kbps, minlength=24 * R)

    want = np.quantile(np.stack([totals(d) for d in days]), 0.9, axis=0)
    assert np.allclose(totals(high), want, rtol=1e-9, atol=1e-6)
    assert totals(high).sum() > 1.05 * totals(mean).sum()  # the two days differ: a busier plan
    ratio = np.divide(high.up_kbps, mean.up_kbps, out=np.ones(len(mean.up_kbps)), where=mean.up_kbps > 0)
    per_cell = mean.slot * R + mean.region  # one factor per (slot, region): the mix is the mean's
    for cell in np.unique(per_cell)[:200]:
        r = ratio[(per_cell == cell) & (mean.up_kbps > 0)]
        assert np.ptp(r) <= 1e-9 * max(r.max(initial=1.0), 1.0)
    assert np.array_equal(wl.predict(days, 2 * wl.DAY_S, None).up_kbps, mean.up_kbps)
    with pytest.raises(ValueError, match="quantile"):
        wl.predict(days, 2 * wl.DAY_S, 1.5)


def test_billing_period_counts_only_the_excess_over_peaks_already_paid(small):
    """With the period's peaks so far, a day's LP pays only for what it adds above them: none
    when the day fits under them, all of it when nothing is paid yet; and its plan may fill
    a link up to a paid peak (the tie-break's limit) but no further than it pays for."""
    world, calls, configs, cfg, prov, opts = small
    demand = wl.demand(calls, cfg, 0.0, 3600.0, 24)
    cap = lp.capacities(world, opts, demand, 1.25)
    head = lp.top_configs(demand, 40)
    alone = lp.solve_day(world, opts, lp.DayProblem(demand, head, cap), "x", (WAN, INTERNET), 1e-3, solver="simplex")
    need = alone.stats["peak_limits"]
    total = alone.stats["planned_sum_of_peaks_kbps"]
    assert total > 0
    paid_all = lp.solve_day(world, opts, lp.DayProblem(demand, head, cap, need * 1.01), "x", (WAN, INTERNET), 1e-3,
                            solver="simplex")
    assert paid_all.stats["planned_excess_kbps"] <= 1e-6 * total
    nothing = lp.solve_day(world, opts, lp.DayProblem(demand, head, cap, np.zeros(world.n_links)), "x",
                           (WAN, INTERNET), 1e-3, solver="simplex")
    assert nothing.stats["planned_excess_kbps"] == pytest.approx(total, rel=1e-6)
    # half the busy links already paid at twice what the day needs: the day pays for at most the rest
    busy = np.flatnonzero(need > 0)
    paid = np.zeros(world.n_links)
    paid[busy[::2]] = 2 * need[busy[::2]]
    half = lp.solve_day(world, opts, lp.DayProblem(demand, head, cap, paid), "x", (WAN, INTERNET), 1e-3,
                        solver="simplex")
    assert half.stats["planned_excess_kbps"] <= need[busy[1::2]].sum() * (1 + 1e-6)
    limits = half.stats["peak_limits"]
    assert np.all(limits >= paid - 1e-6)
    assert limits.sum() - paid.sum() == pytest.approx(half.stats["planned_excess_kbps"], rel=1e-6, abs=1e-3)
    assert np.all(half.stats["planned_peaks"] <= limits * (1 + 1e-3) + 1e-3)


def test_small_study_end_to_end(tmp_path):
    from agents.titan.study import BASELINES, run_study, write_outputs

    spec = load_spec(StudySpec, None, {"users": EU_US, "dcs": ["westeurope", "eastus", "westus2"], "days": 2,
                                       "history_days": 2, "slot_minutes": 60, "max_configs": 80,
                                       "workload.calls_per_day": 3000})
    summary = run_study(spec, solver="simplex")
    files = write_outputs(summary, tmp_path)
    names = {p.name for p in files}
    assert {"summary.json", "days.csv", "peaks.csv", "link_load.png", "sum_of_peaks.png", "latency_cdf.png",
            "internet_share.png", "solver_time.png"} <= names
    js = json.loads((tmp_path / "summary.json").read_text())
    pol = js["policies"]
    assert all(p["calls_over_latency_bound"] == 0 for p in pol.values())
    assert pol["titan-next"]["sum_of_peaks_week_kbps"] < pol["nearest-wan"]["sum_of_peaks_week_kbps"]
    assert set(js["titan_next_reduction"]) >= set(BASELINES)
    for name, p in pol.items():  # planned against realised, for every policy with a plan
        assert (p["planned_sum_of_peaks_per_day_kbps"] is None) == (name == "greedy-internet")
        assert name == "greedy-internet" or len(p["planned_sum_of_peaks_per_day_kbps"]) == 2
    assert len(js["solves"]["titan-next"]) == 2 and all(r["solve_s"] < 30 for r in js["solves"]["titan-next"])
    import csv

    with open(tmp_path / "days.csv", newline="") as fh:  # planned beside realised, per policy and day
        rows = list(csv.DictReader(fh))
    for r in rows:
        plan = pol[r["policy"]]["planned_sum_of_peaks_per_day_kbps"]
        assert r["planned_sum_of_peaks_kbps"] == ("" if plan is None else f"{plan[int(r['day'])]:.1f}")
    assert {r["policy"] for r in rows} == set(pol) and len(rows) == 2 * len(pol)


def _cli():
    from testbed.cli import app

    return app


# --- an independent check of the peaks LP's optimum (issue #33) ----------------------------

TINY_USERS = ["uksouth", "westeurope", "northeurope", "eastus", "centralus"]
TINY_DCS = ["westeurope", "northeurope", "eastus"]


def _tiny_instance():
    """Five user regions, three DCs, three slots, a dozen configurations (by media) with
    hand-seeded demand; DC capacity tight enough to bind in the busiest slot."""
    world = build_world(TINY_USERS, TINY_DCS, internet_cap=0.5)
    configs = wl.Configs(by_media=True)
    rng = np.random.default_rng(7)
    keys = [((0, 1), 2), ((0, 1), 0), ((0, 3), 1), ((0, 3), 2), ((1, 2), 1), ((2, 4), 2), ((3, 4), 1),
            ((0, 2, 3), 1), ((0, 2, 3), 2), ((1, 3, 4), 1), ((0,), 1), ((4,), 2)]
    rows = []
    for regions, media in keys:
        k = configs.id(regions, media)
        up = {0: 30.0, 1: 500.0, 2: 1500.0}[media]
        for t in range(3):
            for u in regions:
                n = float(rng.integers(1, 9)) * (2.0 if t == 1 else 1.0)
                rows.append((t, k, u, n, n * up, n * 2 * up))
    rows.sort()
    a = np.array(rows)
    demand = wl.Demand(0.0, 3600.0, 3, a[:, 1].astype(np.int64), a[:, 0].astype(np.int64), a[:, 2].astype(np.int64),
                       a[:, 3], a[:, 4], a[:, 5])
    opts = Options(world, configs, LatencyRule(delta_ms=20))
    cap = lp.capacities(world, opts, demand, 1.0)  # the nearest-DC peak: binds (1.2x: a lower optimum)
    return world, configs, opts, demand, cap


def _peaks_lp_by_definition(world, opts, demand, cap, head, paid=None):
    """The module docstring's LP written out term by term with HiGHS's modelling interface:
    one x per (configuration, slot, allowed placement) (a configuration outside ``head``
    uses its class's x, the class being its media and allowed-placement set), each link's
    load summed from the participants' own paths, one P per link.  Returns the optimum."""
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    U, D, L = len(world.users), len(world.dcs), world.n_links
    x: dict = {}

    def var(k, t, o):
        owner = k if k in head else opts.class_key(k)
        if (owner, t, o) not in x:
            x[(owner, t, o)] = h.addVariable(lb=0.0, ub=1.0)
        return x[(owner, t, o)]

    link_load = [[[] for _ in range(demand.slots)] for _ in range(L)]
    dc_load = [[[] for _ in range(demand.slots)] for _ in range(D)]
    on_path = {}  # (u, d, t) -> ([all participants' terms], [Internet terms])
    cells = {}
    for i in range(len(demand.config)):
        k, t, u = int(demand.config[i]), int(demand.slot[i]), int(demand.region[i])
        n, up, down = demand.participants[i], demand.up_kbps[i], demand.down_kbps[i]
        cells[(k if k in head else opts.class_key(k), t)] = [var(k, t, o) for o in opts[k].options]
        for o in opts[k].options:
            d, r = o
            v = var(k, t, o)
            dc_load[d][t].append(n * v)
            if world.local[u, d]:
                continue
            a = on_path.setdefault((u, d, t), ([], []))
            a[0].append(n * v)
            if r == INTERNET:
                a[1].append(n * v)
            else:
                for link in world.backbone.path_links(world.users[u], world.dcs[d]):
                    link_load[link][t].append(up * v)
                for link in world.backbone.path_links(world.dcs[d], world.users[u]):
                    link_load[link][t].append(down * v)
    for vs in cells.values():
        h.addConstr(h.qsum(vs) == 1.0)
    peaks = [h.addVariable(lb=0.0) for _ in range(L)]
    for link in range(L):
        for t in range(demand.slots):
            if link_load[link][t]:
                h.addConstr(h.qsum(link_load[link][t]) - peaks[link] <= 0.0)
    for d in range(D):
        for t in range(demand.slots):
            if dc_load[d][t]:
                h.addConstr(h.qsum(dc_load[d][t]) <= float(cap[d]))
    for (u, d, t), (all_p, inet_p) in on_path.items():
        if inet_p:
            h.addConstr(h.qsum(inet_p) - float(world.inet_cap[u, d]) * h.qsum(all_p) <= 0.0)
    if paid is None:
        h.minimize(h.qsum(peaks))
    else:
        excess = [h.addVariable(lb=0.0) for _ in range(L)]
        for link in range(L):
            h.addConstr(peaks[link] - excess[link] <= float(paid[link]))
        h.minimize(h.qsum(excess))
    assert h.modelStatusToString(h.getModelStatus()) == "Optimal"
    return float(h.getInfo().objective_function_value)


@pytest.mark.parametrize("solver", ["simplex", "ipm"])
@pytest.mark.parametrize("head_share", [1.0, 0.5])
@pytest.mark.parametrize("billing", ["day", "period"])
def test_peaks_lp_optimum_matches_the_lp_written_out_by_definition(solver, head_share, billing):
    """``lp.solve_day`` (sparse, aggregated y/z, peaks chained per slot, tail classes) finds
    the same optimum as the docstring's LP written out term by term, on a tiny instance
    where the caps and DC capacity bind; and its plan is feasible at that value (so its
    objective is not below the true optimum either)."""
    world, configs, opts, demand, cap = _tiny_instance()
    traffic = np.bincount(demand.config, weights=demand.up_kbps + demand.down_kbps)
    head = lp.top_configs(demand, int(round(head_share * np.count_nonzero(traffic))))
    paid = None
    if billing == "period":
        alone = lp.solve_day(world, opts, lp.DayProblem(demand, head, cap), "x", (WAN, INTERNET), 1e-3,
                             solver="simplex")
        paid = np.zeros(world.n_links)
        busy = np.flatnonzero(alone.stats["peak_limits"] > 0)
        paid[busy[::2]] = 0.7 * alone.stats["peak_limits"][busy[::2]]  # part of some links' peaks paid already
    plan = lp.solve_day(world, opts, lp.DayProblem(demand, head, cap, paid), "x", (WAN, INTERNET), 1e-3,
                        solver=solver, tie_break="headroom")
    want = _peaks_lp_by_definition(world, opts, demand, cap, head, paid)
    got = plan.stats["rounds"][-1]["sum_of_peaks_kbps"]
    assert want > 0
    assert got == pytest.approx(want, rel=1e-6)
    # the plan's own fractions: feasible, and at the optimum within the tie-break's eps
    loads = plan_loads(world, opts, plan, demand).max(axis=1)
    cost = loads.sum() if paid is None else np.maximum(loads - paid, 0).sum()
    assert want * (1 - 1e-6) - 1e-6 <= cost <= want * (1 + 1e-3) + 1e-3 * (0 if paid is None else paid.sum()) + 1e-3
    if head_share < 1:  # the tail's shared mixes are a restriction: never below the per-configuration optimum
        free = _peaks_lp_by_definition(world, opts, demand, cap, set(np.flatnonzero(traffic).tolist()), paid)
        assert free <= want * (1 + 1e-9)


@pytest.mark.slow
def test_a_days_lp_at_21_dcs_solves_within_60_s():
    """Scale (issue #33): Titan-Next's LP for one weekday on its forecast, every region in the
    matrix as users (54) and the 21 default DCs, the shipped defaults (hourly slots, 200
    configurations planned one by one, configurations by media, IPM, headroom tie-break),
    plans well below the nearest-DC policy on the same forecast, within 60 s of CPU (the
    issue's bar).  HiGHS runs single-threaded here (``threads=1``), so its CPU time is the
    LP's wall time on an idle machine; wall time on the 2-core shared development VM also
    counts other people's work, so it is printed and guarded at 150 s only.

    Measured (2026-12-06, nice 19): on the quiet VM (load average 1.6, one other job of ours)
    41.5 s wall, 40.0 s CPU (peaks LP 35.0 s over 98,620 columns, 24 slot LPs 6.3 s); at load
    average 6, 130.3 s wall, 50.2 s CPU; in earlier runs with other experiments beside it
    (load average 1.5-7) 81-92 s wall, 62.7 and 76.4 s CPU (those would fail the 60 s)."""
    from agents.titan.spec import DEFAULT_DCS

    spec = load_spec(StudySpec, None, {"days": 1})
    assert len(spec.dcs) == len(DEFAULT_DCS) >= 21
    from agents.titan.study import study_world

    world = study_world(spec)
    H, T = spec.history_days, 1440 // spec.slot_minutes
    calls = wl.generate(world, spec.workload, H + 1)
    configs = wl.Configs(by_media=spec.configs_by_media)
    cfg = configs.of_calls(calls)
    opts = Options(world, configs, spec.latency)
    daily = [wl.demand(calls, cfg, d * wl.DAY_S, 3600.0, T) for d in range(H + 1)]
    forecast = wl.predict([daily[d] for d in wl.same_kind_days(H, range(H))], H * wl.DAY_S)
    cap = lp.capacities(world, opts, wl.demand(calls, cfg, 0.0, 3600.0, T * (H + 1)), spec.capacity_headroom)
    import time
    cpu0 = time.process_time()
    plan = lp.solve_day(world, opts, lp.DayProblem(forecast, lp.top_configs(forecast, spec.max_configs), cap),
                        "titan-next", (WAN, INTERNET), spec.tie_break_eps, tie_break=spec.tie_break)
    cpu = time.process_time() - cpu0
    print(f"\n{len(world.users)} users, {len(world.dcs)} DCs, {world.n_links} links: LP {plan.solve_s:.1f} s wall, "
          f"{cpu:.1f} s CPU, "
          f"{plan.stats['variables']:,} variables, rounds {plan.stats['rounds']}")
    nearest = plan_loads(world, opts, rule_plan("n", opts, forecast.config, 0.0), forecast).max(axis=1).sum()
    assert plan.stats["planned_sum_of_peaks_kbps"] < 0.8 * nearest
    assert cpu < 60.0, f"a day's LP at 21 DCs took {cpu:.1f} s of CPU (the issue's bar: 60 s)"
    assert plan.solve_s < 150.0
