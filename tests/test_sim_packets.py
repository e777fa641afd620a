"""The packet-level TCP (``sim.sharing: packets``, testbed/sim/packets.py): one connection's
timing by hand, its restart after idle, loss recovery without a timeout, several hosts'
bursts through one drop-tail queue, and the simulator with it end to end."""

from __future__ import annotations

import json

import pytest
import yaml

from testbed.net.tcpmodel import MSS, PAYLOAD_FRACTION
from testbed.sim import packets
from testbed.sim.engine import Link, Simulator
from testbed.spec.experiment import parse_experiment
from testbed.sim.build import simulate

RATE = 10e6 / 8 * PAYLOAD_FRACTION  # a 10 Mbit/s link, in payload bytes/s (as build.link_capacity says)
WIRE = 10e6 / 8  # ... and on the wire
OWD = 0.05


class _DropOnce(packets.PacketNet):
    """A network that drops the ``nth`` data packet it is given (counted from 1), once."""

    def __init__(self, sim, nth: int):
        super().__init__(sim, seed=1, host_rate=1e12)
        self.nth, self.seen = nth, 0

    def send_from(self, host, path, wire_bytes, payload, deliver, owner=""):
        self.seen += 1
        if self.seen == self.nth:
            return
        super().send_from(host, path, wire_bytes, payload, deliver, owner)


def _path(net_cls=packets.PacketNet, queue=1 << 30, **kw):
    sim = Simulator()
    net = net_cls(sim, **kw) if kw else net_cls(sim, seed=1, host_rate=1e12)
    there, back = Link("a->b", RATE, OWD), Link("b->a", RATE, OWD)
    net.add(there, queue)
    net.add(back, queue)
    counts = packets.new_counts()
    conn = packets._Connection(sim, net, "h1", [there], [back], 2 * OWD, True, True, counts)
    return sim, net, conn, counts


def _send(sim, conn, nbytes: int) -> list[float]:
    got: list[float] = []
    conn.write(nbytes, got.append)
    sim.run()
    return got


