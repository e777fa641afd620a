"""Azure regions, the private WAN's backbone, and the Internet paths beside it.

How it fits: ``AzureWan`` reads the copied data (``data/``): the published P95 RTT matrix
over Azure's backbone, each region's tab group and time zone, Teams' bitrates and targets.
``Backbone`` turns the matrix into WAN links: an edge a-b is kept unless some relay region c
gives RTT(a,c) + RTT(c,b) <= ``relay_factor`` x RTT(a,b) (then the traffic would ride the
relay anyway); traffic between two regions follows the backbone hop by hop, over the direct
edge where one exists, else along the shortest-RTT path (the same rule the testbed's
``Topology.next_hops`` routes by, so the emulator's packets take the paths planned here).
``World`` is one problem instance: user regions, media-server DCs, and for every (user, DC)
the WAN RTT (sum of the backbone edges' RTTs), the Internet RTT, whether the Internet path
meets the quality targets, and the WAN links the traffic crosses in each direction
(``World.crossed_edges``: the part of the backbone its traffic can use).

The Internet model, stated: a pair's Internet RTT is its direct WAN RTT plus the measured
median (Internet - WAN) for its pair of region groups (``data/internet_vs_wan_offsets.csv``;
rows marked ``assumed`` were not measured) plus a per-pair spread drawn once (uniform
+-``_SPREAD_MS``, seeded by the pair's names), never below 0.9 x the WAN RTT.  Loss and
jitter per group pair (``_INTERNET_QUALITY``) are assumptions with heavier tails than the
WAN's (which is taken as clean); a path whose assumed loss or jitter misses Teams' targets
is not eligible for offload.  Access latency (user to edge) is the same on both routes and
left out.
"""

from __future__ import annotations

import csv
import heapq
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from agents.titan.spec import Targets, TitanError

DATA = Path(__file__).resolve().parent / "data"
GROUPS = ("Americas", "Europe", "APAC", "MEA")
_SPREAD_MS = 5.0
# assumed (loss fraction, jitter ms) of Internet paths per pair of region groups: the median
# path; the emulator and the Titan controller see tails around these
_INTERNET_QUALITY: dict[frozenset[str], tuple[float, float]] = {
    frozenset({"Americas"}): (0.002, 4.0),
    frozenset({"Europe"}): (0.002, 4.0),
    frozenset({"Americas", "Europe"}): (0.003, 6.0),
    frozenset({"APAC"}): (0.005, 10.0),
    frozenset({"APAC", "Americas"}): (0.006, 12.0),
    frozenset({"APAC", "Europe"}): (0.006, 12.0),
    frozenset({"MEA"}): (0.006, 12.0),
    frozenset({"Europe", "MEA"}): (0.006, 12.0),
    frozenset({"Americas", "MEA"}): (0.008, 15.0),
    frozenset({"APAC", "MEA"}): (0.015, 25.0),
}


@dataclass(frozen=True)
class Region:
    name: str  # as the latency page writes it, e.g. "West Europe"
    key: str  # programmatic name, e.g. "westeurope" (also the emulator's DC name)
    group: str  # Americas, Europe, APAC or MEA
    utc_offset_h: float
    location: str


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


