"""Low-level process helpers that the network layer and the run layer share: ending a set of
processes (``stop_all``) and the JSON datagram client that talks to a process's control
socket (``DatagramClient``).

Why here, at the top of ``testbed`` beside ``registry``: both ``net`` (the delay lines that
``network.Network`` starts and drives) and ``run`` (the processes a run starts,
``run.procs``), and the extensions' own processes, need them, and the network layer must
not import the run layer (``run`` is built on ``net``, not the other way round).  They
belong to neither: they know no network, no run and no workload, and import only the
standard library and the typed messages (``testbed.messages``), so they sit at the bottom of
the import order with ``registry``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

from testbed import messages as m


def stop_all(procs: list[subprocess.Popen], timeout: float = 3.0) -> None:
    """SIGTERM all, wait up to ``timeout`` together, then SIGKILL what is left."""
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        try:
            proc.terminate()
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for proc in alive:
        try:
            proc.wait(max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


class DatagramClient:
    """Typed messages (``testbed/messages.py``) to processes' Unix datagram sockets (filesystem
    paths: reachable from every namespace), from a socket of our own at ``path`` (so they can
    answer)."""

    def __init__(self, path: str | Path | None = None, timeout: float = 2.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.path = str(path) if path is not None else None
        if self.path is not None:
            if os.path.exists(self.path):
                os.unlink(self.path)
            self.sock.bind(self.path)
        self.sock.settimeout(timeout)

    def send(self, to: str, msg: m.Message) -> bool:
        """Fire and forget; False when nobody listens there."""
        try:
            self.sock.sendto(m.encode(msg), to)
            return True
        except OSError:
            return False

    def request(self, to: str, msg: m.Message, max_reply: int = 65536) -> m.Message:
        """Send and wait for the answer; raises OSError (no answer) or RuntimeError (refused)."""
        self.sock.sendto(m.encode(msg), to)
        reply = m.decode(self.sock.recv(max_reply))
        if isinstance(reply, m.Refused):
            raise RuntimeError(reply.error)
        return reply

    def close(self) -> None:
        self.sock.close()
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
