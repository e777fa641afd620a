"""How precisely a WAN link follows a temporal-sharing plan, measured from its counters.

Two (or more) pipelines send bulk TCP (iperf3, cubic) over one WAN direction while the
delay line's scheduler hands the link to one pipeline per turn (``WanDirection.set_turns``).
For every completed turn the line reports the wire bytes each pipeline sent and how long
anyone had data queued; the link's HTB counters give the utilization over the whole window.

    measure_turns(net, "east", "west", turn_s=0.02)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from dataclasses import dataclass

from testbed.net.network import Network, NetworkError


@dataclass
class TurnPrecision:
    turns: int
    owner_share_mean: float
    owner_share_p10: float  # 90% of turns give the owner at least this share
    line_utilization: float  # wire bytes in all turns / (rate x their duration)
    link_utilization: float  # the HTB counters over the window / (rate x window)
    goodput_mbps: dict[str, float]

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def measure_turns(net: Network, src: str, dst: str, turn_s: float = 0.02, seconds: float = 3.0,
                  pipelines: int = 2, warmup_s: float = 1.5) -> TurnPrecision:
    """Pipeline ``d`` = host d of ``src`` -> host d of ``dst``; turns rotate d = 0, 1, ..."""
    link = net.link(src, dst)
    pairs = [(net.host(src, d), net.host(dst, d)) for d in range(pipelines)]
    names = [f"p{d}" for d in range(pipelines)]
    link.schedule_classes({n: [(a.ip, b.ip)] for n, (a, b) in zip(names, pairs)})
    port = 5400
    total = warmup_s + seconds + 1.0
    servers = [net.popen(b, ["iperf3", "-s", "-1", "-p", str(port + d)]) for d, (_, b) in enumerate(pairs)]
    clients = []
    try:
        time.sleep(0.3)
        for d, (a, b) in enumerate(pairs):
            clients.append(net.popen(a, ["iperf3", "-c", b.ip, "-p", str(port + d), "-t", f"{total:.1f}",
                                         "-C", "cubic", "-J"], stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        time.sleep(warmup_s)
        t0 = time.monotonic()
        period = turn_s * pipelines
        link.set_turns(t0, period, [(n, d * turn_s, (d + 1) * turn_s) for d, n in enumerate(names)])
        before = link.counters()
        time.sleep(seconds)
        after = link.counters()
        t1 = time.monotonic()
        turns, since = [], -1
        while True:
            got = link.delay_line_stats(turns_since=since)["sched"]["turns"]
            if not got:
                break
            turns += got
            since = got[-1][0]
        goodput = {}
        for n, c in zip(names, clients):
            out, err = c.communicate(timeout=total + 10)
            try:
                goodput[n] = json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e6
            except (ValueError, KeyError):
                raise NetworkError(f"iperf3 for {n} failed: {(err or out)[-200:]!r}") from None
    finally:
        for p in clients + servers:
            if p.poll() is None:
                p.terminate()
            p.wait(5)
        link.clear_schedule()
    rate = link.params.rate_mbps * 1e6 / 8
    shares, carried, span = [], 0, 0.0
    for _index, owner, start, sent, _busy, end in turns:
        total_bytes = sum(sent.values())
        if start < t0 or end > t1 or owner not in sent:
            continue
        carried += total_bytes
        span += end - start
        if total_bytes:
            shares.append(sent[owner] / total_bytes)
    if not shares:
        raise NetworkError(f"{src}->{dst}: no completed turns were recorded")
    shares.sort()
    return TurnPrecision(
        turns=len(shares),
        owner_share_mean=round(statistics.fmean(shares), 4),
        owner_share_p10=round(shares[len(shares) // 10], 4),
        line_utilization=round(carried / (rate * span), 4),
        link_utilization=round((after.tx_bytes - before.tx_bytes) / (rate * (after.time - before.time)), 4),
        goodput_mbps={k: round(v, 2) for k, v in goodput.items()},
    )
