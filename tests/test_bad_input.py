"""Generated bad input: topology and experiment files that must each fail in one line.

Hypothesis generates files from a valid topology and a valid experiment by breaking one
thing each: a value of the wrong type or out of its range (read from the pydantic models
themselves, so a field added later is covered), an unknown or duplicate DC, a duplicate or
self link, a disconnected WAN, a placement that does not fit, a schedule that cannot run, an
unknown key, a key given twice, and files that are not YAML at all.  Every file is written
to disk and read the way ``testbed run`` reads it (``load_experiment``, then the emulated
device's profile); each must raise ``SpecError`` whose message is one line, names the file
and the field (or the line), and nothing else may escape: any other exception fails the
test with its traceback.  A sample goes through the real command line, which must print
one ``error:`` line, exit 2, create no results folder and leave nothing behind (the
``network`` marker's check: no process, namespace, interface, cgroup or file).

At least 1,000 files are generated per run (600 topologies, 600 experiments, 150 raw
files; ``GTB_BAD_INPUT_EXAMPLES`` scales it).
"""

from __future__ import annotations


import copy
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from testbed.spec.experiment import Experiment, load_experiment  # noqa: E402
from testbed.spec.topology import SpecError, Topology, key_text, load_topology  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCALE = float(os.environ.get("GTB_BAD_INPUT_EXAMPLES", "1"))
GENERATED: dict[str, int] = {"files": 0, "one_line_errors": 0}

TOPOLOGY: dict = {
    "name": "three",
    "dcs": [{"name": "east", "hosts": 2, "host": {"cpus": 0.25, "gpus": 0}},
            {"name": "mid", "hosts": 2}, {"name": "west", "hosts": 3}],
    "wan": [{"a": "east", "b": "mid", "delay_ms": 10, "jitter_ms": 1, "loss": 0.001, "rate_mbps": 100,
             "queue_bytes": 250000, "reverse": {"delay_ms": 12, "rate_mbps": 80}},
            {"a": "mid", "b": "west", "delay_ms": 20, "rate_mbps": 50, "source_rtt_ms": 40}],
    "intra_dc": {"rate_mbps": 0},
}
EXPERIMENT: dict = {
    "name": "exp",
    "topology": "topo.yaml",
    "model": {"layers": 6, "hidden": 64, "heads": 4, "seq_len": 32},
    "training": {"iterations": 4, "microbatches": 4, "microbatch_size": 2, "lr": 0.001, "seed": 1,
                 "warmup_iterations": 1, "recv_timeout_s": 60},
    "parallel": {"stages": 3, "replicas": 2, "schedule": "1f1b", "connections": 2},
    "placement": {"east": [0], "mid": [1], "west": [2]},
    "device": "cpu",
    "atlas": {"sharing": "fair", "lease_s": 2.0},
    "bubbletea": {"enabled": False, "decode_dc": "west", "model": {"layers": 2}},
    "emulation": {"speedup": 2.0},
    "sim": {"device_tflops": 10.0, "stage_times": [{"forward_s": 0.01, "backward_s": 0.02} for _ in range(3)]},
    "compare": {"a": {"connections": 1}, "b": {"connections": 4, "sharing": "fair"}},
}


