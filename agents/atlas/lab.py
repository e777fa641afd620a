"""Atlas for any job: temporal sharing of the WAN among a ``testbed torchrun`` job's pipelines.

How it fits: ``plugin.py`` names ``AtlasJob`` as Atlas's ``lab`` hook, so ``testbed torchrun
TOPOLOGY --ranks .. --with atlas=FILE.yaml -- SCRIPT`` makes one from FILE (or from an inline
YAML mapping, ``--with 'atlas={...}'``) and the core calls ``apply`` once the ranks are placed
and before they start, ``remove`` after they end.  The user names the pipelines (sets of
ranks, or of hosts) and their order::

    sharing: temporal        # or fair: nothing is changed (the baseline, recorded the same way)
    pipelines:               # name -> ranks (0-based) or hosts ("dc:index", a host name or address)
      p0: [0, 2]
      p1: [1, 3]
    order: [p1, p0]          # default: as listed
    turns_ms: null           # null: strict priority in ``order``; a number: timed turns of that length
    queue: share             # share | deep | bytes per pipeline (see ``JobSharing.queue``)

``apply`` classifies each pipeline's traffic by its hosts' addresses (every ordered pair of
its hosts in different DCs) on every WAN direction between two DCs where at least two
pipelines have a host at each end (or the directions ``links`` names), and installs there
the delay line's strict-priority scheduler (``testbed.net.delayline``), talking to each
line's control socket as the run's gateway agents do (``agent.py``): the first pipeline of
``order`` that has data owns the link, the others are served only when it has none
(work-conserving); with ``turns_ms`` the owner comes from the clock instead, each pipeline
``turns_ms`` in ``order``.  Every scheduler carries a lease that a thread renews, so a
``torchrun`` killed with SIGKILL leaves a lab that stays up (``testbed up``) back to plain
FIFO (fair sharing) within ``lease_s``.  The same thread samples each line's per-pipeline
counters every ``sample_ms``; ``remove`` restores FIFO and returns, per direction, the bytes
and drops of each pipeline, the queue each had, and the owner's share of the link: per
sampling interval in which two or more pipelines were backlogged (the owner being the first of
``order`` backlogged), and per completed turn with ``turns_ms``.

The many-connections lever: NCCL's sockets per peer are ``testbed torchrun --connections N``
(NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD).  gloo opens one TCP connection per pair of
ranks and torch offers no setting to stripe a transfer over more, so for a gloo job there is
no such lever; a ``connections`` key here says so rather than pretending.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from testbed import messages as m
from testbed.extension import ExtensionError
from testbed.run.hooks import JobExtension

_CONNECTIONS = ("connections: NCCL's sockets per peer are set by testbed torchrun --connections N; gloo opens one "
                "TCP connection per pair of ranks and torch has no setting to stripe it, so a gloo job has no "
                "many-connections lever")


class JobSharing(BaseModel):
    """The options of ``--with atlas=FILE`` (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    sharing: Literal["temporal", "fair"] = Field(
        "temporal", description="temporal: the link goes to one pipeline at a time; fair: nothing is changed")
    pipelines: dict[str, list[int | str]] = Field(
        ..., description="pipeline name -> its ranks (0-based) or hosts (dc:index, a name or address)")
    order: list[str] | None = Field(None, description="who owns the link first, second, ... (default: as listed)")
    turns_ms: float | None = Field(None, gt=0, le=60_000,
                                   description="timed turns of this length, in order; null: strict priority")
    queue: Literal["share", "deep"] | int = Field(
        "share", description="each pipeline's queue: share = the link's own queue split among them (the same "
                             "buffer as the FIFO of fair sharing), deep = 4 x the path's BDP each, or bytes each")
    links: list[str] | None = Field(None, description='directions to schedule, "src->dst" (default: every '
                                                      'direction two or more pipelines have hosts at both ends of)')
    lease_s: float = Field(5.0, gt=0, le=600, description="the schedulers fall back to FIFO unless renewed")
    sample_ms: float = Field(20.0, ge=5, le=10_000, description="per-pipeline counters sampled this often")

    @model_validator(mode="after")
    def _consistent(self) -> "JobSharing":
        names = list(self.pipelines)
        if len(names) < 2:
            raise ValueError(f"pipelines: {len(names)} given; temporal sharing needs two or more")
        for name, members in self.pipelines.items():
            if not members:
                raise ValueError(f"pipelines.{name}: empty (list its ranks or hosts)")
        if self.order is not None:
            if sorted(self.order) != sorted(names) or len(set(self.order)) != len(self.order):
                raise ValueError(f"order {self.order} must name each pipeline once: {', '.join(names)}")
        if isinstance(self.queue, int) and self.queue < 65536:
            raise ValueError(f"queue {self.queue}: at least 65536 bytes per pipeline (two GSO packets)")
        for link in self.links or []:
            if link.count("->") != 1:
                raise ValueError(f"links: {link!r} is not src->dst")
        return self

    @property
    def ordered(self) -> list[str]:
        return list(self.order or self.pipelines)


def load_options(value: str) -> JobSharing:
    """``value``: a YAML/JSON file, or an inline mapping (``{...}``); a one-line ExtensionError."""
    origin = "--with atlas" if value.lstrip().startswith("{") else f"atlas options {value}"
    if value.lstrip().startswith("{"):
        text = value
    else:
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise ExtensionError(f"{origin}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ExtensionError(f"{origin}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ExtensionError(f"{origin}: a mapping of options (pipelines:, order:, ...) expected")
    if "connections" in data:
        raise ExtensionError(f"{origin}: {_CONNECTIONS}")
    try:
        return JobSharing(**data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "literal[", "int")))
        msg = err["msg"].removeprefix("Value error, ")
        raise ExtensionError(f"{origin}: {where + ': ' if where else ''}{msg}".replace("\n", " ")) from None


