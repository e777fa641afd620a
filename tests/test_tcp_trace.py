"""The transport's per-message TCP trace (``parallel.tcp_trace``): ``testbed/net/tcpinfo.py``
read against ``ss -ti`` on a real connection, and the rows a traced channel writes, both in a
private network namespace of their own (``unshare -n``: loopback only, no lock needed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from testbed.net import tcpinfo
from testbed.spec.experiment import ParallelSpec

_SCRIPT = textwrap.dedent("""
    import json, re, socket, subprocess, time
    from testbed.net import tcpinfo
    from testbed.train.transport import Endpoint
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)

    # the parser against ss, on one connection that has sent 400 KB and is idle
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    c = socket.socket(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic")
    c.connect(srv.getsockname()); s, _ = srv.accept()
    c.sendall(b"x" * 400_000)
    got = 0
    while got < 400_000:
        got += len(s.recv(1 << 20))
    time.sleep(0.2)
    info = tcpinfo.read(c)
    ss = subprocess.run(["ss", "-tinH", "src", "127.0.0.1:%d" % c.getsockname()[1]],
                        capture_output=True, text=True).stdout
    time.sleep(0.05)
    ss_fields = {k: v for k, v in re.findall(r"\\b(cwnd|rto|bytes_sent|bytes_acked|lastsnd|snd_wnd):([0-9.]+)", ss)}

    # a traced channel of 2 connections: 3 messages, the last after an idle gap past the RTO
    a, b = Endpoint("a", "127.0.0.1", 47001), Endpoint("b", "127.0.0.1", 47002)
    trace = []
    out = a.connect("b", "127.0.0.1", 47002, 0, 2, 1 << 20, trace=trace)
    inc = b.accept("a", 0, 2, 1 << 20)
    for gap in (0.0, 0.0, 0.5):
        time.sleep(gap)
        out.send(bytes(100_000))
        inc.recv(timeout=10)
    out.flush(10)  # (each slice's last row is written before its message counts as sent)
    print(json.dumps({"info": info, "ss": ss_fields, "trace": trace}))
""")


def test_parse_fields_and_infinite_ssthresh():
    raw = bytearray(tcpinfo.TCP_INFO_BYTES)
    raw[0], raw[1] = 1, 4  # ESTABLISHED, Loss
    for off, v in ((8, 462_000), (44, 512), (68, 262_400), (76, 0x7FFFFFFF), (80, 24), (100, 7)):
        raw[off:off + 4] = v.to_bytes(4, sys.byteorder)
    info = tcpinfo.parse(bytes(raw))
    assert info["ca_state"] == 4 and info["rto_ms"] == 462.0 and info["idle_ms"] == 512
    assert info["rtt_ms"] == 262.4 and info["ssthresh"] is None and info["cwnd"] == 24
    assert info["total_retrans"] == 7
    raw[76:80] = (17).to_bytes(4, sys.byteorder)
    assert tcpinfo.parse(bytes(raw))["ssthresh"] == 17
    assert tcpinfo.parse(bytes(raw[:104]))["bytes_acked"] is None  # an older kernel's shorter struct


def test_trace_is_off_by_default():
    assert ParallelSpec().tcp_trace is False


@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("ss") is None, reason="needs unshare and ss")
def test_trace_on_real_sockets_in_a_private_netns(tmp_path):
    script = tmp_path / "trace.py"
    script.write_text(_SCRIPT)
    res = subprocess.run(["unshare", "-n", sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    if res.returncode and "Operation not permitted" in res.stderr:
        pytest.skip("unshare -n is not permitted here")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    info, ss = out["info"], out["ss"]
    assert info["state"] == 1 and info["cwnd"] == int(ss["cwnd"]) and info["rto_ms"] == float(ss["rto"])
    assert info["bytes_sent"] == int(ss["bytes_sent"]) and info["bytes_acked"] == int(ss["bytes_acked"])
    assert abs(info["idle_ms"] - float(ss["lastsnd"])) < 50
    assert info["snd_wnd"] == int(ss["snd_wnd"]) and info["busy_ms"] >= 0  # (in jiffies: 0 for a fast loopback)
    assert 0 <= info["rwnd_limited_ms"] <= info["busy_ms"] and 0 <= info["sndbuf_limited_ms"] <= info["busy_ms"]
    rows = out["trace"]
    assert len(rows) == 3 * 2 * 3  # messages x connections x phases
    assert {(r["seq"], r["conn"], r["phase"]) for r in rows} == {
        (s, c, p) for s in range(3) for c in range(2) for p in ("before", "start", "end")}
    assert all(r["bytes"] == 50_000 and r["cwnd"] >= 1 and r["state"] == 1 for r in rows)
    # the last message found each connection idle for about its 0.5 s gap (and the previous
    # message's last segment sent since), the others not
    last = [r for r in rows if r["seq"] == 2 and r["phase"] == "before"]
    assert all(400 <= r["idle_ms"] <= 1500 for r in last), last
    by = {(r["seq"], r["conn"], r["phase"]): r for r in rows}
    for c in range(2):  # a connection's counters only grow, message by message
        sent = [by[(s, c, p)]["bytes_sent"] for s in range(3) for p in ("before", "start", "end")]
        assert sent == sorted(sent) and sent[-1] >= 3 * 50_000


def test_window_model_takes_hystarts_threshold_as_given():
    """``sim.tcp_ssthresh_segments``: slow start up to the threshold, then a segment a round."""
    from testbed.sim.tcpwindow import TcpWindow

    free = TcpWindow(0.262, 4, 1e9, True)
    held = TcpWindow(0.262, 4, 1e9, True, ssthresh=20)
    assert free.ssthresh == float("inf") and held.ssthresh == 20
    for w in (free, held):
        w.begin(0.0, 4 * 1448 * 200)
        for _ in range(3):
            w.grow()
    assert free.segs == 80 and held.segs == 22  # 10 -> 20 -> 40 -> 80; 10 -> 20 -> 21 -> 22
