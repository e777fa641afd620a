"""The simulator says which parts of its model a run used, and warns where a run leaves the
range over which docs/benchmarks.md shows each part validated (``testbed/sim/validity.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from testbed.spec.experiment import load_experiment, parse_experiment
from testbed.sim import validity
from testbed.sim.build import simulate

REPO = Path(__file__).resolve().parent.parent


def _job(tmp_path, one_way_ms: float, loss: float = 0.0, schedule: str = "gpipe", replicas: int = 2,
         message_kib: int = 512, **sim):
    """Two DCs, one link of 100 Mbit/s, ``replicas`` pipelines crossing it, boundary messages
    of ``message_kib`` (hidden 128 x seq 64 x 4 bytes x microbatch size)."""
    topo = {"name": "v", "dcs": [{"name": "dc1", "hosts": replicas, "host": {"cpus": 0.3}},
                                 {"name": "dc2", "hosts": replicas, "host": {"cpus": 0.3}}],
            "wan": [{"a": "dc1", "b": "dc2", "delay_ms": one_way_ms, "rate_mbps": 100.0, "loss": loss}]}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(topo))
    return parse_experiment({
        "name": "v", "topology": str(tmp_path / "t.yaml"),
        "model": {"layers": 6, "hidden": 128, "heads": 4, "seq_len": 64},
        "training": {"iterations": 2, "microbatches": 2, "microbatch_size": message_kib // 32, "warmup_iterations": 0},
        "parallel": {"stages": 2, "replicas": replicas, "schedule": schedule, "connections": 4},
        "sim": {"stage_times": [{"forward_s": 0.01, "backward_s": 0.02}] * 2, **sim},
    }, "v")


def test_every_part_states_its_range_error_and_source():
    for v in validity.VALIDATED.values():
        assert v.error and v.where, v.part
        if v.validated:
            assert v.rtt_ms is not None and v.loss is not None, v.part
    assert not validity.VALIDATED["loss_model"].validated  # no emulator comparison yet: said so


def test_a_run_inside_the_validated_range_gets_no_warning(tmp_path):
    """20 ms round trip, 512 KiB messages (2.2 BDP), 2 pipelines, no loss: the fluid model's
    range, and the window model's (on by default on these Linux-default hosts: the report says
    so and why); on WAN-tuned hosts the default leaves the window model off, and says that."""
    model = simulate(_job(tmp_path, 10.0)).model
    assert [p["part"] for p in model["parts"]] == ["fluid max-min sharing", "tcp_window_model", "tcp_hystart"]
    assert all(p["inside"] for p in model["parts"]) and model["warnings"] == []
    assert tuple(model["parts"][0]["run"]["rtt_ms"]) == (20.0, 20.0)
    assert model["tcp_window_model"]["on"] and "on by default" in model["tcp_window_model"]["why"]
    tuned = _job(tmp_path, 10.0)
    tuned = tuned.model_copy(update={"parallel": tuned.parallel.model_copy(update={"slow_start_after_idle": False})})
    model = simulate(tuned).model
    assert [p["part"] for p in model["parts"]] == ["fluid max-min sharing"]
    assert not model["tcp_window_model"]["on"] and "WAN-tuned" in model["tcp_window_model"]["why"]
    off = simulate(_job(tmp_path, 10.0, tcp_window_model=False)).model
    assert [p["part"] for p in off["parts"]] == ["fluid max-min sharing"]
    assert off["tcp_window_model"] == {"on": False, "why": "sim.tcp_window_model: false"}


def test_the_spread_model_says_it_ran_and_warns_that_it_reads_worse(tmp_path):
    """Inside every validated range but for its sharing: ``sim.sharing: spread`` measured worse
    than fair sharing on issue #30's matrix, and a run that uses it is told so."""
    model = simulate(_job(tmp_path, 10.0, sharing="spread")).model
    assert model["sharing"] == "spread" and "lognormal" in model["sharing_rule"]
    row = next(p for p in model["parts"] if p["part"] == "sharing policy spread")
    assert row["validated"] is False and not row["inside"]
    assert model["warnings"] == [f"warning: sharing policy spread is not validated: "
                                 f"{validity.NOT_VALIDATED['sharing policy spread']}"]


def test_the_atlas_regime_lies_inside_the_ranges_its_tcp_models_were_validated_on():
    exp = load_experiment(REPO / "experiments" / "atlas-regime.yaml")
    model = simulate(exp, iterations=1).model
    assert {p["part"] for p in model["parts"]} == {"fluid max-min sharing", "tcp_window_model", "tcp_hystart", "tail_loss"}
    assert model["warnings"] == []


