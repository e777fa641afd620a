"""The run's telemetry hub: one Unix stream socket, JSON lines, connections named by their ``Hello``.

How it fits: ``runner.TrainingRun`` opens a ``TelemetryHub`` in the network's state folder
(a filesystem path, so every namespace reaches it; the emulated network is not used for
control, by design).  Each training worker connects and says ``Hello(worker=NAME)``; so
does each run extension's own process (its peer name, e.g. ``atlas-controller``).  Every
line is a typed message (``testbed/messages.py``), decoded here: the hub hands the runner
every message as ``(name, msg)``, says when a named connection closes (``(name, None)``),
and sends messages to a name.  A machine agent (``cluster/agent.py``) opens it ``raw``: it
relays each line's JSON object to the orchestrator undecoded, so a kind of an extension's
own (``agents.*.messages``) is decoded where that extension runs, not on every machine.
A worker may open a second connection to report an error: the first stays its channel.

Why not a library: a selector over a handful of Unix sockets and newline-framed JSON is all
it is; an RPC framework would add a dependency and hide the framing the workers also use.
"""

from __future__ import annotations

import json
import selectors
import socket
from pathlib import Path

from testbed import messages as m


class TelemetryHub:
    def __init__(self, path: Path, peer_timeout_s: float = 1.0, raw: bool = False):
        """``peer_timeout_s``: a send to a peer that stops reading gives up after this long
        (a stuck controller must not stall the run).  ``raw``: messages are JSON objects,
        in and out, checked only for being one (a relay's hub)."""
        self.path = path
        self.raw = raw
        if path.exists():
            path.unlink()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(512)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._server, selectors.EVENT_READ)
        self._buf: dict[socket.socket, bytes] = {}
        self._name: dict[socket.socket, str] = {}
        self._conn: dict[str, socket.socket] = {}  # name -> its first connection
        self._peer_timeout = peer_timeout_s
        self._peers: set[str] = set()

    def expect_peers(self, names: set[str]) -> None:
        """Names that are not workers: their sends time out instead of blocking."""
        self._peers |= set(names)

    def connected(self, name: str) -> bool:
        return name in self._conn

    def poll(self, timeout: float) -> list[tuple[str, m.Message | None]]:
        """Messages that arrived within ``timeout``, as (name, msg); (name, None) when a named
        connection closed."""
        out: list[tuple[str, m.Message | None]] = []
        for key, _ in self._sel.select(timeout=timeout):
            sock = key.fileobj
            if sock is self._server:
                conn, _ = self._server.accept()
                self._sel.register(conn, selectors.EVENT_READ)
                self._buf[conn] = b""
                continue
            try:
                chunk = sock.recv(1 << 20)
            except (ConnectionResetError, OSError):  # killed with data unread: the connection is over
                chunk = b""
            if not chunk:
                self._close(sock, out)
                continue
            self._buf[sock] += chunk
            while b"\n" in self._buf.get(sock, b""):
                line, self._buf[sock] = self._buf[sock].split(b"\n", 1)
                if sock not in self._name:  # the first line names the sender
                    name = m.decode(line, expect=(m.Hello,)).worker
                    self._name[sock] = name
                    if name not in self._conn:
                        self._conn[name] = sock
                        if name in self._peers:
                            sock.settimeout(self._peer_timeout)
                    continue
                try:
                    msg = self._raw(line) if self.raw else m.decode(line)
                except m.MessageError as exc:
                    raise m.MessageError(f"telemetry from {self._name[sock]}: {exc}") from None
                out.append((self._name[sock], msg))
        return out

    @staticmethod
    def _raw(line: bytes) -> dict:
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise m.MessageError(f"a message that is not JSON: {exc}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
            raise m.MessageError("a message must be a JSON object with a 'kind'")
        return obj

    def _close(self, sock: socket.socket, out: list) -> None:
        self._sel.unregister(sock)
        self._buf.pop(sock, None)
        name = self._name.pop(sock, None)
        if name is not None and self._conn.get(name) is sock:
            del self._conn[name]
            out.append((name, None))
        sock.close()

    def send(self, name: str, msg: m.Message | dict) -> bool:
        """One message (raw: a JSON object) to ``name``; False when it is not connected or no
        longer reads."""
        sock = self._conn.get(name)
        if sock is None:
            return False
        try:
            sock.sendall(m.line(msg) if isinstance(msg, m.Message) else json.dumps(msg).encode() + b"\n")
            return True
        except OSError:
            return False

    def close(self) -> None:
        for sock in list(self._buf):
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        self._sel.close()
        self._server.close()