# -- reading the models: every field, its type and its bounds ------------------------------------
def _unwrap(ann: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of an annotation."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return (args[0] if len(args) == 1 else ann), type(None) in typing.get_args(ann)
    return ann, False


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _fields(model: type[BaseModel], data: Any, prefix: tuple = ()) -> list[tuple[tuple, Any, bool, list]]:
    """(path, type, nullable, constraints) of every field of ``model`` that a file can set,
    list items included where ``data`` (the valid base) has them."""
    out = []
    for name, info in model.model_fields.items():
        ann, nullable = _unwrap(info.annotation)
        path = prefix + (name,)
        out.append((path, ann, nullable or (not info.is_required() and info.default is None), info.metadata))
        value = data.get(name) if isinstance(data, dict) else None
        if _is_model(ann):
            out += _fields(ann, value or {}, path)
        elif typing.get_origin(ann) is list and _is_model(typing.get_args(ann)[0]) and isinstance(value, list):
            for i, item in enumerate(value):
                out += _fields(typing.get_args(ann)[0], item, path + (i,))
    return out


def _wrong_types(ann: Any, nullable: bool) -> list[Any]:
    """Values that are not of type ``ann`` (YAML can write each)."""
    none = [] if nullable else [None]
    if ann is bool:
        return ["yes", 1, 0.0, "true", [True], {"a": 1}] + none
    if ann is int:
        return ["abc", "12", 1.5, 2.0, True, [1], {"a": 1}, float("nan")] + none
    if ann is float:
        return ["abc", "1.5", True, [1.0], {"x": 1}, float("nan"), float("inf"), float("-inf")] + none
    if ann is str:
        return [5, 1.5, True, ["a"], {"a": "b"}] + none
    if typing.get_origin(ann) is Literal:
        return ["no-such-choice", 5, ["a"], True] + none
    if _is_model(ann) or typing.get_origin(ann) is dict:
        return [5, "abc", [1, 2]] + none
    if typing.get_origin(ann) is list:
        return [5, "abc", {"a": 1}] + none
    return [object()]  # an annotation this test does not know: fails loudly below


def _out_of_range(ann: Any, constraints: list) -> list[Any]:
    vals: list[Any] = []
    for c in constraints:
        if isinstance(c, Ge):
            vals += [c.ge - 1, c.ge - 10**9] if ann is int else [c.ge - 0.5, -1e12]
        elif isinstance(c, Gt):
            vals += [c.gt, c.gt - 1]
        elif isinstance(c, Le):
            vals += [c.le + 1, 10**18] if ann is int else [c.le * 1.5 + 1, 1e300]
        elif isinstance(c, Lt):
            vals += [c.lt, c.lt + 1]
        elif isinstance(c, MaxLen) and ann is str:
            vals.append("x" * (c.max_length + 1))
        elif isinstance(c, MinLen) and ann is str:
            vals.append("")
        elif getattr(c, "pattern", None):
            vals += ["Bad Name", "a/b", "../up", "-lead", "x" * 80, "tab\there", "new\nline", "é"]
    return vals


def _where(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + key_text(part)
    return out


def _set(data: dict, path: tuple, value: Any) -> None:
    node: Any = data
    for part in path[:-1]:
        if isinstance(part, int):
            node = node[part]
        else:
            if not isinstance(node.get(part), (dict, list)):
                node[part] = {}
            node = node[part]
    node[path[-1]] = value


def _drop(data: dict, path: tuple) -> None:
    node: Any = data
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]


# -- strategies: one defect per file, and what the error must name --------------------------------
@st.composite
def field_defects(draw, model: type[BaseModel], base: dict, skip: tuple = ()) -> tuple[dict, list[str]]:
    """A wrong type, an out-of-range value, a missing required field or an unknown key, at a
    field of ``model``: (data, what the message must contain)."""
    data = copy.deepcopy(base)
    fields = [f for f in _fields(model, base) if f[0][0] not in skip]
    kind = draw(st.sampled_from(["type", "type", "range", "range", "missing", "unknown"]))
    if kind == "range":
        fields = [f for f in fields if _out_of_range(f[1], f[3])] or fields
        kind = "range" if any(_out_of_range(f[1], f[3]) for f in fields) else "type"
    if kind == "missing":
        required = [f for f in fields if _required(model, f[0]) and _exists(base, f[0])]
        path = draw(st.sampled_from(required))[0]
        _drop(data, path)
        return data, [_where(path), "required"]
    if kind == "unknown":
        parents = [()] + [f[0] for f in fields if _is_model(f[1]) and _exists(base, f[0])]
        parent = draw(st.sampled_from(parents))
        key = draw(st.sampled_from(["colour", "hostz", "delay", "Name", "extra key", "x\ny", "über"]))
        node: Any = data
        for part in parent:
            node = node[part]
        node[key] = draw(st.sampled_from([1, "a", [1], {"b": 2}]))
        return data, [_where(parent + (key,)), "Extra inputs are not permitted"]
    path, ann, nullable, constraints = draw(st.sampled_from(fields))
    values = _out_of_range(ann, constraints) if kind == "range" else _wrong_types(ann, nullable)
    _set(data, path, draw(st.sampled_from(values)))
    return data, [_where(path)]


def _required(model: type[BaseModel], path: tuple) -> bool:
    m: Any = model
    for part in path[:-1]:
        if isinstance(part, int):
            continue
        ann, _ = _unwrap(m.model_fields[part].annotation)
        m = typing.get_args(ann)[0] if typing.get_origin(ann) is list else ann
    return m.model_fields[path[-1]].is_required()


def _exists(data: Any, path: tuple) -> bool:
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return False
    return True


@st.composite
def topology_defects(draw) -> tuple[dict, list[str]]:
    """Graph defects (unknown, duplicate, unreachable DCs, doubled or self links), bad names,
    bad sizes; or a field defect."""
    data = copy.deepcopy(TOPOLOGY)
    kind = draw(st.sampled_from(["field"] * 5 + ["unknown_dc", "duplicate_dc", "duplicate_link", "self_link",
                                                  "disconnected", "bad_name", "empty", "jitter", "top"]))
    i = draw(st.integers(0, len(data["wan"]) - 1))
    if kind == "field":
        return draw(field_defects(Topology, TOPOLOGY))
    if kind == "unknown_dc":
        end = draw(st.sampled_from(["a", "b"]))
        data["wan"][i][end] = draw(st.sampled_from(["north", "East", "mid ", "", "x" * 30]))
        return data, [f"wan[{i}]"]
    if kind == "duplicate_dc":
        j = draw(st.integers(1, len(data["dcs"]) - 1))
        data["dcs"][j]["name"] = data["dcs"][draw(st.integers(0, j - 1))]["name"]
        return data, ["dcs", "duplicate DC name"]
    if kind == "duplicate_link":
        link = dict(data["wan"][i])
        if draw(st.booleans()):
            link["a"], link["b"] = link["b"], link["a"]
        data["wan"].append(link)
        return data, [f"wan[{len(data['wan']) - 1}]", "second link"]
    if kind == "self_link":
        data["wan"][i]["b"] = data["wan"][i]["a"]
        return data, [f"wan[{i}]", "two different DCs"]
    if kind == "disconnected":
        if draw(st.booleans()):
            data["dcs"].append({"name": "island", "hosts": 1})
            return data, ["wan", "'island' cannot be reached"]
        del data["wan"][1]
        return data, ["wan", "'west' cannot be reached"]
    if kind == "bad_name":
        j = draw(st.integers(0, len(data["dcs"]) - 1))
        data["dcs"][j]["name"] = draw(st.sampled_from(["East", "1dc", "a b", "x" * 25, "dc_1", "é", "-dc"]))
        return data, [f"dcs[{j}].name"]
    if kind == "empty":
        data["dcs"] = []
        return data, ["dcs"]
    if kind == "jitter":
        where = draw(st.sampled_from(["forward", "reverse"]))
        if where == "forward":
            data["wan"][1]["jitter_ms"] = 25
            return data, ["wan[1]", "jitter_ms"]
        data["wan"][0]["reverse"]["jitter_ms"] = 30
        return data, ["wan[0]", "jitter_ms"]
    return draw(st.sampled_from([[], "text", 5, None, [TOPOLOGY]])), ["expected a mapping"]


@st.composite
def experiment_defects(draw) -> tuple[dict, list[str]]:
    """Placements that do not fit, schedules that cannot run, model shapes that cannot be
    cut, unknown DCs, bad names; or a field defect."""
    data = copy.deepcopy(EXPERIMENT)
    kind = draw(st.sampled_from(["field"] * 6 + ["placement_dc", "placement_stage", "placement_twice",
                                                  "placement_missing", "placement_full", "heads", "layers",
                                                  "schedule", "dp_placement", "dp_full", "decode_dc", "topology",
                                                  "variant", "top"]))
    if kind == "field":
        return draw(field_defects(Experiment, EXPERIMENT, skip=("placement", "compare")))
    if kind == "placement_dc":
        dc = draw(st.sampled_from(["north", "East", "dc 9", "x\ny"]))
        data["placement"] = {dc: data["placement"].pop("west"), **data["placement"]}
        return data, [f"placement.{key_text(dc)}", "no DC"]
    if kind == "placement_stage":
        data["placement"]["west"] = [draw(st.sampled_from([3, 7, -1, 10**9]))]
        return data, ["placement.west", "outside"]
    if kind == "placement_twice":
        data["placement"]["west"] = [2, 1]
        return data, ["placement", "already placed"]
    if kind == "placement_missing":
        del data["placement"][draw(st.sampled_from(["east", "mid", "west"]))]
        return data, ["placement", "is not placed"]
    if kind == "placement_full":
        data["parallel"]["replicas"] = draw(st.integers(3, 500))
        return data, ["placement.", "host(s)"]
    if kind == "heads":
        data["model"]["heads"] = draw(st.sampled_from([3, 5, 7, 48]))
        return data, ["model.heads", "multiple of heads"]
    if kind == "layers":
        data["model"]["layers"] = 2
        return data, ["parallel.stages", "layers"]
    if kind == "schedule":
        data["parallel"]["schedule"] = draw(st.sampled_from(["zigzag", "GPIPE", "", "1f1b "]))
        return data, ["parallel.schedule"]
    if kind == "dp_placement":
        data["parallel"]["dp_across_dcs"] = True
        return data, ["parallel.dp_across_dcs", "drop placement"]
    if kind == "dp_full":
        data["parallel"]["dp_across_dcs"] = True
        data["parallel"]["replicas"] = draw(st.integers(4, 60))
        del data["placement"]
        return data, ["parallel.dp_across_dcs", "needs"]
    if kind == "decode_dc":
        data["bubbletea"]["decode_dc"] = draw(st.sampled_from(["north", "East", "dc-9"]))
        return data, ["bubbletea.decode_dc", "no DC"]
    if kind == "topology":
        data["topology"] = draw(st.sampled_from(["nope.yaml", "no-such-topology", "a\0b", "x" * 300, "/dev/null/x"]))
        return data, ["topology"]
    if kind == "variant":
        data["compare"] = {draw(st.sampled_from(["a b", "a/b", "x" * 70, "é"])): {"connections": 2}}
        return data, ["compare."]
    return draw(st.sampled_from([[], "text", 5, None, [EXPERIMENT]])), ["expected a mapping"]


# -- what testbed run does before it builds anything ------------------------------------------------
def _load_as_run_does(path: Path) -> None:
    exp = load_experiment(path)
    if exp.device == "emulated":
        from testbed.sim.device import device_profile

        device_profile(exp)


def _each_line_names_the_file(msg: str, path: Path) -> None:
    """One line per mistake (a file with several gets several), each ``FILE[:LINE]: ...``."""
    assert "\r" not in msg and msg.strip() == msg, repr(msg)
    for line in msg.split("\n"):
        assert re.match(rf"{re.escape(str(path))}(:\d+)?: ", line), repr(msg)


def _expect_one_line_error(load, path: Path, must: list[str], also: str | None = None) -> None:
    GENERATED["files"] += 1
    try:
        load(path)
    except SpecError as exc:
        msg = str(exc)
        _each_line_names_the_file(msg, path)
        for part in must + ([also] if also else []):
            assert part in msg, f"{part!r} not in {msg!r}"
        GENERATED["one_line_errors"] += 1
        return
    pytest.fail(f"{path.read_text()[:2000]}\nwas accepted: it should have been a one-line error naming {must}")


_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                        HealthCheck.data_too_large])