def _resolve(member: int | str, ranks: list[dict], hosts: list[dict], pipeline: str) -> dict:
    """A pipeline member -> the host it names."""
    if isinstance(member, int):
        for r in ranks:
            if r["rank"] == member:
                return r
        raise ExtensionError(f"atlas: pipelines.{pipeline}: rank {member} does not exist (ranks 0-{len(ranks) - 1})")
    text = member.strip()
    dc, sep, index = text.partition(":")
    for h in hosts:
        if text in (h["name"], h["ip"]) or (sep and h["dc"] == dc and index.isdigit() and h["index"] == int(index)):
            return h
    raise ExtensionError(f"atlas: pipelines.{pipeline}: no host {text!r} (a rank, DC:INDEX, a host name or address)")


class _Line:
    """One delay line's control socket, from a socket of our own next to it (recorded for
    ``testbed clean``)."""

    def __init__(self, control: str):
        from testbed.registry import Registry
        from testbed.procutil import DatagramClient

        self.control = control
        path = Path(control).parent / f"atlas-job-{os.getpid()}-{abs(hash(control)) % 10**6}.sock"
        Registry(Path(control).parent).file(path)
        self.client = DatagramClient(path, timeout=2.0)
        self.lock = threading.Lock()

    def request(self, msg: m.Message) -> m.Message:
        with self.lock:
            try:
                return self.client.request(self.control, msg)
            except (OSError, RuntimeError, ValueError) as exc:
                raise ExtensionError(f"atlas: the delay line at {self.control} refused {msg.kind}: {exc}") from None

    def close(self) -> None:
        self.client.close()


