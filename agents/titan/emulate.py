"""Titan and Titan-Next on the emulator: real UDP calls over WAN and Internet paths.

How it fits: ``prepare`` builds the small world (``EmulationSpec``: a few user regions and
DCs; the backbone among them from the Azure matrix), synthesises history days and one
evaluated day of calls (``workload.py``), and asks every policy for its per-call placement
exactly as the offline study does (``placement.py``, ``lp.py``): the LPs plan on the
history's forecast (Titan-Next also on the day's actual demand, as an oracle), and the
plan is realised call by call with quota counters.  It also evaluates each realisation on
the model, so the emulator's measurements can be set beside the model's numbers.

``run`` then builds a testbed ``Lab`` of the world (``emunet.topology_data``) with the
Internet paths on it (``emunet.InternetPaths``), starts every media agent and route checker
through the lab's launcher (each waited for until it says ``ready``), and plays the day,
compressed into ``day_seconds``, once per policy: every participant is an up stream
(participant host -> media-server host of the call's DC) and a down stream back, at the
Teams bitrate of the call's media times ``bitrate_scale``, ``packets_per_s`` packets a
second, with the call's route in the packets' DSCP.  While it plays, every WAN direction's byte counter is sampled every 20 ms;
afterwards the per-slot load of each WAN link (kbps, Ethernet frames as the counters count
them) gives the measured sum of peaks, the receivers give each participant's RTT (median
one-way delay up + down), loss and jitter, and the route checkers' per-interface counts
show whether every stream left on exactly the links of its route.

The model plans in the same units the counters measure: each stream's rate is its frame
rate on the wire (IP packet + 14-byte Ethernet header, ``packets_per_s`` a second), so
planned, modelled and measured loads compare directly.

``run_controller`` plays the day again under Titan's controller (``controller.py``), live:
each call's route is decided when it starts from the current offload fraction of its
(home region, DC) path, the fractions are updated every window from what the receivers
measured on that path (calls and a probe stream per path), and a fault (loss, delay) is
injected on one Internet path part way through.
"""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from agents.titan import lp
from agents.titan import messages as tm
from agents.titan import workload as wl
from agents.titan.controller import Quality, TitanController
from agents.titan.emunet import HUB_NS, InternetPaths, participant_hosts, server_host, topology_data
from agents.titan.media import INTERNET_TOS, PORT, ip_bytes_per_packet
from agents.titan.placement import (INTERNET, WAN, Evaluation, Options, Plan, Realisation, evaluate, incidence, realise,
                        realise_greedy, rule_plan)
from agents.titan.regions import World, build_world
from agents.titan.spec import EmulationSpec, TitanError
from testbed.run.lab import Lab
from testbed.spec.topology import parse_topology

ETH_BYTES = 14
_SAMPLE_S = 0.02
_LEAD_S = 1.0
ALL_POLICIES = ("nearest-wan", "wan-lp", "titan", "greedy-internet", "titan-next", "titan-next-oracle")


def internet_model(spec: EmulationSpec):
    """The emulated Internet paths as the planners see them: (RTT, loss, jitter) per pair."""
    from agents.titan.regions import load_wan

    wan = load_wan()

    def model(a: str, b: str) -> tuple[float, float, float]:
        rtt, loss, jitter = wan.internet_rtt(a, b), spec.internet_loss, spec.internet_jitter_ms
        for o in spec.internet:
            if {wan.key(o.user, "internet.user"), wan.key(o.dc, "internet.dc")} == {a, b}:
                loss = o.loss if o.loss is not None else loss
                jitter = o.jitter_ms if o.jitter_ms is not None else jitter
                rtt += 2 * (o.extra_delay_ms or 0.0)
        return rtt, loss, jitter

    return model


