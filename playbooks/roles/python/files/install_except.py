"""Install the project (editable) with its dependencies except those named.

    install_except.py PROJECT_DIR EXTRAS NAME...     e.g. /opt/geo-testbed "" torch

The python role runs it where ``python_exclude`` is set (the netem VM leaves PyTorch out);
everywhere else the role installs with a plain ``pip install -e PROJECT[EXTRAS]``.
"""

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
    for extra in filter(None, extras.strip("[]").split(",")):
        deps += project.get("optional-dependencies", {}).get(extra.strip(), [])
    keep = [d for d in deps if _name(d) not in exclude]
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.check_call(pip + keep)
    subprocess.check_call(pip + ["--no-deps", "-e", root])


if __name__ == "__main__":
    main()
