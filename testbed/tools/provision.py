"""``testbed provision``: run ``playbooks/site.yml`` through ansible-runner, from Python.

How it fits: README's setup (``setup.sh``), Vagrant's ``ansible_local`` provisioner and a
fleet inventory all run the same playbook; this module is the Python way in.  It streams
ansible-runner's events into a progress callback (one line per task and host), collects a
summary per host (ok / changed / failed / unreachable / skipped), and turns the first
failure into a one-line reason.  The default inventory is this machine with connection
local.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from testbed.spec.shipped import shipped

PLAYBOOK = shipped("playbooks") / "site.yml"
LOCAL_INVENTORY = shipped("playbooks") / "inventory.local.ini"


class ProvisionError(RuntimeError):
    """A play failed or a host was unreachable; the message is one line."""


@dataclass
class ProvisionResult:
    status: str
    rc: int
    hosts: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    outputs: dict[str, dict[str, str]] = field(default_factory=dict)  # host -> task -> its stdout (ok tasks)

    @property
    def changed(self) -> int:
        return sum(h.get("changed", 0) for h in self.hosts.values())


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else str(text).strip()


@contextlib.contextmanager
def _restored(handlers: dict):
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


def provision(inventory: Path | None = None, check: bool = False, limit: str | None = None,
              playbook: Path = PLAYBOOK, extravars: dict | None = None,
              progress: Callable[[str], None] | None = None, tags: str | None = None) -> ProvisionResult:
    """Run the playbook; raise ProvisionError with the failing task's message on failure."""
    import ansible_runner

    inventory = Path(inventory or LOCAL_INVENTORY).resolve()
    if not inventory.exists():
        raise ProvisionError(f"inventory {inventory} does not exist")
    # ansible-runner starts ansible-playbook from PATH: use the one next to this Python
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    failures: list[str] = []
    outputs: dict[str, dict[str, str]] = {}
    say = progress or (lambda line: None)

    def on_event(event: dict) -> bool:
        kind = event.get("event", "")
        data = event.get("event_data", {})
        host, task = data.get("host", ""), data.get("task", "")
        if kind == "runner_on_ok":
            if data.get("res", {}).get("stdout"):
                outputs.setdefault(host, {})[task] = str(data["res"]["stdout"])
            say(f"{'changed' if data.get('res', {}).get('changed') else 'ok':>8}  {host}: {task}")
        elif kind == "runner_on_skipped":
            say(f"{'skipped':>8}  {host}: {task}")
        elif kind in ("runner_on_failed", "runner_on_unreachable"):
            if kind == "runner_on_failed" and data.get("ignore_errors"):
                return True
            res = data.get("res", {})
            msg = res.get("msg") or res.get("stderr") or res.get("stdout") or "failed"
            what = "unreachable" if kind == "runner_on_unreachable" else "failed"
            failures.append(f"{host}: task '{task}' {what}: {_one_line(msg)}")
            say(f"{what:>8}  {host}: {task}: {_one_line(msg)}")
        return True

    cmdline = []
    if check:
        cmdline.append("--check")
    if limit:
        cmdline += ["--limit", limit]
    if tags:
        cmdline += ["--tags", tags]
    # ansible-runner sets its own SIGINT and SIGTERM handlers (they only flag a cancel) and
    # leaves them: a run across machines would then ignore Ctrl-C; ours come back after
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with tempfile.TemporaryDirectory(prefix="gtb-ansible-") as private, _restored(handlers):
        runner = ansible_runner.run(
            private_data_dir=private,
            playbook=str(Path(playbook).resolve()),
            inventory=str(inventory),
            extravars=extravars or {},
            cmdline=" ".join(cmdline) or None,
            event_handler=on_event,
            quiet=True,
            envvars={"ANSIBLE_NOCOLOR": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0",
                     "ANSIBLE_HOST_KEY_CHECKING": "0", "ANSIBLE_DEPRECATION_WARNINGS": "0"},
        )
        stats = runner.stats or {}
        hosts: dict[str, dict[str, int]] = {}
        for key, name in (("ok", "ok"), ("changed", "changed"), ("failures", "failed"),
                          ("dark", "unreachable"), ("skipped", "skipped")):
            for host, n in (stats.get(key) or {}).items():
                hosts.setdefault(host, {})[name] = n
        result = ProvisionResult(runner.status, runner.rc, hosts, failures, outputs)
        if runner.rc != 0 or failures:
            if failures:
                raise ProvisionError(failures[0])
            out = runner.stdout.read() if runner.stdout else ""
            where = f" (inventory {inventory}{', --limit ' + limit if limit else ''})"
            raise ProvisionError(f"ansible-playbook exited {runner.rc}: {_one_line(out) or runner.status}{where}")
        if not hosts:
            raise ProvisionError(f"no host in {inventory} matched{' --limit ' + limit if limit else ''}")
    return result
