"""Fidelity of one WAN link, on every delay backend this kernel offers.

Tolerances are those of the WAN-emulator issue: min RTT within max(0.5 ms, 3%) of the
configured RTT; goodput 90-101% of the rate; 5% loss measures 3-7% over 2,000 packets.
A message after an idle spell pays its serialisation at the rate (no line-speed burst).
The netem variants run in the netem VM on a kernel without netem (``tests/netem_vm.py``);
under its software emulation delays may read up to ``delay_slack_ms()`` high and links run at
``link_rate()`` (conftest.py says why and how much).
"""

from __future__ import annotations

import statistics
import sys

import pytest

from conftest import delay_slack_ms, emulation, link_rate, two_dcs
from testbed.net.fidelity import datagram_loss, iperf3, message_delays, one_way_delays, one_way_probe, ping, ping_loss
from testbed.net.network import Network
from testbed.sim.build import PAYLOAD_FRACTION

pytestmark = [pytest.mark.network, pytest.mark.fidelity]


def _rtt_tolerance(rtt_ms: float) -> float:
    return max(0.5, 0.03 * rtt_ms)


# the netem VM runs the middle delay only (its 5 and 50 ms variants are the full suite's; tun runs all three)
@pytest.mark.parametrize("delay_ms", [pytest.param(5, marks=pytest.mark.slow_on_netem), 25,
                                      pytest.param(50, marks=pytest.mark.slow_on_netem)])
def test_min_rtt_matches_configured_delay(delay_backend, delay_ms, caps):
    with Network(two_dcs(delay_ms=delay_ms), delay_backend=delay_backend, caps=caps) as net:
        rtts = ping(net.host("east"), net.host("west").ip, count=30, interval_s=0.02)
    assert len(rtts) >= 25
    tol = _rtt_tolerance(2 * delay_ms)
    assert -tol <= min(rtts) - 2 * delay_ms <= tol + delay_slack_ms(), rtts


def _shaped(perf: dict, rate: float) -> float:
    """What a bulk TCP flow says of the shaper: outside the TCG guest, the upper quartile of
    the receiver's half-second intervals over the rate; a stall of the machine (CPU steal)
    dips a few intervals, the shaper caps every one.  In the guest, the mean."""
    if emulation() == "tcg":
        return perf["goodput_mbps"] / rate
    iv = sorted(perf["intervals_mbps"])
    assert len(iv) >= 4, perf
    return iv[int(0.75 * (len(iv) - 1))] / rate


def _goodput_band() -> tuple[float, float]:
    """Around the payload fraction (1448 of every 1514 bytes on the wire, 0.956), still failing
    HTB at 0.95 (0.908) or 1.10 (1.05) of its rate.  The intervals' upper quartile read
    0.9568-0.9573 alone on a quiet machine, but 0.9376-0.942 on this machine the same evening
    under CPU steal (the delay line dropped: 13-38 retransmissions), so the band spans what was
    measured: 0.926-0.968, not centred on 0.956.  In the TCG guest (scaled-down links, software
    emulation) the old band on the mean stays: not re-measured."""
    if emulation() == "tcg":
        return 0.90, 1.01
    return 0.926, PAYLOAD_FRACTION + 0.012


def test_goodput_of_100_mbit_link(delay_backend, caps):
    rate = link_rate(100)
    with Network(two_dcs(delay_ms=10, rate_mbps=rate), delay_backend=delay_backend, caps=caps) as net:
        perf = iperf3(net, net.host("east"), net.host("west"), seconds=5, omit_s=1)
    lo, hi = _goodput_band()
    assert lo <= _shaped(perf, rate) <= hi, perf