def emulated_world(spec: EmulationSpec) -> World:
    """The emulator's world: ``spec``'s users and DCs on the backbone pruned among those
    regions alone (the network ``run`` builds), with the emulated Internet paths.  ``prepare``
    builds it here, and ``testbed titan backbone --emulated`` shows its backbone from here."""
    return build_world(spec.users, spec.dcs, spec.relay_factor, spec.targets, full_backbone=False,
                       internet_cap=spec.internet_cap, internet_model=internet_model(spec))


def wire_kbps(ip_kbps: float, pps: float) -> float:
    """What a stream puts on a link, as interface counters count it (Ethernet frames)."""
    return (ip_bytes_per_packet(ip_kbps, pps) + ETH_BYTES) * 8 * pps / 1000.0


@dataclass
class Prepared:
    spec: EmulationSpec
    world: World
    calls: wl.Calls  # the evaluated day, times from its start (s), kbps on the wire
    ip_up: np.ndarray  # per call: IP kbps the agents send (scaled Teams rates)
    ip_down: np.ndarray
    config: np.ndarray
    options: Options
    slot_s: float  # model seconds per slot
    plans: dict[str, Plan]
    realised: dict[str, Realisation]
    model: dict[str, Evaluation]
    capacity: np.ndarray
    forecast: wl.Demand
    actual: wl.Demand


def prepare(spec: EmulationSpec) -> Prepared:
    """Everything that needs no network: world, calls, plans, per-call placements, model figures."""
    unknown = [p for p in spec.policies if p not in ALL_POLICIES]
    if unknown:
        raise TitanError(f"policies: unknown policy {unknown[0]!r} (known: {', '.join(ALL_POLICIES)})")
    world = emulated_world(spec)
    calls = wl.generate(world, spec.workload, spec.history_days + 1)
    ip_up = calls.up_kbps * spec.bitrate_scale
    ip_down = calls.down_kbps * spec.bitrate_scale
    wire = np.vectorize(lambda k: wire_kbps(k, spec.packets_per_s))
    calls.up_kbps = wire(ip_up)
    calls.down_kbps = wire(ip_down)
    configs = wl.Configs()
    cfg = configs.of_calls(calls)
    prov = configs.provisional_of_calls(calls)
    options = Options(world, configs, spec.latency)
    options.check_all(np.concatenate((cfg, prov)))
    slots = spec.slots
    slot_s = wl.DAY_S / slots
    history = [wl.demand(calls, cfg, d * wl.DAY_S, slot_s, slots)
               for d in wl.same_kind_days(spec.history_days, range(spec.history_days))]
    t0 = spec.history_days * wl.DAY_S
    forecast = wl.predict(history, t0)
    in_day = (calls.start_s >= t0) & (calls.start_s < t0 + wl.DAY_S)
    day = calls.select(in_day)
    day.start_s = day.start_s - t0
    day.duration_s = np.minimum(day.duration_s, wl.DAY_S - day.start_s)  # the emulated day ends
    ip_up, ip_down = ip_up[in_day], ip_down[in_day]
    cfg_day, prov_day = cfg[in_day], prov[in_day]
    actual = wl.demand(day, cfg_day, 0.0, slot_s, slots)
    forecast.t0 = 0.0
    horizon = wl.demand(calls, cfg, 0.0, slot_s, slots * (spec.history_days + 1))
    capacity = lp.capacities(world, options, horizon, spec.capacity_headroom)
    all_cfg = np.concatenate((cfg_day, prov_day))
    plans: dict[str, Plan] = {}
    for name in spec.policies:
        if name == "nearest-wan":
            plans[name] = rule_plan(name, options, all_cfg, 0.0)
        elif name == "titan":
            plans[name] = rule_plan(name, options, all_cfg, spec.titan_share)
        elif name == "greedy-internet":
            plans[name] = Plan(name)  # realised call by call (realise_greedy)
        else:
            demand = actual if name == "titan-next-oracle" else forecast
            routes = (WAN,) if name == "wan-lp" else (WAN, INTERNET)
            problem = lp.DayProblem(demand, set(np.unique(demand.config).tolist()), capacity)
            plans[name] = lp.solve_day(world, options, problem, name, routes, spec.tie_break_eps, solver="simplex")
    incid = incidence(world)
    realised, model = {}, {}
    for name, plan in plans.items():
        if name == "greedy-internet":
            realised[name] = realise_greedy(options, day, cfg_day, prov_day, 0.0, slot_s)
        else:
            realised[name] = realise(plan, options, day, cfg_day, prov_day, 0.0, slot_s)
        model[name] = evaluate(world, options, day, cfg_day, realised[name], 0.0, slot_s, slots, incid)
    return Prepared(spec, world, day, ip_up, ip_down, cfg_day, options, slot_s, plans, realised, model, capacity,
                    forecast, actual)


