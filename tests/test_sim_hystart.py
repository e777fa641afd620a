"""CUBIC's HyStart in the simulator's window model (``testbed/sim/tcpwindow.py`` ``_hystart``)."""

from testbed.net.tcpmodel import MSS
from testbed.sim.tcpwindow import TcpWindow, hystart_delay_threshold


def test_hystart_delay_ends_slow_start_where_the_queue_rises():
    """Delay: from a window of 16, a round whose first segments meet a queue deeper than
    clamp(min_rtt / 8, 4 ms, 16 ms) ends slow start at its 9th ACK (every second segment
    acknowledged): ssthresh = cwnd then; a shallower queue does not."""
    assert hystart_delay_threshold(0.005) == 0.004 and hystart_delay_threshold(0.05) == 0.00625
    assert hystart_delay_threshold(0.262) == 0.016
    ends = {}
    for queue in (0.010, 0.020):
        w = TcpWindow(0.262, 4, 1e9, True, hystart=True)
        w.segs = 40
        w.begin(0.0, 4 * 23 * MSS)  # 24 segments a connection, the header's included
        w.sample_round(queue, MSS / 4e6)
        w.end(0.01)
        w.in_flight(0.3)
        ends[queue] = (w.segs, w.ssthresh, w.hystart_exit)
    assert ends[0.010] == (48, float("inf"), None)  # slow start: twice the flight
    assert ends[0.020] == (48, 48, (48, "delay"))  # 40 + 16 segments by the 9th ACK, held to 2 x 24
    low = TcpWindow(0.262, 4, 1e9, True, hystart=True)  # under hystart_low_window it does not run
    low.begin(0.0, 4 * 11 * MSS)
    low.sample_round(0.1, MSS / 4e6)
    low.end(0.01)
    low.in_flight(0.3)
    assert low.ssthresh == float("inf") and low.hystart_exit is None
    off = TcpWindow(0.262, 4, 1e9, True)  # off: the window model as before
    off.segs = 40
    off.begin(0.0, 4 * 23 * MSS)
    off.sample_round(0.1, MSS / 4e6)
    off.end(0.01)
    off.in_flight(0.3)
    assert off.ssthresh == float("inf") and off.segs == 48


def test_hystart_ack_train_and_cubic_growth():
    """ACK train: a round's ACKs (every second segment) no more than 2 ms apart spanning half
    (min_rtt + 1 ms) end slow start (a lone bulk flow: about half the BDP into a round); at
    8 Mbit/s a delayed ACK comes 2.9 ms after the last, no train.  Above ssthresh, no loss
    yet: CUBIC, at least 5% a round trip."""

    def bulk(rate):
        w = TcpWindow(0.05, 1, 1e9, True, hystart=True)
        w.begin(0.0, 1e9)
        for i in range(7):
            w.sample_round(0.0, MSS / rate)
            w.grow(now=0.05 * (i + 1))
        return w

    fast, slow = bulk(12.5e6), bulk(1e6)
    # 100 Mbit/s: ACKs 0.23 ms apart; past 25.5 ms at the 112th ACK (222 segments) of the 320-segment round
    assert fast.hystart_exit == (542, "train") and fast.ssthresh == 542
    assert slow.hystart_exit is None and slow.segs == 1280  # 10 x 2^7
    before = fast.segs
    fast.grow(now=1.0)
    assert before * 1.045 <= fast.segs <= before * 1.06  # 574 ACKs / 20
