"""The simulator: closed forms it must hold exactly, and the command's outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.experiment import parse_experiment
from testbed.metrics import summarise
from testbed.schedules import ideal_bubble_fraction
from testbed.sim.build import simulate
from testbed.sim.engine import Link, Simulator

REPO = Path(__file__).resolve().parent.parent
TOPO = str(REPO / "tests" / "data" / "train3.yaml")


def _exp(stages, microbatches, schedule, replicas=1, times=(1.0, 2.0, 0.0), **sim):
    return parse_experiment({
        "name": "sim", "topology": TOPO, "model": {"layers": 6, "hidden": 32, "heads": 2, "seq_len": 16},
        "training": {"iterations": 3, "microbatches": microbatches, "warmup_iterations": 1},
        "parallel": {"stages": stages, "replicas": replicas, "schedule": schedule},
        "sim": {"stage_times": [{"forward_s": times[0], "backward_s": times[1], "optimizer_s": times[2]}] * stages,
                **sim},
    }, "sim")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (3, 6), (3, 1)])
def test_bubble_fraction_without_communication_is_exactly_the_closed_form(schedule, stages, microbatches):
    exp = _exp(stages, microbatches, schedule, intra_dc_gbps=1e12)
    for link in exp.topo.wan:  # no communication cost: no delay, a 100 Gbit/s link for 8 kB messages
        link.delay_ms, link.rate_mbps = 0.0, 1e5
    s = summarise(simulate(exp))["summary"]
    assert s["bubble_fraction"] == pytest.approx(ideal_bubble_fraction(stages, microbatches), abs=1e-3)
    assert s["mean_iteration_time_s"] == pytest.approx((microbatches + stages - 1) * 3.0, rel=1e-3)


def test_one_transfer_takes_delay_plus_size_over_bandwidth():
    sim = Simulator()
    link = Link("a->b", bandwidth=1e6, delay=0.05)
    done = []
    sim.transfer([link], 250_000, float("inf"), done.append)
    sim.run()
    assert done == [pytest.approx(0.05 + 0.25)]


@pytest.mark.parametrize("k", [2, 3, 5])
def test_k_equal_concurrent_transfers_each_take_k_times_longer(k):
    sim = Simulator()
    link = Link("a->b", bandwidth=1e6, delay=0.0)
    done = []
    for _ in range(k):
        sim.transfer([link], 100_000, float("inf"), done.append)
    sim.run()
    assert done == [pytest.approx(k * 0.1)] * k


def test_a_flow_ceiling_caps_one_connection_and_n_connections_lift_it():
    sim = Simulator()
    link = Link("a->b", bandwidth=1e9, delay=0.05)  # a fast link, 100 ms RTT
    window = 1 << 20
    done = []
    for n in (1, 4):
        sim.transfer([link], 10e6, n * window / 0.1, done.append)
        sim.run()
    one, four = done[0], done[1] - done[0]
    assert one == pytest.approx(0.05 + 10e6 / (window / 0.1), rel=1e-6)
    assert four == pytest.approx(0.05 + 10e6 / (4 * window / 0.1), rel=1e-6)


def test_a_flow_finishing_gives_its_share_back():
    sim = Simulator()
    link = Link("a->b", bandwidth=1e6, delay=0.0)
    done = {}
    sim.transfer([link], 100_000, float("inf"), lambda t: done.setdefault("small", t))
    sim.transfer([link], 300_000, float("inf"), lambda t: done.setdefault("big", t))
    sim.run()
    assert done["small"] == pytest.approx(0.2)  # half the link for 0.2 s
    assert done["big"] == pytest.approx(0.4)  # then the whole link: 100 kB + 200 kB


def test_sim_command_json_and_outputs(tmp_path):
    result = subprocess.run([sys.executable, "-m", "testbed.cli", "sim", str(REPO / "experiments" / "default.yaml"),
                             "--json", "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)
    for key in ("iteration_time_s", "bubble_fraction", "mean_busy_fraction", "wan_utilization"):
        assert isinstance(row[key], float)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert {"iterations", "summary"} <= set(metrics)
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]


def test_sim_sweep_writes_table_csv_and_plot(tmp_path):
    result = subprocess.run([sys.executable, "-m", "testbed.cli", "sim", str(REPO / "experiments" / "default.yaml"),
                             "--json", "--sweep", "delay_ms=1,20,80", "--out", str(tmp_path)],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    times = [r["iteration_time_s"] for r in rows]
    assert times == sorted(times) and times[0] < times[-1]  # more delay, slower
    assert (tmp_path / "sweep.csv").exists() and (tmp_path / "sweep.png").exists()


def test_bad_experiment_gets_the_same_one_line_error_as_run(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"name: b\ntopology: {TOPO}\nparallel: {{stages: 3, replicas: 5}}\n")
    result = subprocess.run([sys.executable, "-m", "testbed.cli", "sim", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert "placement.dc1: 1 stage(s) x 5 replica(s)" in result.stderr


@pytest.mark.network
def test_simulator_predicts_an_emulator_run_within_10_percent(tmp_path):
    """End to end: train on the emulator, profile it, simulate it, compare iteration times."""
    from conftest import skip_unless_network

    skip_unless_network()
    sys.path.insert(0, str(REPO / "experiments"))
    from validate_sim import compare

    row = compare(tmp_path, stages=2, replicas=2, delay_ms=10, connections=4)
    # two pipelines on every WAN link; this case -5.3% (2026-12-02) and -0.1% (12-03). P=3 D=2
    # runs 4-12% pessimistic on the faster machine (docs/benchmarks.md): not this test's case
    assert abs(row["error"]) <= 0.10, row


def test_paper_scale_scenarios_load_and_simulate_fast():
    from testbed.experiment import load_experiment

    exp = load_experiment(REPO / "experiments" / "sim-10k.yaml")
    assert exp.parallel.stages * exp.parallel.replicas * exp.sim.tensor_parallel >= 9_984
    assert len(exp.topo.dcs) == 8
    result = simulate(exp, iterations=1)
    exp.training.iterations, exp.training.warmup_iterations = 1, 0
    s = summarise(result)["summary"]
    assert s["mean_iteration_time_s"] > 0 and 0 <= s["bubble_fraction"] <= 1
    small = load_experiment(REPO / "experiments" / "sim-1k-4dc.yaml")
    assert small.parallel.stages * small.parallel.replicas * small.sim.tensor_parallel >= 1_000
    assert len(small.topo.dcs) >= 4
