"""A channel's messages a window at a time, into drop-tail FIFO queues (``sim.sharing:
fifo-bursts`` with ``sim.tcp_window_model``).

How it fits: ``build.simulate`` makes one ``RoundsChannel`` per channel (a worker's TCP
connection set to one peer, for one kind of message) when both are on (the window model is
on by default on hosts with Linux's slow start after idle: ``build.window_model``), and hands
it every message the channel sends.  The channel asks its ``tcpwindow.TcpWindow`` what may
leave and puts each round in flight as one burst flow of the engine (``Simulator.transfer``
with ``burst=True``), which ``engine.FifoBurstPolicy`` serves first-in first-out at every
link.  Fair sharing and fifo-bursts without the window model never come here.

What it models, as Linux and a drop-tail bottleneck do it:

* **Rounds.** A message goes out as the window allows: what the window has room for at once
  (a message the window holds is one round), the rest as ACKs open it, a round trip after
  the previous round's first byte left the bottleneck (``TcpWindow.served``; in slow start
  the ACK clock sends two segments an ACK, so the next round leaves right behind).  Each
  round takes its place in the FIFO when it is sent, ahead of bursts sent later: a message
  larger than the window is no longer served only with what every later burst leaves.
* **Pipelining.** The sender writes message after message into its socket (the transport's
  sends return at once), so the channel's next message starts as soon as the last round of
  this one is sent, with whatever room the window has left: several messages of one channel
  can be in the queue together.
* **ACK clock.** A round released by ACKs reaches the queue as the acknowledged bytes leave
  it, so only its growth queues (``TcpWindow.take_clocked``); a message's first round, sent
  into room the window already had, lands whole.  ACKs come back through the reverse link's
  FIFO, behind what is queued there when the round's first byte leaves (``ack_path``).
* **Drop-tail losses.** A round that arrives at a link whose queue (the bytes its flows have
  still to send, ``Simulator.backlog``) would exceed the link's queue bytes loses its tail
  beyond.  Those segments stay in flight until the loss is known; the window is then cut
  (CUBIC's 0.7, once a round trip: ``TcpWindow.lose``) and they are sent again at once, paced
  by the ACKs as PRR paces a recovery (so they take only room the queue has).  The loss is
  known when segments sent after them are acknowledged (RACK: their first byte's ACK plus a
  quarter round trip for reordering), or else by a tail-loss probe two smoothed round trips
  after the lost round left the host (the probe's answer a round trip later); a
  retransmission lost again waits for the retransmission timeout (srtt + 200 ms) and the
  window restarts from one segment.
* **In order.** TCP hands the receiver a byte stream: a message whole before an earlier one
  of its channel is handed over with it.

* **HyStart** (with ``sim.tcp_hystart``): each round tells its window the queueing delay its
  first byte met (at the bottleneck and on the ACKs' way back) and how far apart its ACKs come,
  for CUBIC's HyStart (``TcpWindow._hystart``).

Left out: which flow's packets a full queue drops when bursts arrive together (the later
round loses, whole tail first), the spread of a first round over the sender's own link,
CUBIC's return to its last maximum after a loss (above ssthresh after a loss a segment per
window of ACKs, Reno's), delayed ACKs but for HyStart's ACK train.  Validated on ``bench_emulated``'s four cases and ``validate_emulated``'s matrix
(docs/benchmarks.md, "fifo-bursts with the window model").
"""

from __future__ import annotations

from typing import Callable

from testbed.net.tcpmodel import MSS, RTO_MIN_S
from testbed.sim.engine import Link, Simulator
from testbed.sim.tcpwindow import TcpWindow

REORDER_FRACTION = 0.25  # RACK's reordering window: a quarter of the minimum round trip