def _wire(nbytes: int) -> float:
    """Seconds the segments of ``nbytes`` (header segment first) take on the 10 Mbit/s wire."""
    sizes = [packets.SLICE_HEADER_BYTES] + [MSS] * ((nbytes - packets.SLICE_HEADER_BYTES) // MSS)
    rest = nbytes - sum(sizes)
    if rest:
        sizes.append(rest)
    return sum(s + packets.WIRE_OVERHEAD for s in sizes) / WIRE, len(sizes)


def test_a_message_its_first_window_holds_arrives_one_way_and_its_bytes_later():
    sim, _net, conn, _ = _path()
    nbytes = packets.SLICE_HEADER_BYTES + 8 * MSS  # 9 segments: the initial window of 10 holds it
    took, segments = _wire(nbytes)
    assert segments == 9
    assert _send(sim, conn, nbytes) == [pytest.approx(OWD + took, abs=1e-9)]


def test_a_message_past_the_initial_window_waits_a_round_trip_for_its_second_flight():
    """24 segments from a window of 10: the first 10 go at once; the receiver, new, ACKs each
    segment at once (quick ACKs), so the header's ACK is back a round trip and its own bytes
    on, and from then on each ACK releases two more: the other 14 leave the queue back to
    back, the last one way after the delay line.  Exactly that, to the microsecond."""
    sim, _net, conn, _ = _path()
    nbytes = packets.SLICE_HEADER_BYTES + 23 * MSS
    took, segments = _wire(nbytes)
    assert segments == 24
    [arrived] = _send(sim, conn, nbytes)
    tau = (MSS + packets.WIRE_OVERHEAD) / WIRE  # one full segment on the wire
    header_ack = 2 * OWD + (packets.SLICE_HEADER_BYTES + packets.WIRE_OVERHEAD) / WIRE + packets.ACK_BYTES / WIRE
    assert arrived == pytest.approx(header_ack + OWD + 14 * tau, abs=1e-6)
    assert conn.cwnd == 10 + 24  # slow start: one a segment delivered while the window was used


def test_the_window_restarts_after_idle_halving_once_per_rto_and_not_on_tuned_hosts():
    for restart in (True, False):
        sim, _net, conn, counts = _path()
        conn.restart = restart
        _send(sim, conn, packets.SLICE_HEADER_BYTES + 60 * MSS)
        grown, ssthresh, rto = conn.cwnd, conn.ssthresh, conn.rto
        assert grown >= 40
        # idle 2.5 RTOs since the last data left: two halvings
        sim.at(conn.lsndtime + 2.5 * rto, lambda: conn.write(MSS, lambda t: None))
        sim.run()
        if restart:
            assert counts["restarts"] == 1
            assert conn.ssthresh == max(ssthresh, (grown >> 1) + (grown >> 2))
            assert conn.cwnd == max(grown >> 2, packets.INIT_CWND)
        else:
            assert counts["restarts"] == 0 and conn.cwnd == grown


def test_the_restart_halves_per_rto_of_idle_down_to_the_initial_window():
    sim, _net, conn, counts = _path()
    conn.cwnd, rto = 80, conn.rto
    conn._cwnd_restart(2.5 * rto)  # two RTOs past the first: 80 -> 40 -> 20
    assert conn.cwnd == 20
    conn.cwnd = 80
    conn._cwnd_restart(9 * rto)  # down to 10, no further
    assert conn.cwnd == packets.INIT_CWND
    assert counts["restarts"] == 2


def test_an_unused_window_decays_only_after_an_rto_without_an_ack_of_data():
    """``tcp_cwnd_application_limited`` halves the unused part of a window once an RTO has passed
    since ``snd_cwnd_stamp``, and every ACK of data sets that stamp (``tcp_cong_avoid``, even
    when CUBIC does not grow the window): a sender writing a little every 50 ms, its ACKs
    coming back all the while, keeps its window of 100 for 2 s.  (On the emulator, 2026-12-07,
    250 ms, 8 pipelines, default hosts: no such decay at any of 640 writes of 16 connections;
    the model without the stamp on ACKs made 28 in a simulation of that run.)"""
    sim, _net, conn, _ = _path()
    conn.cwnd, conn.ssthresh = 100, 50
    for i in range(40):
        sim.at(0.05 * i, lambda: conn.write(packets.SLICE_HEADER_BYTES + 4 * MSS, lambda t: None))
    sim.run()
    assert conn.cwnd == 100


def test_a_retransmission_restarts_the_idle_clock_of_the_restart_after_idle():
    """Linux stamps ``lsndtime`` for every data segment it sends, a retransmission too
    (``tcp_event_data_sent``): 20 segments leave at 0, the last is lost and the tail-loss probe
    sends it again at 0.48 s; a write at 0.7 s has been idle 0.22 s since then, under the RTO
    (0.32 s), so the window stays.  Counting from the last new data instead (0.68 s, two RTOs),
    this test failed with the window halved twice, to 10."""
    sim, net, conn, counts = _path(_DropOnce, nth=20)
    conn.cwnd = 40
    conn.write(packets.SLICE_HEADER_BYTES + 19 * MSS, lambda t: None)
    seen = {}

    def again():
        seen["idle"], seen["rto"], seen["out"] = sim.now - conn.lsndtime, conn.rto, conn.packets_out
        conn.write(packets.SLICE_HEADER_BYTES + 19 * MSS, lambda t: None)
        seen["cwnd"] = conn.cwnd

    sim.at(0.7, again)
    sim.run()
    assert seen["cwnd"] == 40 and counts["restarts"] == 0
    assert counts["probes"] == 1 and counts["timeouts"] == 0
    assert seen["out"] == 0 and 0.2 < seen["idle"] < seen["rto"] < 0.4


def test_a_window_used_to_the_full_counts_as_limited_until_the_last_limited_send_is_acknowledged():
    """``tcp_cwnd_validate`` as Linux 6.1 on has it: each send that fills the window moves
    ``cwnd_usage_seq`` to ``snd_nxt``, so the window counts as limited (and CUBIC grows it) until
    that last limited send is acknowledged, not the first.  With the older rule (the mark kept
    from the first limited send), the send at una 12 cleared it and this test failed."""
    sim, net, conn, counts = _path()
    conn.nxt, conn.packets_out = 10, 10
    conn._cwnd_validate(True)  # the window full at snd_nxt 10
    conn.una, conn.nxt, conn.packets_out = 5, 20, 15
    conn._cwnd_validate(True)  # full again at snd_nxt 20
    conn.una, conn.packets_out = 12, 8
    conn._cwnd_validate(False)  # not full, past 10 but not past 20
    assert conn.cwnd_limited and conn.cwnd_usage_seq == 20
    conn.una, conn.packets_out = 20, 0
    conn._cwnd_validate(False)  # past 20: a new window, not limited
    assert not conn.cwnd_limited and conn.max_packets_out == 0


def test_a_burst_that_loses_its_first_segment_recovers_by_rack_not_by_a_timeout():
    """The first data segment of a 9-segment message (the window holds it: one flight) is
    dropped; the rest, sent at the same instant, are SACKed: RACK (sent before the latest
    delivered, by time, then by sequence) marks it lost, fast recovery sends it again, and the
    message arrives about a round trip late, with no probe and no timeout.  (Comparing send
    times alone, a flight's segments all tie and the loss waits for the probe: this test
    failed that way; on the lossy long haul it waited for RTOs.)"""
    sim, net, conn, counts = _path(_DropOnce, nth=2)
    nbytes = packets.SLICE_HEADER_BYTES + 8 * MSS
    [arrived] = _send(sim, conn, nbytes)
    assert counts["timeouts"] == 0 and counts["probes"] == 0
    assert counts["recoveries"] == 1 and counts["retransmits"] == 1
    lossless_sim, _n, lossless, _c = _path()
    [clean] = _send(lossless_sim, lossless, nbytes)
    assert clean + 0.5 * 2 * OWD < arrived < clean + 2 * 2 * OWD


def test_a_lost_last_segment_is_recovered_by_the_tail_loss_probe():
    """The last segment of a 9-segment message is lost: nothing after it can be SACKed, so the
    tail-loss probe (2 srtt on) sends it again; no timeout."""
    sim, net, conn, counts = _path(_DropOnce, nth=9)
    [arrived] = _send(sim, conn, packets.SLICE_HEADER_BYTES + 8 * MSS)
    assert counts["probes"] == 1 and counts["timeouts"] == 0
    assert arrived == pytest.approx(2 * conn.srtt + 0.008 + OWD, abs=0.02) or arrived > 2 * 2 * OWD


def test_hystart_counts_its_rounds_from_the_first_ack_and_ends_slow_start_by_the_ack_train():
    """The matrix's one-pipeline cell at 150 ms (13.3 Mbit/s, two 1x-BDP messages at once, 362
    segments): the kernel, traced at each ACK (bpftrace on tcp:tcp_probe reading ``struct bictcp``,
    2026-12-07), starts a HyStart round at every flight from the first ACK (flights 9, 20, 40, 80,
    160), sees every round's first samples within 0.6 ms of the minimum (so the delay test never
    fires), and ends slow start by the ACK train at cwnd 246, 78 ms into the 160-segment flight.
    Resetting the round only once the window reaches 16 (the order before Linux 6.11) puts the
    rounds' starts mid-flight, where the samples come from segments queued behind the flight's
    head: the delay test then fired at 144 (this test failed that way; the cell read +12.3%)."""
    sim = Simulator()
    net = packets.PacketNet(sim, seed=1, host_rate=1e12)
    rate = 13.3e6 / 8 * PAYLOAD_FRACTION
    there, back = Link("a->b", rate, 0.075), Link("b->a", rate, 0.075)
    net.add(there, 1 << 30)
    net.add(back, 1 << 30)
    counts = packets.new_counts()
    conn = packets._Connection(sim, net, "h1", [there], [back], 0.150, True, True, counts)
    got: list[float] = []
    conn.write(2 * 262144, got.append)
    sim.run()
    assert got and counts["hystart_delay"] == 0 and counts["hystart_train"] == 1
    assert 236 <= conn.ssthresh <= 256  # the kernel: 246


def test_bursts_from_several_hosts_interleave_and_lose_their_tails_not_whole_flights():
    """Four hosts each write 40 segments at the same instant into a 60-segment queue: their
    segments reach the gateway interleaved (each host's own link), so every connection gets
    some through and finds its losses by SACK; everything arrives, with no timeout."""
    sim = Simulator()
    net = packets.PacketNet(sim, seed=1, host_rate=1e9 / 8)
    there, back = Link("a->b", RATE, OWD), Link("b->a", RATE, OWD)
    net.add(there, 60 * (MSS + packets.WIRE_OVERHEAD))
    net.add(back, 1 << 30)
    counts = packets.new_counts()
    conns = [packets._Connection(sim, net, f"h{i}", [there], [back], 2 * OWD, True, True, counts)
             for i in range(4)]
    for c in conns:
        c.cwnd = 40
    got: list[float] = []
    for c in conns:
        c.write(packets.SLICE_HEADER_BYTES + 39 * MSS, got.append)
    sim.run()
    assert len(got) == 4 and net.dropped > 0
    assert counts["timeouts"] == 0
    assert counts["recoveries"] == 4  # every connection lost some and recovered by SACK
    assert all(c.packets_out == 0 and c.una == len(c.segs) for c in conns)


def _job(tmp_path, loss: float = 0.0, sharing: str = "packets", replicas: int = 1, microbatch_size: int = 64):
    topo = {"name": "pk", "dcs": [{"name": "dc1", "hosts": replicas, "host": {"cpus": 0.3}},
                                  {"name": "dc2", "hosts": replicas, "host": {"cpus": 0.3}}],
            "wan": [{"a": "dc1", "b": "dc2", "delay_ms": 40, "rate_mbps": 20, "loss": loss}]}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(topo))
    return parse_experiment({
        "name": "pk", "topology": str(tmp_path / "t.yaml"),
        "model": {"layers": 6, "hidden": 32, "heads": 2, "seq_len": 16},
        "training": {"iterations": 4, "microbatches": 3, "microbatch_size": microbatch_size, "warmup_iterations": 1},
        "parallel": {"stages": 2, "replicas": replicas, "schedule": "1f1b", "connections": 2},
        "sim": {"stage_times": [{"forward_s": 0.05, "backward_s": 0.1}] * 2, "sharing": sharing},
    }, "pk")


