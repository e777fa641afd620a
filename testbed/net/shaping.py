"""Traffic control on one WAN egress interface, through pyroute2.

How it fits: ``network.py`` gives each WAN direction an ``EgressShaper`` on the sending
router's WAN interface.  The shaper owns the tc tree there and changes it in place (never
delete-and-re-add: that causes artefacts)::

    htb 1: (default 1:10)
      class 1:1   rate R ceil R                      the link
        class 1:10  rate R*(1 - sum shares) ceil R   unclassified traffic
          leaf 10:  bfifo limit=queue_bytes          (TUN backend: delay is upstream)
                    netem delay/jitter/loss limit    (netem backend; a rate far above R keeps
                                                      packet order under jitter)
        class 1:N   rate R*share ceil R              one traffic class per caller's name
          leaf N:   the same leaf kind
      u32 filters (protocol IPv4) on src/dst address -> 1:N

Ceil R on every class keeps sharing work-conserving: a class gets at least its share and
may borrow what the others leave.  Counters come from the interface's 64-bit statistics and
the classes' tc statistics, one netlink dump each, cheap enough to sample every 10 ms.
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field

from pyroute2 import IPRoute
from pyroute2.netlink.rtnl import tcmsg as _tcmsg

# pyroute2 0.9 has no bfifo plugin and then ignores ``parent`` (attaching at the root);
# bfifo's options are pfifo's (struct tc_fifo_qopt, a byte limit instead of packets).
_tcmsg.plugins.setdefault("bfifo", _tcmsg.sched_pfifo)
# pyroute2 0.9 also sends netem's ``rate`` as the generic TCA_RATE attribute (a rate estimator,
# encoded as a string: TypeError); netem's own TCA_NETEM_RATE is all that is meant.
if not hasattr(_tcmsg.plugins["netem"], "fix_request"):
    _tcmsg.plugins["netem"].fix_request = lambda context: context.pop("rate", None)

_ROOT = 0x10000
_LINK = 0x10001
_DEFAULT = 0x10010
_FIRST_CLASS_MINOR = 0x100
_MTU = 1600
_GSO_MAX = 65536
# netem draws each packet's delay on its own, so under jitter a later packet can leave before
# an earlier one (measured: 30 of 300 pings 2 ms apart reordered at 20 +- 5 ms).  With a rate
# set, netem times each packet after the last one queued (sch_netem.c: "last packet in queue is
# reference point"), which keeps their order as the TUN delay line does.  The largest rate its
# 32-bit field holds (~34 Gbit/s: 15 us per 64 KB GSO packet) leaves the shaping to HTB.
_NETEM_ORDER_RATE = 0xFFFFFFFF  # bytes/s


def _handle(major: int, minor: int = 0) -> int:
    return (major << 16) | minor


def _tc(handle: int) -> str:
    """A handle as tc spells it (hex major:minor)."""
    return f"{handle >> 16:x}:{handle & 0xFFFF:x}"


@dataclass
class NetemParams:
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0


@dataclass
class ClassCounters:
    bytes: int
    packets: int
    drops: int
    backlog_bytes: int


@dataclass
class Counters:
    """One sample of a WAN direction's counters (``time`` is time.monotonic())."""

    time: float
    tx_bytes: int
    tx_packets: int
    drops: int
    backlog_bytes: int
    classes: dict[str, ClassCounters] = field(default_factory=dict)


@dataclass
class _Class:
    name: str
    minor: int
    share: float
    matches: list[tuple[str | None, str | None]]
    filter_prios: list[int] = field(default_factory=list)


def htb_burst(rate_bytes_s: float) -> int:
    """Bucket depth: 0.5 ms at the rate, at least two MTUs.

    The bucket is what leaves at line speed after an idle spell, so it must be small against
    the messages the link carries: it was two GSO packets (128 KiB), and a 128 KiB message
    crossed a 200 Mbit/s, 1 ms link in 2.7 ms instead of the 7.5 ms its serialisation takes
    (measured; with this depth 7.3 ms).  A GSO packet larger than the bucket only drives the
    tokens negative, so bulk goodput stays within 1% of the rate (measured 200 Mbit/s to
    8 Gbit/s); below 0.5 ms at the rate, the pacing timer lost 10% at 4 Gbit/s."""
    return int(max(2 * _MTU, rate_bytes_s * 0.0005))


