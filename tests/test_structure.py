"""The house's structure, checked: no import circle, and the core knows no extension by name.

Imports are read from the source (``ast``), so a lazy import inside a function counts as
much as one at the top.  ``testbed/`` may reach Atlas and BubbleTea only through the
extension registry (``testbed/extension.py``: names in strings, loaded by importlib).
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("testbed", "agents")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def test_no_import_circle():
    graph = _graph()
    # package __init__ files that only hold a docstring don't make a cycle; count module edges
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if graph.get(m) is None or m in PACKAGES:
                continue
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if state.get(m) is None:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if state.get(n) is None:
            cycle = visit(n)
            assert cycle is None, " -> ".join(cycle)


_EXTENSION_NAMES = re.compile(r"atlas|bubbletea|titan|prefill", re.IGNORECASE)


def _code_tokens(path: Path):
    """The names and string literals of a module's code: comments and docstrings left out."""
    toks = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    skip = (tokenize.NL, tokenize.COMMENT)
    fstring_middle = getattr(tokenize, "FSTRING_MIDDLE", None)
    for i, tok in enumerate(toks):
        if tok.type == tokenize.STRING:
            j = i - 1
            while j >= 0 and toks[j].type in skip:
                j -= 1
            alone_before = j < 0 or toks[j].type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
            if alone_before and toks[i + 1].type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                continue  # a docstring (or a bare string statement)
        if tok.type in (tokenize.NAME, tokenize.STRING) or tok.type == fstring_middle:
            yield tok


def test_no_core_module_names_an_extension():
    """Outside an extension's own package, no code names atlas, bubbletea, titan or prefill:
    the core reaches extensions only through the registry (entry points)."""
    named = [f"{p.relative_to(REPO)}:{tok.start[0]}: {tok.string[:60]}"
             for p in sorted((REPO / "testbed").rglob("*.py")) for tok in _code_tokens(p)
             if _EXTENSION_NAMES.search(tok.string)]
    assert not named, "\n".join(named)
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("testbed"):
            bad = sorted(d for d in deps if d.startswith("agents"))
            assert not bad, f"{name} imports {bad}"


def test_the_name_check_catches_a_name(tmp_path):
    """The check above sees names and strings in code, and passes over docstrings and comments."""
    mod = tmp_path / "m.py"
    mod.write_text('"""Atlas in a docstring."""\n# bubbletea in a comment\ndef f():\n    """Titan."""\n'
                   '    return "kill-atlas-agent"\n')
    assert [t.string for t in _code_tokens(mod) if _EXTENSION_NAMES.search(t.string)] == ['"kill-atlas-agent"']


def test_extensions_are_found_through_entry_points_only():
    from importlib.metadata import entry_points

    import testbed.extension as registry

    assert not hasattr(registry, "REGISTRY") and not hasattr(registry, "COMMANDS")
    declared = {ep.name for ep in entry_points(group=registry.GROUP)}
    assert {"atlas", "bubbletea", "titan"} <= declared
    assert set(registry.extensions()) == declared
    from testbed.spec.experiment import Experiment

    assert {"atlas", "bubbletea"} <= set(Experiment.model_fields)  # their sections, from the registry


def test_device_kinds_are_plug_ins_of_the_registry():
    """cpu, cuda, emulated and auto come through the same entry points as any extension, and
    outside the module that declares them (and the worker's side, which computes on them)
    the core names no device kind: it asks the kind."""
    from testbed.extension import device_kinds, extensions

    assert {"auto", "cpu", "cuda", "emulated"} <= set(device_kinds())
    assert set(extensions()["devices"].devices) == {"auto", "cpu", "cuda", "emulated"}
    allowed = {"testbed/run/devices.py", "testbed/sim/device.py", "testbed/train/torch_compute.py"}
    named = [f"{p.relative_to(REPO)}:{tok.start[0]}: {tok.string}"
             for p in sorted((REPO / "testbed").rglob("*.py")) if str(p.relative_to(REPO)) not in allowed
             for tok in _code_tokens(p) if tok.type == tokenize.STRING and tok.string.strip("'\"") in ("emulated", "cuda")]
    assert not named, "\n".join(named)


