"""Measure a running network against its spec: RTT with ping, goodput with iperf3.

How it fits: ``testbed fidelity`` builds a ``Network``, calls ``measure_all`` and prints
configured against measured; every ``testbed run`` calls ``check_wan`` before training (a
second or two) and records it in metrics.json; the tests call the single-measurement
helpers on networks they build.  Measurements run one at a time (the machine has two
cores) from the first host of the source DC to the first host of the destination DC, so
each crosses exactly the WAN link under test.

Per direction: the round trip (min of a ping series) against the configured round trip and,
where the topology names a measured source (``source_rtt_ms``), against that; the one-way
delay (``owd.py``: every namespace reads the same clock) against the direction's
``delay_ms``; and a steady-state goodput.  Goodput leaves TCP's slow start and the loss
recovery that ends it out (``iperf3 -O``, 30 round trips, at least 1 s) and measures for at
least 20 round trips, so a 262 ms link is measured as long as it needs.  Tolerances
(``within_tolerance``): RTT within max(0.5 ms, 2%), goodput 90-101% of the rate.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Callable

from .network import HostInfo, Network, NetworkError

RTT_TOLERANCE_MS = 0.5
RTT_TOLERANCE_FRAC = 0.02
GOODPUT_RANGE = (0.90, 1.01)
_PING_RTT = re.compile(r"time=([0-9.]+) ms")
_IPERF_PORT = 5201


def rtt_tolerance_ms(configured_ms: float) -> float:
    return max(RTT_TOLERANCE_MS, RTT_TOLERANCE_FRAC * configured_ms)


@dataclass
class LinkReport:
    """One WAN direction, configured against measured."""

    src: str
    dst: str
    rtt_ms_configured: float
    rtt_ms_measured: float
    rtt_error_ms: float
    rtt_ms_source: float | None  # the round trip the topology's source measured (AWS matrix)
    owd_ms_configured: float
    owd_ms_measured: float | None
    rate_mbps_configured: float
    goodput_mbps_measured: float
    goodput_ratio: float
    goodput_seconds: float  # measured for this long, after omitting slow start
    retransmits: int
    loss_configured: float

    def to_dict(self) -> dict:
        return asdict(self)

    def within_tolerance(self) -> bool:
        """RTT within max(0.5 ms, 2%) of the configured round trip, goodput 90-101% of the rate
        (a lossy link's goodput is what TCP makes of the loss: not judged)."""
        rtt_ok = abs(self.rtt_error_ms) <= rtt_tolerance_ms(self.rtt_ms_configured)
        rate_ok = self.loss_configured > 0 or GOODPUT_RANGE[0] <= self.goodput_ratio <= GOODPUT_RANGE[1]
        return rtt_ok and rate_ok


def ping(src: HostInfo, dst_ip: str, count: int = 20, interval_s: float = 0.05) -> list[float]:
    """RTTs in ms of the echo replies that came back (lost ones are absent)."""
    out = src.node.cmd(f"ping -n -c {count} -i {interval_s} -W 2 {dst_ip}")
    return [float(x) for x in _PING_RTT.findall(out)]


def ping_loss(src: HostInfo, dst_ip: str, count: int = 2000, interval_s: float = 0.002) -> float:
    """Fraction of echo requests without a reply (losses in either direction)."""
    out = src.node.cmd(f"ping -n -q -c {count} -i {interval_s} -W 3 {dst_ip}")
    m = re.search(r"(\d+) packets transmitted, (\d+) received", out)
    if not m:
        raise NetworkError(f"ping {src.name} -> {dst_ip} printed no summary: {out.strip()[-200:]}")
    sent, got = int(m.group(1)), int(m.group(2))
    return 1.0 - got / sent


def iperf3(net: Network, src: HostInfo, dst: HostInfo, seconds: float = 3.0, streams: int = 1,
           port: int = _IPERF_PORT, omit_s: float = 0.0, window_bytes: int | None = None) -> dict:
    """One iperf3 TCP run src -> dst; returns goodput (receiver) and retransmits.

    Goodput is what the receiver got in its own intervals after the omitted ones: the
    client's end-of-test figure counts a long path's queue and in-flight data, which arrive
    after the sender stopped, against the sender's duration (measured: 1.012 of the rate on
    a 262 ms link, where the receiver's intervals give 0.956, the payload fraction)."""
    server = net.popen(dst, ["iperf3", "-s", "-1", "-J", "-p", str(port)], stdout=subprocess.DEVNULL)
    try:
        for attempt in range(20):
            out = src.node.cmd(
                f"iperf3 -c {dst.ip} -p {port} -t {seconds} -P {streams} -O {omit_s} -J -C cubic --get-server-output"
                + (f" -w {window_bytes}" if window_bytes else "")
            )
            try:
                data = json.loads(out[out.index("{"):])
            except ValueError:
                data = {"error": out.strip()[-200:]}
            if "error" not in data:
                break
            if "connect" not in str(data["error"]) or attempt == 19:
                raise NetworkError(f"iperf3 {src.name} -> {dst.name}: {data['error']}")
            time.sleep(0.05)  # the server is not listening yet
        end = data["end"]
        steady = [i["sum"] for i in data.get("server_output_json", {}).get("intervals", [])
                  if not i["sum"].get("omitted")]
        seconds_in = sum(i["seconds"] for i in steady)
        goodput = (sum(i["bytes"] for i in steady) * 8 / seconds_in if seconds_in > 0
                   else end["sum_received"]["bits_per_second"])
        return {
            "goodput_mbps": goodput / 1e6,
            "sent_mbps": end["sum_sent"]["bits_per_second"] / 1e6,
            "retransmits": end["sum_sent"].get("retransmits", 0),
        }
    finally:
        if server.poll() is None:
            server.terminate()
        server.wait(5)


def one_way_delays(net: Network, src: HostInfo, dst: HostInfo, count: int = 50, interval_s: float = 0.01,
                   port: int = 5301) -> list[float]:
    """One-way delays (ms) src -> dst, from the clock all namespaces share, in arrival order."""
    return [d for d, _seq in one_way_probe(net, src, dst, count, interval_s, port)]


def one_way_probe(net: Network, src: HostInfo, dst: HostInfo, count: int = 50, interval_s: float = 0.01,
                  port: int = 5301) -> list[tuple[float, int]]:
    """(one-way delay ms, sequence number) of each datagram that arrived, in arrival order:
    the order shows whether the path reordered them."""
    rows = _probe(net, src, dst, ["recv", str(port), str(count)],
                  ["send", dst.ip, str(port), str(count), str(interval_s)], 2.0 + count * interval_s + 2.0)
    return [(float(r[0]), int(r[1])) for r in rows]


def _probe(net: Network, src: HostInfo, dst: HostInfo, recv_args: list[str], send_args: list[str],
           timeout: float) -> list[list[str]]:
    """Run ``testbed.owd``'s receiver on dst and its sender on src; the receiver's lines, split."""
    import sys

    recv = net.popen(dst, [sys.executable, "-m", "testbed.owd", *recv_args, str(timeout)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if recv.stdout.readline().strip() != "listening":
        raise NetworkError(f"one-way delay receiver on {dst.name} did not start: {recv.stderr.read()[-200:]}")
    src.node.cmd(" ".join([sys.executable, "-m", "testbed.owd", *send_args]))
    try:
        stdout, _ = recv.communicate(timeout=timeout + 2)
    except subprocess.TimeoutExpired:
        recv.kill()
        stdout, _ = recv.communicate()
    return [line.split() for line in stdout.splitlines() if line.strip()]


def message_delays(net: Network, src: HostInfo, dst: HostInfo, size: int = 131072, count: int = 30,
                   interval_s: float = 0.05, port: int = 5302) -> list[float]:
    """One-way times (ms) of ``count`` TCP messages of ``size`` bytes src -> dst, each sent
    after ``interval_s`` of idle: delay plus serialisation at the link's rate."""
    rows = _probe(net, src, dst, ["msg-recv", str(port), str(count), str(size)],
                  ["msg-send", dst.ip, str(port), str(count), str(size), str(interval_s)],
                  2.0 + count * (interval_s + 0.5))
    return [float(r[0]) for r in rows]


def configured_rtt_ms(net: Network, src: str, dst: str) -> float:
    return net.topo.rtt_ms(src, dst)


def steady_state_seconds(rtt_ms: float, seconds: float) -> tuple[float, float]:
    """(omit, measure) for iperf3 on a path of this round trip.  Slow start overshoots a
    one-BDP queue and the recovery from that loss lasts up to ~30 round trips (measured: 238
    ms, 34 Mbit/s, retransmissions until 7 s); until it is over, data held behind a hole
    reaches the application in bursts above the link's rate (1.2x in one interval).  So 30
    round trips are left out, then at least 20 measured."""
    rtt = rtt_ms / 1000.0
    return max(1.0, 30 * rtt), max(seconds, 20 * rtt)


def measure_link(net: Network, src: str, dst: str, seconds: float = 3.0, pings: int = 20,
                 rtt_ms: float | None = None) -> LinkReport:
    a, b = net.host(src), net.host(dst)
    params = net.link(src, dst).params
    if rtt_ms is None:
        rtts = ping(a, b.ip, count=pings)
        if not rtts:
            raise NetworkError(f"{src} -> {dst}: no ping reply")
        rtt_ms = min(rtts)
    conf = configured_rtt_ms(net, src, dst)
    owds = one_way_delays(net, a, b, count=20, interval_s=0.01)
    omit, measure = steady_state_seconds(conf, seconds)
    perf = iperf3(net, a, b, seconds=measure, omit_s=omit)
    return LinkReport(
        src=src,
        dst=dst,
        rtt_ms_configured=round(conf, 3),
        rtt_ms_measured=round(rtt_ms, 3),
        rtt_error_ms=round(rtt_ms - conf, 3),
        rtt_ms_source=net.topo.source_rtt_ms(src, dst),
        owd_ms_configured=round(net.topo.one_way_delay_ms(src, dst), 3),
        owd_ms_measured=round(min(owds), 3) if owds else None,
        rate_mbps_configured=params.rate_mbps,
        goodput_mbps_measured=round(perf["goodput_mbps"], 2),
        goodput_ratio=round(perf["goodput_mbps"] / params.rate_mbps, 4),
        goodput_seconds=round(measure, 2),
        retransmits=perf["retransmits"],
        loss_configured=params.loss,
    )


def measure_all(net: Network, seconds: float = 3.0, pings: int = 20,
                progress: Callable[[str], None] | None = None) -> list[LinkReport]:
    """Every WAN direction: min RTT of its link (one ping series per link), one-way delay and
    steady-state goodput."""
    reports = []
    rtt_of_pair: dict[frozenset, float] = {}
    for wd in net.links():
        if progress:
            progress(f"{wd.src} -> {wd.dst}")
        pair = frozenset((wd.src, wd.dst))
        if pair not in rtt_of_pair:
            rtts = ping(net.host(wd.src), net.host(wd.dst).ip, count=pings)
            if not rtts:
                raise NetworkError(f"{wd.src} -> {wd.dst}: no ping reply")
            rtt_of_pair[pair] = min(rtts)
        reports.append(measure_link(net, wd.src, wd.dst, seconds=seconds, rtt_ms=rtt_of_pair[pair]))
    return reports


@dataclass
class DirectionCheck:
    """The quick check of one WAN direction that every run makes before training."""

    src: str
    dst: str
    rtt_ms_configured: float
    rtt_ms_measured: float | None
    owd_ms_configured: float
    owd_ms_measured: float | None
    rtt_ms_source: float | None
    ok: bool
    problem: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def check_wan(net: Network, pings: int = 5) -> list[DirectionCheck]:
    """Per WAN direction: a short ping series from the source DC (min RTT) and a one-way probe
    (min of 10), against the configuration.  A direction outside max(0.5 ms, 2%) on the round
    trip, or without replies, is not ``ok``; the caller warns.  About 0.2 s + 2 RTT a direction."""
    out = []
    for wd in net.links():
        a, b = net.host(wd.src), net.host(wd.dst)
        conf = configured_rtt_ms(net, wd.src, wd.dst)
        owd_conf = net.topo.one_way_delay_ms(wd.src, wd.dst)
        rtts = ping(a, b.ip, count=pings, interval_s=0.01)
        owds = one_way_delays(net, a, b, count=10, interval_s=0.005)
        rtt = min(rtts) if rtts else None
        owd = min(owds) if owds else None
        problems = []
        if rtt is None:
            problems.append("no ping reply")
        elif abs(rtt - conf) > rtt_tolerance_ms(conf):
            problems.append(f"RTT {rtt:.2f} ms against {conf:.2f} configured")
        if owd is not None and abs(owd - owd_conf) > rtt_tolerance_ms(owd_conf):
            problems.append(f"one-way {owd:.2f} ms against {owd_conf:.2f} configured")
        out.append(DirectionCheck(wd.src, wd.dst, round(conf, 3), None if rtt is None else round(rtt, 3),
                                  round(owd_conf, 3), None if owd is None else round(owd, 3),
                                  net.topo.source_rtt_ms(wd.src, wd.dst), not problems, "; ".join(problems)))
    return out
