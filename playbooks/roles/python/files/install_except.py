"""Install the project (editable) with its dependencies except those named.

    install_except.py PROJECT_DIR EXTRAS NAME...     e.g. /opt/geo-testbed "" torch

The python role runs it where ``python_exclude`` is set (the netem VM leaves PyTorch out);
everywhere else the role installs with a plain ``pip install -e PROJECT[EXTRAS]``.
"""

import os
import re
import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python < 3.11: pip carries a copy
    from pip._vendor import tomli as tomllib


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ \[;]", spec, maxsplit=1)[0].strip().lower()


def main() -> None:
    root, extras, exclude = sys.argv[1], sys.argv[2], {n.lower() for n in sys.argv[3:]}
    with open(f"{root}/pyproject.toml", "rb") as fh:
        project = tomllib.load(fh)["project"]
    deps = list(project.get("dependencies", []))
    todo, seen = [e.strip() for e in extras.strip("[]").split(",") if e.strip()], set()
    while todo:  # an extra may name others of this project ("all": "geo-testbed[train,titan]")
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for dep in project.get("optional-dependencies", {}).get(extra, []):
            if _name(dep) == project["name"].lower():
                todo += [e.strip() for e in dep.split("[", 1)[1].split("]")[0].split(",")]
            else:
                deps.append(dep)
    keep = [d for d in deps if _name(d) not in exclude]
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if os.path.exists(f"{root}/constraints.txt"):  # the tested versions
        pip += ["-c", f"{root}/constraints.txt"]
    subprocess.check_call(pip + keep)
    subprocess.check_call(pip + ["--no-deps", "-e", root])


if __name__ == "__main__":
    main()