def test_the_simulator_runs_a_job_on_packets_and_says_so(tmp_path):
    from testbed.results.metrics import summarise

    result = simulate(_job(tmp_path))
    s = summarise(result)["summary"]
    assert s["mean_iteration_time_s"] > 0
    # every message of every iteration arrived (none stranded in a connection)
    assert all(len(w.iteration_end) == 4 for w in result.workers.values())
    assert result.model["sharing"] == "packets"
    assert [p["part"] for p in result.model["parts"]] == ["packet-level TCP"]
    assert result.model["tcp_window_model"]["on"] is False
    assert "packets:" in result.log_lines[0] and "restart(s) after idle" in result.log_lines[0]
    fluid = summarise(simulate(_job(tmp_path, sharing="fair")))["summary"]["mean_iteration_time_s"]
    assert s["mean_iteration_time_s"] == pytest.approx(fluid, rel=0.25)  # the same job, another model


def test_random_loss_drops_segments_and_every_message_still_arrives(tmp_path):
    result = simulate(_job(tmp_path, loss=0.02))
    assert all(len(w.iteration_end) == 4 for w in result.workers.values())
    line = result.log_lines[0]
    assert " 0 at random" not in line and "at random" in line


def test_the_gateways_strict_priority_serves_the_owner_first_and_acks_pass_it():
    """Two pipelines' messages written at once over one link with Atlas's scheduler in front of
    its delay line (r1 ranked first, at 0.97 of the rate): r1's arrives as if it were alone on
    a link of 0.97 the rate, r0's only after it; without the scheduler the FIFO mixes them and
    r1's arrives later than that."""
    def run(prioritised: bool) -> dict[str, float]:
        sim = Simulator()
        net = packets.PacketNet(sim, seed=1, host_rate=1e9 / 8)
        there, back = Link("a->b", RATE, OWD), Link("b->a", RATE, OWD)
        net.add(there, 1 << 30)
        net.add(back, 1 << 30)
        if prioritised:
            net.prioritise(there, {"r1": 0, "r0": 1}, 0.97, 1 << 30)
            net.prioritise(back, {"r1": 0, "r0": 1}, 0.97, 1 << 30)
        counts = packets.new_counts()
        got: dict[str, float] = {}
        for owner in ("r0", "r1"):
            c = packets._Connection(sim, net, f"h{owner}", [there], [back], 2 * OWD, True, True, counts, owner)
            c.write(packets.SLICE_HEADER_BYTES + 8 * MSS, lambda t, o=owner: got.setdefault(o, t))
        sim.run()
        return got

    took, _ = _wire(packets.SLICE_HEADER_BYTES + 8 * MSS)
    first = run(True)
    # r1 alone at 0.97 of the rate: its last segment leaves the scheduler, then the delay, then HTB
    assert first["r1"] == pytest.approx(took / 0.97 + OWD + (MSS + packets.WIRE_OVERHEAD) / WIRE, rel=0.02)
    assert first["r0"] > first["r1"] + 0.9 * took
    mixed = run(False)
    assert mixed["r1"] > first["r1"] + 0.5 * took  # a FIFO interleaves the two hosts' bursts


