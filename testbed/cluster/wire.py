"""The orchestrator <-> machine-agent wire: JSON lines over the agent's stdin and stdout.

The orchestrator starts each agent over SSH (``remote.AgentClient``: ``ssh ... testbed
machine-agent``), so the wire is the SSH session's two pipes; nothing listens on a port and
SSH does the authentication and encryption.  Each line is a typed message
(``testbed/messages.py``).  Requests are calls (``Call``: an ``id``, an ``op`` and its
``args``); the agent answers each with an ``Answer`` of the same ``id``, holding either its
``result`` or an ``error`` (one line).  Between answers the agent sends events:
``Telemetry`` (a worker's message), ``Exited`` (a process ended), ``NetworkFailed`` (a
delay line died).
Why not a library (gRPC, Pyro as MaxiNet uses): the testbed's control channels are all
newline-framed JSON (``hub.py``, the workers); one more framing would be one more thing to
install on every server and to get wrong.
"""

from __future__ import annotations

import os

from testbed import messages as m


class Channel:
    """A byte stream made of two file descriptors (read, write): a pipe pair or a socket."""

    def __init__(self, read_fd: int, write_fd: int):
        self.read_fd = read_fd
        self.write_fd = write_fd

    def fileno(self) -> int:
        return self.read_fd

    def send(self, msg: m.Message) -> None:
        data = memoryview(m.line(msg))
        while data:
            data = data[os.write(self.write_fd, data):]

    def recv(self, size: int) -> bytes:
        return os.read(self.read_fd, size)

    def close(self) -> None:
        for fd in {self.read_fd, self.write_fd}:
            try:
                os.close(fd)
            except OSError:
                pass


class LineReader:
    """Whole messages from a channel, as their lines arrive."""

    def __init__(self, chan: Channel):
        self.chan = chan
        self._buf = b""

    def read(self) -> list[m.Message] | None:
        """The lines one read completes (maybe none); None when the peer closed."""
        try:
            chunk = self.chan.recv(1 << 20)
        except OSError:
            chunk = b""
        if not chunk:
            return None
        self._buf += chunk
        out = []
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            out.append(m.decode(line))
        return out