class AzureWan:
    """The published data: regions, the directed P95 RTT matrix, Teams' bitrates and targets."""

    def __init__(self, data_dir: Path = DATA):
        with open(data_dir / "azure_interregion_rtt_p95_matrix.csv", newline="") as fh:
            rows = list(csv.reader(fh))
        names = rows[0][1:]
        n = len(names)
        rtt = np.full((n, n), np.nan)
        for i, row in enumerate(rows[1:]):
            if row[0] != names[i]:
                raise TitanError(f"{data_dir}: matrix row {i} is {row[0]!r}, expected {names[i]!r}")
            for j, value in enumerate(row[1:]):
                if value.strip():
                    rtt[i, j] = float(value)
        meta = {}
        with open(data_dir / "azure_regions.csv", newline="") as fh:
            for r in csv.DictReader(fh):
                meta[r["region"]] = r
        with open(data_dir / "region_timezones.csv", newline="") as fh:
            tz = {r["region"]: float(r["utc_offset_h"]) for r in csv.DictReader(fh)}
        self.regions: list[Region] = []
        for name in names:
            m = meta.get(name, {})
            key = m.get("programmatic_name") or _norm(name)
            self.regions.append(Region(name, key, m["latency_doc_group"], tz[name], m.get("physical_location", "")))
        self._index = {r.key: i for i, r in enumerate(self.regions)}
        self._lookup = {_norm(r.name): r.key for r in self.regions} | {_norm(r.key): r.key for r in self.regions}
        self.rtt_directed = rtt
        sym = (rtt + rtt.T) / 2
        np.fill_diagonal(sym, 0.0)
        self.rtt_sym = sym
        with open(data_dir / "internet_vs_wan_offsets.csv", newline="") as fh:
            self.internet_offsets = {
                frozenset((r["group_a"], r["group_b"])): (float(r["internet_minus_wan_ms"]), r["source"])
                for r in csv.DictReader(fh)
            }
        with open(data_dir / "teams_bandwidth_scenarios.csv", newline="") as fh:
            self.teams_kbps = {r["scenario"]: (float(r["up_kbps"]), float(r["down_kbps"])) for r in csv.DictReader(fh)}

    @property
    def keys(self) -> list[str]:
        return [r.key for r in self.regions]

    def key(self, name: str, field_name: str = "region") -> str:
        """The programmatic name of a region given by either spelling; one-line error if unknown."""
        key = self._lookup.get(_norm(name))
        if key is None:
            raise TitanError(f"{field_name}: unknown Azure region {name!r} (not in the P95 RTT matrix; "
                             f"known: {', '.join(self.keys)})")
        return key

    def region(self, name: str) -> Region:
        return self.regions[self._index[self.key(name)]]

    def index(self, key: str) -> int:
        return self._index[key]

    def rtt(self, a: str, b: str) -> float:
        """Symmetric P95 RTT (ms), the mean of both directions; 0 within a region."""
        return float(self.rtt_sym[self._index[a], self._index[b]])

    def internet_rtt(self, a: str, b: str) -> float:
        """The modelled Internet RTT between two regions (see the module docstring)."""
        if a == b:
            return 0.0
        wan = self.rtt(a, b)
        ga, gb = self.region(a).group, self.region(b).group
        offset, _ = self.internet_offsets[frozenset((ga, gb))]
        pair = "|".join(sorted((a, b)))
        u = (zlib.crc32(pair.encode()) % 10_000) / 10_000.0  # fixed per pair, same every run
        return max(0.9 * wan, wan + offset + (2 * u - 1) * _SPREAD_MS)

    def internet_quality(self, a: str, b: str) -> tuple[float, float]:
        """Assumed (loss, jitter ms) of the Internet path between two regions."""
        return _INTERNET_QUALITY[frozenset((self.region(a).group, self.region(b).group))]

    def bitrates(self, media: str, participants: int) -> tuple[float, float]:
        """Teams kbps (up, down) per participant for a call's media and size."""
        k = self.teams_kbps
        if media == "audio":
            return k["Peer-to-peer audio calling"]
        if media == "video":
            if participants <= 2:
                return k["Peer-to-peer quality video calling 360p at 30fps"]
            return k["Group Video calling"]
        if media == "hd":
            if participants <= 2:
                return k["Peer-to-peer HD quality video calling with resolution of HD 720p at 30fps"]
            return k["HD Group video calling (540p videos on 1080p screen)"]
        raise TitanError(f"media: unknown kind {media!r} (audio, video, hd)")

    def targets(self) -> Targets:
        """Teams' client-to-edge targets from the copied table."""
        with open(DATA / "teams_network_targets.csv", newline="") as fh:
            rows = {r["metric"]: r["client_to_microsoft_edge"] for r in csv.DictReader(fh)}

        def num(text: str) -> float:
            return float("".join(ch for ch in text.split("during")[0] if ch.isdigit() or ch == "."))

        return Targets(rtt_ms=num(rows["Latency (RTT or Round-trip Time)"]),
                       loss=num(rows["Packet loss"]) / 100, jitter_ms=num(rows["Packet inter-arrival Jitter"]))


