"""Measure a running network against its spec: RTT with ping, one-way delay and goodput
with probes of its own (``owd.py``, ``goodput.py``), iperf3 for the tests' plain flows.

How it fits: ``testbed fidelity`` builds a network (``Network``, or ``ClusterNetwork`` across
machines: anything that satisfies ``surface.NetworkSurface``), calls ``measure_all`` and prints
configured against measured; every ``testbed run`` calls ``check_wan`` before training (a
second or two) and records it in metrics.json; the tests call the single-measurement
helpers on networks they build.  Measurements run one at a time (the machine has two
cores; ``parallel`` runs the links' goodput flows at once, the delays still one at a time)
from the first host of the source DC to the first host of the destination DC, so each
crosses exactly the WAN link under test.

Per direction: the round trip (min of a ping series) against the configured round trip and,
where the topology names a measured source (``source_rtt_ms``), against that; the one-way
delay (``owd.py``: every namespace reads the same clock) against the direction's
``delay_ms``; and a steady-state goodput.  Goodput leaves the flow's slow start out (12
round trips, at least 1 s, cut from the receiver's own half-second intervals) and measures
for at least 20 round trips, so a 262 ms link is measured as long as it needs; the flow's
window is clamped by its receiver a little above the link's bandwidth-delay product
(``measuring_window`` says why, ``goodput.py`` how), so it fills the link without
overflowing its queue.  Tolerances
(``within_tolerance``): RTT within max(0.5 ms, 2%), goodput 90-101% of the rate.

A lossy direction (random ``loss``) also reports the goodput its one measuring flow can expect
(``expected_goodput_mbps``: the payload rate, the flow's window over the round trip, and what
one CUBIC connection sustains under that loss and round trip, whichever is least; the last is
``tcpmodel.cubic_goodput``, Linux's CUBIC driven by the random drops, for a measurement of the
length this one has after its omitted start) and the spread of that measurement (5th-95th
percentile, and how often it lands within 10% of the mean).  Its goodput is not judged
against the rate; with ``judge_loss`` it is judged against that expectation, within 10%
(``goodput_under_loss_ok``), and measured for at least 20 loss epochs
(``steady_state_seconds``), since a CUBIC flow's rate is an average over the cycles between
its losses, and then for as long as the model says a measurement needs to land within 10% of
its mean 95% of the time (``confident_seconds``, 40 minutes at most by default).  At 0.05%
loss on 150-260 ms round trips a 90 s measurement spreads +-30% (5th-95th percentile): the
10% bar would be met in about two directions in five; 10-20 minutes meet it in 19 of 20
(docs/benchmarks.md).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

from testbed.net import tcpmodel
from testbed.net.surface import HostInfo, NetworkError, NetworkSurface
from testbed.spec.topology import Direction, default_queue_bytes

RTT_TOLERANCE_MS = 0.5
RTT_TOLERANCE_FRAC = 0.02
GOODPUT_RANGE = (0.90, 1.01)
LOSS_GOODPUT_TOLERANCE = 0.10  # judge_loss: a lossy direction's goodput within 10% of what TCP can expect
LOSS_EPOCHS = 20  # judge_loss: measure a lossy direction for at least this many loss epochs ...
LOSS_MEASURE_MAX_S = 120.0  # ... or this long (seconds on the wire), whichever is shorter; then:
LOSS_CONFIDENCE = 0.95  # judge_loss: long enough that a measurement lands within 10% of the mean this often ...
LOSS_MEASURE_CONFIDENT_MAX_S = 2400.0  # ... by the model (tcpmodel), or this long at most (emulated seconds)
LOSS_SECONDS_LADDER = (300.0, 600.0, 900.0, 1200.0, 1800.0, 2400.0, 3600.0, 5400.0, 7200.0)
_PARALLEL_PORT = 5310  # measure_all(parallel=True): direction i's goodput flow on this port + i
_PING_RTT = re.compile(r"time=([0-9.]+) ms")
_IPERF_PORT = 5201
_INTERVAL_S = 0.5


def rtt_tolerance_ms(configured_ms: float) -> float:
    return max(RTT_TOLERANCE_MS, RTT_TOLERANCE_FRAC * configured_ms)


def delay_estimate(samples: list[float], jittery: bool) -> float:
    """The delay a series of probes measured, to set against the configured one: their minimum
    (the host's own scheduling only ever adds), or, where the path has jitter (symmetric about
    the configured delay: uniform in the delay line and in netem), their median, since the
    minimum of N jittered probes sits near the delay less the jitter (262 ms with +-4 ms each
    way read 255 ms)."""
    return statistics.median(samples) if jittery else min(samples)


def _jittery(net: NetworkSurface, src: str, dst: str, both_ways: bool) -> bool:
    """Whether a probe from src to dst (and back, ``both_ways``) crosses a jittery hop."""
    hops = net.topo.path(src, dst)
    pairs = list(zip(hops, hops[1:]))
    if both_ways:
        back = net.topo.path(dst, src)
        pairs += list(zip(back, back[1:]))
    return any(net.topo.direction(a, b).jitter_ms > 0 for a, b in pairs)


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
    window_bytes: int | None = None  # the goodput flow's window clamp (``measuring_window``)
    time_dilation: float = 1.0  # k: every figure above is in emulated terms (wall-clock times / k, rates x k)
    # what the measuring flow can expect under the direction's loss (``expected_goodput_mbps``;
    # without loss, the payload rate) and what one connection sustains under it (None: no loss)
    goodput_mbps_expected: float | None = None
    loss_cap_mbps_per_connection: float | None = None
    # the 5th-95th percentiles of what a measurement this long reads under the loss
    # (``tcpmodel.cubic_goodput``'s spread; None: no loss), and how often it lands within 10%
    goodput_mbps_expected_low: float | None = None
    goodput_mbps_expected_high: float | None = None
    goodput_expected_within_tolerance: float | None = None

    def to_dict(self, min_goodput: float = GOODPUT_RANGE[0], judge_loss: bool = False) -> dict:
        """Its fields, and ``ok``: within tolerance (``testbed fidelity`` exits 1 unless every one is)."""
        return asdict(self) | {"ok": self.within_tolerance(min_goodput, judge_loss)}

    def within_tolerance(self, min_goodput: float = GOODPUT_RANGE[0], judge_loss: bool = False) -> bool:
        """RTT within max(0.5 ms, 2%) of the configured round trip, goodput from ``min_goodput``
        (90% unless asked for more) to 101% of the rate.  A lossy link's goodput is what TCP
        makes of the loss: not judged, or (``judge_loss``) judged against what TCP can expect
        there (``goodput_under_loss_ok``)."""
        rtt_ok = abs(self.rtt_error_ms) <= rtt_tolerance_ms(self.rtt_ms_configured)
        if self.loss_configured > 0:
            rate_ok = not judge_loss or goodput_under_loss_ok(self.goodput_mbps_measured, self.goodput_mbps_expected)
        else:
            rate_ok = min_goodput <= self.goodput_ratio <= GOODPUT_RANGE[1]
        return rtt_ok and rate_ok


def goodput_under_loss_ok(measured_mbps: float, expected_mbps: float | None,
                          tolerance: float = LOSS_GOODPUT_TOLERANCE) -> bool:
    """A lossy direction's goodput within ``tolerance`` (10%) of what its flow can expect
    (``expected_goodput_mbps``), either way; no expectation, no verdict (not ok)."""
    if expected_mbps is None or expected_mbps <= 0:
        return False
    return abs(measured_mbps / expected_mbps - 1.0) <= tolerance


def expected_goodput_mbps(params: Direction, rtt_ms: float, back: Direction | None = None, streams: int = 1,
                          window_bytes: int | None = None, seconds: float | None = None,
                          omit_s: float = 0.0) -> float:
    """The goodput (Mbit/s of payload) that ``streams`` bulk CUBIC flows can expect across the
    direction ``params`` on a path of round trip ``rtt_ms``: the link's payload rate, the flows'
    windows over the round trip and ``streams`` x what one connection sustains under the
    direction's random loss (``tcpmodel.expected_goodput``: the loss-driven CUBIC window model,
    alone on the link and its queue), whichever is least; ``seconds``: the mean of a
    measurement that long, ``omit_s`` after the flow's start (None: the long run).  The RTO's
    rttvar is half the jitter of the round trip (``back``: the reverse direction, for its
    jitter).  All in one time base (emulated, under time dilation: the hosts' rto_min is
    dilated too)."""
    rate = params.rate_mbps * 1e6 / 8 * tcpmodel.PAYLOAD_FRACTION
    got = tcpmodel.expected_goodput(rate, params.loss, rtt_ms / 1000.0, connections=streams,
                                    window_bytes=window_bytes, rttvar_s=_rttvar_s(params, back),
                                    queue_bytes=default_queue_bytes(params, rtt_ms), seconds=seconds, omit_s=omit_s)
    return got * 8 / 1e6


def expected_goodput_spread(params: Direction, rtt_ms: float, back: Direction | None = None,
                            window_bytes: int | None = None, seconds: float | None = None,
                            omit_s: float = 0.0) -> tcpmodel.GoodputEstimate:
    """One measuring flow's ``tcpmodel.GoodputEstimate`` under the direction's loss (bytes/s):
    the mean, and the spread of what a measurement of ``seconds`` reads."""
    rate = params.rate_mbps * 1e6 / 8 * tcpmodel.PAYLOAD_FRACTION
    return tcpmodel.expected_goodput_estimate(rate, params.loss, rtt_ms / 1000.0, window_bytes=window_bytes,
                                              rttvar_s=_rttvar_s(params, back),
                                              queue_bytes=default_queue_bytes(params, rtt_ms),
                                              seconds=seconds, omit_s=omit_s)


def _rttvar_s(params: Direction, back: Direction | None) -> float:
    jitter_ms = params.jitter_ms + (back.jitter_ms if back is not None else params.jitter_ms)
    return jitter_ms / 2000.0


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


def iperf3(net: NetworkSurface, src: HostInfo, dst: HostInfo, seconds: float = 3.0, streams: int = 1,
           port: int = _IPERF_PORT, omit_s: float = 0.0, congestion: str = "cubic") -> dict:
    """One iperf3 TCP run src -> dst: ``omit_s`` left out, then at least ``seconds`` measured;
    returns goodput (at the receiver), retransmits (while measured) and the seconds measured.

    Goodput is what the receiver got in its own half-second intervals once ``omit_s`` had
    passed: the client's end-of-test figure counts a long path's queue and in-flight data,
    which arrive after the sender stopped, against the sender's duration (measured: 1.012 of
    the rate on a 262 ms link, where the receiver's intervals give 0.956, the payload
    fraction).  The omitted time is cut here, not by iperf3's ``-O``: iperf3 3.12's server
    restarts its interval clock where omitting ends and, in about one run in three, reports
    that interval once more as two seconds holding one second's bytes, or ends its omitted
    period a second early (measured: 0.72 of the rate on a 67 ms link, 1.02 on a 148 ms link,
    where the intervals themselves read 0.956)."""
    server = net.popen(dst, ["iperf3", "-s", "-1", "-J", "-i", str(_INTERVAL_S), "-p", str(port)],
                       stdout=subprocess.DEVNULL)
    if omit_s:  # the cut falls on an interval's start
        omit_s = math.ceil(omit_s / _INTERVAL_S - 1e-9) * _INTERVAL_S
    # two intervals more: the server's clock starts a round trip or two after the client's
    # (measured: 0.52 s on a 238 ms link), and its last interval is a partial one
    total = omit_s + seconds + (2 * _INTERVAL_S if omit_s else 0.0)
    try:
        for attempt in range(20):
            out = src.node.cmd(
                f"iperf3 -c {dst.ip} -p {port} -t {total:.3f} -i {_INTERVAL_S} -P {streams} -J -C {congestion} "
                "--get-server-output"
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
        steady = _after([i["sum"] for i in data.get("server_output_json", {}).get("intervals", [])], omit_s)
        seconds_in = sum(i["seconds"] for i in steady)
        goodput = (sum(i["bytes"] for i in steady) * 8 / seconds_in if seconds_in > 0
                   else end["sum_received"]["bits_per_second"])
        sent = _after([i["sum"] for i in data.get("intervals", [])], omit_s)
        retransmits = (sum(i.get("retransmits", 0) for i in sent) if omit_s
                       else end["sum_sent"].get("retransmits", 0))
        return {
            "goodput_mbps": goodput / 1e6,
            "sent_mbps": end["sum_sent"]["bits_per_second"] / 1e6,
            "retransmits": retransmits,
            "seconds": seconds_in if seconds_in > 0 else total,
            # the receiver's goodput in each whole interval measured (a stall of the machine
            # shows as a dip in a few; the shaper's rate caps every one)
            "intervals_mbps": [i["bytes"] * 8 / i["seconds"] / 1e6 for i in steady
                               if i["seconds"] >= 0.9 * _INTERVAL_S],
        }
    finally:
        if server.poll() is None:
            server.terminate()
        server.wait(5)


def measuring_window(params: Direction, rtt_ms: float) -> int:
    """The window (bytes) ``measure_link`` clamps a direction's goodput flow to: its
    bandwidth-delay product plus a quarter of its queue (at most a quarter BDP).

    A flow whose window stays between one BDP and one BDP plus the queue keeps the link busy
    and never overflows the queue: no loss, no recovery, no congestion-control artefact in
    the figure.  Without the cap, cubic overshoots a one-BDP queue every few seconds and the
    data held behind each hole reaches the receiver at once (half-second intervals read 0.65
    and 1.26 of the rate in turn, a window of a few seconds 0.95-1.01 depending on where it
    falls), and BBR drains the path for 200 ms plus a round trip every 10 s (ProbeRTT: 0.87
    of the rate over a 6 s window on a 262 ms link, in about one direction in six, where
    every other interval read 0.955).  Clamped at 1.25 BDP, every half-second interval read
    0.952-0.957 from 1.5 s on at 148 ms, 0 retransmits (2026-12-05).  The clamp is the
    receiver's ``TCP_WINDOW_CLAMP``, exact in bytes on every path (``goodput.py`` says why
    socket buffers are not).  The training's own connections keep the hosts' settings."""
    bdp = params.rate_mbps * 1e6 / 8 * rtt_ms / 1000.0
    queue = default_queue_bytes(params, rtt_ms)
    return max(int(bdp + min(queue, bdp) / 4), 4096)


def steady_goodput(net: NetworkSurface, src: HostInfo, dst: HostInfo, seconds: float, omit_s: float,
                   clamp_bytes: int, port: int = 5303) -> dict:
    """One bulk TCP flow src -> dst with its window clamped at ``clamp_bytes`` by the receiver
    (``goodput.py``): ``omit_s`` left out, then at least ``seconds`` measured; returns the
    goodput (Mbit/s, from the receiver's own intervals), the sender's retransmissions while
    measured and the seconds measured, as ``iperf3`` does."""
    return _GoodputFlow(net, src, dst, seconds, omit_s, clamp_bytes, port).result()


class _GoodputFlow:
    """A ``steady_goodput`` flow started (its receiver listening, its sender running), so that
    several can run at once (``measure_all(parallel=True)``); ``result`` waits for it.  Both
    ends are processes of their own (``net.popen``): no host's shell is shared between flows."""

    def __init__(self, net: NetworkSurface, src: HostInfo, dst: HostInfo, seconds: float, omit_s: float,
                 clamp_bytes: int, port: int):
        self.src, self.dst, self.omit_s = src, dst, omit_s
        total = omit_s + seconds + 2 * _INTERVAL_S  # the last interval is a partial one
        self.timeout = total + 30.0
        self.recv = net.popen(dst, [sys.executable, "-m", "testbed.net.goodput", "recv", str(port),
                                    str(int(clamp_bytes)), str(self.timeout)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.send = None
        try:
            if self.recv.stdout.readline().strip() != "listening":
                raise NetworkError(f"goodput receiver on {dst.name} did not start: {self.recv.stderr.read()[-200:]}")
            self.send = net.popen(src, [sys.executable, "-m", "testbed.net.goodput", "send", dst.ip, str(port),
                                        f"{total:.3f}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for proc in (self.send, self.recv):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()

    def result(self) -> dict:
        src, dst, omit_s = self.src, self.dst, self.omit_s
        try:
            out, _ = self.send.communicate(timeout=self.timeout + 5)
            try:
                sent = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                raise NetworkError(f"goodput flow {src.name} -> {dst.name}: {out.strip()[-200:]}") from None
            stdout, stderr = self.recv.communicate(timeout=self.timeout + 5)
            try:
                intervals = json.loads(stdout.strip().splitlines()[-1])["intervals"]
            except (ValueError, IndexError, KeyError):
                raise NetworkError(f"goodput receiver on {dst.name}: {stderr.strip()[-200:]}") from None
        finally:
            self.close()
        steady = _after([{"seconds": t, "bytes": n} for t, n in intervals[:-1]], omit_s)
        seconds_in = sum(i["seconds"] for i in steady)
        if seconds_in <= 0:
            raise NetworkError(f"goodput flow {src.name} -> {dst.name}: nothing measured after {omit_s:.1f} s")
        samples = sent["retransmits"]
        at_omit = max((r for t, r in samples if t <= omit_s), default=0)
        return {
            "goodput_mbps": sum(i["bytes"] for i in steady) * 8 / seconds_in / 1e6,
            "retransmits": samples[-1][1] - at_omit,
            "seconds": seconds_in,
        }


def _after(intervals: list[dict], omit_s: float) -> list[dict]:
    """Each interval (a dict with its ``seconds``) that began once ``omit_s`` had passed, by
    the intervals' own lengths, added up: no interval clock of iperf3's is trusted."""
    out, t = [], 0.0
    for cur in intervals:
        if t >= omit_s - 1e-3:
            out.append(cur)
        t += cur["seconds"]
    return out


def one_way_delays(net: NetworkSurface, src: HostInfo, dst: HostInfo, count: int = 50, interval_s: float = 0.01,
                   port: int = 5301) -> list[float]:
    """One-way delays (ms) src -> dst, from the clock all namespaces share, in arrival order."""
    return [d for d, _seq in one_way_probe(net, src, dst, count, interval_s, port)]


def datagram_loss(net: NetworkSurface, src: HostInfo, dst: HostInfo, count: int = 2000,
                  interval_s: float = 0.001) -> float:
    """Fraction of ``count`` datagrams src -> dst that did not arrive (one direction only;
    ``ping_loss`` sees both, and ping paces at ~10 ms here whatever its interval)."""
    return 1.0 - len(one_way_probe(net, src, dst, count, interval_s)) / count


def one_way_probe(net: NetworkSurface, src: HostInfo, dst: HostInfo, count: int = 50, interval_s: float = 0.01,
                  port: int = 5301) -> list[tuple[float, int]]:
    """(one-way delay ms, sequence number) of each datagram that arrived, in arrival order:
    the order shows whether the path reordered them.  Once datagrams arrive, a silence of
    max(2 s, 20 intervals) ends the count (with losses the last would not come)."""
    rows = _probe(net, src, dst, ["recv", str(port), str(count)],
                  ["send", dst.ip, str(port), str(count), str(interval_s)], 2.0 + count * interval_s + 2.0,
                  recv_tail=(str(max(2.0, 20 * interval_s)),))
    return [(r[0], int(r[1])) for r in rows]


def _probe(net: NetworkSurface, src: HostInfo, dst: HostInfo, recv_args: list[str], send_args: list[str],
           timeout: float, recv_tail: tuple[str, ...] = ()) -> list[list]:
    """Run ``testbed.net.owd``'s receiver on dst and its sender on src; the receiver's lines, split,
    each led by its delay in ms on one timeline (``net.owd_correction_ms``: across machines the
    sender's and the receiver's clocks differ)."""
    recv = net.popen(dst, [sys.executable, "-m", "testbed.net.owd", *recv_args, str(timeout), *recv_tail],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if recv.stdout.readline().strip() != "listening":
        raise NetworkError(f"one-way delay receiver on {dst.name} did not start: {recv.stderr.read()[-200:]}")
    src.node.cmd(" ".join([sys.executable, "-m", "testbed.net.owd", *send_args]))
    try:
        stdout, _ = recv.communicate(timeout=timeout + 2)
    except subprocess.TimeoutExpired:
        recv.kill()
        stdout, _ = recv.communicate()
    skew = net.owd_correction_ms(src, dst)
    rows = [line.split() for line in stdout.splitlines() if line.strip()]
    return [[float(r[0]) - skew, *r[1:]] for r in rows]


def message_delays(net: NetworkSurface, src: HostInfo, dst: HostInfo, size: int = 131072, count: int = 30,
                   interval_s: float = 0.05, port: int = 5302) -> list[float]:
    """One-way times (ms) of ``count`` TCP messages of ``size`` bytes src -> dst, each sent
    after ``interval_s`` of idle: delay plus serialisation at the link's rate."""
    rows = _probe(net, src, dst, ["msg-recv", str(port), str(count), str(size)],
                  ["msg-send", dst.ip, str(port), str(count), str(size), str(interval_s)],
                  2.0 + count * (interval_s + 0.5))
    return [r[0] for r in rows]


def configured_rtt_ms(net: NetworkSurface, src: str, dst: str) -> float:
    return net.topo.rtt_ms(src, dst)


def steady_state_seconds(rtt_ms: float, seconds: float, loss: float = 0.0,
                         expected_mbps: float | None = None) -> tuple[float, float]:
    """(omit, measure) for a goodput flow on a path of this round trip.  A flow clamped at
    1.25 BDP (``measuring_window``) never overshoots the queue, so it is in steady state once
    slow start has reached the clamp: about 8 round trips from 10 segments (measured: every
    half-second interval 0.956 from 2.0 s on at 262 ms, 7.6 round trips).  So 12 round trips
    (at least 1 s) are left out, then at least 20 measured.  (An unclamped cubic flow
    overshoots a one-BDP queue in slow start and recovers for up to ~30 round trips.)

    Under random ``loss`` with the flow's ``expected_mbps`` given (``judge_loss``), at least
    ``LOSS_EPOCHS`` loss epochs (the time between two loss events, the emulator dropping
    GSO packets of at least ``tcpmodel.MIN_DROP_SEGMENTS`` segments: 2 / (loss x segments a
    second), 4.7 s at 0.05% and 9.9 Mbit/s) and at most ``LOSS_MEASURE_MAX_S``: a CUBIC flow's
    rate is its average over those cycles, and one cycle's is not that average.  That is not
    long enough to read the expectation within 10%: ``tcpmodel.cubic_goodput``'s spread for
    the measurement is reported beside it (docs/benchmarks.md: about 20 minutes would be)."""
    rtt = rtt_ms / 1000.0
    omit, measure = max(1.0, 12 * rtt), max(seconds, 20 * rtt)
    if loss > 0 and expected_mbps:
        epoch = tcpmodel.MIN_DROP_SEGMENTS * tcpmodel.MSS * 8 / (expected_mbps * 1e6) / loss
        measure = max(measure, min(LOSS_EPOCHS * epoch, LOSS_MEASURE_MAX_S))
    return omit, measure


def confident_seconds(within_at: Callable[[float], float], start: float, maximum: float,
                      confidence: float = LOSS_CONFIDENCE) -> float:
    """The shortest measurement, from ``start`` up to ``maximum`` seconds (``LOSS_SECONDS_LADDER``'s
    lengths between them), at which ``within_at(seconds)``, how often a measurement that long
    lands within 10% of what it expects, reaches ``confidence``; ``maximum`` where none does
    (never less than ``start``).  At 0.05% loss the model asks 600-1200 s of a 148-262 ms
    round trip (docs/benchmarks.md)."""
    lengths = [start] + [x for x in LOSS_SECONDS_LADDER if start < x < maximum] + [max(start, maximum)]
    for length in lengths:
        if within_at(length) >= confidence:
            return length
    return lengths[-1]


@dataclass
class _Direction:
    """What ``measure_link`` knows of a direction before its goodput flow: the delays measured,
    the flow's window and length, and what it can expect."""

    src: str
    dst: str
    conf: float
    rtt_ms: float
    owds: list[float]
    params: Direction
    window: int
    omit: float
    measure: float
    k: float
    expected: float
    spread: tcpmodel.GoodputEstimate | None
    per_connection: float


def _plan_direction(net: NetworkSurface, src: str, dst: str, seconds: float, pings: int, rtt_ms: float | None,
                    judge_loss: bool, max_loss_seconds: float) -> _Direction:
    a, b = net.host(src), net.host(dst)
    params = net.link(src, dst).params
    if rtt_ms is None:
        rtts = ping(a, b.ip, count=pings)
        if not rtts:
            raise NetworkError(f"{src} -> {dst}: no ping reply")
        rtt_ms = delay_estimate(rtts, _jittery(net, src, dst, both_ways=True))
    conf = configured_rtt_ms(net, src, dst)
    owds = one_way_delays(net, a, b, count=20, interval_s=0.01)
    k = _dilation(net)  # the wire's figures are dilated; ``seconds`` are emulated
    window = measuring_window(params, conf)
    # what the flow can expect, in emulated terms (the wire's rate x k, its round trip and jitter / k)
    emulated = params.model_copy(update={"rate_mbps": params.rate_mbps * k, "jitter_ms": params.jitter_ms / k})
    back = net.topo.direction(dst, src)
    back = back.model_copy(update={"jitter_ms": back.jitter_ms / k})
    long_run = expected_goodput_mbps(emulated, conf / k, back, streams=1, window_bytes=window)
    omit, measure = steady_state_seconds(conf, seconds * k, params.loss if judge_loss else 0.0, long_run / k)

    def spread_for(seconds: float) -> tcpmodel.GoodputEstimate:  # (emulated seconds)
        return expected_goodput_spread(emulated, conf / k, back, window_bytes=window, seconds=seconds,
                                       omit_s=omit / k)

    if judge_loss and params.loss > 0:  # long enough that a right emulator reads within 10%, mostly
        measure = k * confident_seconds(lambda s: spread_for(s).within_10pct, measure / k, max_loss_seconds)
    # what this measurement (its length, after its omitted start) reads under the loss: mean and spread
    spread = spread_for(measure / k) if params.loss > 0 else None
    expected = long_run if spread is None else spread.mean * 8 / 1e6
    per_connection = tcpmodel.loss_limited_rate(params.loss, conf / k / 1000.0, rttvar_s=_rttvar_s(emulated, back),
                                                link_rate=emulated.rate_mbps * 1e6 / 8 * tcpmodel.PAYLOAD_FRACTION,
                                                queue_bytes=default_queue_bytes(emulated, conf / k))
    return _Direction(src, dst, conf, rtt_ms, owds, params, window, omit, measure, k, expected, spread,
                      per_connection)


def _report(net: NetworkSurface, d: _Direction, perf: dict) -> LinkReport:
    source = net.topo.source_rtt_ms(d.src, d.dst)
    k, spread = d.k, d.spread
    return LinkReport(
        src=d.src,
        dst=d.dst,
        rtt_ms_configured=round(d.conf / k, 3),
        rtt_ms_measured=round(d.rtt_ms / k, 3),
        rtt_error_ms=round((d.rtt_ms - d.conf) / k, 3),
        rtt_ms_source=None if source is None else source / k,
        owd_ms_configured=round(net.topo.one_way_delay_ms(d.src, d.dst) / k, 3),
        owd_ms_measured=(round(delay_estimate(d.owds, _jittery(net, d.src, d.dst, both_ways=False)) / k, 3)
                         if d.owds else None),
        rate_mbps_configured=round(d.params.rate_mbps * k, 6),
        goodput_mbps_measured=round(perf["goodput_mbps"] * k, 2),
        goodput_ratio=round(perf["goodput_mbps"] / d.params.rate_mbps, 4),
        goodput_seconds=round(perf["seconds"] / k, 2),
        retransmits=perf["retransmits"],
        loss_configured=d.params.loss,
        window_bytes=d.window,
        time_dilation=k,
        goodput_mbps_expected=round(d.expected, 3),
        loss_cap_mbps_per_connection=None if d.params.loss <= 0 else round(d.per_connection * 8 / 1e6, 3),
        goodput_mbps_expected_low=None if spread is None else round(spread.low * 8 / 1e6, 3),
        goodput_mbps_expected_high=None if spread is None else round(spread.high * 8 / 1e6, 3),
        goodput_expected_within_tolerance=None if spread is None else round(spread.within_10pct, 3),
    )


def measure_link(net: NetworkSurface, src: str, dst: str, seconds: float = 3.0, pings: int = 20,
                 rtt_ms: float | None = None, judge_loss: bool = False,
                 max_loss_seconds: float = LOSS_MEASURE_CONFIDENT_MAX_S) -> LinkReport:
    """One direction's report; ``judge_loss``: a lossy direction is measured for long enough to
    be judged against what TCP can expect under its loss: 20 loss epochs (``steady_state_seconds``)
    and then as long as the model says a measurement needs to land within 10% of its mean with
    probability ``LOSS_CONFIDENCE`` (``confident_seconds``), ``max_loss_seconds`` at most."""
    d = _plan_direction(net, src, dst, seconds, pings, rtt_ms, judge_loss, max_loss_seconds)
    perf = steady_goodput(net, net.host(src), net.host(dst), seconds=d.measure, omit_s=d.omit, clamp_bytes=d.window)
    return _report(net, d, perf)


def _dilation(net: NetworkSurface) -> float:
    """The network's time dilation k (1 for a network without one)."""
    return float(getattr(net, "time_dilation", 1.0) or 1.0)


def measure_all(net: NetworkSurface, seconds: float = 3.0, pings: int = 20,
                progress: Callable[[str], None] | None = None, judge_loss: bool = False,
                parallel: bool = False, both_ways: bool = False,
                max_loss_seconds: float = LOSS_MEASURE_CONFIDENT_MAX_S) -> list[LinkReport]:
    """Every WAN direction: the RTT of its link (one ping series per link; ``delay_estimate``:
    the minimum, the median where jittery), one-way delay and steady-state goodput
    (``judge_loss``: see ``measure_link``).

    ``parallel``: the delays are measured one direction at a time as ever, then the goodput
    flows run at once, each on its own port: every link's one direction, then every link's
    other (two waves), so a long measurement (``judge_loss``) takes twice its longest
    direction's time instead of the sum of all.  ``both_ways``: one wave, both directions of
    a link at once; each flow's ACKs then queue behind the other direction's data, which
    costs a flow that fills its link its rate (two DCs at 20 Mbit/s, both ways at once: 0.71
    of the rate), and not one that loss holds well below it (aws-longhaul3-lossy's flows at
    6 of 32-58 Mbit/s read 0.99-1.10 of their expectation so)."""
    in_turn: list[LinkReport] = []  # one direction after another
    plans: list[_Direction] = []  # parallel: the directions whose flows run at once, below
    rtt_of_pair: dict[frozenset, float] = {}
    for wd in net.links():
        if progress:
            progress(f"{wd.src} -> {wd.dst}" + (" (delays)" if parallel else ""))
        pair = frozenset((wd.src, wd.dst))
        if pair not in rtt_of_pair:
            rtts = ping(net.host(wd.src), net.host(wd.dst).ip, count=pings)
            if not rtts:
                raise NetworkError(f"{wd.src} -> {wd.dst}: no ping reply")
            rtt_of_pair[pair] = delay_estimate(rtts, _jittery(net, wd.src, wd.dst, both_ways=True))
        if parallel:
            plans.append(_plan_direction(net, wd.src, wd.dst, seconds, pings, rtt_of_pair[pair], judge_loss,
                                         max_loss_seconds))
        else:
            in_turn.append(measure_link(net, wd.src, wd.dst, seconds=seconds, pings=pings, rtt_ms=rtt_of_pair[pair],
                                        judge_loss=judge_loss, max_loss_seconds=max_loss_seconds))
    if not parallel:
        return in_turn
    first: set[frozenset] = set()
    waves: list[list[int]] = [[], []]
    for i, d in enumerate(plans):
        pair = frozenset((d.src, d.dst))
        waves[0 if both_ways or pair not in first else 1].append(i)
        first.add(pair)
    reports: dict[int, LinkReport] = {}
    for wave in filter(None, waves):
        flows: list[_GoodputFlow] = []
        try:
            for i in wave:
                d = plans[i]
                flows.append(_GoodputFlow(net, net.host(d.src), net.host(d.dst), d.measure, d.omit, d.window,
                                          _PARALLEL_PORT + i))
            longest = max(plans[i].omit + plans[i].measure for i in wave) / _dilation(net)
            if progress:
                until = time.strftime("%H:%M:%S", time.localtime(time.time() + longest))
                progress(f"{len(flows)} goodput flows at once, {longest:.0f} s (until {until})")
            for i, flow in zip(wave, flows):
                reports[i] = _report(net, plans[i], flow.result())
        finally:
            for flow in flows:
                flow.close()
    return [reports[i] for i in range(len(plans))]


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


def check_wan(net: NetworkSurface, pings: int = 5) -> list[DirectionCheck]:
    """Per WAN direction: a short ping series from the source DC and a one-way probe (10), each
    read by ``delay_estimate`` (the minimum, the median where jittery), against the
    configuration.  A direction outside max(0.5 ms, 2%) on the round trip, or without replies,
    is not ``ok``; the caller warns.  About 0.2 s + 2 RTT a direction."""
    out = []
    k = _dilation(net)  # judged, and reported, in emulated terms
    for wd in net.links():
        a, b = net.host(wd.src), net.host(wd.dst)
        conf = configured_rtt_ms(net, wd.src, wd.dst) / k
        owd_conf = net.topo.one_way_delay_ms(wd.src, wd.dst) / k
        jittery = _jittery(net, wd.src, wd.dst, both_ways=True), _jittery(net, wd.src, wd.dst, both_ways=False)
        # a median of jittered probes wanders: 4x the probes keep it well inside the tolerance
        # (+-4 ms each way: the median of 20 round trips within ~0.9 ms, of 40 one-way probes ~0.5 ms)
        rtts = ping(a, b.ip, count=pings * (4 if jittery[0] else 1), interval_s=0.01)
        owds = one_way_delays(net, a, b, count=40 if jittery[1] else 10, interval_s=0.005)
        rtt = delay_estimate(rtts, jittery[0]) / k if rtts else None
        owd = delay_estimate(owds, jittery[1]) / k if owds else None
        source = net.topo.source_rtt_ms(wd.src, wd.dst)
        problems = []
        if rtt is None:
            problems.append("no ping reply")
        elif abs(rtt - conf) > rtt_tolerance_ms(conf):
            problems.append(f"RTT {rtt:.2f} ms against {conf:.2f} configured")
        if owd is not None and abs(owd - owd_conf) > rtt_tolerance_ms(owd_conf):
            problems.append(f"one-way {owd:.2f} ms against {owd_conf:.2f} configured")
        out.append(DirectionCheck(wd.src, wd.dst, round(conf, 3), None if rtt is None else round(rtt, 3),
                                  round(owd_conf, 3), None if owd is None else round(owd, 3),
                                  None if source is None else source / k, not problems, "; ".join(problems)))
    return out
