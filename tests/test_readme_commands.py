"""Every ``testbed`` command README shows exists, with every flag it shows: README's command
lines (``.venv/bin/testbed ...`` in its code blocks, and ```testbed ...``` in its text) are
resolved against the CLI's own command tree (typer's click), so a renamed command or a
dropped flag fails here instead of on a reader's machine."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import typer.main

from testbed.cli import app

REPO = Path(__file__).resolve().parents[1]

_CODE_LINE = re.compile(r"^\.venv/bin/testbed (.*)$", re.M)
_INLINE = re.compile(r"`testbed ([^`]+)`")


def _commands() -> list[str]:
    """README's testbed command lines, comments and ``[optional]`` brackets kept as written."""
    text = (REPO / "README.md").read_text()
    lines = [m.split("  #")[0].strip() for m in _CODE_LINE.findall(text)]
    return lines + [m.strip() for m in _INLINE.findall(text)]


def _words(line: str) -> list[str]:
    line = line.replace("[", " ").replace("]", " ").replace("...", " ").replace("..", " ")
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    return words[:words.index("--")] if "--" in words else words


def _check(line: str, root) -> list[str]:
    """What of ``line`` the CLI does not have: an unknown command, or a flag its command lacks."""
    words, cmd = _words(line), root
    while words and hasattr(cmd, "commands") and not words[0].startswith("-"):
        name = words.pop(0)
        if name not in cmd.commands:
            return [f"{line!r}: no command {name!r} under {cmd.name!r}"]
        if words[:1] == ["|"]:  # "vm status | remove": each a command of the same group
            missing = [w for w in words[1:] if not w.startswith("-") and w not in cmd.commands]
            return [f"{line!r}: no command {w!r} under {cmd.name!r}" for w in missing]
        cmd = cmd.commands[name]
    flags = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
    return [f"{line!r}: {cmd.name!r} has no {flag}" for flag in (w.split("=")[0] for w in words)
            if flag.startswith("--") and flag not in flags]


def test_every_command_and_flag_readme_shows_exists():
    root = typer.main.get_command(app)
    lines = _commands()
    assert len(lines) >= 40, lines  # README's code blocks and text were read
    problems = [p for line in lines for p in _check(line, root)]
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_wrong_flag_and_a_wrong_command():
    root = typer.main.get_command(app)
    assert _check("fidelity aws-us3 --json", root) == []
    assert _check("fidelity aws-us3 --jsn", root) != []
    assert _check("vm chek-playbook", root) != []
    assert _check("vm status | remov", root) != [] and _check("vm status | remove", root) == []
    assert _check("vm run -- testbed doctor --whatever", root) == []  # after --, the job's own