def test_every_package_is_installed():
    """pyproject's package search finds every package that holds Python code."""
    import tomllib

    from setuptools import find_packages

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(str(REPO), include=include))
    with_code = {_module_name(p.parent) for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    assert with_code <= found, sorted(with_code - found)


def test_each_package_docstring_names_its_modules():
    """testbed's docstring names its subpackages and modules; each subpackage's names its modules."""
    import importlib

    for init in sorted((REPO / "testbed").rglob("__init__.py")):
        pkg = importlib.import_module(_module_name(init.parent))
        doc = pkg.__doc__ or ""
        for path in sorted(init.parent.iterdir()):
            stem = path.stem
            if stem.startswith("_") or stem == "data" or not (path.suffix == ".py" or (path / "__init__.py").is_file()):
                continue
            assert f"``{stem}``" in doc, f"{pkg.__name__} does not name {stem}"


def test_module_docstrings_cite_only_modules_that_exist():
    mods = _modules()
    for name, path in mods.items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        for cited in re.findall(r"``([a-z_/]+)\.py``", doc):
            stem = cited.rsplit("/", 1)[-1]
            exists = (REPO / f"{cited}.py").is_file() if "/" in cited else False  # e.g. tests/conftest.py
            assert exists or any(p.stem == stem for p in mods.values()), f"{name} cites {cited}.py"


def test_the_wheel_holds_every_package_and_data_file(tmp_path):
    """A non-editable install gets the agents' processes and their data, not only the core."""
    import zipfile

    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    wheel = next(tmp_path.glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in _modules().values():
        assert str(module.relative_to(REPO)) in names, module
    assert "agents/bubbletea/data/AzureLLMInferenceTrace_conv.csv" in names
    assert "testbed/data/aws-inter-region.csv" in names
    shipped = {n.split(".data/data/share/geo-testbed/")[1] for n in names if ".data/data/share/geo-testbed/" in n}
    for kind in ("topologies", "experiments", "playbooks"):
        for f in (REPO / kind).rglob("*.y*ml"):
            assert str(f.relative_to(REPO)) in shipped, f"{f.relative_to(REPO)} is not in the wheel"

    # installed (not editable) into a prefix of its own, run from an empty folder: the shipped
    # experiment by name, its topology by name, Titan's shipped spec by relative path
    prefix, empty = tmp_path / "venv", tmp_path / "empty"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True, timeout=120)
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--prefix", str(prefix),
                             str(wheel)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    site = next(prefix.glob("lib/python3*/site-packages"))
    (site / "_deps.pth").write_text(next(p for p in sys.path if p.endswith("site-packages")) + "\n")  # the deps only
    empty.mkdir()
    python = str(prefix / "bin" / "python")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed copy, not a checkout
    probe = ("import json, testbed, agents.titan.spec as t; from testbed.spec.experiment import load_experiment; "
             "e = load_experiment('default'); print(json.dumps([testbed.__file__, e._topo_file, "
             "t.load_spec(t.EmulationSpec, 'experiments/titan/emu.yaml').name]))")
    result = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=empty, timeout=120, env=clean)
    assert result.returncode == 0, result.stderr[-2000:]
    module, topology, titan = json.loads(result.stdout)
    assert module.startswith(str(site)) and topology.startswith(str(prefix / "share" / "geo-testbed")), (module, topology)
    assert titan == "titan-emu"
    result = subprocess.run([python, "-m", "testbed.cli", "sim", "default", "--json"], capture_output=True, text=True,
                            cwd=empty, timeout=120, env=clean)
    assert result.returncode == 0 and json.loads(result.stdout)["workers"] == 6, result.stderr[-2000:]


# testbed's parts, bottom up: each may import only itself and those before it (the order of
# testbed/__init__.py's docstring)
LAYERS = ["extension", "messages", "spec", "registry", "procutil", "cliutil", "net", "train", "results", "sim", "run", "tools", "cluster",
          "cli"]


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "testbed" and len(parts) > 1 else None


def test_the_core_is_layered_without_a_package_loop():
    """No package-level loop: a part of testbed imports only the parts below it, and never an
    extension (agents/ sits above all of them)."""
    graph = _graph()
    up = []
    for name, deps in graph.items():
        mine = _part(name)
        if mine is None:
            continue
        assert mine in LAYERS, f"{name}: a new part of testbed; put it in LAYERS (and the package docstring)"
        for d in deps:
            theirs = _part(d)
            if theirs is not None and theirs != mine and LAYERS.index(theirs) > LAYERS.index(mine):
                up.append(f"{name} -> {d}")
    assert not up, "imports that run up the layers: " + "; ".join(sorted(up))
    import testbed

    doc = testbed.__doc__
    named = [p for p in LAYERS if f"``{p}``:" in doc]  # where each part is described
    assert sorted(named, key=lambda p: doc.index(f"``{p}``:")) == named, "testbed's docstring lists the parts in another order"


def test_the_netem_marker_selects_the_netem_variants():
    """``-m netem`` selects every netem variant (conftest once shadowed the hook that marks them).
    Collected from the files whose tests take the ``delay_backend`` fixture (the only source of
    netem variants; they share the one conftest), not the whole folder: 2 s instead of 11."""
    files = [str(f) for f in sorted((REPO / "tests").glob("test_*.py")) if "delay_backend" in f.read_text()]
    assert len(files) >= 2, files
    got = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "netem", "-p", "no:cacheprovider",
                          *files], capture_output=True, text=True, cwd=REPO, timeout=300)
    ids = [ln for ln in got.stdout.splitlines() if "::" in ln]
    assert ids and all(i.endswith("[netem]") or "netem" in i for i in ids), got.stdout[-2000:]
    every = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            *files], capture_output=True, text=True, cwd=REPO, timeout=300)
    variants = [ln for ln in every.stdout.splitlines() if ln.endswith("[netem]")]
    assert set(variants) <= set(ids), sorted(set(variants) - set(ids))
