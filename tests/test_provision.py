"""Provisioning: the playbook passes its checks, runs for real twice (the second time
changing nothing), and a failing task makes `testbed provision` fail in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENV = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def test_playbook_syntax_check():
    result = subprocess.run([str(BIN / "ansible-playbook"), "--syntax-check", "-i", "playbooks/inventory.local.ini",
                             "playbooks/site.yml"], capture_output=True, text=True, cwd=REPO, env=ENV)
    assert result.returncode == 0, result.stderr


def test_ansible_lint_passes():
    lint = BIN / "ansible-lint"
    if not lint.exists():
        pytest.skip("ansible-lint is not installed (pip install -e '.[test]')")
    result = subprocess.run([str(lint), "--offline", "--nocolor", "playbooks/site.yml",
                             "playbooks/cluster.yml"], capture_output=True,
                            text=True, cwd=REPO, env=ENV, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_example_inventory_is_one_a_run_across_machines_reads():
    """README points at playbooks/inventory.example.ini for a fleet: it must be what
    ``--inventory`` reads (every machine with its ``gtb_underlay``), not only what Ansible
    reads.  In a process of its own: Ansible's inventory parser patches ``sys.intern``."""
    probe = ("from testbed.cluster.inventory import load_inventory; "
             "print(' '.join(f'{m.name}={m.underlay}/{m.gpus}' for m in load_inventory('playbooks/inventory.example.ini')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["lab-head=192.0.2.10/0", "gpu-a=192.0.2.21/1", "gpu-b=192.0.2.22/1"], result.stdout


def test_vagrantfile_validates():
    if shutil.which("vagrant") is None:
        pytest.skip("vagrant is not installed (apt-get install vagrant; setup.sh test installs it)")
    result = subprocess.run(["vagrant", "validate", "--ignore-provider"], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "validated successfully" in result.stdout


def _root_with_apt():
    if os.geteuid() != 0:
        pytest.skip("needs root: the playbook installs packages and writes /etc/sysctl.d")
    if shutil.which("apt-get") is None:
        pytest.skip("needs a Debian/Ubuntu machine (apt)")


def test_playbook_runs_for_real_and_a_second_run_changes_nothing():
    _root_with_apt()
    from testbed.tools.provision import provision

    provision()  # the first run may change things (a fresh machine)
    second = provision()
    assert second.hosts["localhost"].get("failed", 0) == 0
    assert second.changed == 0, second.hosts


@pytest.mark.slow  # the real run just before it checks more
def test_the_dry_run_passes_on_a_provisioned_machine():
    """README's ``testbed provision --check``: in check mode the doctor still runs (it only
    reads the kernel), so the delay-backend assert has its answer (it failed with
    "from_json ... Expecting value" when the doctor was skipped)."""
    _root_with_apt()
    from testbed.tools.provision import provision

    result = provision(check=True)
    assert result.hosts["localhost"].get("failed", 0) == 0, result.failures
    assert not result.failures


def test_a_failing_task_fails_provision_in_one_line(tmp_path):
    _root_with_apt()
    play = tmp_path / "broken.yml"
    play.write_text(
        "- hosts: all\n  gather_facts: false\n  tasks:\n"
        "    - name: Install a package that does not exist\n"
        "      ansible.builtin.apt:\n        name: gtb-no-such-package-zz\n        state: present\n"
    )
    from testbed.tools.provision import ProvisionError, provision

    with pytest.raises(ProvisionError) as err:
        provision(playbook=play)
    text = str(err.value)
    assert "\n" not in text
    assert "localhost: task 'Install a package that does not exist' failed" in text
    assert "gtb-no-such-package-zz" in text


def test_cli_exits_non_zero_for_an_unknown_host_or_inventory(tmp_path):
    _root_with_apt()
    result = subprocess.run([sys.executable, "-m", "testbed.cli", "provision", "--limit", "no-such-host"],
                            capture_output=True, text=True, cwd=REPO, env=ENV, timeout=300)
    assert result.returncode == 1
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "no-such-host" in lines[0], result.stderr
    result = subprocess.run([sys.executable, "-m", "testbed.cli", "provision", "--inventory", str(tmp_path / "nope.ini")],
                            capture_output=True, text=True, cwd=REPO, env=ENV, timeout=60)
    assert result.returncode == 1 and "does not exist" in result.stderr


def test_a_play_leaves_the_callers_ctrl_c_and_sigterm_handlers_as_they_were(tmp_path):
    """ansible-runner installs SIGINT/SIGTERM handlers that only flag a cancel: left in place,
    a run across machines (which plays Ansible first) ignored Ctrl-C to the end."""
    import signal

    from testbed.tools.provision import provision

    play = tmp_path / "noop.yml"
    play.write_text("- hosts: all\n  gather_facts: false\n  tasks:\n"
                    "    - name: Nothing\n      ansible.builtin.command: 'true'\n      changed_when: false\n")
    mine = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    provision(playbook=play)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == mine
