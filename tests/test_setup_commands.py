"""README's setup commands are the ones setup.sh takes: each ``bash setup.sh WORD`` README
names is one of its cases, and a word it does not take is a one-line usage error before
anything is installed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_readme_names_only_what_setup_takes():
    taken = set(re.search(r'\n  ([\w|-]+)\) ;;\n', (REPO / "setup.sh").read_text()).group(1).split("|"))
    named = set(re.findall(r"bash setup\.sh ([\w-]+)", (REPO / "README.md").read_text()))
    assert {"demo", "test", "test-all"} <= named and named <= taken, (named, taken)
    res = subprocess.run(["bash", str(REPO / "setup.sh"), "nope"], capture_output=True, text=True, timeout=10)
    assert res.returncode == 2 and res.stdout == "", res
    assert res.stderr.strip().splitlines() == ["usage: bash setup.sh [setup|demo|test|test-all]"], res.stderr
