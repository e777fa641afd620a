"""Where a run's figures came from: metrics.json's ``provenance``.

How it fits: the runner adds ``provenance(exp)`` to every run's metrics.json (and the
simulator's), so a figure read months later says what produced it: the experiment as it
was resolved (every default filled in, ``--set`` overrides applied) with its topology, the
code (the checkout's commit and whether it had uncommitted changes, or the installed
package's version), the versions of what shapes the figures (Python, torch, pyroute2, the
kernel), the machine (its name, CPU model and cores) and when.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> dict[str, Any] | None:
    """The checkout's commit and whether its tracked files differ from it (None: not a checkout)."""
    if not (_ROOT / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", str(_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return {"commit": head.stdout.strip(), "uncommitted_changes": bool(dirty.stdout.strip())}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def provenance(exp: Any) -> dict:
    """What produced a run of ``exp`` (a ``testbed.spec.experiment.Experiment``)."""
    return {
        "experiment": exp.model_dump(mode="json"),
        "experiment_file": exp.origin,
        "topology": exp.topo.model_dump(mode="json"),
        "topology_file": exp.topology_file,
        "code": {"package": "geo-testbed", "version": _version("geo-testbed"), "git": _commit()},
        "versions": {"python": platform.python_version(), "torch": _version("torch"),
                     "pyroute2": _version("pyroute2"), "kernel": platform.release()},
        "machine": {"name": platform.node(), "cpu": _cpu_model(), "cores": os.cpu_count()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
