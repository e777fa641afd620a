"""A process for ``tests/test_site_conformance.py``, started in an emulated host through a
site's launcher as ``python -m tests.site_probe CONFIG.json`` (one machine: this checkout is
on PYTHONPATH; the fake cluster's machines see the same checkout at the same path).

``mode: echo``: connect to the run's telemetry hub (``telemetry``: the agent puts its own
hub's path there across machines), say hello as ``name``, send one ``Log`` with this
process's cgroups (``/proc/self/cgroup``), wait for the hub's answer, print it and exit
with ``rc``.  ``mode: sleep``: print a line and sleep until ended.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

from testbed import messages as m


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    if cfg["mode"] == "sleep":
        print("sleeping", flush=True)
        time.sleep(600)
        return 0
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(cfg["telemetry"])
    cgroups = Path("/proc/self/cgroup").read_text()
    print(f"cgroups: {cgroups.strip()!r}", flush=True)
    for msg in (m.Hello(worker=cfg["name"]), m.Log(msg=cgroups)):  # the core's typed kinds
        sock.sendall(m.line(msg))
    buf = b""
    sock.settimeout(60)
    while b"\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            print("the hub hung up", flush=True)
            return 1
        buf += chunk
    reply = m.decode(buf.split(b"\n", 1)[0], expect=(m.Log,))
    print(f"got {reply.msg}", flush=True)
    return int(cfg["rc"])


if __name__ == "__main__":
    sys.exit(main())