class EgressShaper:
    """Rate, queue (and, with netem, delay/loss) of one interface's egress, plus classes."""

    def __init__(
        self,
        ipr: IPRoute,
        ifname: str,
        rate_mbps: float,
        queue_bytes: int,
        netem: NetemParams | None = None,
        index: int | None = None,
    ):
        self._ipr = ipr
        self.ifname = ifname
        self.index = index if index is not None else ipr.link_lookup(ifname=ifname)[0]
        self.rate_mbps = rate_mbps
        self.queue_bytes = queue_bytes
        self.netem = netem  # None: bfifo leaves (the delay line sits upstream)
        self._classes: dict[str, _Class] = {}
        self._next_minor = _FIRST_CLASS_MINOR
        self._next_prio = 10

    # -- building -------------------------------------------------------------------
    def install(self) -> None:
        ipr, idx = self._ipr, self.index
        ipr.tc("add", "htb", idx, _ROOT, default=0x10, r2q=10)
        rate = self._rate()
        ipr.tc("add-class", "htb", idx, _LINK, parent=_ROOT, **self._class_args(rate, rate))
        ipr.tc("add-class", "htb", idx, _DEFAULT, parent=_LINK, **self._class_args(rate, rate))
        self._leaf("add", _DEFAULT)

    def install_commands(self) -> list[str] | None:
        """What ``install`` makes, as ``tc -batch`` lines, for a gateway's shell to run with
        its other shapers' (a large network's start-up: one tc process per gateway, all at
        once, instead of four netlink requests from Python per direction).  The kernel holds
        the same tree either way (``tests/test_network.py`` compares them).  None with netem:
        its order-keeping rate is a 32-bit netlink field that tc spells differently, so
        ``install`` makes that tree."""
        if self.netem is not None:
            return None
        rate = self._rate()
        a = self._class_args(rate, rate)
        cls = (f"htb rate {rate * 8}bit ceil {rate * 8}bit burst {a['burst']}b cburst {a['cburst']}b "
               f"quantum {a['quantum']} mtu {a['mtu']}")
        dev = self.ifname
        return [f"qdisc add dev {dev} root handle {_ROOT >> 16:x}: htb default {_DEFAULT & 0xFFFF:x} r2q 10",
                f"class add dev {dev} parent {_ROOT >> 16:x}: classid {_tc(_LINK)} {cls}",
                f"class add dev {dev} parent {_tc(_LINK)} classid {_tc(_DEFAULT)} {cls}",
                f"qdisc add dev {dev} parent {_tc(_DEFAULT)} handle {_DEFAULT & 0xFFFF:x}: bfifo limit {self.queue_bytes}"]

    def _rate(self) -> int:
        return int(self.rate_mbps * 1e6 / 8)

    def _class_args(self, rate: int, ceil: int) -> dict:
        return {
            "rate": rate,
            "ceil": ceil,
            "burst": htb_burst(ceil),
            "cburst": htb_burst(ceil),
            "quantum": int(min(200_000, max(_MTU, rate / 1000))),
            "mtu": _GSO_MAX,
        }

    def _leaf(self, verb: str, class_handle: int) -> None:
        minor = class_handle & 0xFFFF
        if self.netem is None:
            self._ipr.tc(verb, "bfifo", self.index, _handle(minor), parent=class_handle, limit=self.queue_bytes)
        else:
            p = self.netem
            # netem queues in packets: the in-flight delay-bandwidth product plus the queue.
            in_flight = self._rate() * (p.delay_ms + p.jitter_ms) / 1000.0
            limit = max(1000, int((in_flight + self.queue_bytes) / 1500) + 1)
            self._ipr.tc(
                verb,
                "netem",
                self.index,
                _handle(minor),
                parent=class_handle,
                delay=int(p.delay_ms * 1000),
                jitter=int(p.jitter_ms * 1000),
                loss=p.loss * 100.0,
                limit=limit,
                rate=_NETEM_ORDER_RATE,
            )

    def _leaves(self) -> list[int]:
        return [_DEFAULT] + [_handle(1, c.minor) for c in self._classes.values()]

    # -- changing in place ----------------------------------------------------------
    def set_rate(self, rate_mbps: float) -> None:
        """Change the link's rate (and every class's share of it) in place.  On a failure the
        rate goes back (as far as the kernel lets it), so ``rate_mbps`` is what tc has."""
        old = self.rate_mbps
        self.rate_mbps = rate_mbps
        try:
            self._apply_rate()
        except BaseException:
            self.rate_mbps = old
            try:
                self._apply_rate()
            except Exception:
                pass
            raise

    def _apply_rate(self) -> None:
        rate = self._rate()
        self._ipr.tc("change-class", "htb", self.index, _LINK, parent=_ROOT, **self._class_args(rate, rate))
        self._apply_shares()
        if self.netem is not None:  # the netem limit depends on the rate
            for leaf in self._leaves():
                self._leaf("change", leaf)

    def set_queue(self, queue_bytes: int) -> None:
        self._change_leaves("queue_bytes", queue_bytes)

    def set_netem(self, params: NetemParams) -> None:
        if self.netem is None:
            raise RuntimeError(f"{self.ifname}: this shaper has bfifo leaves; delay lives in the delay line")
        self._change_leaves("netem", params)

    def _change_leaves(self, attr: str, value) -> None:
        """Set ``attr`` and change every leaf; on a failure put the old value back on them."""
        old = getattr(self, attr)
        setattr(self, attr, value)
        try:
            for leaf in self._leaves():
                self._leaf("change", leaf)
        except BaseException:
            setattr(self, attr, old)
            try:
                for leaf in self._leaves():
                    self._leaf("change", leaf)
            except Exception:
                pass
            raise

    # -- traffic classes ------------------------------------------------------------
    def add_class(self, name: str, matches: list[tuple[str | None, str | None]], share: float = 0.0) -> None:
        """A class for packets matching any (src, dst) pair (an address or None = any)."""
        if name in self._classes:
            raise ValueError(f"class {name!r} exists on {self.ifname}")
        if not matches:
            raise ValueError(f"class {name!r}: give at least one (src, dst) match")
        cls = _Class(name, self._next_minor, share, list(matches))
        self._next_minor += 1
        handle = _handle(1, cls.minor)
        rate = self._rate()
        self._ipr.tc(
            "add-class", "htb", self.index, handle, parent=_LINK, **self._class_args(max(1, int(rate * share)), rate)
        )
        self._leaf("add", handle)
        for src, dst in cls.matches:
            prio = self._next_prio
            self._next_prio += 1
            self._ipr.tc(
                "add-filter",
                "u32",
                self.index,
                parent=_ROOT,
                prio=prio,
                protocol=0x0800,  # ETH_P_IP; socket.AF_INET would make an ax25 filter
                target=handle,
                keys=_u32_keys(src, dst),
            )
            cls.filter_prios.append(prio)
        self._classes[name] = cls
        self._apply_shares()

    def set_shares(self, shares: dict[str, float]) -> None:
        """Guaranteed fraction of the link per class; what is unused is lent to the others."""
        unknown = set(shares) - set(self._classes)
        if unknown:
            raise KeyError(f"{self.ifname}: no class {sorted(unknown)[0]!r}")
        total = sum(shares.values())
        if total > 1.0 + 1e-9 or min(shares.values(), default=0) < 0:
            raise ValueError(f"shares must be >= 0 and sum to at most 1, got {shares}")
        for name, share in shares.items():
            self._classes[name].share = share
        self._apply_shares()

    def class_names(self) -> list[str]:
        return list(self._classes)

    def _apply_shares(self) -> None:
        rate = self._rate()
        for cls in self._classes.values():
            self._ipr.tc(
                "change-class",
                "htb",
                self.index,
                _handle(1, cls.minor),
                parent=_LINK,
                **self._class_args(max(1, int(rate * cls.share)), rate),
            )
        rest = max(0.01, 1.0 - sum(c.share for c in self._classes.values()))
        self._ipr.tc("change-class", "htb", self.index, _DEFAULT, parent=_LINK, **self._class_args(int(rate * rest), rate))

    # -- counters -------------------------------------------------------------------
    def counters(self) -> Counters:
        now = time.monotonic()
        link = self._ipr.get_links(self.index)[0]
        stats = link.get_attr("IFLA_STATS64")
        drops = backlog = 0
        by_minor: dict[int, ClassCounters] = {}
        for msg in self._ipr.get_classes(self.index):
            handle = msg["handle"]
            st = msg.get_attr("TCA_STATS2")
            if st is None:
                continue
            basic = st.get_attr("TCA_STATS_BASIC") or {}
            queue = st.get_attr("TCA_STATS_QUEUE") or {}
            c = ClassCounters(basic.get("bytes", 0), basic.get("packets", 0), queue.get("drops", 0), queue.get("backlog", 0))
            by_minor[handle & 0xFFFF] = c
            if handle != _LINK:
                drops += c.drops
                backlog += c.backlog_bytes
        classes = {name: by_minor[c.minor] for name, c in self._classes.items() if c.minor in by_minor}
        if (_DEFAULT & 0xFFFF) in by_minor:
            classes["default"] = by_minor[_DEFAULT & 0xFFFF]
        return Counters(now, stats["tx_bytes"], stats["tx_packets"], drops, backlog, classes)


def _u32_keys(src: str | None, dst: str | None) -> list[str]:
    keys = []
    for addr, offset in ((src, 12), (dst, 16)):
        if addr is None:
            continue
        net = ipaddress.ip_network(addr, strict=False)
        keys.append(f"0x{int(net.network_address):08x}/0x{int(net.netmask):08x}+{offset}")
    if not keys:
        keys.append("0x0/0x0+0")
    return keys
