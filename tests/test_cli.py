"""The command line as a script drives it: a shipped experiment by name from any folder,
``--set`` overrides judged like the file, ``--json`` on stdout with progress on stderr, exit
codes a script can trust, ``--version``, shell completion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.spec.experiment import apply_overrides, load_experiment
from testbed.spec.topology import SpecError


def test_overrides_change_the_fields_they_name_and_are_judged_like_the_file():
    exp = load_experiment("default", ["training.iterations=3", "parallel.schedule=gpipe", "model.heads=2"])
    assert (exp.training.iterations, exp.parallel.schedule, exp.model.heads) == (3, "gpipe", 2)
    assert load_experiment("default").training.iterations == 12  # the file is untouched
    data = {"a": {"b": 1}}
    assert apply_overrides(data, ["a.c=[1, 2]", "d.e=x"], "f") == {"a": {"b": 1, "c": [1, 2]}, "d": {"e": "x"}}
    assert data == {"a": {"b": 1}}
    bad = {"training.iterations": "expected KEY.PATH=VALUE", "name.x=1": "name is not a mapping",
           "training.iterations=many": "training.iterations", "trainin.iterations=3": "trainin"}
    for text, words in bad.items():
        with pytest.raises(SpecError) as err:
            load_experiment("default", [text])
        assert words in str(err.value) and "\n" not in str(err.value), (text, str(err.value))


def test_version_and_a_missing_experiment():
    res = subprocess.run([sys.executable, "-m", "testbed.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("testbed "), res
    res = subprocess.run([sys.executable, "-m", "testbed.cli", "run", "no-such-experiment"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "no-such-experiment" in res.stderr and res.stdout == "", res


def test_shell_completion_completes_commands():
    """What bash asks of ``testbed`` (as ``testbed --install-completion bash`` wires it): the
    commands a prefix starts."""
    script = Path(sys.executable).parent / "testbed"
    env = os.environ | {"_TESTBED_COMPLETE": "complete_bash", "COMP_WORDS": "testbed fid", "COMP_CWORD": "1"}
    res = subprocess.run([str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0 and res.stdout.split() == ["fidelity"], res
    res = subprocess.run([str(script), "--show-completion", "bash"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "_TESTBED_COMPLETE=complete_bash" in res.stdout, res


@pytest.mark.network
def test_run_by_name_from_any_folder_with_json_on_stdout(tmp_path):
    """``testbed run default --set training.iterations=2 --json`` from an empty folder: one
    JSON document on stdout (a script parses it), the progress on stderr, exit 0."""
    res = subprocess.run([sys.executable, "-m", "testbed.cli", "run", "default", "--set", "training.iterations=2",
                          "--json", "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["experiment"] == "default" and doc["topology"] == "aws-us3", doc
    assert doc["summary"]["iterations"] == 2 and doc["summary"]["mean_iteration_time_s"] > 0, doc
    assert "WAN check" in res.stderr
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["summary"]["iterations"] == 2


def test_the_schema_accepts_every_shipped_file_and_names_a_mistake():
    """``testbed schema`` is what an editor checks a file against: every shipped experiment and
    topology passes it, a misspelt key does not."""
    import jsonschema
    import yaml

    from testbed.spec.shipped import shipped

    for kind, folder in (("experiment", "experiments"), ("topology", "topologies")):
        res = subprocess.run([sys.executable, "-m", "testbed.cli", "schema", kind], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        validator = jsonschema.Draft202012Validator(json.loads(res.stdout))
        files = sorted(shipped(folder).glob("*.yaml"))
        assert files
        for f in files:
            errors = [e.message for e in validator.iter_errors(yaml.safe_load(f.read_text()))]
            assert errors == [], (f.name, errors)
        wrong = yaml.safe_load(files[0].read_text()) | {"nmae": "x"}
        assert any("nmae" in e.message for e in validator.iter_errors(wrong))


def test_every_mistake_at_once_with_its_line_and_a_suggestion(tmp_path):
    bad = tmp_path / "three.yaml"
    bad.write_text("name: default\n"
                   "topology: aws-us3\n"
                   "model: {layrs: 6, hidden: 128, heads: 4, seq_len: 64}\n"
                   "training:\n"
                   "  iterations: many\n"
                   "  microbatchs: 6\n"
                   "  microbatch_size: 4\n"
                   "parallel: {stages: 3, replicas: 2, schedule: 1f1b, connections: 4}\n"
                   "placement: {virginia: [0], ohio: [1], oregon: [2]}\n")
    res = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(bad)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2, res
    lines = res.stderr.removeprefix("error: ").strip().splitlines()
    assert sorted(lines) == [
        f"{bad}:3: model.layrs: Extra inputs are not permitted (did you mean 'layers'?)",
        f"{bad}:5: training.iterations: Input should be a valid integer",
        f"{bad}:6: training.microbatchs: Extra inputs are not permitted (did you mean 'microbatches'?)",
    ], res.stderr


_WITHOUT = """import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # import name raises ModuleNotFoundError, as where it is not installed
sys.argv = ["testbed"] + sys.argv[2:]
runpy.run_module("testbed.cli", run_name="__main__")
"""


def test_a_missing_extra_is_named_in_one_line_and_the_core_works_without_them(tmp_path):
    """pyproject.toml's extras: the core needs none of them (the simulator and the doctor run
    without PyTorch, HiGHS and Ansible), and a command whose extra is missing names it."""
    def without(modules: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _WITHOUT, modules, *args], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)

    res = without("torch,highspy,ansible,ansible_runner,scapy", "sim", "default", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["workers"] == 6, res.stderr[-2000:]
    for modules, args, extra in [("torch", ["run", "default", "--out", str(tmp_path / "r")], "train"),
                                 ("highspy", ["titan", "study", "--days", "1", "--out", str(tmp_path / "t")], "lp"),
                                 ("ansible_runner", ["provision", "--check"], "cluster")]:
        res = without(modules, *args)
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert res.returncode == 2 and len(lines) == 1 and f"geo-testbed[{extra}]" in lines[0], (args, res.stderr[-2000:])
    assert not (tmp_path / "r").exists()  # the run stopped before it made anything
