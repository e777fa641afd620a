"""A worker's line to the orchestrator: JSON lines over the run's Unix socket (``testbed/run/hub.py``)."""

from __future__ import annotations

import json
import os
import socket
import threading


class Telemetry:
    def __init__(self, path: str, worker: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self._file = self.sock.makefile("r")
        self._lock = threading.Lock()
        self.send({"type": "hello", "worker": worker, "pid": os.getpid()})

    def send(self, msg: dict) -> None:
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self.sock.sendall(data)

    def receive(self) -> dict:
        line = self._file.readline()
        if not line:
            raise ConnectionError("orchestrator closed the telemetry socket")
        return json.loads(line)
