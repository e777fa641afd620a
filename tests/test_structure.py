"""The house's structure, checked: no import circle, and the core knows no extension by name.

Imports are read from the source (``ast``), so a lazy import inside a function counts as
much as one at the top.  ``testbed/`` may reach Atlas and BubbleTea only through the
extension registry (``testbed/extension.py``: names in strings, loaded by importlib).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
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


def test_the_core_reaches_extensions_only_through_the_registry():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("testbed"):
            bad = sorted(d for d in deps if d.startswith(("agents.atlas", "agents.bubbletea", "agents.titan")))
            assert not bad, f"{name} imports {bad}"
    runner = (REPO / "testbed" / "run" / "runner.py").read_text()
    assert not re.search(r"atlas|bubbletea", runner, re.IGNORECASE)
    from testbed.extension import COMMANDS, REGISTRY

    assert set(REGISTRY) >= {"atlas", "bubbletea"}
    assert "titan" in COMMANDS


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