def test_the_valid_bases_load(tmp_path):
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(TOPOLOGY))
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(EXPERIMENT))
    load_topology(tmp_path / "topo.yaml")
    assert load_experiment(tmp_path / "exp.yaml").workers()


@settings(max_examples=int(600 * SCALE), **_SETTINGS)
@given(defect=topology_defects())
def test_bad_topology_files_fail_in_one_line_naming_file_and_field(tmp_path, defect):
    data, must = defect
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    _expect_one_line_error(load_topology, path, must)


@settings(max_examples=int(600 * SCALE), **_SETTINGS)
@given(defect=experiment_defects(), via_topology=st.integers(0, 4))
def test_bad_experiment_files_fail_in_one_line_naming_file_and_field(tmp_path, defect, via_topology):
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(TOPOLOGY))
    data, must = defect
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    _expect_one_line_error(_load_as_run_does, path, must)


@settings(max_examples=int(100 * SCALE), **_SETTINGS)
@given(defect=topology_defects())
def test_a_bad_topology_named_by_an_experiment_names_both_files(tmp_path, defect):
    data, must = defect
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(data, allow_unicode=True))
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(EXPERIMENT))
    _expect_one_line_error(_load_as_run_does, path, must, also=f"topology: {tmp_path / 'topo.yaml'}:")


