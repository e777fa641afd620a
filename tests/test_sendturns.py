"""Turns at the senders (``testbed/net/sendturns.py``): the server hands a link to one pipeline
at a time in the plan's order, nobody's turn outlives its sender, a sender without a server
sends anyway, and a turn is handed on only once the message's tail is in flight.  Real Unix
and TCP sockets on this machine; no network namespaces."""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from testbed import messages as m
from testbed.net.sendturns import TurnClient, TurnServer, unacknowledged


@pytest.fixture
def server(tmp_path):
    srv = TurnServer(str(tmp_path / "turns.sock"))
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            ready, _, _ = select.select(srv.fds(), [], [], 0.05)
            for fd in ready:
                srv.handle(fd)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield srv
    stop.set()
    t.join(2)
    srv.close()


class _Sender:
    """A raw client: want, read a grant (or not, within a timeout), done."""

    def __init__(self, path: str, pipeline: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.pipeline = pipeline

    def want(self, link="a->b") -> None:
        self.sock.sendall(m.line(m.TurnWant(link=link, pipeline=self.pipeline)))

    def granted(self, timeout=0.3) -> bool:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except socket.timeout:
            return False
        return b"turn_grant" in data

    def done(self, link="a->b", nbytes=100) -> None:
        self.sock.sendall(m.line(m.TurnDone(link=link, nbytes=nbytes)))


def test_one_pipeline_at_a_time_in_the_plans_order(server):
    server.set_order("a->b", ["r2", "r0", "r1"])
    r0, r1, r2 = (_Sender(server.path, f"r{i}") for i in range(3))
    r0.want()
    assert r0.granted()  # the link was free
    r1.want()
    time.sleep(0.05)
    r2.want()
    assert not r1.granted(0.1) and not r2.granted(0.1)  # r0 holds it
    r0.done()
    assert r2.granted() and not r1.granted(0.1)  # r2 ranks first, though r1 asked first
    r2.done()
    assert r1.granted()
    r1.done(nbytes=7)
    deadline = time.monotonic() + 2
    while server.stats()["a->b"]["pipelines"]["r1"]["bytes"] != 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = server.stats()["a->b"]
    assert stats["order"] == ["r2", "r0", "r1"]
    assert {p: c["turns"] for p, c in stats["pipelines"].items()} == {"r0": 1, "r1": 1, "r2": 1}
    assert stats["pipelines"]["r1"]["bytes"] == 7
    assert stats["pipelines"]["r1"]["waited_s"] > stats["pipelines"]["r2"]["waited_s"]


def test_without_an_order_every_sender_is_granted_at_once(server):
    a, b = _Sender(server.path, "r0"), _Sender(server.path, "r1")
    a.want()
    b.want()
    assert a.granted() and b.granted()


def test_an_order_arriving_waits_for_the_free_turns_to_end(server):
    a, b = _Sender(server.path, "r0"), _Sender(server.path, "r1")
    a.want()
    assert a.granted()
    server.set_order("a->b", ["r1", "r0"])
    b.want()
    assert not b.granted(0.1)  # a still sends what it was given without turns
    a.done()
    assert b.granted()


def _one_holding_one_waiting(server) -> tuple[_Sender, _Sender]:
    server.set_order("a->b", ["r0", "r1"])
    a, b = _Sender(server.path, "r0"), _Sender(server.path, "r1")
    a.want()
    assert a.granted()
    b.want()
    assert not b.granted(0.1)
    return a, b


def test_a_plan_withdrawn_frees_everyone_waiting(server):
    _a, b = _one_holding_one_waiting(server)
    server.set_order("a->b", None)
    assert b.granted()


def test_a_dead_senders_turn_goes_to_the_next(server):
    a, b = _one_holding_one_waiting(server)
    a.sock.close()  # killed while holding the link
    assert b.granted()


def test_a_sender_without_a_server_sends_without_turns(tmp_path, capsys):
    client = TurnClient(str(tmp_path / "nobody.sock"), "r0", ["a->b"], 0, 1e6, name="w", connect_s=0.3)
    t0 = time.monotonic()
    client.acquire()
    assert client.down and time.monotonic() - t0 < 10
    client.acquire()  # from then on at once
    assert "sending without turns" in capsys.readouterr().err


def test_a_multi_link_path_takes_its_links_in_sorted_order(server):
    server.set_order("a->b", ["r0", "r1"])
    server.set_order("b->c", ["r0", "r1"])
    holder = _Sender(server.path, "r1")
    holder.want("b->c")
    assert holder.granted()
    client = TurnClient(server.path, "r0", ["b->c", "a->b"], 0, 1e6, timeout_s=5)
    done = threading.Event()
    threading.Thread(target=lambda: (client.acquire(), done.set()), daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set()  # it holds a->b and waits for b->c
    assert server.stats()["a->b"]["pipelines"]["r0"]["turns"] == 1
    holder.done("b->c")
    assert done.wait(2) and not client.down


def test_a_turn_is_handed_on_only_once_the_tail_is_in_flight(server):
    """``release`` holds the turn while more than ``handover_bytes`` of the message is
    unacknowledged: here a receiver that does not read keeps 2 MB in the sender's queue."""
    server.set_order("a->b", ["r0", "r1"])
    lst = socket.create_server(("127.0.0.1", 0))
    tx = socket.create_connection(lst.getsockname())
    rx, _ = lst.accept()
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    tx.setblocking(False)
    sent = 0
    payload = b"x" * (2 << 20)
    try:
        while sent < len(payload):
            sent += tx.send(payload[sent:])
    except BlockingIOError:
        pass
    assert unacknowledged([tx]) > 256 * 1024
    client = TurnClient(server.path, "r0", ["a->b"], 256 * 1024, 1e6, timeout_s=5)
    client.acquire()
    released = threading.Event()
    threading.Thread(target=lambda: (client.release([tx], sent), released.set()), daemon=True).start()
    other = _Sender(server.path, "r1")
    other.want()
    assert not released.wait(0.3) and not other.granted(0.1)
    rx.setblocking(False)
    deadline = time.monotonic() + 5
    while not released.is_set() and time.monotonic() < deadline:  # the receiver reads: the queue drains
        try:
            rx.recv(1 << 20)
        except BlockingIOError:
            time.sleep(0.001)
    assert released.is_set() and other.granted()
    for s in (tx, rx, lst):
        s.close()


def test_a_sender_with_its_next_message_ready_keeps_its_rank(server):
    """``more``: the holder's next message waits with the others in its rank, so a
    higher-ranked pipeline sends its messages back to back, as strict priority would (without
    it, two pipelines alternate message by message)."""
    server.set_order("a->b", ["r0", "r1"])
    a, b = _Sender(server.path, "r0"), _Sender(server.path, "r1")
    a.want()
    assert a.granted()
    b.want()
    a.sock.sendall(m.line(m.TurnDone(link="a->b", nbytes=1, more=True)))
    assert a.granted() and not b.granted(0.1)
    a.done()
    assert b.granted()


def test_a_turn_goes_to_as_many_pipelines_as_it_takes_to_fill_the_link(server):
    """Pipelines whose connections carry 0.4 of the link each: two hold it at once, and the
    third waits; a holder of unknown ceiling (0: the whole link) holds it alone."""
    server.set_order("a->b", ["r0", "r1", "r2"], capacity_bytes_s=1e6)
    senders = [_Sender(server.path, f"r{i}") for i in range(3)]
    for s in senders:
        s.sock.sendall(m.line(m.TurnWant(link="a->b", pipeline=s.pipeline, ceiling_bytes_s=4e5)))
    granted = [s.granted(0.3) for s in senders]
    assert granted.count(True) == 3  # 0.4 + 0.4 < 1: room for a third
    for s in senders:
        s.done()
    time.sleep(0.1)
    for s in senders:
        s.sock.sendall(m.line(m.TurnWant(link="a->b", pipeline=s.pipeline, ceiling_bytes_s=5e5)))
    assert [s.granted(0.3) for s in senders] == [True, True, False]  # 0.5 + 0.5 fills it
    senders[0].done()
    assert senders[2].granted()
    whole = _Sender(server.path, "r0")
    whole.want()  # no ceiling: the whole link
    assert not whole.granted(0.1)
    senders[1].done()
    senders[2].done()
    assert whole.granted()


def test_a_paced_channel_carries_the_kernels_pacing_rate_and_its_messages_arrive_whole():
    """``parallel.paced``: every connection of the channel has SO_MAX_PACING_RATE set (read
    back from the socket), and a message striped over them arrives whole."""
    from testbed.train.transport import _SO_MAX_PACING_RATE, Endpoint

    a, b = Endpoint("a", "127.0.0.1", 0), Endpoint("b", "127.0.0.1", 0)
    port = b._listener.getsockname()[1]
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("ch", b.accept("a", 1, 4, 0, timeout=10)), daemon=True)
    t.start()
    out = a.connect("b", "127.0.0.1", port, 1, 4, 0, timeout=10, pace=1_000_000)
    t.join(10)
    assert [s.getsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE) for s in out.socks] == [1_000_000] * 4
    out.send(b"x" * 100_000)
    assert bytes(got["ch"].recv(timeout=10)) == b"x" * 100_000
    for x in (out, got["ch"], a, b):
        x.close()


def test_a_sender_whose_turn_never_comes_sends_without_turns_after_its_timeout(server, capsys):
    holder = _Sender(server.path, "r0")
    server.set_order("a->b", ["r0", "r1"])
    holder.want()
    assert holder.granted()
    client = TurnClient(server.path, "r1", ["a->b"], 0, 1e6, timeout_s=0.3, name="w")
    t0 = time.monotonic()
    client.acquire()
    assert client.down and 0.25 < time.monotonic() - t0 < 5
    assert "gave no turn on a->b within 0.3 s" in capsys.readouterr().err