@lru_cache(maxsize=1)
def load_wan() -> AzureWan:
    return AzureWan()


class Backbone:
    """WAN links between regions, pruned from the full mesh by the relay rule."""

    def __init__(self, wan: AzureWan, keys: list[str] | None = None, relay_factor: float = 1.1):
        self.wan = wan
        self.nodes = list(keys) if keys is not None else wan.keys
        self.relay_factor = relay_factor
        idx = [wan.index(k) for k in self.nodes]
        rtt = wan.rtt_sym[np.ix_(idx, idx)]
        n = len(self.nodes)
        self.edges: list[tuple[str, str, float]] = []
        for a in range(n):
            for b in range(a + 1, n):
                via = rtt[a, :] + rtt[:, b]
                via[[a, b]] = np.inf
                if not np.any(via <= relay_factor * rtt[a, b]):
                    self.edges.append((self.nodes[a], self.nodes[b], float(rtt[a, b])))
        self._adj: dict[str, dict[str, float]] = {k: {} for k in self.nodes}
        for a, b, w in self.edges:
            self._adj[a][b] = w
            self._adj[b][a] = w
        self.links: list[tuple[str, str]] = [(a, b) for a, b, _ in self.edges] + [(b, a) for a, b, _ in self.edges]
        self.link_index = {link: i for i, link in enumerate(self.links)}
        self._first_hops: dict[str, dict[str, str]] = {}
        unreachable = set(self.nodes) - set(self._shortest_first_hops(self.nodes[0]))
        if unreachable:
            raise TitanError(f"backbone: region {sorted(unreachable)[0]!r} is not connected")

    def edge_rtt(self, a: str, b: str) -> float:
        return self._adj[a][b]

    def _shortest_first_hops(self, src: str) -> dict[str, str]:
        if src in self._first_hops:
            return self._first_hops[src]
        best = {src: 0.0}
        first = {src: src}
        heap = [(0.0, src, src)]
        while heap:
            cost, node, hop = heapq.heappop(heap)
            if cost > best.get(node, float("inf")):
                continue
            for nxt, w in sorted(self._adj[node].items(), key=lambda kv: (kv[1], kv[0])):
                c = cost + w
                if c < best.get(nxt, float("inf")):
                    best[nxt] = c
                    first[nxt] = nxt if node == src else hop
                    heapq.heappush(heap, (c, nxt, first[nxt]))
        self._first_hops[src] = first
        return first

    def next_hop(self, src: str, dst: str) -> str:
        """Over the direct edge where there is one, else the shortest path's first hop."""
        if dst in self._adj[src]:
            return dst
        return self._shortest_first_hops(src)[dst]

    def path(self, src: str, dst: str) -> list[str]:
        path = [src]
        while path[-1] != dst:
            path.append(self.next_hop(path[-1], dst))
            if len(path) > len(self.nodes):
                raise TitanError(f"backbone: routing loop from {src} to {dst}")
        return path

    def path_rtt(self, src: str, dst: str) -> float:
        p = self.path(src, dst)
        return sum(self._adj[a][b] for a, b in zip(p, p[1:]))

    def path_links(self, src: str, dst: str) -> list[int]:
        p = self.path(src, dst)
        return [self.link_index[(a, b)] for a, b in zip(p, p[1:])]