_VALID_TEXT = yaml.safe_dump(EXPERIMENT, sort_keys=False)


@st.composite
def raw_files(draw) -> tuple[bytes, list[str]]:
    """Files that are not a valid YAML mapping at all, or only just: (bytes, what the message
    must contain)."""
    kind = draw(st.sampled_from(["bytes", "text", "duplicate", "deep", "aliases", "self", "cut", "tabs"]))
    if kind == "bytes":
        blob = draw(st.binary(min_size=1, max_size=300))
        return blob, []
    if kind == "text":
        return draw(st.text(min_size=0, max_size=200)).encode(), []
    if kind == "duplicate":
        key = draw(st.sampled_from(["model", "training", "parallel", "name"]))
        text = _VALID_TEXT + f"{key}: {{}}\n"
        return text.encode(), ["line", f"duplicate key '{key}'"]
    if kind == "deep":
        n = draw(st.integers(70, 600))
        return (_VALID_TEXT + "description: " + "[" * n + "]" * n + "\n").encode(), ["nested"]
    if kind == "aliases":
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
        for k in range(1, draw(st.integers(7, 12))):
            lines.append(f"a{k}: &a{k} [" + ", ".join([f"*a{k - 1}"] * 10) + "]")
        return ("\n".join(lines) + f"\nname: *a{k}\n").encode(), ["values once YAML aliases are expanded"]
    if kind == "self":
        return b"name: &n [1, *n]\n", []
    if kind == "cut":
        cut = draw(st.integers(1, len(_VALID_TEXT) - 1))
        return (_VALID_TEXT[:cut] + draw(st.sampled_from(["{", "[", ": :", "\t- x", "'", '"', "&", "*"]))).encode(), []
    return _VALID_TEXT.replace("  ", "\t", 1).encode(), ["invalid YAML"]