@pytest.mark.slow_on_netem
def test_a_message_after_idle_pays_its_serialisation(delay_backend, caps):
    """A 128 KiB activation on a 200 Mbit/s, 1 ms link takes delay + size / rate (6.5 ms),
    not the delay alone: the shaper's bucket must not let a message out at line speed."""
    rate = link_rate(200)
    idle_s = 0.05 * 200 / rate  # 50 ms; as much longer as the link is slower (the netem VM's TCG)
    with Network(two_dcs(delay_ms=1, rate_mbps=rate), delay_backend=delay_backend, caps=caps) as net:
        times = message_delays(net, net.host("east"), net.host("west"), size=131072, count=25, interval_s=idle_s)
    assert len(times) == 25, times
    wire = 131072 / PAYLOAD_FRACTION  # bytes on the wire: headers per 1448-byte segment
    expected_ms = 1.0 + wire * 8 / (rate * 1e6) * 1000
    ratio = statistics.median(times[5:]) / expected_ms  # the first ones open the window
    assert 0.85 <= ratio <= 1.25 + delay_slack_ms() / expected_ms, (ratio, times)


@pytest.mark.parametrize(("delay_backend", "loss_backend"),
                         [("tun", "iptables"), ("tun", "delayline"), ("netem", "netem")])
def test_five_percent_loss(delay_backend, loss_backend, caps):
    # loss on east -> west only: the echo requests see it, the replies do not
    topo = two_dcs(delay_ms=5, rate_mbps=100, loss=0.05, reverse={"loss": 0.0})
    with Network(topo, delay_backend=delay_backend, loss_backend=loss_backend, caps=caps) as net:
        if emulation() == "tcg":  # the guest's software emulation: pings, few, and the old band
            lost, (lo, hi) = ping_loss(net.host("east"), net.host("west").ip, count=2000, interval_s=0.002), (0.03, 0.07)
        else:
            # 8000 datagrams at p = 0.05: binomial sd 0.0024, so +-0.01 is four of them, and a
            # loss halved (0.025) is six below the band (2000 pings and 0.03-0.07 let it pass one
            # run in twelve; ping here paces at ~10 ms whatever its -i, so datagrams, 1 ms apart)
            lost, (lo, hi) = datagram_loss(net, net.host("east"), net.host("west"), count=8000), (0.04, 0.06)
    assert lo <= lost <= hi, lost


@pytest.mark.slow_on_netem
def test_asymmetric_link_measures_asymmetric(delay_backend, caps):
    topo = two_dcs(delay_ms=10, rate_mbps=link_rate(40), reverse={"delay_ms": 30, "rate_mbps": link_rate(80)})
    with Network(topo, delay_backend=delay_backend, caps=caps) as net:
        east, west = net.host("east"), net.host("west")
        fwd = one_way_delays(net, east, west, count=40)
        back = one_way_delays(net, west, east, count=40)
        up = iperf3(net, east, west, seconds=4, omit_s=1)["goodput_mbps"]
        down = iperf3(net, west, east, seconds=4, omit_s=1)["goodput_mbps"]
    assert len(fwd) >= 35 and len(back) >= 35
    slack = delay_slack_ms()
    assert -0.5 <= min(fwd) - 10 <= 0.5 + slack and -0.9 <= min(back) - 30 <= 0.9 + slack, (min(fwd), min(back))
    # each direction carries its own rate: the ratio of goodputs is the ratio of rates
    assert 0.9 * 2.0 <= down / up <= 1.1 * 2.0, (up, down)


def test_jitter_spreads_delay_without_reordering(delay_backend, caps):
    """Datagrams 1 ms apart on a link with 5 ms of jitter: their delays spread, but they
    arrive in the order they were sent (the delay line only stretches the gap behind a packet;
    netem times each packet after the last one queued, see shaping.py)."""
    topo = two_dcs(delay_ms=20, rate_mbps=100, jitter_ms=5)
    with Network(topo, delay_backend=delay_backend, caps=caps) as net:
        probe = one_way_probe(net, net.host("east"), net.host("west"), count=300, interval_s=0.001)
        owd = one_way_delays(net, net.host("east"), net.host("west"), count=200, interval_s=0.01)
    seqs = [seq for _d, seq in probe]
    assert len(seqs) >= 285, len(seqs)
    # netem without order keeping swapped 30 of 300 pings 2 ms apart; with it, where two CPUs
    # forward consecutive packets one may still overtake (0-1 of 300 measured in the netem VM)
    swapped = [b for a, b in zip(seqs, seqs[1:]) if b < a]
    assert len(swapped) <= (0 if delay_backend == "tun" else 3), swapped[:10]
    assert len(owd) >= 190
    # 20 +- 5 ms; the receiver is a process on a busy machine, so judge the top by its 95th
    # percentile (under TCG by the bottom: emulation adds delay, it cannot take any away)
    p95 = sorted(owd)[int(0.95 * len(owd))]
    assert 15.0 - 0.3 <= min(owd) and p95 <= 25.0 + 1.0 + delay_slack_ms(tail=True), (min(owd), p95, max(owd))
    assert statistics.pstdev(owd) >= 1.5, statistics.pstdev(owd)


