"""A worker's line to the orchestrator: JSON lines over the run's Unix socket (``testbed/run/hub.py``),
each a typed message of ``testbed/messages.py``."""

from __future__ import annotations

import os
import socket
import threading

from testbed import messages as m


class Telemetry:
    def __init__(self, path: str, worker: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self._file = self.sock.makefile("rb")
        self._lock = threading.Lock()
        self.send(m.Hello(worker=worker, pid=os.getpid()))

    def send(self, msg: m.Message) -> None:
        data = m.line(msg)
        with self._lock:
            self.sock.sendall(data)

    def receive(self) -> m.Message:
        data = self._file.readline()
        if not data:
            raise ConnectionError("orchestrator closed the telemetry socket")
        return m.decode(data)