def test_an_extensions_strict_priority_runs_on_packets_as_the_gateways_scheduler(tmp_path):
    """``sim.sharing: packets`` with a strict-priority policy (what Atlas's temporal sharing gives
    the simulator) runs segment by segment with the gateway's scheduler, and says so; the
    pipeline ranked first gets its messages through sooner (messages of 524 KB: four times the
    scheduler's bucket, which lets a burst through first in first out after a pause)."""
    from testbed.sim.engine import PriorityPolicy

    exp = _job(tmp_path, replicas=2, microbatch_size=256)
    result = simulate(exp, policy=PriorityPolicy(["r1", "r0"], rate_factor=0.97))
    parts = [p["part"] for p in result.model["parts"]]
    assert parts == ["packet-level TCP", "sharing policy temporal"] and result.model["sharing"] == "temporal"
    took = {w: sum(t.end - t.start for t in rec.transfers) for w, rec in result.workers.items()}
    assert took["s1r1"] < took["s1r0"]  # r1's activations, first at the gateway, arrive sooner


def test_the_gateways_bucket_lets_a_burst_through_in_arrival_order_after_a_pause():
    """The delay line's scheduler is a token bucket (``delayline.bucket_bytes``): after a pause
    it sends what arrives while it holds tokens at once, whoever's it is; then, waiting for
    tokens, it serves by rank.  Without a bucket every packet waits its turn by rank."""
    def order(burst: float) -> list[str]:
        sim = Simulator()
        net = packets.PacketNet(sim, seed=1, host_rate=1e9 / 8)
        there = Link("a->b", RATE, OWD)
        net.add(there, 1 << 30)
        net.prioritise(there, {"r1": 0, "r0": 1}, 0.97, 1 << 30, burst_bytes=burst)
        got: list[str] = []
        for owner in ["r0"] * 4 + ["r1"] * 4:  # r0's burst first, r1's right behind it
            net.send([there], 1000, 960, lambda t, o=owner: got.append(o), owner=owner)
        sim.run()
        return got

    assert order(3000) == ["r0"] * 3 + ["r1"] * 4 + ["r0"]  # 3000 bytes of tokens: three go at once
    assert order(0) == ["r0"] + ["r1"] * 4 + ["r0"] * 3  # (the first was on the wire already)