@pytest.mark.slow_on_netem
def test_runtime_change_of_delay_and_rate_takes_effect(delay_backend, caps):
    fast, slow = link_rate(100), link_rate(40)
    with Network(two_dcs(delay_ms=10, rate_mbps=fast), delay_backend=delay_backend, caps=caps) as net:
        east, west = net.host("east"), net.host("west")
        link = net.link("east", "west")
        before_owd = min(one_way_delays(net, east, west, count=30))
        before = iperf3(net, east, west, seconds=3, omit_s=1)
        hosts_before = [h.node.pid for h in net.hosts()]
        link.set(delay_ms=30, rate_mbps=slow)
        after_owd = min(one_way_delays(net, east, west, count=30))
        after = iperf3(net, east, west, seconds=3, omit_s=1)
        assert [h.node.pid for h in net.hosts()] == hosts_before  # nothing was rebuilt
    slack = delay_slack_ms()
    assert -0.5 <= before_owd - 10 <= 0.5 + slack and -0.9 <= after_owd - 30 <= 0.9 + slack, (before_owd, after_owd)
    # that the change took effect, not the shaper's precision (test_goodput_of_100_mbit_link):
    # the old band, since this flow retransmits (13-22 here) and its upper quartile read
    # 0.938-0.942 against the precision band's 0.944 (2026-12-05, with and without steal); on
    # the intervals' upper quartile, not the mean: under 16-19% CPU steal the mean read 0.72-0.85
    # in a quick suite (2026-12-06), the delay line starved, not the shaper
    r0, r1 = _shaped(before, fast), _shaped(after, slow)
    assert 0.9 <= r0 <= 1.01 and 0.9 <= r1 <= 1.01, (before, after)


# the iptables variant is the full suite's: five_percent_loss[tun-iptables] keeps that backend's loss
@pytest.mark.parametrize(("delay_backend", "loss_backend"), [pytest.param("tun", "iptables", marks=pytest.mark.slow),
                                                             ("tun", "delayline")])
def test_runtime_change_of_loss_and_jitter_takes_effect(delay_backend, loss_backend, caps):
    """``link.set(loss=..)`` and ``set(jitter_ms=..)`` on a running link, measured: none of
    either before, the new loss and spread after, and the loss taken away again."""
    topo = two_dcs(delay_ms=5, rate_mbps=100, reverse={"loss": 0.0})
    with Network(topo, delay_backend=delay_backend, loss_backend=loss_backend, caps=caps) as net:
        east, west = net.host("east"), net.host("west")
        link = net.link("east", "west")
        # datagrams 1 ms apart (ping paces at ~10 ms here: 3000 took 30 s)
        lost_before = datagram_loss(net, east, west, count=500)
        spread_before = _iqr(one_way_delays(net, east, west, count=100, interval_s=0.01))
        link.set(loss=0.05, jitter_ms=4)
        lost_during = datagram_loss(net, east, west, count=2000)
        owd = one_way_delays(net, east, west, count=200, interval_s=0.01)
        link.set(loss=0.0, jitter_ms=0)
        lost_after = datagram_loss(net, east, west, count=500)
    assert lost_before == 0 and lost_after == 0, (lost_before, lost_after)
    # 2000 at p = 0.05: binomial sd 0.0049, so +-0.02 is four of them (measured 0.044-0.060 in
    # six runs with pings, 2026-12-05)
    assert 0.03 <= lost_during <= 0.07, lost_during
    # 5 +- 4 ms uniform: interquartile range 4 ms, and that of 200 draws varies by ~0.3 ms, so
    # +-1 ms is three of those.  The range between quartiles, not the standard deviation: the
    # receiver's own delays (a process on a machine with CPU steal) are a tail of outliers,
    # which moved the deviation with no jitter from 0.1 to 0.9 ms and with jitter to 2.79
    # against a true 2.31 in one full suite
    assert spread_before < 1.0 and 3.0 <= _iqr(owd) <= 5.0, (spread_before, _iqr(owd))
    assert 1.0 - 0.3 <= min(owd) and sorted(owd)[int(0.95 * len(owd))] <= 9.0 + 1.0 + delay_slack_ms(tail=True), owd