class AtlasJob(JobExtension):
    """Temporal sharing of a torchrun job's WAN directions among its pipelines."""

    def __init__(self, value: str):
        super().__init__(value)
        self.opts = load_options(value)
        self._lines: dict[str, _Line] = {}
        self._lanes: dict[str, tuple[_Line, str, dict]] = {}  # "src->dst" -> (line, lane, classes)
        self._samples: dict[str, list[tuple[float, dict]]] = {}
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._problems: list[str] = []
        self._pipelines: dict[str, list[str]] = {}
        self._link_queue: dict[str, int] = {}

    # -- apply ------------------------------------------------------------------------
    def apply(self, lab, ranks: list[dict]) -> None:
        opts = self.opts
        hosts = lab.host_table()
        members = {p: [_resolve(m, ranks, hosts, p) for m in ms] for p, ms in opts.pipelines.items()}
        seen: dict[str, str] = {}
        for p, hs in members.items():
            for h in hs:
                if h["name"] in seen and seen[h["name"]] != p:
                    raise ExtensionError(f"atlas: host {h['name']} ({h['dc']}:{h['index']}) is in pipelines "
                                         f"{seen[h['name']]} and {p}: a host's traffic can be classified once")
                seen[h["name"]] = p
        self._pipelines = {p: [h["name"] for h in hs] for p, hs in members.items()}
        if opts.sharing == "fair":
            return
        pairs = {p: [[a["ip"], b["ip"]] for a in hs for b in hs if a["dc"] != b["dc"]] for p, hs in members.items()}
        links = {f"{x['src']}->{x['dst']}": x for x in lab.link_table()}
        if opts.links is not None:
            for name in opts.links:
                if name not in links:
                    raise ExtensionError(f"atlas: links: lab {lab.name} has no WAN direction {name} "
                                         f"(directions: {', '.join(links)})")
            chosen = list(opts.links)
        else:
            dcs = {p: {h["dc"] for h in hs} for p, hs in members.items()}
            chosen = [n for n, x in links.items() if sum(1 for d in dcs.values() if {x["src"], x["dst"]} <= d) >= 2]
        if not chosen:
            raise ExtensionError("atlas: no WAN direction has two pipelines with hosts at both of its ends: "
                                 "nothing to share (name the directions with links:)")
        for name in chosen:
            if links[name]["delay_line"] is None:
                raise ExtensionError(f"atlas: {name} has no delay line in its path (netem delays it); temporal "
                                     "sharing needs the TUN delay line (testbed up/torchrun --delay-backend tun)")
        try:
            for name in chosen:
                dl = links[name]["delay_line"]
                line = self._lines.get(dl["control"]) or self._lines.setdefault(dl["control"], _Line(dl["control"]))
                classes = {p: pairs[p] for p in opts.ordered if pairs[p]}
                queue = opts.queue if opts.queue != "deep" else None  # None: the line's deep default
                line.request(m.LaneSet(lane=dl["lane"], classes={p: [list(pair) for pair in v] for p, v in classes.items()},
                                       queue_bytes=queue, lease_s=opts.lease_s))
                self._lanes[name] = (line, dl["lane"], classes)
                self._link_queue[name] = links[name]["queue_bytes"]
                order = [p for p in opts.ordered if p in classes]
                line.request(m.LaneSet(lane=dl["lane"], order=order))
                if opts.turns_ms is not None:
                    turn = opts.turns_ms / 1000
                    line.request(m.LaneSet(lane=dl["lane"], turns={
                        "t0": time.monotonic(), "period_s": turn * len(order),
                        "slots": [[p, i * turn, (i + 1) * turn] for i, p in enumerate(order)]}))
                self._samples[name] = []
        except BaseException:
            self._clear()
            raise
        self._thread = threading.Thread(target=self._tend, daemon=True, name="atlas-job")
        self._thread.start()

    def _tend(self) -> None:
        """Renew the leases (every lease_s / 4) and sample the per-pipeline counters."""
        renew_every = self.opts.lease_s / 4
        renewed = time.monotonic()
        while not self._halt.wait(self.opts.sample_ms / 1000):
            now = time.monotonic()
            for name, (line, lane, _) in self._lanes.items():
                try:
                    st = line.request(m.LaneStats(lane=lane)).lanes[lane]["sched"]
                except ExtensionError as exc:
                    self._problems.append(str(exc))
                    continue
                if st is not None:
                    self._samples[name].append((now, {"bytes": st["bytes_out"], "backlog": st["backlog"],
                                                      "drops": st["drops"], "queue_bytes": st["queue_bytes"]}))
            if now - renewed >= renew_every:
                renewed = now
                for name, (line, lane, _) in self._lanes.items():
                    try:
                        line.request(m.LaneSet(lane=lane, lease_s=self.opts.lease_s))
                    except ExtensionError as exc:
                        self._problems.append(str(exc))

    # -- remove -----------------------------------------------------------------------
    def remove(self) -> dict:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(10)
        out = {"sharing": self.opts.sharing, "order": self.opts.ordered,
               "mode": None if self.opts.sharing == "fair" else ("turns" if self.opts.turns_ms else "priority"),
               "turns_ms": self.opts.turns_ms, "pipelines": self._pipelines, "links": {}}
        for name, (line, lane, classes) in self._lanes.items():
            try:
                st = line.request(m.LaneStats(lane=lane, turns_since=-1)).lanes[lane]["sched"]
                while st and len(st["turns"]) % 200 == 0 and st["turns"]:  # the line answers 200 at a time
                    more = line.request(m.LaneStats(lane=lane, turns_since=st["turns"][-1][0]))
                    got = more.lanes[lane]["sched"]["turns"]
                    if not got:
                        break
                    st["turns"] += got
            except ExtensionError as exc:
                self._problems.append(str(exc))
                st = None
            out["links"][name] = self._figures(name, classes, st)
        self._clear()
        out["problems"] = self._problems[:10]
        return out

    def _clear(self) -> None:
        for name, (line, lane, _) in list(self._lanes.items()):
            try:
                line.request(m.LaneSet(lane=lane, classes=None))
            except ExtensionError as exc:
                self._problems.append(f"{name}: clearing failed: {exc}")
        self._lanes.clear()
        for line in self._lines.values():
            line.close()
        self._lines.clear()

    def _figures(self, name: str, classes: dict, st: dict | None) -> dict:
        order = [p for p in self.opts.ordered if p in classes]
        samples = self._samples.get(name, [])
        fig: dict = {"classes": classes, "link_queue_bytes": self._link_queue.get(name),
                     "queue_bytes_per_pipeline": st["queue_bytes"] if st else None,
                     "bytes": st["bytes_out"] if st else None, "drops": st["drops"] if st else None}
        shares = []
        for (_, a), (_, b) in zip(samples, samples[1:]):
            sent = {p: b["bytes"][p] - a["bytes"][p] for p in order}
            total = sum(sent.values())
            backlogged = [p for p in order if a["backlog"][p] and b["backlog"][p]]
            if total and len(backlogged) >= 2:
                shares.append(sent[backlogged[0]] / total)
        fig["owner_share"] = _summary(shares) | {
            "per": "sampling interval with two or more pipelines backlogged at both ends; the owner: the first "
                   "of them in the order", "interval_ms": self.opts.sample_ms}
        if self.opts.turns_ms and st and st.get("turns"):
            rate = st["rate_bytes_s"]
            turn_shares = []
            for _index, owner, start, sent, _busy, end in st["turns"]:
                total = sum(sent.values())
                # a turn the link was mostly busy in (half its capacity or more), the owner among the senders
                if owner in sent and sent[owner] and total >= 0.5 * rate * (end - start):
                    turn_shares.append(sent[owner] / total)
            fig["owner_share_per_turn"] = _summary(turn_shares) | {"turns_logged": len(st["turns"])}
        return fig


def _summary(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "mean": None, "p10": None}
    s = sorted(xs)
    return {"n": len(s), "mean": round(statistics.fmean(s), 4), "p10": round(s[len(s) // 10], 4)}