def test_pure_acks_pass_the_gateways_queues_but_pay_its_bucket():
    """The delay line's scheduler sends pure ACKs ahead of its queues but takes their bytes from
    its token bucket (``delayline._Scheduler.dequeue``, its ``other`` packets): a backlog of data
    leaves later by the ACKs' bytes at the scheduler's rate, and the ACKs wait for none of it.
    On the emulator (2026-12-07, 50 ms, 40 Mbit/s, 4 pipelines) a turn carried 4.79 MB/s of data
    wire bytes against the bucket's 4.85 while the other direction was busy: its ACKs' share."""
    def run(acks: int) -> tuple[float, list[float]]:
        sim = Simulator()
        net = packets.PacketNet(sim, seed=1, host_rate=1e9 / 8)
        there = Link("a->b", RATE, OWD)
        net.add(there, 1 << 30)
        net.prioritise(there, {"r0": 0}, 0.5, 1 << 30, burst_bytes=3000)  # (half the rate: HTB never queues)
        data: list[float] = []
        for _ in range(100):  # 0.16 s of data at half of 10 Mbit/s
            net.send([there], 1000, 960, data.append, owner="r0")
        acked: list[float] = []
        for i in range(acks):
            sim.at(0.01 + 0.001 * i, lambda: net.send([there], packets.ACK_BYTES, 0, acked.append))
        sim.run()
        return max(data), acked

    alone, _ = run(0)
    later, acked = run(50)
    assert later - alone == pytest.approx(50 * packets.ACK_BYTES / (0.5 * WIRE), rel=0.05)
    # each ACK: the one-way delay, the packet on the wire and its own bytes at most, not the backlog
    assert all(t - (0.01 + 0.001 * i) <= OWD + (1000 + packets.ACK_BYTES) / WIRE for i, t in enumerate(sorted(acked)))