@dataclass
class Stream:
    sid: int
    call: int
    region: int  # the participant's user index
    up: bool  # participant -> server
    src_host: str
    dst_ip: str
    ip_kbps: float
    route: int
    dc: int
    start: float  # emulated seconds from the run's t0
    end: float


@dataclass
class PolicyRun:
    policy: str
    slot_load_kbps: np.ndarray  # [link, slot] measured
    sum_of_peaks_kbps: float
    model_sum_of_peaks_kbps: float
    streams: int
    calls: int
    participants_over_bound: int
    participant_rtt: list[dict]
    loss: float
    route_violations: int
    route_coverage: float
    misrouted_packets: int
    internet_share_calls: float
    details: dict = field(default_factory=dict)


class Emulation:
    """Agents and route checkers on a ``Lab`` with ``InternetPaths``; plays policies one after
    another."""

    def __init__(self, prep: Prepared, lab: Lab, paths: InternetPaths, workdir: Path,
                 log: Callable[[str], None] | None = None):
        self.prep = prep
        self.lab = lab
        self.paths = paths
        self.workdir = workdir
        self.log = log or (lambda m: None)
        self.agents: dict[str, object] = {}  # host name -> ControlClient
        self.host_ip: dict[str, str] = {}
        self.sniffers: dict[str, object] = {}
        self._sid = 1
        self.day_scale = prep.spec.day_seconds / wl.DAY_S

    def participants(self, region: str):
        return participant_hosts(self.lab, self.prep.world, self.prep.spec, region)

    def server(self, dc: str):
        return server_host(self.lab, dc)

    # -- set-up -------------------------------------------------------------------------
    def start_agents(self) -> None:
        """A media agent in every participant and server host, a route checker in every
        gateway router and in the hub, all through the lab's launcher, waited for together."""
        w = self.prep.world
        lab, launcher = self.lab, self.lab.launcher
        self.workdir.mkdir(parents=True, exist_ok=True)
        hosts = []
        for r in w.backbone.nodes:
            hosts += self.participants(r)
            if r in w.dcs:
                hosts.append(self.server(r))
        controls = []
        with launcher.together():
            for h in hosts:
                control = launcher.file(f"gtbta-{h.name}.sock")
                lab.start(f"titan-agent-{h.name}", "agents.titan.media", {"control": str(control), "port": PORT},
                          host=h, ready=True)
                controls.append((h.name, control, self.agents))
                self.host_ip[h.name] = h.ip
            for r in w.backbone.nodes:
                ifs = [ln.ifname for ln in lab.net.links() if ln.src == r] + [self.paths.router_hub_ifname(r)]
                control = launcher.file(f"gtbtc-{r}.sock")
                lab.start(f"titan-routecheck-{r}", "agents.titan.routecheck",
                          {"control": str(control), "interfaces": ifs, "port": PORT}, router=r, ready=True)
                controls.append((r, control, self.sniffers))
            control = launcher.file("gtbtc-hub.sock")
            lab.start("titan-routecheck-hub", "agents.titan.routecheck",
                      {"control": str(control), "interfaces": [self.paths.hub_ifname(r) for r in w.backbone.nodes],
                       "port": PORT}, netns=HUB_NS, ready=True)
            controls.append(("hub", control, self.sniffers))
        for name, control, table in controls:
            # a sniffer counts what it still holds before it answers a dump: give it time
            table[name] = self.paths.control_client(control, name, 30.0 if table is self.sniffers else 5.0)

    # -- streams ------------------------------------------------------------------------
    def _streams(self, policy: str, t0: float) -> list[Stream]:
        prep = self.prep
        w = prep.world
        calls = prep.calls
        real = prep.realised[policy]
        pps = prep.spec.packets_per_s
        rr: dict[str, int] = {}
        out: list[Stream] = []
        for i in range(len(calls)):
            d = int(real.dc[i])
            server = self.server(w.dcs[d])
            start = t0 + calls.start_s[i] * self.day_scale
            end = start + calls.duration_s[i] * self.day_scale
            if end - start < 2.0 / pps:
                end = start + 2.0 / pps
            for e in range(calls.ptr[i], calls.ptr[i + 1]):
                u = int(calls.region[e])
                hosts = self.participants(w.users[u])
                for _ in range(int(calls.count[e])):
                    n = rr.get(w.users[u], 0)
                    rr[w.users[u]] = n + 1
                    host = hosts[n % len(hosts)]
                    route = int(real.route[i])
                    out.append(Stream(self._sid, i, u, True, host.name, server.ip, float(prep.ip_up[i]), route, d,
                                      start, end))
                    out.append(Stream(self._sid + 1, i, u, False, server.name, host.ip, float(prep.ip_down[i]),
                                      route, d, start, end))
                    self._sid += 2
        return out

    def _send_streams(self, streams: list[Stream], chunk: int = 400) -> None:
        pps = self.prep.spec.packets_per_s
        by_host: dict[str, list] = {}
        for s in streams:
            tos = INTERNET_TOS if s.route == INTERNET else 0
            by_host.setdefault(s.src_host, []).append(tm.StreamSpec(s.sid, s.dst_ip, s.ip_kbps, pps, tos, s.start, s.end))
        for host, items in by_host.items():
            for k in range(0, len(items), chunk):
                self.agents[host].request(tm.StartStreams(streams=items[k:k + chunk]))

    # -- one policy -----------------------------------------------------------------------
    def run_policy(self, policy: str) -> PolicyRun:
        prep = self.prep
        spec = prep.spec
        for c in list(self.agents.values()) + list(self.sniffers.values()):
            c.request(tm.Reset())
        t0 = time.monotonic() + _LEAD_S
        streams = self._streams(policy, t0)
        self._send_streams(streams)
        links = self.lab.net.links()
        samples: list[tuple[float, list[int]]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic(), [ln.counters().tx_bytes for ln in links]))
                time.sleep(_SAMPLE_S)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        end = t0 + spec.day_seconds
        max_owd = max([ln.delay_ms for ln in self.paths.lanes.values()] + [ln.params.delay_ms * 4 for ln in links])
        time.sleep(max(0.0, end - time.monotonic()) + max_owd / 1000.0 + 0.3)
        stop.set()
        th.join()
        rx: dict[int, dict] = {}
        sent: dict[int, int] = {}
        for name, client in self.agents.items():
            path = self.workdir / f"dump-{policy}-{name}.json"
            client.request(tm.Dump(path=str(path)))
            data = json.loads(path.read_text())
            rx.update({int(k): v for k, v in data["rx"].items()})
            sent.update({int(k): v for k, v in data["sent"].items()})
        seen: dict[str, dict[int, int]] = {}
        for name, client in self.sniffers.items():
            path = self.workdir / f"routes-{policy}-{name}.json"
            client.request(tm.Dump(path=str(path)))
            for ifname, table in json.loads(path.read_text()).items():
                seen[ifname] = {int(k): v for k, v in table.items()}
        load = self._slot_loads(samples, t0, links)
        return self._judge(policy, streams, rx, sent, seen, load, links)

    def _slot_loads(self, samples, t0: float, links) -> np.ndarray:
        """[world link, slot] kbps from the sampled counters (linear between samples)."""
        prep = self.prep
        w = prep.world
        slots = prep.spec.slots
        slot_emu = prep.spec.day_seconds / slots
        times = np.array([s[0] for s in samples])
        counts = np.array([s[1] for s in samples], dtype=np.float64)
        edges = t0 + slot_emu * np.arange(slots + 1)
        out = np.zeros((w.n_links, slots))
        for j, ln in enumerate(links):
            at = np.interp(edges, times, counts[:, j])
            out[w.backbone.link_index[(ln.src, ln.dst)]] = np.diff(at) * 8 / 1000.0 / slot_emu
        return out

    def _expected_ifaces(self, s: Stream) -> list[str]:
        w = self.prep.world
        u, d = w.users[s.region], w.dcs[s.dc]
        src, dst = (u, d) if s.up else (d, u)
        if src == dst:
            return []
        if s.route == INTERNET:
            return [self.paths.router_hub_ifname(src), self.paths.hub_ifname(dst)]
        path = w.backbone.path(src, dst)
        return [self.lab.net.link(a, b).ifname for a, b in zip(path, path[1:])]

    def _judge(self, policy, streams, rx, sent, seen, load, links) -> PolicyRun:
        prep = self.prep
        spec = prep.spec
        w = prep.world
        monitored = set(seen)
        violations = 0
        misrouted = 0
        expected_pkts = 0
        covered_pkts = 0
        lost = 0
        total_sent = 0
        by_part: dict[tuple[int, int, int], dict] = {}
        for s in streams:
            r = rx.get(s.sid, {})
            got = int(r.get("received", 0))
            n_sent = int(sent.get(s.sid, 0))
            total_sent += n_sent
            lost += max(0, n_sent - got)
            exp = self._expected_ifaces(s)
            bad = False
            for ifname in exp:
                c = seen.get(ifname, {}).get(s.sid, 0)
                expected_pkts += got
                covered_pkts += min(c, got)
                if c > n_sent or (got > 0 and c == 0):
                    bad = True
            for ifname in monitored - set(exp):
                c = seen[ifname].get(s.sid, 0)
                if c:
                    misrouted += c
                    bad = True
            violations += bad
            key = (s.call, s.region, s.sid if s.up else s.sid - 1)
            part = by_part.setdefault(key, {})
            part["up" if s.up else "down"] = r.get("owd_p50_ms")
            part["min_up" if s.up else "min_down"] = r.get("owd_min_ms")
            part["n_up" if s.up else "n_down"] = got
            part["route"], part["dc"] = s.route, s.dc
        # each participant's RTT against its bound
        over = over_min = 0
        over_rows: list[dict] = []
        rtts = []
        for (call, u, _), p in by_part.items():
            if p.get("up") is None or p.get("down") is None:
                continue
            co = prep.options[int(prep.config[call])]
            ref = co.ref_rtt[list(co.regions).index(u)]
            bound = ref + spec.latency.delta_ms
            if spec.latency.max_rtt_ms is not None:
                bound = min(bound, spec.latency.max_rtt_ms)
            rtt = p["up"] + p["down"]
            model = (w.wan_rtt if p["route"] == WAN else w.inet_rtt)[u, p["dc"]]
            row = {"call": call, "region": w.users[u], "dc": w.dcs[p["dc"]], "route": p["route"],
                   "rtt_ms": rtt, "rtt_min_ms": p["min_up"] + p["min_down"], "packets": p["n_up"] + p["n_down"],
                   "model_rtt_ms": float(model), "bound_ms": float(bound)}
            if rtt > bound + spec.latency_allowance_ms:
                over += 1
                over_rows.append(row)
            if row["rtt_min_ms"] > bound + spec.latency_allowance_ms:
                over_min += 1
            rtts.append(row)
        model = prep.model[policy]
        real = prep.realised[policy]
        return PolicyRun(
            policy=policy, slot_load_kbps=load, sum_of_peaks_kbps=float(load.max(axis=1).sum()),
            model_sum_of_peaks_kbps=float(model.sum_of_peaks()), streams=len(streams), calls=len(prep.calls),
            participants_over_bound=over, participant_rtt=rtts, loss=lost / max(total_sent, 1),
            route_violations=violations, route_coverage=covered_pkts / max(expected_pkts, 1),
            misrouted_packets=misrouted, internet_share_calls=float((real.route == INTERNET).mean()),
            details={"over_bound": over_rows[:50], "over_bound_min": over_min},
        )

    # -- Titan's controller, live ----------------------------------------------------------
    def run_controller(self, seconds: float, window_s: float, controller: TitanController,
                       fault=None, probe_pps: float = 50.0) -> dict:
        """Play the day compressed into ``seconds`` with routes decided live by ``controller``."""
        prep = self.prep
        w = prep.world
        opts = prep.options
        calls = prep.calls
        pps = prep.spec.packets_per_s
        for c in list(self.agents.values()) + list(self.sniffers.values()):
            c.request(tm.Reset())
        scale = seconds / wl.DAY_S
        t0 = time.monotonic() + _LEAD_S
        # one probe stream each way per Internet path (home region -> DC) the calls could use
        paths = sorted({(w.users[u], w.dcs[d]) for u in range(len(w.users)) for d in range(len(w.dcs))
                        if not w.local[u, d] and w.inet_ok[u, d]})
        stream_path: dict[int, tuple[str, str]] = {}
        stream_dir: dict[int, bool] = {}
        probes = []
        for (u, d) in paths:
            host = self.participants(u)[0]
            server = self.server(d)
            for up in (True, False):
                sid = self._sid
                self._sid += 1
                stream_path[sid] = (u, d)
                stream_dir[sid] = up
                src, dst = (host, server) if up else (server, host)
                probes.append(Stream(sid, -1, w.users.index(u), up, src.name, dst.ip, 64.0, INTERNET,
                                     w.dcs.index(d), t0, t0 + seconds))
        self._send_streams(probes)
        # calls, decided at their start from the current fraction of (home region, nearest DC)
        order = np.argsort(calls.start_s, kind="stable")
        counters: dict[tuple[str, str], list[int]] = {}
        fault_at = t0 + seconds * fault.at_fraction if fault is not None else None
        clear_at = t0 + seconds * fault.clear_at_fraction if fault is not None and fault.clear_at_fraction else None
        fault_done = cleared = False
        lane = self.paths.lanes[(fault.user, fault.dc)] if fault is not None else None
        before = (lane.delay_ms, lane.jitter_ms, lane.loss) if lane is not None else None
        next_window = t0 + window_s
        timeline = []
        routes = np.zeros(len(calls), dtype=np.int64)
        i = 0
        end = t0 + seconds
        for c in self.agents.values():
            c.request(tm.Window())  # start the first window clean
        while time.monotonic() < end:
            now = time.monotonic()
            while i < len(order) and t0 + calls.start_s[order[i]] * scale <= now + 0.05:
                ci = int(order[i])
                i += 1
                k = int(prep.config[ci])
                co = opts[k]
                home = w.users[int(calls.first[ci])]
                d = co.nearest
                path = (home, w.dcs[d])
                route = WAN
                if opts.option_index(k, d, INTERNET) is not None:
                    f = controller.fraction(path)
                    cnt = counters.setdefault(path, [0, 0])
                    cnt[0] += 1
                    if f * cnt[0] - cnt[1] >= 0.5 or (f >= 1.0):
                        cnt[1] += 1
                        route = INTERNET
                routes[ci] = route
                start = max(t0 + calls.start_s[ci] * scale, time.monotonic() + 0.02)
                stop_t = start + max(calls.duration_s[ci] * scale, 2.0 / pps)
                streams = []
                server = self.server(w.dcs[d])
                for e in range(calls.ptr[ci], calls.ptr[ci + 1]):
                    u = int(calls.region[e])
                    host = self.participants(w.users[u])[0]
                    for _ in range(int(calls.count[e])):
                        streams.append(Stream(self._sid, ci, u, True, host.name, server.ip, float(prep.ip_up[ci]),
                                              route, d, start, stop_t))
                        streams.append(Stream(self._sid + 1, ci, u, False, server.name, host.ip,
                                              float(prep.ip_down[ci]), route, d, start, stop_t))
                        if route == INTERNET and not w.local[u, d]:
                            stream_path[self._sid] = (w.users[u], w.dcs[d])
                            stream_path[self._sid + 1] = (w.users[u], w.dcs[d])
                            stream_dir[self._sid], stream_dir[self._sid + 1] = True, False
                        self._sid += 2
                self._send_streams(streams)
            if fault_at is not None and not fault_done and now >= fault_at:
                self.paths.set_internet(fault.user, fault.dc, loss=fault.loss, delay_ms=before[0] + fault.extra_delay_ms,
                                        jitter_ms=before[1] + fault.extra_jitter_ms)
                fault_done = True
                self.log(f"fault injected on {fault.user}<->{fault.dc}: loss {fault.loss}, "
                         f"+{fault.extra_delay_ms:g} ms delay, +{fault.extra_jitter_ms:g} ms jitter")
            if clear_at is not None and fault_done and not cleared and now >= clear_at:
                self.paths.set_internet(fault.user, fault.dc, delay_ms=before[0], jitter_ms=before[1], loss=before[2])
                cleared = True
                self.log(f"fault cleared on {fault.user}<->{fault.dc}")
            if now >= next_window:
                stats = {}
                for c in self.agents.values():
                    stats.update({int(k): v for k, v in c.request(tm.Window()).window.items()})
                qual = _path_quality(stats, stream_path, stream_dir)
                for path in paths:
                    f = controller.update(path, qual.get(path), now - t0)
                    q = qual.get(path)
                    timeline.append({"t": now - t0, "path": f"{path[0]}->{path[1]}", "fraction": f,
                                     "rtt_ms": q.rtt_ms if q else None, "loss": q.loss if q else None,
                                     "jitter_ms": q.jitter_ms if q else None,
                                     "verdict": controller.history(path)[-1][1]})
                next_window += window_s
            time.sleep(0.005)
        time.sleep(0.5)
        if fault_done and not cleared:  # leave the path as it was
            self.paths.set_internet(fault.user, fault.dc, delay_ms=before[0], jitter_ms=before[1], loss=before[2])
        return {"timeline": timeline, "fault_at_s": (fault_at - t0) if fault_at else None,
                "fault_cleared_at_s": (clear_at - t0) if cleared else None,
                "fault_path": f"{fault.user}->{fault.dc}" if fault else None,
                "internet_share_calls": float((routes == INTERNET).mean()) if len(routes) else 0.0,
                "max_backoff_steps": controller.max_backoff_steps, "window_s": window_s}

    def close(self) -> None:
        for c in list(self.agents.values()) + list(self.sniffers.values()):
            try:
                c.request(tm.Quit())
            except Exception:
                pass
            c.close()
        self.agents.clear()
        self.sniffers.clear()