def _iqr(values: list[float]) -> float:
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def test_bad_runtime_change_is_refused_and_leaves_link_as_it_was(caps):
    with Network(two_dcs(delay_ms=10, rate_mbps=100), caps=caps) as net:
        link = net.link("east", "west")
        from testbed.net.network import NetworkError

        with pytest.raises(NetworkError, match="rate_mbps") as err:
            link.set(rate_mbps=-5)
        assert str(err.value) == "east->west: rate_mbps: Input should be greater than 0"
        assert link.params.rate_mbps == 100


_HOLDS = r"""
import json, socket, struct, sys, time
lane, seconds = sys.argv[1], float(sys.argv[2])
s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(3))
s.bind((lane, 3))
s.setsockopt(socket.SOL_SOCKET, 35, 1)  # SO_TIMESTAMPNS: when the kernel saw each packet
s.settimeout(0.2)
print("ready", flush=True)
seen, end = [], time.monotonic() + seconds
while time.monotonic() < end:
    try:
        data, anc, _f, addr = s.recvmsg(64, 64)
    except socket.timeout:
        continue
    if len(data) >= 28 and data[9] == 1 and data[20] == 8:  # ICMP echo requests only
        sec, nsec = struct.unpack("qq", anc[0][2][:16])
        seen.append([struct.unpack("!H", data[26:28])[0], addr[2], sec + nsec * 1e-9])
print(json.dumps(seen), flush=True)
"""


def test_sparse_packets_are_held_for_the_configured_delay_as_the_kernel_sees_it(caps):
    """Each echo request, 0.2 s after the last: the time between the kernel handing it to the
    delay line's TUN and the line writing it back, against the configured one-way delay less
    the line's compensation.  The line reads its own wake-ups out of it (arrival stamps, a spin
    to each release); without them the holds read 0.5-3 ms long on this VM (2026-12-06)."""
    import json
    import subprocess

    from testbed.net.network import DEFAULT_COMPENSATION_MS

    if not caps.tun:
        pytest.skip("needs TUN devices (the delay line)")
    with Network(two_dcs(delay_ms=25), delay_backend="tun", caps=caps) as net:
        lane = net.link("east", "west").lane
        tap = subprocess.Popen(["mnexec", "-a", str(net.router("east").pid), sys.executable, "-c", _HOLDS, lane, "3.0"],
                               stdout=subprocess.PIPE, text=True)
        assert tap.stdout.readline().strip() == "ready"
        net.host("east").node.cmd(f"ping -n -c 12 -i 0.2 -W 1 {net.host('west').ip}")
        seen = json.loads(tap.communicate(timeout=10)[0])
    into = {seq: t for seq, kind, t in seen if kind == 4}  # PACKET_OUTGOING: into the line
    out = {seq: t for seq, kind, t in seen if kind != 4}  # written back by the line
    held = [(out[q] - into[q]) * 1e3 - (25 - DEFAULT_COMPENSATION_MS) for q in sorted(into) if q in out]
    assert len(held) >= 10, seen
    assert abs(statistics.median(held)) <= 0.1, [round(h, 3) for h in held]