def test_a_plan_reaches_the_gateways_after_the_warm_up_iterations_and_until_then_the_link_is_fifo(tmp_path):
    """Atlas's controller plans once every worker has ended its warm-up iterations; until then the
    gateways are first in first out, and the TCP windows those iterations leave carry on (a
    traced run, 150 ms, 4 pipelines, tuned hosts: 293 retransmissions on the way out, all in the
    FIFO iterations; with the scheduler from the start the packet model had 4 and read -11.5%).
    ``priority_plans`` replays when each order came into force: the scheduler is off (rank None:
    FIFO) until every worker has ended that many iterations, then serves by the plan's order."""
    from testbed.sim.engine import PriorityPolicy

    sim = Simulator()
    net = packets.PacketNet(sim, seed=1, host_rate=1e9 / 8)
    there = Link("a->b", RATE, OWD)
    net.add(there, 1 << 30)
    net.prioritise(there, None, 0.97, 1 << 30)
    got: list[str] = []
    for owner in ("r0", "r1", "r0", "r1"):  # not yet in force: first in, first out
        net.send([there], 1000, 960, lambda t, o=owner: got.append(o), owner=owner)
    sim.run()
    assert got == ["r0", "r1", "r0", "r1"] and net.scheduler_drops == 0
    net.reorder({"r1": 0, "r0": 1})
    got.clear()
    for owner in ("r0", "r1", "r0", "r1"):
        net.send([there], 1000, 960, lambda t, o=owner: got.append(o), owner=owner)
    sim.run()
    assert got == ["r0", "r1", "r1", "r0"]  # r0's first was on the wire already; then r1 first

    exp = _job(tmp_path, replicas=2)
    ended: list[tuple[int, float]] = []
    original = packets.PacketNet.reorder
    try:
        packets.PacketNet.reorder = lambda self, rank: ended.append((rank["r1"], self._sim.now))
        result = simulate(exp, policy=PriorityPolicy(["r1", "r0"], rate_factor=0.97),
                          priority_plans=[(2, ["r1", "r0"]), (3, ["r0", "r1"])])
    finally:
        packets.PacketNet.reorder = original
    last_end = {n: max(w.iteration_end[n - 1] for w in result.workers.values()) for n in (2, 3)}
    assert ended == [(0, last_end[2]), (1, last_end[3])]  # each once every worker had ended n


def _behind_r1(r0_segments: int, got: dict[str, float] | None = None):
    """Two pipelines at a gateway that serves r1 first, on the 10 Mbit/s link: r1 (window 400)
    writes 400 segments and r0 (window 40) ``r0_segments``, both at 0, so r0's wait behind r1
    (0.48 s) is longer than its timers; each arrival goes into ``got`` by owner."""
    sim = Simulator()
    net = packets.PacketNet(sim, seed=1, host_rate=1e9 / 8)
    there, back = Link("a->b", RATE, OWD), Link("b->a", RATE, OWD)
    net.add(there, 1 << 30)
    net.add(back, 1 << 30)
    net.prioritise(there, {"r1": 0, "r0": 1}, 1.0, 1 << 30)
    counts = {o: packets.new_counts() for o in ("r0", "r1")}
    conns = {o: packets._Connection(sim, net, f"h{o}", [there], [back], 2 * OWD, True, False, counts[o], o)
             for o in ("r0", "r1")}
    conns["r1"].cwnd, conns["r0"].cwnd = 400, 40
    for owner, segments in (("r1", 400), ("r0", r0_segments)):
        done = (lambda t, o=owner: got.setdefault(o, t)) if got is not None else (lambda t: None)
        conns[owner].write(packets.SLICE_HEADER_BYTES + (segments - 1) * MSS, done)
    return sim, conns, counts


def test_a_timeout_while_the_segments_wait_at_a_scheduler_is_found_spurious_and_undone():
    """r0's 40 segments wait at the gateway behind r1's 400 (r1 ranked first): longer than r0's
    RTO, which fires.  The first ACK echoes the timestamp of an original sent before the
    retransmission, so the timeout was spurious: the window comes back and the rest is not
    sent again (``tcp_try_undo_loss``).  Without the undo, every segment marked lost at the
    timeout went again: this test failed with 41 retransmissions."""
    got: dict[str, float] = {}
    sim, conns, counts = _behind_r1(40, got)
    sim.run()
    r0 = counts["r0"]
    assert r0["timeouts"] >= 1 and r0["undos"] == r0["timeouts"]
    assert r0["retransmits"] <= 2 * r0["timeouts"]  # the head only, before the first ACK
    assert conns["r0"].cwnd >= 40 and set(got) == {"r0", "r1"}


def test_a_probe_with_data_unsent_sends_one_new_segment_past_a_full_window():
    """``tcp_send_loss_probe``: with unsent data it calls ``tcp_write_xmit`` with ``push_one`` 2,
    which sends one new segment even past a full window, and retransmits nothing.  r0's window
    of 40 is full, 20 more segments wait to be sent, and its segments wait at the gateway behind
    r1's 400: the probe at 2 srtt + 8 ms (0.21 s) sends segment 40.  With the old rule (the last
    segment sent again when the window was full) this test failed with 1 retransmission."""
    sim, conns, counts = _behind_r1(60)
    seen = {}
    sim.at(0.25, lambda: seen.update(nxt=conns["r0"].nxt, **counts["r0"]))
    sim.run()
    assert seen["probes"] == 1 and seen["retransmits"] == 0 and seen["nxt"] == 41