@dataclass
class World:
    """One problem instance: user regions x DCs with both routes' RTTs and the WAN links used.

    Arrays are indexed [user, dc].  Route 0 is the WAN, route 1 the Internet.
    """

    wan: AzureWan
    backbone: Backbone
    users: list[str]
    dcs: list[str]
    targets: Targets
    internet_cap: float = 1.0  # Titan's largest offload share per path where quality holds
    internet_model: Callable[[str, str], tuple[float, float, float]] | None = None  # (rtt, loss, jitter)
    wan_rtt: np.ndarray = field(init=False)
    inet_rtt: np.ndarray = field(init=False)
    inet_ok: np.ndarray = field(init=False)
    inet_cap: np.ndarray = field(init=False)  # [user, dc] share of participants allowed on the Internet
    local: np.ndarray = field(init=False)  # user region hosts the DC: no WAN either way
    up_links: list[list[list[int]]] = field(init=False)  # [u][d] links user -> DC
    down_links: list[list[list[int]]] = field(init=False)  # [u][d] links DC -> user

    def __post_init__(self) -> None:
        U, D = len(self.users), len(self.dcs)
        self.wan_rtt = np.zeros((U, D))
        self.inet_rtt = np.zeros((U, D))
        self.inet_ok = np.zeros((U, D), dtype=bool)
        self.local = np.zeros((U, D), dtype=bool)
        self.up_links = [[[] for _ in range(D)] for _ in range(U)]
        self.down_links = [[[] for _ in range(D)] for _ in range(U)]
        for i, u in enumerate(self.users):
            for j, d in enumerate(self.dcs):
                if u == d:
                    self.local[i, j] = True
                    continue
                self.wan_rtt[i, j] = self.backbone.path_rtt(u, d)
                if self.internet_model is not None:
                    self.inet_rtt[i, j], loss, jitter = self.internet_model(u, d)
                else:
                    self.inet_rtt[i, j] = self.wan.internet_rtt(u, d)
                    loss, jitter = self.wan.internet_quality(u, d)
                self.inet_ok[i, j] = loss < self.targets.loss and jitter < self.targets.jitter_ms
                self.up_links[i][j] = self.backbone.path_links(u, d)
                self.down_links[i][j] = self.backbone.path_links(d, u)
        self.inet_cap = np.where(self.inet_ok, self.internet_cap, 0.0)

    @property
    def n_links(self) -> int:
        return len(self.backbone.links)

    def link_name(self, link: int) -> str:
        a, b = self.backbone.links[link]
        return f"{a}->{b}"

    def rtt(self, route: int) -> np.ndarray:
        return self.wan_rtt if route == 0 else self.inet_rtt

    def crossed_edges(self) -> list[tuple[str, str, float]]:
        """The backbone edges that some user region's traffic to or from some DC crosses
        (``up_links``/``down_links``), in ``backbone.edges`` order."""
        used = {frozenset(self.backbone.links[link]) for row_up, row_down in zip(self.up_links, self.down_links)
                for up, down in zip(row_up, row_down) for link in up + down}
        return [e for e in self.backbone.edges if frozenset(e[:2]) in used]


def build_world(users: list[str] | None, dcs: list[str], relay_factor: float = 1.1,
                targets: Targets | None = None, wan: AzureWan | None = None,
                full_backbone: bool = True, internet_cap: float = 1.0,
                internet_model: Callable[[str, str], tuple[float, float, float]] | None = None) -> World:
    """Check the names (one-line errors), build the backbone and the instance over the given
    user regions and DCs.  The backbone spans every region in the matrix (the Azure WAN), or
    with ``full_backbone=False`` only the users and DCs (the emulator's small network)."""
    wan = wan or load_wan()
    dc_keys = _unique([wan.key(d, "dcs") for d in dcs], "dcs")
    user_keys = _unique([wan.key(u, "users") for u in users], "users") if users else wan.keys
    nodes = None if full_backbone else user_keys + [d for d in dc_keys if d not in user_keys]
    backbone = Backbone(wan, nodes, relay_factor)
    return World(wan, backbone, user_keys, dc_keys, targets or Targets(), internet_cap, internet_model)


def _unique(keys: list[str], field_name: str) -> list[str]:
    seen: set[str] = set()
    for k in keys:
        if k in seen:
            raise TitanError(f"{field_name}: region {k!r} is listed twice")
        seen.add(k)
    return keys
