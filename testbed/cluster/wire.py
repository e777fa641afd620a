"""The orchestrator <-> machine-agent wire: JSON lines over one TCP connection.

Each line is a typed message (``testbed/messages.py``).  Requests are calls (``Call``: an ``id``,
an ``op`` and its ``args``); the agent answers each with an ``Answer`` of the same ``id``,
holding either its ``result`` or an ``error`` (one line).  Between answers the agent sends
events: ``Telemetry`` (a worker's message), ``Exited`` (a process ended),
``NetworkFailed`` (a delay line died).
Why not a library (gRPC, Pyro as MaxiNet uses): the testbed's control channels are all
newline-framed JSON (``hub.py``, the workers); one more framing would be one more thing to
install on every server and to get wrong.
"""

from __future__ import annotations

import socket

from testbed import messages as m

AGENT_PORT = 29700


def send(sock: socket.socket, msg: m.Message) -> None:
    sock.sendall(m.line(msg))


class LineReader:
    """Whole messages from a socket, as their lines arrive."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = b""

    def read(self) -> list[m.Message] | None:
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
            out.append(m.decode(line))
        return out