def test_a_long_haul_run_is_warned_naming_the_part_and_its_round_trip(tmp_path):
    """320 ms round trip with the window model: the window model was validated up to 250 ms
    (issue #30's matrix), the fluid model up to 100 ms; each warns once, with the run's longest
    RTT.  (262 ms, aws-longhaul3's, lies inside the window model's range now, with the slack.)"""
    model = simulate(_job(tmp_path, 160.0, tcp_window_model=True)).model
    warnings = model["warnings"]
    assert len(warnings) == 3, warnings  # (tcp_hystart shares tcp_window_model's range)
    window = next(w for w in warnings if w.startswith("warning: tcp_window_model "))
    assert "validated for RTT 5-250 ms; this run's longest RTT is 320 ms" in window
    fluid = next(w for w in warnings if w.startswith("warning: fluid max-min sharing "))
    assert "validated for RTT 2-100 ms; this run's longest RTT is 320 ms" in fluid
    assert not any(p["inside"] for p in model["parts"])
    assert validity.outside(validity.VALIDATED["tcp_window_model"],
                            validity.RunFigures((262.0, 262.0), (1.1, 1.1), (1, 1), (0.0, 0.0), "1f1b")) == []


def test_a_lossy_run_uses_the_loss_model_and_is_warned(tmp_path):
    model = simulate(_job(tmp_path, 10.0, loss=0.0005)).model
    assert [p["part"] for p in model["parts"]] == ["fluid max-min sharing", "tcp_window_model", "tcp_hystart", "loss_model"]
    assert "warning: loss_model not validated against the emulator" in model["warnings"]
    assert any("this run's highest path loss is 0.050%" in w for w in model["warnings"])
    off = simulate(_job(tmp_path, 10.0, loss=0.0005, loss_model=False)).model
    assert [p["part"] for p in off["parts"]] == ["fluid max-min sharing", "tcp_window_model", "tcp_hystart"]


def test_small_messages_many_pipelines_and_the_schedule_are_checked(tmp_path):
    # 16 KiB at 200 ms round trip: 0.0069 BDP, below the smallest validated (0.05)
    few = validity.outside(validity.VALIDATED["fluid max-min sharing"],
                           validity.RunFigures((20.0, 20.0), (0.0069, 0.0069), (16, 16), (0.0, 0.0), "1f1b"))
    assert few == ["validated for messages 0.05-105 BDP; this run's smallest message is 0.0069 BDP",
                   "validated for pipelines per link 1-8; this run's most pipelines on a link is 16"]
    tail = validity.outside(validity.VALIDATED["tail_loss"],
                            validity.RunFigures((49.0, 49.0), (7.2, 7.2), (4, 4), (0.0, 0.0), "1f1b"))
    assert tail == ["validated with gpipe only; this run's schedule is 1f1b"]
    # within the 10% slack: a 52 ms path is the 49 ms validation's
    assert validity.outside(validity.VALIDATED["tcp_window_model"],
                            validity.RunFigures((52.0, 52.0), (7.0, 7.0), (2, 2), (0.0, 0.0), "gpipe")) == []


def test_sim_command_prints_the_parts_and_warnings_and_its_json_carries_them(tmp_path):
    exp = _job(tmp_path, 131.0, loss=0.0005)
    spec = tmp_path / "exp.yaml"
    spec.write_text(yaml.safe_dump(exp.model_dump(mode="json") | {"topology": str(tmp_path / "t.yaml")}))
    cmd = [sys.executable, "-m", "testbed.cli", "sim", str(spec)]
    text = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=os.environ | {"COLUMNS": "400"})
    assert text.returncode == 0, text.stderr
    assert "model: fluid max-min sharing, tcp_window_model, tcp_hystart, loss_model" in text.stdout
    assert ("tcp window model: on (on by default: the hosts restart slow start after idle "
            "(parallel.slow_start_after_idle: true, Linux's default)") in text.stdout
    assert "warning: loss_model not validated against the emulator" in text.stdout
    assert "this run's longest RTT is 262 ms" in text.stdout
    js = subprocess.run(cmd + ["--json"], capture_output=True, text=True, cwd=REPO)
    model = json.loads(js.stdout)["model"]
    assert [p["part"] for p in model["parts"]] == ["fluid max-min sharing", "tcp_window_model", "tcp_hystart", "loss_model"]
    assert model["tcp_window_model"]["on"] is True
    # loss_model (not validated), the fluid model (262 ms > 100 ms) and the window model (its
    # 0.17 BDP messages are below the matrix's 1.1)
    assert len(model["warnings"]) == 4, model["warnings"]  # (tcp_hystart shares tcp_window_model's range)
    assert any(w.startswith("warning: tcp_window_model validated for messages 1.1-105 BDP") for w in model["warnings"])
    tuned = exp.model_dump(mode="json") | {"topology": str(tmp_path / "t.yaml")}
    tuned["parallel"]["slow_start_after_idle"] = False
    spec.write_text(yaml.safe_dump(tuned))
    text = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=os.environ | {"COLUMNS": "400"})
    assert "model: fluid max-min sharing, loss_model" in text.stdout
    assert "tcp window model: off (off by default: WAN-tuned hosts" in text.stdout


@pytest.mark.parametrize("dp_across_dcs", [False, True])
def test_a_wan_all_reduce_is_its_own_part(tmp_path, dp_across_dcs):
    exp = _job(tmp_path, 5.5)
    if dp_across_dcs:
        data = exp.model_dump(mode="json") | {"topology": str(tmp_path / "t.yaml"), "placement": None}
        data["parallel"]["dp_across_dcs"] = True
        exp = parse_experiment(data, "v")
    parts = [p["part"] for p in simulate(exp).model["parts"]]
    assert ("wan_allreduce" in parts) == dp_across_dcs