class RoundsChannel:
    """One channel sending its messages a window at a time (see the module's docstring).

    ``send`` takes a message of ``size`` bytes and calls ``arrived(t)`` once all of it is in
    at the receiver; ``on_free()`` once the channel may start its next message (all of this
    one sent).  ``counts`` (shared by the run's channels) gathers "burst" (messages sent in
    one round), "rounds" (in several) and "lost" (segments dropped, all connections)."""

    def __init__(self, sim: Simulator, path: list[Link], ack_path: list[Link], ceiling: float, window: TcpWindow,
                 connections: int, queue_bytes: Callable[[Link], float], counts: dict[str, int]):
        self._sim, self._path, self._ack_path = sim, path, ack_path
        self._ceiling, self._win, self._n = ceiling, window, connections
        self._queue_bytes, self._counts = queue_bytes, counts
        self._current: dict | None = None  # the message being written (new segments left)
        self._on_free: Callable[[], None] = lambda: None
        self._losses: list[dict] = []  # lost tails not yet known lost (oldest first)
        self._in_order: list[dict] = []  # messages sent and not yet handed to the receiver, in order
        self._srtt: float | None = None  # the smoothed round trip (RFC 6298's 1/8), queueing included

    def send(self, size: float, owner: str, arrived: Callable[[float], None], on_free: Callable[[], None]) -> None:
        """Start writing a message of ``size`` bytes (the channel is free: ``on_free`` was
        called for the previous one, or there was none)."""
        win = self._win
        win.begin(self._sim.now)
        msg = {"segments": win.segments(size), "bytes": float(size), "owner": owner, "arrived": arrived,
               "rounds": 0, "landed": 0, "unsent_loss": 0, "first": True, "done": None}
        self._counts["burst" if msg["segments"] <= win.room(self._sim.now) else "rounds"] += 1
        self._current, self._on_free = msg, on_free
        self._in_order.append(msg)
        self._pump()

    # -- internals -------------------------------------------------------------------------
    def _pump(self) -> None:
        """The window has (or may have) room: the current message's next round goes."""
        msg = self._current
        if msg is None:
            self._win.in_flight(self._sim.now)  # (the ACKs due now still grow the window now)
            return
        flight = self._win.send_round(self._sim.now, msg["segments"])
        if flight is None:
            return
        payload = flight[1] - (self._win.HEADER_SEGMENTS if msg["first"] else 0)
        msg["first"] = False
        msg["segments"] -= flight[1]
        size = msg["bytes"] if not msg["segments"] else min(msg["bytes"], self._n * payload * MSS)
        msg["bytes"] -= size
        # an ACK-clocked round arrives while the acknowledged bytes leave the queue
        self._put(msg, flight, size, clocked=self._n * self._win.take_clocked(self._sim.now, flight[1]) * MSS)
        if not msg["segments"]:  # all of it is in flight: the channel's next message may follow
            self._current = None
            self._on_free()

    def _put(self, msg: dict, flight: list, size: float, clocked: float = 0.0, recovery: bool = False) -> None:
        """One round of ``msg`` into the network: what the queues take of it, and its lost tail.
        ``clocked``: bytes whose ACKs release the round as they come in, so that it reaches
        the queue as fast as they left it; the queue grows by the rest (a burst: all of it).
        ``recovery``: lost segments sent again, as the ACKs come in (PRR's pace): they take
        the room those leave, and are lost only to a queue already over its bytes."""
        sim, win = self._sim, self._win
        sent_at, srtt = sim.now, self._srtt
        grows = 0.0 if recovery else size - min(size, clocked)
        whole = not recovery and clocked <= 0  # sent into room the window had: all at once
        over = max(sim.backlog(link) + grows - self._queue_bytes(link) for link in self._path)
        mine = None
        lost = min(flight[1], -(-int(round(min(size, over) / self._n)) // MSS)) if over > 0 and size > 0 else 0
        if lost > 0:
            lost_bytes = min(size, self._n * lost * MSS)
            mine = {"msg": msg, "entry": win.lose(flight, lost, timeout=recovery), "segments": lost,
                    "bytes": lost_bytes, "sent_at": sent_at, "known": False}
            self._losses.append(mine)
            msg["unsent_loss"] += 1
            self._counts["lost"] += lost * self._n
            size -= lost_bytes
        msg["rounds"] += 1

        def started(t: float) -> None:  # the round's first byte leaves the bottleneck
            # its ACKs queue behind what the way back holds (the peer's own bursts) then
            back = max((sim.backlog(link) / link.bandwidth for link in self._ack_path), default=0.0)
            # HyStart's sample (``TcpWindow.sample_round``): the round trip's rise is both queues;
            # a round sent into room at once leaves a connection's slice behind another (the
            # typical connection behind half its siblings'), one released by ACKs interleaves them
            bandwidth = min(link.bandwidth for link in self._path)
            per_conn = flight[1] * MSS
            if whole:
                sample = ((t - sent_at) + back + (self._n - 1) / 2 * per_conn / bandwidth, MSS / bandwidth)
            else:
                sample = ((t - sent_at) + back, self._n * MSS / bandwidth)
            win.served(flight, t + back, sample)
            sim.at(flight[0], self._pump)
            sample = (t - sent_at) + back + win.rtt  # its round trip, both queues included
            self._srtt = sample if self._srtt is None else 0.875 * self._srtt + 0.125 * sample
            for loss in self._losses:  # earlier lost segments: this round's ACKs tell of them
                if loss is not mine and not loss["known"] and loss["sent_at"] < sent_at:
                    sim.at(t + back + win.rtt * (1 + REORDER_FRACTION), lambda loss=loss: self._known(loss))
            if mine is not None and recovery:  # a retransmission lost again: the retransmission timeout
                sim.at(sent_at + (srtt if srtt is not None else sample) + RTO_MIN_S, lambda: self._known(mine))
            elif mine is not None:  # the tail-loss probe (two smoothed round trips on), unless told sooner
                probe = sent_at + 2 * (srtt if srtt is not None else sample)
                sim.at(max(probe, t) + sample, lambda: self._known(mine))

        def landed(t: float) -> None:
            msg["landed"] += 1
            if not msg["segments"] and not msg["unsent_loss"] and msg["landed"] == msg["rounds"]:
                msg["done"] = t
                self._deliver()

        sim.transfer(self._path, size, self._ceiling, landed, owner=msg["owner"], burst=True, on_start=started)

    def _deliver(self) -> None:
        """Hand the receiver every message that is whole, in order: TCP delivers a byte stream,
        so a message waits for an earlier one still missing a lost segment."""
        while self._in_order and self._in_order[0]["done"] is not None:
            msg = self._in_order.pop(0)
            msg["arrived"](self._sim.now)

    def _known(self, loss: dict) -> None:
        """``loss`` is known lost now: the window is cut, and its segments go again at once."""
        if loss["known"]:
            return
        loss["known"] = True
        self._losses.remove(loss)
        now = self._sim.now
        self._win.detected(loss["entry"], now)
        flight = self._win.send_round(now, loss["segments"], retransmit=True)
        msg = loss["msg"]
        msg["unsent_loss"] -= 1
        self._put(msg, flight, loss["bytes"], recovery=True)
