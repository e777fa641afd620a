"""The orchestrator <-> machine-agent wire: JSON lines over one TCP connection.

Requests carry an ``id`` and an ``op``; the agent answers each with the same ``id`` and
either ``ok`` (its result) or ``error`` (one line).  Between answers the agent sends
``event`` lines: a worker's telemetry, a process that ended, a delay line that died.
Why not a library (gRPC, Pyro as MaxiNet uses): the testbed's control channels are all
newline-framed JSON (``hub.py``, the workers); one more framing would be one more thing to
install on every server and to get wrong.
"""

from __future__ import annotations

import json
import socket

AGENT_PORT = 29700


def send(sock: socket.socket, msg: dict) -> None:
    sock.sendall((json.dumps(msg, separators=(",", ":")) + "\n").encode())


class LineReader:
    """Whole JSON lines from a socket, as they arrive."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = b""

    def read(self) -> list[dict] | None:
        """The lines one ``recv`` completes (maybe none); None when the peer closed."""
        try:
            chunk = self.sock.recv(1 << 20)
        except (ConnectionResetError, OSError):
            chunk = b""
        if not chunk:
            return None
        self._buf += chunk
        out = []
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            out.append(json.loads(line))
        return out
