"""The netem VM's image key (``testbed/tools/vm.py``): what an install reads rebuilds the
image, pytest's own table in pyproject.toml does not (its markers reach the guest through
the live project; a marker added once cost an 8-minute rebuild here)."""

from __future__ import annotations

import shutil

import pytest

from testbed.tools import vm


def test_the_image_key_follows_the_install_not_pytests_table(tmp_path, monkeypatch):
    for name in ("pyproject.toml", "constraints.txt"):
        shutil.copy(vm.REPO / name, tmp_path / name)
    shutil.copytree(vm.REPO / "playbooks", tmp_path / "playbooks")
    monkeypatch.setattr(vm, "REPO", tmp_path)
    key = vm.image_key()
    pyproject = tmp_path / "pyproject.toml"
    text = pyproject.read_text()
    assert "\nmarkers = [\n" in text and '\nversion = "' in text
    pyproject.write_text(text.replace("\nmarkers = [\n", '\nmarkers = [\n    "another: a marker",\n'))
    assert vm.image_key() == key
    pyproject.write_text(text.replace('\nversion = "', '\nversion = "9', 1))
    assert vm.image_key() != key
    pyproject.write_text(text)
    (tmp_path / "constraints.txt").write_text((tmp_path / "constraints.txt").read_text() + "\nsix==1.16.0\n")
    assert vm.image_key() != key


@pytest.mark.slow
def test_the_playbook_provisions_the_netem_guest():
    """The playbook on a machine that is not this one (Debian 12's own kernel): it runs to its
    end in a throwaway copy of the image, and the guest's doctor then chooses netem."""
    why = vm.missing()
    if why:
        pytest.skip(why)
    result = vm.check_playbook()
    assert result["doctor"].get("backends", {}).get("delay") == "netem", result