def _path_quality(stats: dict[int, tm.StreamWindow], stream_path: dict,
                  stream_dir: dict) -> dict[tuple[str, str], Quality]:
    """Per path: loss over both directions, RTT = median one-way delay up + down, mean jitter."""
    acc: dict[tuple[str, str], dict] = {}
    for sid, w in stats.items():
        path = stream_path.get(sid)
        if path is None:
            continue
        a = acc.setdefault(path, {"n": 0, "exp": 0, "up": [], "down": [], "jit": []})
        a["n"] += w.received
        a["exp"] += max(w.received, w.seq_hi - w.seq_lo + 1)
        a["up" if stream_dir[sid] else "down"].append(w.owd_p50_ms)
        a["jit"].append(w.jitter_ms)
    out = {}
    for path, a in acc.items():
        if not a["up"] or not a["down"]:
            continue
        out[path] = Quality(rtt_ms=statistics.median(a["up"]) + statistics.median(a["down"]),
                            loss=1.0 - a["n"] / a["exp"], jitter_ms=statistics.mean(a["jit"]), packets=a["n"])
    return out


def run(spec: EmulationSpec, out: Path | None = None, caps=None,
        log: Callable[[str], None] | None = None) -> dict:
    """Prepare, build the network, play every policy (and the live controller), tear down."""
    log = log or (lambda m: None)
    prep = prepare(spec)
    log(f"{len(prep.calls)} calls over {len(prep.world.users)} user regions and {len(prep.world.dcs)} DCs; "
        f"{prep.world.n_links // 2} backbone links")
    # absolute: the agents that write into it run in other namespaces from other folders (a
    # relative --out once made every route dump fail, the sniffer never answering)
    workdir = ((out or Path("results") / spec.name) / "emu").resolve()
    result: dict = {"spec": json.loads(spec.model_dump_json()), "policies": {}}
    topo = parse_topology(topology_data(prep.world, spec), spec.name)
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", spec.name)[:32].lstrip("_.-") or "titan"
    with Lab(topo, name=name, check=False, caps=caps, progress=log) as lab:
        paths = InternetPaths(lab, prep.world, spec, progress=log).build()
        emu = Emulation(prep, lab, paths, workdir, log)
        try:
            emu.start_agents()
            for policy in spec.policies:
                log(f"playing the day under {policy} ({spec.day_seconds:g} s)")
                pr = emu.run_policy(policy)
                result["policies"][policy] = _policy_json(pr, prep)
            if spec.controller_seconds > 0:
                log(f"Titan's controller, live ({spec.controller_seconds:g} s)")
                ctl = TitanController(spec.targets, step=0.2, max_fraction=spec.internet_cap)
                result["controller"] = emu.run_controller(spec.controller_seconds, spec.controller_window_s, ctl,
                                                          spec.fault)
        finally:
            emu.close()
            paths.close()
            lab.launcher.copy_logs(workdir / "logs", list(lab.launcher.processes))
    result["world"] = {"users": prep.world.users, "dcs": prep.world.dcs,
                       "links": [prep.world.link_name(i) for i in range(prep.world.n_links)]}
    return result


