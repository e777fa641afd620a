"""Which links each media stream's packets left on: per-interface, per-stream packet counts.

How it fits: ``emulate.py`` starts one of these inside every gateway router and inside the
Internet hub.  It opens an AF_PACKET socket on each of its WAN and Internet interfaces and
counts the media packets *sent* out of each (PACKET_OUTGOING: what really left on that
link, after the delay line and the rate limit), keyed by the stream id in the packet.  The
orchestrator compares the counts with the route each call was given: a WAN call's streams
must appear on exactly the backbone links of its path, an Internet call's on the hub's link
to the destination and on no WAN link.  Counting here, in C-speed sockets with a few lines
of parsing, costs far less than dissecting every packet with scapy; the test suite also
checks a sample with scapy.

Run as ``python -m agents.titan.routecheck CONFIG.json`` (``{"control": path, "interfaces":
[..], "port": n}``); control messages (``messages.py``) ``Dump`` (path), ``Reset``, ``Quit``,
each answered ``Ok`` (a bad one ``Refused``).  Prints ``ready`` once every socket is bound.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys

from agents.titan import messages as tm
from testbed import messages as m

_ETH_P_IP = 0x0800
_ETH_P_ALL = 0x0003  # outgoing packets reach only "all protocols" taps
_PACKET_OUTGOING = 4
_UDP = 17


def main() -> None:
    cfg = json.loads(open(sys.argv[1]).read())
    port = int(cfg.get("port", 5004))
    socks = {}
    for ifname in cfg["interfaces"]:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(_ETH_P_ALL))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.bind((ifname, _ETH_P_ALL))
        s.setblocking(False)
        socks[s] = ifname
    control = cfg["control"]
    if os.path.exists(control):
        os.unlink(control)
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ctl.bind(control)
    ctl.setblocking(False)
    counts: dict[str, dict[int, int]] = {name: {} for name in socks.values()}
    running = [True]
    signal.signal(signal.SIGTERM, lambda s, f: running.__setitem__(0, False))
    print("ready", flush=True)
    watch = list(socks) + [ctl]

    def drain(s, limit: int | None) -> None:
        """Count what ``s`` holds (at most ``limit`` packets: a busy interface must not keep
        the control socket waiting)."""
        table = counts[socks[s]]
        n = 0
        while limit is None or n < limit:
            try:
                pkt, addr = s.recvfrom(128)
            except BlockingIOError:
                return
            n += 1
            if addr[2] != _PACKET_OUTGOING or addr[1] != _ETH_P_IP or len(pkt) < 32 or pkt[9] != _UDP:
                continue
            ihl = (pkt[0] & 0x0F) * 4
            if len(pkt) < ihl + 12 or struct.unpack_from("!H", pkt, ihl + 2)[0] != port:
                continue
            sid = struct.unpack_from("!I", pkt, ihl + 8)[0]
            table[sid] = table.get(sid, 0) + 1

    while running[0]:
        r, _, _ = select.select(watch, [], [], 0.2)
        for s in r:
            if s is ctl:
                try:
                    data, addr = ctl.recvfrom(65536)
                except BlockingIOError:
                    continue
                reply: m.Message = m.Ok()
                try:
                    msg = m.decode(data, expect=(tm.Dump, tm.Reset, tm.Quit))
                except m.MessageError as exc:
                    msg, reply = None, m.Refused(error=str(exc))
                if isinstance(msg, tm.Dump):
                    for sock in socks:  # everything that went out before the request, counted
                        drain(sock, None)
                    try:
                        with open(msg.path, "w") as fh:
                            json.dump(counts, fh)
                    except OSError as exc:  # answered, not a silent death
                        reply = m.Refused(error=f"dump to {msg.path}: {exc.strerror or exc}")
                elif isinstance(msg, tm.Reset):
                    for sock in socks:
                        drain(sock, None)
                    counts = {name: {} for name in socks.values()}
                elif isinstance(msg, tm.Quit):
                    running[0] = False
                if addr:
                    try:
                        ctl.sendto(m.encode(reply), addr)
                    except OSError:
                        pass
                continue
            drain(s, 512)
    ctl.close()
    try:
        os.unlink(control)
    except OSError:
        pass


if __name__ == "__main__":
    main()
