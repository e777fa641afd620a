"""``experiments/validate_emulated.py``'s matrix and its command, without the emulator: the
cells (``validation_matrix``), their link rates and messages, the earlier 12 cells kept as
they were, ``--plan`` and ``--reuse`` on a kept folder made up here."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

import validate_emulated  # noqa: E402
import validation_matrix as vm  # noqa: E402


def test_the_full_matrix_is_the_issues_144_cells():
    cells = vm.cells()
    assert len(cells) == 4 * 3 * 3 * 2 * 2 == 144 and len({c.name for c in cells}) == 144
    assert {c.rtt_ms for c in cells} == {5.0, 50.0, 150.0, 250.0}
    assert {c.sharing for c in cells} == {"fair", "temporal"}


def test_long_round_trips_get_lower_rates_and_keep_the_bdp():
    assert [vm.rate_mbps(r) for r in (4.2, 5, 20, 50, 150, 250)] == [100, 100, 100, 40, 13.3, 8]
    for cell in vm.cells(rtts=(50.0, 150.0, 250.0), pipelines=(1,), hosts=("default",), sharing=("fair",)):
        bdp = cell.rate_mbps * 1e6 / 8 * cell.rtt_ms / 1000
        assert bdp == pytest.approx(250e3, rel=0.01)
        assert cell.message_bytes / bdp == pytest.approx(cell.message_bdp, rel=0.12)


def test_the_earlier_twelve_cells_are_built_as_before(tmp_path):
    """4.2 ms, 100 Mbit/s, 0.5 / 5 MiB messages as (seq_len, microbatch_size) (1024, 1) and
    (2048, 5), compute a third / two thirds of a message's time alone (2026-12-03's matrix)."""
    old = vm.cells(rtts=(4.2,), message_bdp=(10.0, 100.0), sharing=("fair",))
    assert len(old) == 12 and all(c.legacy_name for c in old)
    cell = vm.Cell(4.2, 4, 100.0, "tuned", "fair")
    assert cell.shape == (2048, 5) and vm.Cell(4.2, 4, 10.0, "tuned", "fair").shape == (1024, 1)
    data = yaml.safe_load(vm.write_experiment(cell, tmp_path, 5).read_text())
    topo = yaml.safe_load(Path(data["topology"]).read_text())
    assert topo["wan"][0]["delay_ms"] == 2.1 and topo["wan"][0]["rate_mbps"] == 100.0
    t = 5 * 2048 * 128 * 4 / (100e6 / 8 * 1448 / 1514)
    assert data["sim"]["stage_times"][0] == {"forward_s": round(t / 3, 5), "backward_s": round(2 * t / 3, 5)}
    assert data["parallel"]["slow_start_after_idle"] is False and "atlas" not in data
    temporal = yaml.safe_load(vm.write_experiment(vm.Cell(5.0, 4, 1.0, "default", "temporal"), tmp_path, 5).read_text())
    assert temporal["atlas"] == {"sharing": "temporal"}


@pytest.mark.parametrize("kw, says", [({"hosts": ("fast",)}, "hosts: 'fast' is not one of default, tuned"),
                                      ({"sharing": ("paced",)}, "sharing: 'paced' is not one of fair, temporal"),
                                      ({"rtts": (-5.0,)}, "rtt: -5.0 is not a positive number"),
                                      ({"pipelines": (0,)}, "pipelines: 0 is not a positive whole number")])
def test_a_bad_selection_is_one_line(kw, says):
    with pytest.raises(ValueError, match=says):
        vm.cells(**kw)


def test_plan_prints_each_cells_estimate_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert validate_emulated.main(["--plan", "--out", str(out), "--rtt", "5,250", "--pipelines", "4",
                                   "--message-bdp", "1", "--hosts", "default", "--max-cell-seconds", "40"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("4 cell(s) selected, 0 finished, 2 left out by --max-cell-seconds")
    assert "skipped rtt250-d4-x1-default-fair: estimated" in text and "> --max-cell-seconds 40" in text
    assert "rtt5-d4-x1-default-temporal" in text and not out.exists()


def test_reuse_predicts_kept_runs_and_lists_every_cell(tmp_path, capsys):
    """A kept folder with two finished cells (one under the earlier matrix's name) and one cut
    short: the two are predicted, the others listed as not run; nothing runs."""
    for name, measured in (("d1-x10-default", 0.406), ("rtt4.2-d1-x10-tuned-fair", 0.405)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({"summary": {"mean_iteration_time_s": measured}}))
    (tmp_path / "rtt4.2-d4-x10-default-fair").mkdir()  # no metrics.json: not finished
    assert validate_emulated.main(["--reuse", "--out", str(tmp_path), "--rtt", "4.2", "--pipelines", "1,4",
                                   "--message-bdp", "10", "--sharing", "fair"]) == 0
    text = capsys.readouterr().out
    assert "2 finished cell(s): mean |error| 0.6%, max |error| 0.7%" in text  # the 12-03 table's -0.7% / -0.5%
    rows = list(csv.DictReader(open(tmp_path / "validate_emulated.csv")))
    assert [r["status"] for r in rows] == ["finished", "finished", "not run", "not run"]
    assert all(r["rate_mbps"] == "100.0" for r in rows)
    table = (tmp_path / "validate_emulated.md").read_text()
    assert table.count("\n| 4.2 |") == 4 and "| -0.7% |" in table


def test_repeats_are_averaged_with_their_spread_and_each_run_is_simulated_as_long_as_it_ran(tmp_path, capsys,
                                                                                            monkeypatch):
    """Three kept runs of one cell (``<cell>``, ``<cell>.run2``, ``<cell>.run3``) of 4, 6 and 9
    iterations: the measured figure is their mean, the CSV gives their range, and each run is
    simulated for as many iterations as it had (the windows keep growing, so a shorter or
    longer simulated run is another figure)."""
    from testbed.sim import build

    asked = []
    simulate = build.simulate

    def spy(exp, iterations, **kw):
        asked.append(iterations)
        return simulate(exp, iterations=iterations, **kw)

    monkeypatch.setattr(build, "simulate", spy)
    name = "rtt4.2-d1-x10-tuned-fair"
    for folder, measured, iterations in ((name, 0.40, 4), (name + ".run2", 0.41, 6), (name + ".run3", 0.45, 9)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "metrics.json").write_text(json.dumps(
            {"summary": {"mean_iteration_time_s": measured, "iterations": iterations}}))
    assert validate_emulated.main(["--reuse", "--out", str(tmp_path), "--rtt", "4.2", "--pipelines", "1",
                                   "--message-bdp", "10", "--sharing", "fair", "--hosts", "tuned",
                                   "--repeats", "3"]) == 0
    assert asked[-3:] == [4, 6, 9]  # (after the plan's estimate)
    assert "measured 0.420 s" in capsys.readouterr().out
    row = next(csv.DictReader(open(tmp_path / "validate_emulated.csv")))
    assert (row["runs"], row["measured_s"], row["measured_min_s"], row["measured_max_s"]) == ("3", "0.42", "0.4", "0.45")
    assert "0.420 (0.400-0.450, 3 runs)" in (tmp_path / "validate_emulated.md").read_text()


def test_fair_window_keeps_the_experiments_sharing_and_turns_the_window_model_on(tmp_path):
    from testbed.sim.build import window_model
    from testbed.spec.experiment import load_experiment

    cell = vm.Cell(150.0, 4, 1.0, "default", "fair")
    exp = load_experiment(vm.write_experiment(cell, tmp_path, 5))
    fair = validate_emulated._with_model(exp, "fair-window")
    fifo = validate_emulated._with_model(exp, "fifo-window")
    fluid = validate_emulated._with_model(exp, "no-window")
    # the cell's own experiment leaves the window model to the simulator's default: on for these
    # Linux-default hosts, off for WAN-tuned ones (build.window_model)
    assert (exp.sim.sharing, exp.sim.tcp_window_model, window_model(exp)[0]) == ("fair", None, True)
    tuned = load_experiment(vm.write_experiment(vm.Cell(150.0, 4, 1.0, "tuned", "fair"), tmp_path, 5))
    assert (tuned.sim.tcp_window_model, window_model(tuned)[0]) == (None, False)
    assert (fair.sim.sharing, fair.sim.tcp_window_model) == ("fair", True)
    assert (fifo.sim.sharing, fifo.sim.tcp_window_model) == ("fifo-bursts", True)
    assert (fluid.sim.sharing, fluid.sim.tcp_window_model, window_model(fluid)[0]) == ("fair", False, False)


def test_the_prediction_counts_the_iterations_the_run_counted(tmp_path):
    """A run whose figure counts from iteration 4 (Atlas's: the iteration after its last plan)
    is predicted over iterations 4-5 of the simulation, not over 2-5 (the warm-up's end): the
    windows still grow from one iteration to the next, so those are other figures.  ``testbed
    compare`` predicts its variants the same way (it simulated 24 iterations and counted from
    the warm-up's end)."""
    from testbed.results.metrics import summarise
    from testbed.run.compare import predict_seeds
    from testbed.sim.build import simulate
    from testbed.spec.experiment import load_experiment

    cell = next(c for c in vm.cells(rtts=(50,), pipelines=(1,), message_bdp=(1,), hosts=("tuned",),
                                    sharing=("fair",)))
    exp = validate_emulated._with_model(load_experiment(vm.write_experiment(cell, tmp_path / "specs", 6)), "packets")
    run = tmp_path / cell.name
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps(
        {"summary": {"mean_iteration_time_s": 0.6, "iterations": 6, "steady_state_iterations": [4, 5]}}))
    times = [it.time_s for it in summarise(simulate(exp, iterations=6)).iterations]
    assert abs(times[2] - times[5]) / times[5] > 0.01  # (else this test could not tell them apart)
    [predicted] = validate_emulated._predict(exp, run, 6)
    assert predicted == pytest.approx((times[4] + times[5]) / 2, rel=1e-6)
    assert predict_seeds(exp, run, profile=False) == [predicted]


def test_a_cells_error_comes_with_the_standard_error_of_its_two_means():
    """Runs 1.0 and 1.2 s (mean 1.1, standard error 0.1) and four simulations of 1.1 s: the
    error's standard error is the runs' alone, 0.1 / 1.1; the simulations' own spread adds in
    quadrature; one run gives no interval (the emulator's noise unknown)."""
    import math

    assert validate_emulated._error_se([1.0, 1.2], [1.1] * 4) == pytest.approx(0.1 / 1.1, abs=1e-4)
    both = validate_emulated._error_se([1.0, 1.2], [1.0, 1.2, 1.0, 1.2])
    assert both == pytest.approx(math.hypot(0.1 / 1.1, (0.2 / math.sqrt(3)) / 2 / 1.1), abs=1e-4)
    assert validate_emulated._error_se([1.0], [1.1, 1.2]) is None
