"""The Atlas agent of one WAN gateway: enforces the controller's plan on its links' egress.

How it fits: ``testbed run`` starts one agent per DC gateway (in the root namespace; the
delay line's control socket is a file).  The controller sends it plans and heartbeats as
Unix datagrams.  For each of its outgoing WAN directions the agent installs the delay
line's per-pipeline scheduler (pipelines classified by host addresses) with the plan's
rank order, and renews a lease on it every ``lease_s / 4``.  If the controller falls
silent for ``lease_s`` the agent removes the schedulers itself; if the agent dies, the
leases run out in the delay line.  Either way the links are back to one FIFO (TCP fair
sharing) within ``lease_s``, and training goes on.

Turns at the senders (``atlas.enforce: senders``): the agent also hosts the core's
``TurnServer`` (``testbed/net/sendturns.py``) for its DC's outgoing WAN directions; a plan
sets each link's order there instead of in a delay line, and a cleared plan (or a silent
controller) leaves every sender free to send at once (fair sharing).  When it stops it
writes the turns' counters to ``stats``.

    python -m agents.atlas.agent CONFIG.json

CONFIG: ``{"dc", "listen", "lease_s", "links": {"src->dst": {"control": path, "lane": name}},
"turns": path | null, "turn_links": ["src->dst", ..], "stats": path | null}``.
Messages (``messages.py``): ``AgentPlan`` (``{"kind": "atlas.links", "links": {"src->dst":
{"classes": {..}, "order": [..], "queue_bytes": null | "share"}}}``), ``Heartbeat``,
``Clear``; to the delay line, the core's ``LaneSet``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time

from agents.atlas.config import AgentConfig
from agents.atlas.messages import AgentPlan, Clear, Heartbeat, LinkSchedule
from testbed import messages as m
from testbed.net.sendturns import TurnServer
from testbed.procutil import DatagramClient


def _log(dc: str, msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} atlas agent {dc}: {msg}", flush=True)


class _Line:
    """One delay line's control socket, talked to from a socket of the agent's own."""

    def __init__(self, control: str, me: str):
        self.control = control
        self.client = DatagramClient(me, timeout=1.0)

    def request(self, msg: m.Message) -> m.Message:
        return self.client.request(self.control, msg)

    def close(self) -> None:
        self.client.close()


def _apply(line: _Line, lane: str, link: LinkSchedule, lease: float, active: bool, dc: str, name: str) -> bool:
    """The classes once; a later plan only reorders (the queues, and the rate, which follows
    the link's own changes, stay as they are).  A line that lost its scheduler meanwhile (its
    lease ran out) gets the whole plan again."""
    for whole in ((False, True) if active else (True,)):
        try:
            if whole:  # at the link's rate as the delay line knows it (it follows the link's changes)
                line.request(m.LaneSet(lane=lane, classes=link.classes, lease_s=lease, queue_bytes=link.queue_bytes))
            line.request(m.LaneSet(lane=lane, order=link.order, lease_s=lease))
            return True
        except (OSError, RuntimeError, ValueError) as exc:
            if whole:
                _log(dc, f"{name}: plan refused: {exc}")
    return False


def run(cfg: AgentConfig) -> None:
    dc, lease = cfg.dc, cfg.lease_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if os.path.exists(cfg.listen):
        os.unlink(cfg.listen)
    sock.bind(cfg.listen)
    sock.setblocking(False)
    turns = TurnServer(cfg.turns) if cfg.turns else None
    by_control: dict[str, _Line] = {}  # one socket per delay line (a gateway's lanes share it)
    for link in cfg.links.values():
        if link.control not in by_control:
            by_control[link.control] = _Line(link.control, f"{cfg.listen}.{len(by_control)}")
    lines = {name: by_control[link.control] for name, link in cfg.links.items()}
    lanes = {name: link.lane for name, link in cfg.links.items()}
    active: set[str] = set()
    heard = time.monotonic()
    running = [True]
    signal.signal(signal.SIGTERM, lambda *_: running.__setitem__(0, False))
    _log(dc, f"up, links {', '.join(lanes) or 'none'}"
             + (f", turns at the senders on {', '.join(cfg.turn_links)}" if turns else ""))

    def clear(why: str) -> None:
        for name in sorted(active):
            if name in lines:
                try:
                    lines[name].request(m.LaneSet(lane=lanes[name], classes=None))
                except (OSError, RuntimeError, ValueError) as exc:
                    _log(dc, f"{name}: clearing failed: {exc}")
            elif turns is not None:
                turns.set_order(name, None)
        if active:
            _log(dc, f"fair sharing restored on {', '.join(sorted(active))} ({why})")
        active.clear()

    renewed = time.monotonic()
    try:
        while running[0]:
            fds = [sock.fileno()] + (turns.fds() if turns else [])
            try:
                ready, _, _ = select.select(fds, [], [], lease / 4)
            except InterruptedError:
                continue
            msg = None
            for fd in ready:
                if fd != sock.fileno():
                    turns.handle(fd)
                    continue
                try:
                    msg = m.decode(sock.recv(65536), expect=(AgentPlan, Heartbeat, Clear))
                except (OSError, ValueError):
                    msg = None
            now = time.monotonic()
            if msg is not None:
                heard = now
                if isinstance(msg, AgentPlan):
                    for name, link in msg.links.items():
                        if name in lines:
                            if _apply(lines[name], lanes[name], link, lease, name in active, dc, name):
                                active.add(name)
                            else:
                                active.discard(name)
                        elif turns is not None and name in cfg.turn_links:
                            turns.set_order(name, link.order, cfg.turn_rates.get(name, 0.0))
                            active.add(name)
                    _log(dc, f"plan applied on {', '.join(sorted(active)) or 'no link'}: order "
                             f"{next((link.order for link in msg.links.values()), None)}")
                elif isinstance(msg, Clear):
                    clear("the controller asked")
            if active and now - heard > lease:
                clear(f"controller silent for {now - heard:.1f} s")
            if now - renewed >= lease / 4:
                renewed = now
                for name in [n for n in active if n in lines]:  # renew the delay lines' leases
                    try:
                        lines[name].request(m.LaneSet(lane=lanes[name], lease_s=lease))
                    except (OSError, RuntimeError, ValueError) as exc:
                        _log(dc, f"{name}: lease renewal failed: {exc}")
    finally:
        clear("agent stopping")
        for line in by_control.values():
            line.close()
        sock.close()
        if turns is not None:
            if cfg.stats:
                with open(cfg.stats, "w") as fh:
                    json.dump(turns.stats(), fh, indent=1)
            turns.close()
        try:
            os.unlink(cfg.listen)
        except OSError:
            pass


def main() -> int:
    run(AgentConfig.load(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
