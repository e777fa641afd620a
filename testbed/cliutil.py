"""What every ``testbed`` command shares when it speaks to a terminal.

How it fits: ``cli`` (the ``testbed`` command), ``vmcli`` (``testbed vm``) and the agents'
command groups mounted through ``extension.COMMANDS`` (``testbed titan``) end an error the
user can fix with one red line and a non-zero exit (``fail``), report Ctrl-C the same way
(``fail_interrupted``), and turn SIGTERM into the same unwinding as Ctrl-C
(``on_sigterm``), so the network's context manager removes everything it made.
"""

from __future__ import annotations

import os
import signal
from typing import NoReturn

import typer
from rich.console import Console

_console = Console(stderr=True)
_MAIN_PID = os.getpid()


def fail(msg: str, code: int = 2) -> NoReturn:
    """One line on stderr, exit ``code``."""
    from rich.markup import escape

    _console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def fail_interrupted(exc: KeyboardInterrupt) -> NoReturn:
    """Ctrl-C (or SIGTERM, through ``on_sigterm``) after the clean-up has run: exit 130."""
    by = exc.args[0] if exc.args else "SIGINT"
    fail(f"interrupted ({by}); everything the testbed made was removed", 130)


def on_sigterm(signum, frame) -> None:
    """Unwind like Ctrl-C so clean-up runs, but only in this process.

    pyroute2 forks helper processes (to open sockets inside namespaces) and ends them
    with SIGTERM; a fork inherits this handler, and must not unwind our stack and tear
    the network down from inside the helper.
    """
    if os.getpid() != _MAIN_PID:
        os._exit(128 + signum)
    raise KeyboardInterrupt(signal.Signals(signum).name)