@settings(max_examples=int(150 * SCALE), **_SETTINGS)
@given(raw=raw_files())
def test_files_that_are_not_valid_yaml_mappings_fail_in_one_line(tmp_path, raw):
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(TOPOLOGY))
    blob, must = raw
    path = tmp_path / "exp.yaml"
    path.write_bytes(blob)
    GENERATED["files"] += 1
    try:
        _load_as_run_does(path)
    except SpecError as exc:
        msg = str(exc)
        _each_line_names_the_file(msg, path)
        for part in must:
            assert part in msg, (part, msg)
        GENERATED["one_line_errors"] += 1
        return
    # random bytes can make a valid experiment only by a miracle; say what it was
    pytest.fail(f"accepted: {blob!r}")


def test_at_least_a_thousand_files_were_generated():
    """Run last in this module (pytest keeps file order): the count the reliability table reports."""
    if SCALE < 1:
        pytest.skip("GTB_BAD_INPUT_EXAMPLES < 1")
    assert GENERATED["files"] >= 1000, GENERATED
    assert GENERATED["one_line_errors"] == GENERATED["files"], GENERATED
    print(f"\nbad input: {GENERATED['files']} files generated, {GENERATED['one_line_errors']} one-line errors")


# -- a sample through the real command line --------------------------------------------------------
_CLI_SAMPLES = [
    ("run", "exp", {"parallel": {"stages": 3, "replicas": 2, "schedule": "zigzag"}}, "parallel.schedule"),
    ("run", "exp", {"placement": {"north": [0], "mid": [1], "west": [2]}}, "placement.north"),
    ("run", "exp", {"training": {"iterations": "many"}}, "training.iterations"),
    ("run", "exp", {"training": {"lr": float("inf")}}, "training.lr"),
    ("run", "exp", {"name": "../escape"}, "name"),
    ("run", "exp", {"device": "emulated", "emulation": {"profile": "missing.json"}}, "emulation.profile"),
    ("run", "topo", {"wan": [TOPOLOGY["wan"][0], dict(TOPOLOGY["wan"][0], a="mid", b="east")]}, "wan[1]"),
    ("run", "topo", {"dcs": [{"name": "east", "hosts": True}, *TOPOLOGY["dcs"][1:]]}, "dcs[0].hosts"),
    ("fidelity", "topo", {"dcs": TOPOLOGY["dcs"] + [{"name": "island", "hosts": 1}]}, "'island' cannot be reached"),
    ("sim", "exp", {"parallel": {"stages": 9}}, "parallel.stages"),
    ("run", "raw", b"\xff\xfe garbage \x00", "not UTF-8"),
    ("run", "raw", (_VALID_TEXT + "name: again\n").encode(), "duplicate key 'name'"),
]


@pytest.mark.network
@pytest.mark.parametrize(("command", "what", "change", "must"), _CLI_SAMPLES,
                         ids=[f"{c}-{w}-{m[:20]}" for c, w, _, m in _CLI_SAMPLES])
def test_the_command_line_prints_one_error_line_and_creates_nothing(tmp_path, command, what, change, must):
    topo, exp = copy.deepcopy(TOPOLOGY), copy.deepcopy(EXPERIMENT)
    if what == "topo":
        topo.update(change)
    elif what == "exp":
        for key, value in change.items():
            exp[key] = {**exp[key], **value} if isinstance(value, dict) and isinstance(exp.get(key), dict) else value
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo))
    path = tmp_path / "exp.yaml"
    if what == "raw":
        path.write_bytes(change)
    else:
        path.write_text(yaml.safe_dump(exp))
    target = tmp_path / "topo.yaml" if command == "fidelity" else path
    out = tmp_path / "results"
    argv = [sys.executable, "-m", "testbed.cli", command, str(target)] + (["--out", str(out)] if command != "fidelity" else [])
    result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert must in lines[0] and "Traceback" not in result.stderr, lines[0]
    assert not out.exists()  # no results folder
