"""Where the files shipped with the testbed live: ``topologies/``, ``experiments/`` and
``playbooks/``.

How it fits: in a checkout they are the folders beside ``testbed/``; ``pip install`` puts the
same files under ``<prefix>/share/geo-testbed/`` (pyproject's ``data-files``), because they are
YAML and Ansible roles a user reads and copies, not Python modules.  ``resolve_topology``,
``load_experiment`` and ``testbed provision`` ask ``shipped(kind)`` for the folder, so an
installed testbed runs ``testbed run default`` from any folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

KINDS = ("topologies", "experiments", "playbooks")
_CHECKOUT = Path(__file__).resolve().parents[2]


def shipped_folders(kind: str) -> list[Path]:
    """The folders that may hold the shipped ``kind``: the checkout's, then the installed copy."""
    if kind not in KINDS:
        raise ValueError(f"shipped files: {kind!r} is not one of {', '.join(KINDS)}")
    return [_CHECKOUT / kind, Path(sys.prefix) / "share" / "geo-testbed" / kind]


def shipped(kind: str) -> Path:
    """The folder of the shipped ``kind`` (the checkout's where there is one)."""
    folders = shipped_folders(kind)
    for folder in folders:
        if folder.is_dir():
            return folder
    return folders[0]


def find_shipped(kind: str, name_or_path: str | Path) -> Path | None:
    """A relative path or a name (``default``, ``experiments/titan/emu.yaml``, ``titan/emu``)
    that does not exist from here, looked up in ``./<kind>/`` and the shipped folders."""
    p = Path(name_or_path)
    if p.is_absolute():
        return None
    rel = Path(*p.parts[1:]) if p.parts[:1] == (kind,) and len(p.parts) > 1 else p
    for folder in [Path.cwd() / kind, *shipped_folders(kind)]:
        for candidate in (folder / rel, folder / f"{rel}.yaml"):
            try:
                if candidate.is_file():
                    return candidate
            except (OSError, ValueError):
                continue
    return None
