"""The orchestrator's own build: what it is called, and the archive every machine runs.

How it fits: a run across machines runs one version of the testbed everywhere.  ``version()``
names the code this process runs: the package version and a digest of every file of the
``testbed`` and ``agents`` packages (sources and their data, not ``__pycache__``), so two
checkouts at the same commit with the same edits have the same name and any edit changes
it.  ``archive()`` packs exactly those files into ``<cache>/<digest>.tar.gz``; the
``install`` play (``plays.install_build``) unpacks it into ``BUILDS/<digest>/`` on each
machine, and the orchestrator starts each agent from there (``remote.agent_argv``), with
the machine's own Python (its venv from ``testbed provision``, which has the
dependencies).  The agent computes its own name the same way and refuses an orchestrator
whose name differs (``agent.py``), with both names in the one-line error.

Why a digest and not the git commit: an orchestrator may run from an installed wheel (no
git) or from a checkout with uncommitted edits; the digest names what is actually running
in both cases.  Why a tarball of the packages and not a wheel: building a wheel needs the
checkout's build backend and takes seconds; the tarball is the same files, made in
milliseconds from whatever this process imported.
"""

from __future__ import annotations

import functools
import hashlib
import io
import tarfile
from pathlib import Path

PACKAGES = ("testbed", "agents")
BUILDS = Path("/var/lib/geo-testbed/builds")  # on each machine: one folder per build
_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the packages (checkout or site-packages)
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def _files(root: Path = _ROOT) -> list[Path]:
    out = []
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*")):
            rel = p.relative_to(root)
            if p.is_file() and not _SKIP_DIRS.intersection(rel.parts) and not p.name.endswith(_SKIP_SUFFIXES):
                out.append(rel)
    return out


@functools.cache
def digest(root: Path = _ROOT) -> str:
    """A digest of the packages' files under ``root`` (paths and contents), 16 hex digits;
    read once a process (this process's own: what it imported when it started running)."""
    h = hashlib.sha256()
    for rel in _files(root):
        h.update(str(rel).encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def version() -> str:
    """This process's build: ``<package version>+<digest>``."""
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        base = dist_version("geo-testbed")
    except PackageNotFoundError:
        base = "0"
    return f"{base}+{digest()}"


def archive(cache: Path) -> Path:
    """The build's files as ``cache/<digest>.tar.gz`` (made once; deterministic)."""
    name = digest()
    path = cache / f"{name}.tar.gz"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel in _files():
            info = tar.gettarinfo(str(_ROOT / rel), arcname=str(rel))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(_ROOT / rel, "rb") as fh:
                tar.addfile(info, fh)
    tmp = path.with_suffix(".part")
    tmp.write_bytes(buf.getvalue())
    tmp.rename(path)
    return path