def test_a_timeout_makes_cubic_forget_its_least_delay_and_take_the_next_sample():
    """CUBIC entering Loss (``bictcp_reset``) zeroes its least delay with the rest of its state,
    so the next ACK's sample sets it: after r0's timeout at the gateway, the wait behind r1's
    400 segments (0.48 s at 10 Mbit/s) is in it, and HyStart's delay test and the cubic's clock
    read from there.  Keeping the bare path's 0.1 s instead, this test failed with 0.1."""
    sim, conns, counts = _behind_r1(40)
    sim.run()
    assert counts["r0"]["timeouts"] >= 1 and counts["r1"]["timeouts"] == 0
    assert conns["r1"].delay_min == pytest.approx(2 * OWD)  # no timeout: the bare path's, from the start
    assert 2 * OWD + 0.4 < conns["r0"].delay_min < 2 * OWD + 0.6


def test_a_slice_waits_for_its_writer_thread_and_a_traced_runs_latency_is_read(tmp_path):
    """Each slice starts a draw of the writer threads' latency after the message is handed over
    (here a fixed 10 ms: the arrival moves by exactly that); ``profiled_write_latency`` reads a
    traced run's (the "start" row less ``queued_at``, past the warm-up), and ``testbed sim
    --write-latency`` refuses a run that was not traced, in one line."""
    from testbed.sim.build import profiled_write_latency
    from testbed.sim.cli import run_sim
    from testbed.spec.topology import SpecError

    def arrival(latency):
        sim = Simulator()
        net = packets.PacketNet(sim, seed=1, host_rate=1e12)
        there, back = Link("a->b", RATE, OWD), Link("b->a", RATE, OWD)
        net.add(there, 1 << 30)
        net.add(back, 1 << 30)
        channel = packets.PacketChannel(sim, net, "h1", [there], [back], 2 * OWD, 2, True, True,
                                        packets.new_counts(), write_latency=latency)
        got: list[float] = []
        channel.send(8 * MSS, got.append)
        sim.run()
        return got[0]

    assert arrival(lambda: 0.010) == pytest.approx(arrival(None) + 0.010, abs=1e-9)
    trace = tmp_path / "run" / "tcp-trace"
    trace.mkdir(parents=True)
    rows = [{"phase": "before", "t": 5.0, "queued_at": 4.0, "it": 3},
            {"phase": "start", "t": 5.004, "queued_at": 5.0, "it": 3},
            {"phase": "start", "t": 1.5, "queued_at": 1.0, "it": 0}]  # (the warm-up: left out)
    (trace / "s0r0.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert profiled_write_latency(tmp_path / "run") == [pytest.approx(0.004)]
    assert profiled_write_latency(tmp_path / "run" / "timeline.json") == [pytest.approx(0.004)]
    spec = tmp_path / "job.yaml"
    job = _job(tmp_path)
    spec.write_text(yaml.safe_dump(job.model_dump(mode="json", exclude_none=True) | {"topology": str(tmp_path / "t.yaml")}))
    with pytest.raises(SpecError, match="--write-latency .*no traced slices"):
        run_sim(spec, write_latency=tmp_path / "nothing")


class _Late(packets.PacketNet):
    """A network that holds the ``n``-th data packet it is given (counted from 1) ``late[n]``
    seconds before sending it on, and drops those in ``drop``."""

    def __init__(self, sim, late: dict[int, float] | None = None, drop: set[int] | frozenset = frozenset()):
        super().__init__(sim, seed=1, host_rate=1e12)
        self.late, self.drop, self.seen = late or {}, drop, 0

    def send_from(self, host, path, wire_bytes, payload, deliver, owner=""):
        self.seen += 1
        if self.seen in self.drop:
            return
        wait = self.late.get(self.seen, 0.0)
        send = super().send_from
        if wait:
            self._sim.at(self._sim.now + wait, lambda: send(host, path, wire_bytes, payload, deliver, owner))
        else:
            send(host, path, wire_bytes, payload, deliver, owner)


def test_a_probes_original_delivered_from_a_queue_marks_nothing_lost():
    """Nine segments leave at once; the first eight wait 350 ms in a queue, the ninth 150 ms.
    The tail-loss probe (2 srtt on) sends the ninth again; the original arrives before it, and
    its SACK comes back 42 ms after the probe left: sooner than any round trip, so it is the
    original's, and RACK must not take it as the probe's (``tcp_rack_advance``).  Taken as the
    probe's, it marked the eight before it lost: this test failed with a recovery and 9
    retransmissions."""
    late = {k: 0.35 for k in range(1, 9)} | {9: 0.15}
    sim, net, conn, counts = _path(_Late, late=late)
    [arrived] = _send(sim, conn, packets.SLICE_HEADER_BYTES + 8 * MSS)
    assert counts["probes"] == 1 and counts["retransmits"] == 1
    assert counts["recoveries"] == 0 and counts["timeouts"] == 0
    assert arrived == pytest.approx(OWD + 0.35, abs=0.01)


def test_a_timeout_within_a_recovery_keeps_the_recoverys_ssthresh():
    """A flight of 60 segments loses 39 of them; the recovery sets ssthresh by CUBIC's 0.7,
    and its first 18 retransmissions are lost too, so the RTO fires within the recovery.  As
    ``tcp_enter_loss`` does there, the timeout keeps the recovery's ssthresh (it does not cut
    it again from the few segments PRR had let out), so what is left goes in slow start up to
    it.  This test failed with ssthresh cut again to 12; in the 250 ms, 8-pipeline matrix
    cell such a cut (to 2) left a connection 10 s in recovery at 2 segments a round trip."""
    drop = set(range(2, 41)) | set(range(61, 79))
    sim, net, conn, counts = _path(_Late, drop=drop)
    conn.cwnd = 60
    seen = []
    for name in ("_on_rto", "_enter_recovery"):
        def spy(*a, call=getattr(conn, name), name=name):
            fired = name == "_enter_recovery" or (a[0] == conn._rto_gen and conn.packets_out)
            before = (conn.state, conn.ssthresh)
            call(*a)
            if fired:
                seen.append((name, *before, conn.ssthresh))
        setattr(conn, name, spy)
    [arrived] = _send(sim, conn, packets.SLICE_HEADER_BYTES + 59 * MSS)
    assert counts["recoveries"] == 1 and counts["timeouts"] == 1 and counts["undos"] == 0
    (_, _, _, recovery_ssthresh), rto = seen
    assert 40 <= recovery_ssthresh <= 45
    assert rto == ("_on_rto", "recovery", recovery_ssthresh, recovery_ssthresh)
    assert arrived < 0.405 + 0.5 + 6 * 2 * OWD  # the RTO, then a few slow-start rounds


def test_the_heads_retransmission_restarts_the_rto():
    """A flight of 60 segments loses 39; the head's first two retransmissions (the 61st and
    79th packets) are lost too, and RACK finds each lost a round trip later, once a
    retransmission sent after it is SACKed.  The third leaves 2 round trips into the recovery
    and arrives.  As ``tcp_xmit_retransmit_queue`` does, sending the head again restarts the
    RTO, so no timeout fires; left at the recovery's start, it fired just before the third
    retransmission's ACK came back: this test failed with a timeout."""
    sim, net, conn, counts = _path(_Late, drop=set(range(2, 41)) | {61, 79})
    conn.cwnd = 60
    _send(sim, conn, packets.SLICE_HEADER_BYTES + 59 * MSS)
    assert counts["recoveries"] == 1 and counts["timeouts"] == 0
    assert counts["retransmits"] == 39 + 2


def test_an_ack_over_a_retransmission_alone_samples_the_round_trip_from_its_timestamp_echo():
    """The first data segment of nine is lost, and its retransmission waits 150 ms longer on
    the way.  The ACK that fills the hole acknowledges only that retransmission (the rest
    were SACKed): Karn's rule gives no sample from its send time, but, as
    ``tcp_ack_update_rtt`` does, its timestamp echo (the retransmission's own TSval) does,
    so the round trip it took, 250 ms, reaches srtt.  Without it, srtt never saw a queue that
    only retransmissions met (the 250 ms matrix cell's RTOs fired early): this test failed
    with no ninth sample."""
    sim, net, conn, counts = _path(_Late, drop={2}, late={10: 0.15})
    samples = []
    estimate = conn._rtt_estimator

    def spy(m):
        samples.append(m)
        estimate(m)

    conn._rtt_estimator = spy
    _send(sim, conn, packets.SLICE_HEADER_BYTES + 8 * MSS)
    assert counts["retransmits"] == 1 and counts["timeouts"] == 0
    assert len(samples) == 9 and samples[-1] == pytest.approx(2 * OWD + 0.15, abs=0.005)
