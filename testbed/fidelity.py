"""Measure a running network against its spec: RTT with ping, goodput with iperf3.

How it fits: ``testbed fidelity`` builds a ``Network``, calls ``measure_all`` and prints
configured against measured; the tests call the single-measurement helpers on networks
they build.  Measurements run one at a time (the machine has two cores) from the first
host of the source DC to the first host of the destination DC, so each crosses exactly the
WAN link under test.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from typing import Callable

from .network import HostInfo, Network, NetworkError

_PING_RTT = re.compile(r"time=([0-9.]+) ms")
_IPERF_PORT = 5201


@dataclass
class LinkReport:
    src: str
    dst: str
    rtt_ms_configured: float
    rtt_ms_measured: float
    rtt_error_ms: float
    rate_mbps_configured: float
    goodput_mbps_measured: float
    goodput_ratio: float
    retransmits: int
    loss_configured: float

    def to_dict(self) -> dict:
        return asdict(self)


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
           port: int = _IPERF_PORT, omit_s: float = 0.0) -> dict:
    """One iperf3 TCP run src -> dst; returns goodput (receiver) and retransmits."""
    server = net.popen(dst, ["iperf3", "-s", "-1", "-p", str(port)])
    try:
        for attempt in range(20):
            out = src.node.cmd(
                f"iperf3 -c {dst.ip} -p {port} -t {seconds} -P {streams} -O {omit_s} -J -C cubic"
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
        return {
            "goodput_mbps": end["sum_received"]["bits_per_second"] / 1e6,
            "sent_mbps": end["sum_sent"]["bits_per_second"] / 1e6,
            "retransmits": end["sum_sent"].get("retransmits", 0),
        }
    finally:
        if server.poll() is None:
            server.terminate()
        server.wait(5)


def one_way_delays(net: Network, src: HostInfo, dst: HostInfo, count: int = 50, interval_s: float = 0.01,
                   port: int = 5301) -> list[float]:
    """One-way delays (ms) src -> dst, from the clock all namespaces share."""
    return _probe(net, src, dst, ["recv", str(port), str(count)],
                  ["send", dst.ip, str(port), str(count), str(interval_s)], 2.0 + count * interval_s + 2.0)


def _probe(net: Network, src: HostInfo, dst: HostInfo, recv_args: list[str], send_args: list[str],
           timeout: float) -> list[float]:
    """Run ``testbed.owd``'s receiver on dst and its sender on src; the receiver's figures."""
    import subprocess
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
    return [float(x) for x in stdout.split()]


def message_delays(net: Network, src: HostInfo, dst: HostInfo, size: int = 131072, count: int = 30,
                   interval_s: float = 0.05, port: int = 5302) -> list[float]:
    """One-way times (ms) of ``count`` TCP messages of ``size`` bytes src -> dst, each sent
    after ``interval_s`` of idle: delay plus serialisation at the link's rate."""
    return _probe(net, src, dst, ["msg-recv", str(port), str(count), str(size)],
                  ["msg-send", dst.ip, str(port), str(count), str(size), str(interval_s)],
                  2.0 + count * (interval_s + 0.5))


def configured_rtt_ms(net: Network, src: str, dst: str) -> float:
    return net.topo.one_way_delay_ms(src, dst) + net.topo.one_way_delay_ms(dst, src)


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
    # leave TCP's slow start out of the goodput figure: ~10 round trips, 0.5-2 s
    perf = iperf3(net, a, b, seconds=seconds, omit_s=min(2.0, max(0.5, conf / 100.0)))
    return LinkReport(
        src=src,
        dst=dst,
        rtt_ms_configured=round(conf, 3),
        rtt_ms_measured=round(rtt_ms, 3),
        rtt_error_ms=round(rtt_ms - conf, 3),
        rate_mbps_configured=params.rate_mbps,
        goodput_mbps_measured=round(perf["goodput_mbps"], 2),
        goodput_ratio=round(perf["goodput_mbps"] / params.rate_mbps, 4),
        retransmits=perf["retransmits"],
        loss_configured=params.loss,
    )


def measure_all(net: Network, seconds: float = 3.0, pings: int = 20,
                progress: Callable[[str], None] | None = None) -> list[LinkReport]:
    """Every WAN direction: min RTT of its link (one ping series per link) and goodput."""
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