def _policy_json(pr: PolicyRun, prep: Prepared) -> dict:
    model = prep.model[pr.policy]
    rtts = pr.participant_rtt
    return {
        "sum_of_peaks_kbps": pr.sum_of_peaks_kbps, "model_sum_of_peaks_kbps": pr.model_sum_of_peaks_kbps,
        "planned_sum_of_peaks_kbps": prep.plans[pr.policy].stats.get("planned_sum_of_peaks_kbps"),
        "calls": pr.calls, "streams": pr.streams, "participants_over_bound": pr.participants_over_bound,
        "participants_measured": len(rtts), "loss": pr.loss, "route_violations": pr.route_violations,
        "route_coverage": pr.route_coverage, "misrouted_packets": pr.misrouted_packets,
        "internet_share_calls": pr.internet_share_calls, "migrations": model.migrations,
        "solve_s": prep.plans[pr.policy].solve_s,
        "rtt_error_ms_p50": float(np.median([r["rtt_ms"] - r["model_rtt_ms"] for r in rtts])) if rtts else None,
        "slot_load_kbps": pr.slot_load_kbps.tolist(),
        "model_slot_load_kbps": model.link_load.tolist(),
        "participant_rtt": rtts,
        "over_bound": pr.details.get("over_bound", []),
        "participants_over_bound_min_rtt": pr.details.get("over_bound_min", 0),
    }
