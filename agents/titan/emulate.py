"""Titan and Titan-Next on the emulator: real UDP calls over WAN and Internet paths.

How it fits: ``prepare`` builds the small world (``EmulationSpec``: a few user regions and
DCs; the backbone among them from the Azure matrix), synthesises history days and one
evaluated day of calls (``workload.py``), and asks every policy for its per-call placement
exactly as the offline study does (``placement.py``, ``lp.py``): the LPs plan on the
history's forecast (Titan-Next also on the day's actual demand, as an oracle), with the
study's planning knobs (``spec._Planning``: configurations by media, the headroom
tie-break), and each LP's plan is realised call by call as the study realises it
(``placement.realise_plan``: by default guarded, the Internet share caps kept and the WAN
links held to the plan's peaks); the rule policies by quota counters.  It also evaluates
each realisation on the model, so the emulator's measurements can be set beside the
model's numbers.

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

The counters are judged per slot against the senders' own schedule (``_expected_slot_loads``:
every packet when it falls due, on each link of its route after the delays up to and
through it), over the slots no stall touched (``stalled_slots``: a media agent's catch-up
of ``media.STALL_MS`` or more across a slot edge, or a gap of a tenth of a slot in the
counter sampler).

The model plans in the same units the counters measure: each stream's rate is its frame
rate on the wire (IP packet + 14-byte Ethernet header, ``packets_per_s`` a second), so
planned, modelled and measured loads compare directly.

``run_controller`` plays the day again under Titan's controller (``controller.py``), live.
Every window the controller updates each (region, DC) Internet path's offload fraction
from what the receivers measured on it (its calls and a probe stream each way).  Calls are
placed as ``controller_policy`` says: ``titan``, each at its nearest DC, on the Internet at
its home path's current fraction (counters); ``titan-next``, where Titan-Next's realisation
put it, on the Internet only while every path of it stays within the path's current
fraction of the participants in progress (the live fractions are Titan-Next's caps), else
on the WAN.  When a path's fraction falls below what it carries, calls in progress move
to the WAN (latest end first) until it is within: each of their senders changes the
streams' DSCP (``Reroute``), so the routers send the next packets over the backbone.
``faults`` (loss, delay, jitter; ``FaultSpec``) are injected on their paths and cleared.  A
thread samples the packets entering both lanes of each faulted path in the Internet hub
(``_LaneWatch``), so the time to mitigate is read from the network: the first 0.2 s bin
after the fault from which no call stream is left on the path until it clears; and the
path's reuse, the first bin after it clears that carries calls again.  The bound the
controller gives: every bad window backs off, so the fraction is 0 after at most
``max_backoff_steps`` windows counted from the first whole window after the fault, plus
one bin.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
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
from agents.titan.placement import (INTERNET, WAN, Evaluation, Options, PeakGuard, Plan, Realisation, evaluate,
                                    incidence, realise, realise_greedy, realise_plan, rule_plan)
from agents.titan.regions import World, build_world
from agents.titan.spec import EmulationSpec, TitanError
from testbed.run.lab import Lab
from testbed.spec.topology import parse_topology

ETH_BYTES = 14
_SAMPLE_S = 0.02
_LEAD_S = 1.0
ALL_POLICIES = ("nearest-wan", "wan-lp", "titan", "greedy-internet", "titan-next", "titan-next-oracle")
# the policies planned by an LP (and realised as the study realises them), and the routes each may use
_LP_ROUTES = {"wan-lp": (WAN,), "titan-next": (WAN, INTERNET), "titan-next-oracle": (WAN, INTERNET)}


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
    configs = wl.Configs(by_media=spec.configs_by_media)
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
    plan_on = forecast if spec.forecast_quantile is None else wl.predict(history, t0, spec.forecast_quantile)
    in_day = (calls.start_s >= t0) & (calls.start_s < t0 + wl.DAY_S)
    day = calls.select(in_day)
    day.start_s = day.start_s - t0
    day.duration_s = np.minimum(day.duration_s, wl.DAY_S - day.start_s)  # the emulated day ends
    ip_up, ip_down = ip_up[in_day], ip_down[in_day]
    cfg_day, prov_day = cfg[in_day], prov[in_day]
    actual = wl.demand(day, cfg_day, 0.0, slot_s, slots)
    forecast.t0 = plan_on.t0 = 0.0
    horizon = wl.demand(calls, cfg, 0.0, slot_s, slots * (spec.history_days + 1))
    capacity = lp.capacities(world, options, horizon, spec.capacity_headroom)
    all_cfg = np.concatenate((cfg_day, prov_day))
    plans: dict[str, Plan] = {}
    names = list(spec.policies)
    if spec.controller_seconds > 0 and spec.controller_policy == "titan-next" and "titan-next" not in names:
        names.append("titan-next")  # the live controller places Titan-Next's calls
    for name in names:
        if name == "nearest-wan":
            plans[name] = rule_plan(name, options, all_cfg, 0.0)
        elif name == "titan":
            plans[name] = rule_plan(name, options, all_cfg, spec.titan_share)
        elif name == "greedy-internet":
            plans[name] = Plan(name)  # realised call by call (realise_greedy)
        else:
            demand = actual if name == "titan-next-oracle" else plan_on
            problem = lp.DayProblem(demand, lp.top_configs(demand, spec.max_configs), capacity)
            plans[name] = lp.solve_day(world, options, problem, name, _LP_ROUTES[name], spec.tie_break_eps,
                                       solver="simplex", tie_break=spec.tie_break)
    incid = incidence(world)
    realised, model = {}, {}
    for name, plan in plans.items():
        if name == "greedy-internet":
            realised[name] = realise_greedy(options, day, cfg_day, prov_day, 0.0, slot_s)
        elif name in _LP_ROUTES:  # as the offline study realises them (``realisation``, the guard)
            realised[name] = realise_plan(plan, options, day, cfg_day, prov_day, 0.0, slot_s, spec.realisation,
                                          PeakGuard(world, spec.guard_keeps_caps), plan.stats["planned_peaks"],
                                          _LP_ROUTES[name], spec.move_at)
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
    pps: float | None = None  # packets a second (None: the spec's packets_per_s)


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
            by_host.setdefault(s.src_host, []).append(tm.StreamSpec(s.sid, s.dst_ip, s.ip_kbps, s.pps or pps, tos,
                                                                    s.start, s.end))
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
        stalls: list[list[int]] = []
        for name, client in self.agents.items():
            path = self.workdir / f"dump-{policy}-{name}.json"
            client.request(tm.Dump(path=str(path)))
            data = json.loads(path.read_text())
            rx.update({int(k): v for k, v in data["rx"].items()})
            sent.update({int(k): v for k, v in data["sent"].items()})
            stalls += data.get("stalls", [])
        seen = self._route_counts(policy)
        load = self._slot_loads(samples, t0, links)
        pr = self._judge(policy, streams, rx, sent, seen, load, links)
        # the counter sampler's own gaps (the machine did not run it) share a gap's bytes
        # between the slots on either side of an edge in proportion to time: a tenth of a slot
        # or more (one run: 21-36 gaps of 60 ms or more per policy, on a loaded machine)
        times = [x[0] for x in samples]
        gap_s = max(3 * _SAMPLE_S, 0.1 * spec.day_seconds / spec.slots)
        gaps = [[int(a * 1e9), int(b * 1e9), 0, 0] for a, b in zip(times, times[1:]) if b - a >= gap_s]
        pr.details["stalled_slots"], pr.details["stall_bytes_moved"] = stalled_slots(
            stalls + gaps, t0, spec.day_seconds / spec.slots, spec.slots)
        pr.details["sampler_gaps"] = len(gaps)
        pr.details["expected_slot_load_kbps"] = self._expected_slot_loads(streams, t0)
        return pr

    def _expected_slot_loads(self, streams: list[Stream], t0: float) -> np.ndarray:
        """[world link, slot] kbps the WAN links' counters should read if every sender kept its
        schedule: each packet (frame bytes, as the counters count them) at the instant it
        falls due (``media``: start, then every 1/pps, while before the end), on every
        backbone link of its route, later by the one-way delays up to and through that link."""
        prep = self.prep
        w = prep.world
        slots = prep.spec.slots
        slot_emu = prep.spec.day_seconds / slots
        edges = t0 + slot_emu * np.arange(slots + 1)
        out = np.zeros((w.n_links, slots))
        pps = prep.spec.packets_per_s
        interval = int(1e9 / pps) / 1e9
        for s in streams:
            if s.route != WAN:
                continue
            u, d = w.users[s.region], w.dcs[s.dc]
            src, dst = (u, d) if s.up else (d, u)
            if src == dst:
                continue
            n = int(np.ceil((s.end - s.start) / interval - 1e-9))
            times = s.start + interval * np.arange(max(n, 0))
            frame = (ip_bytes_per_packet(s.ip_kbps, pps) + ETH_BYTES) * 8 / 1000.0 / slot_emu
            path = w.backbone.path(src, dst)
            offset = 0.0
            for a, b in zip(path, path[1:]):
                # counted as it leaves the gateway's WAN device: after this link's delay (the
                # delay line or netem sits before the device's counters)
                offset += self.lab.net.link(a, b).params.delay_ms / 1000.0
                counts, _ = np.histogram(times + offset, edges)
                out[w.backbone.link_index[(a, b)]] += counts * frame
        return out

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
                       faults: list | tuple = (), policy: str = "titan-next") -> dict:
        """Play the day compressed into ``seconds`` with routes decided live under ``controller``
        (module docstring): calls admitted on the Internet within each path's current fraction,
        moved back to the WAN when a path's fraction falls below its calls in progress, and
        ``faults`` (``FaultSpec``) injected and cleared on their paths."""
        prep = self.prep
        w = prep.world
        opts = prep.options
        calls = prep.calls
        if policy == "titan-next" and "titan-next" not in prep.realised:
            raise TitanError("controller_policy titan-next: Titan-Next has no plan here (add it to policies)")
        real = prep.realised.get("titan-next") if policy == "titan-next" else None
        for c in list(self.agents.values()) + list(self.sniffers.values()):
            c.request(tm.Reset())
        scale = seconds / wl.DAY_S
        t0 = time.monotonic() + _LEAD_S
        # one probe stream each way per Internet path (region -> DC) the calls could use
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
                                     w.dcs.index(d), t0, t0 + seconds, pps=_PROBE_PPS))
        self._send_streams(probes)
        lane_probes = {}
        for (u, d) in paths:
            for lane in ((u, d), (d, u)):
                lane_probes[lane] = lane_probes.get(lane, 0) + 1
        faults = list(faults)
        lanes = [lane for f in faults for lane in ((f.user, f.dc), (f.dc, f.user))]
        watch = _LaneWatch([self.paths.lanes[ln].name for ln in lanes]).start()
        state = [{"fault": f, "at": t0 + seconds * f.at_fraction,
                  "clear": t0 + seconds * f.clear_at_fraction if f.clear_at_fraction else None,
                  "before": (self.paths.lanes[(f.user, f.dc)].delay_ms, self.paths.lanes[(f.user, f.dc)].jitter_ms,
                             self.paths.lanes[(f.user, f.dc)].loss), "on": False, "cleared": False}
                 for f in faults]
        order = np.argsort(calls.start_s, kind="stable")
        counters: dict[tuple[str, str], list[int]] = {}
        live: dict[int, _LiveCall] = {}  # in progress
        live_calls: dict[int, _LiveCall] = {}  # every call started
        moves: list[dict] = []
        planned: list[tuple[float, tuple[str, str], int]] = []  # Titan-Next's Internet participants, as they start
        unmovable = 0
        next_window = t0 + window_s
        timeline = []
        routes = np.zeros(len(calls), dtype=np.int64)
        i = 0
        end = t0 + seconds
        for c in self.agents.values():
            c.request(tm.Window())  # start the first window clean
        try:
            while time.monotonic() < end:
                now = time.monotonic()
                while i < len(order) and t0 + calls.start_s[order[i]] * scale <= now + 0.05:
                    ci = int(order[i])
                    i += 1
                    k = int(prep.config[ci])
                    start = max(t0 + calls.start_s[ci] * scale, time.monotonic() + 0.02)
                    stop_t = start + max(calls.duration_s[ci] * scale, 2.0 / prep.spec.packets_per_s)
                    if real is None:  # Titan: the nearest DC, the home path's fraction by counters
                        d = opts[k].nearest
                        route = WAN
                        if opts.option_index(k, d, INTERNET) is not None:
                            path = (w.users[int(calls.first[ci])], w.dcs[d])
                            f = controller.fraction(path)
                            cnt = counters.setdefault(path, [0, 0])
                            cnt[0] += 1
                            if f * cnt[0] - cnt[1] >= 0.5 or f >= 1.0:
                                cnt[1] += 1
                                route = INTERNET
                    else:  # Titan-Next's placement, on the Internet only within the live fractions
                        d, route = int(real.dc[ci]), int(real.route[ci])
                        if route == INTERNET:
                            inet, every = _in_progress(live, now)
                            wants = self._call_paths(ci, d)
                            planned += [(now - t0, p, n) for p, n in wants.items()]
                            if not all(_within(inet[p], every[p], n, controller.fraction(p))
                                       for p, n in wants.items()):
                                route = WAN
                                if opts.option_index(k, d, WAN) is None:
                                    d = opts[k].nearest
                    routes[ci] = route
                    live[ci] = live_calls[ci] = self._start_live_call(ci, d, route, start, stop_t, stream_path,
                                                                      stream_dir)
                for st in state:
                    f = st["fault"]
                    if not st["on"] and now >= st["at"]:
                        b0 = st["before"]
                        self.paths.set_internet(f.user, f.dc, loss=f.loss, delay_ms=b0[0] + f.extra_delay_ms,
                                                jitter_ms=b0[1] + f.extra_jitter_ms)
                        st["on"], st["at"] = True, now
                        self.log(f"fault injected on {f.user}<->{f.dc}: loss {f.loss}, "
                                 f"+{f.extra_delay_ms:g} ms delay, +{f.extra_jitter_ms:g} ms jitter")
                    if st["clear"] is not None and st["on"] and not st["cleared"] and now >= st["clear"]:
                        b0 = st["before"]
                        self.paths.set_internet(f.user, f.dc, delay_ms=b0[0], jitter_ms=b0[1], loss=b0[2])
                        st["cleared"], st["clear"] = True, now
                        self.log(f"fault cleared on {f.user}<->{f.dc}")
                if now >= next_window:
                    stats = {}
                    for c in self.agents.values():
                        stats.update({int(k): v for k, v in c.request(tm.Window()).window.items()})
                    qual = _path_quality(stats, stream_path, stream_dir)
                    for path in paths:
                        controller.update(path, qual.get(path), now - t0)
                    # calls in progress above a path's new fraction go back to the WAN, latest end first
                    inet, every = _in_progress(live, now)
                    for path in paths:
                        f = controller.fraction(path)
                        on = sorted((c for c in live.values() if c.route == INTERNET and path in c.paths),
                                    key=lambda c: -c.end)
                        for c in on:
                            if inet[path] <= f * every[path] + 0.5:
                                break
                            if opts.option_index(int(prep.config[c.call]), c.dc, WAN) is None:
                                unmovable += 1
                                continue
                            self._move_to_wan(c, stream_path)
                            for p, n in c.paths.items():
                                inet[p] -= n
                            moves.append({"t": now - t0, "at": time.monotonic(), "call": c.call,
                                          "path": f"{path[0]}->{path[1]}", "participants": sum(c.paths.values())})
                    for path in paths:
                        q = qual.get(path)
                        timeline.append({"t": now - t0, "path": f"{path[0]}->{path[1]}",
                                         "fraction": controller.fraction(path),
                                         "rtt_ms": q.rtt_ms if q else None, "loss": q.loss if q else None,
                                         "jitter_ms": q.jitter_ms if q else None,
                                         "verdict": controller.history(path)[-1][1],
                                         "internet_participants": inet[path], "participants": every[path]})
                    next_window += window_s
                time.sleep(0.005)
            time.sleep(0.5)
            moved = self._moved_streams_seen(moves, live_calls)
        finally:
            samples = watch.stop()
            for st in state:  # leave every path as it was
                if st["on"] and not st["cleared"]:
                    f, b0 = st["fault"], st["before"]
                    self.paths.set_internet(f.user, f.dc, delay_ms=b0[0], jitter_ms=b0[1], loss=b0[2])
        bound = (controller.max_backoff_steps + 1) * window_s + _LANE_BIN_S
        out_faults = []
        for st in state:
            f = st["fault"]
            idx = [lanes.index((f.user, f.dc)), lanes.index((f.dc, f.user))]
            probes_here = [lane_probes.get((f.user, f.dc), 0), lane_probes.get((f.dc, f.user), 0)]
            series = _lane_streams(samples, idx, sum(probes_here) * _PROBE_PPS, prep.spec.packets_per_s, t0)
            at = st["at"] - t0 if st["on"] else None
            clear = st["clear"] - t0 if st["cleared"] else None
            mitigated = _mitigated_at(series, at, clear) if at is not None else None
            used = _used_again_at(series, clear) if clear is not None else None
            name = f"{f.user}->{f.dc}"
            raised = next((r["t"] for r in timeline if r["path"] == name and clear is not None and r["t"] >= clear
                           and r["fraction"] > 0), None)
            # Titan-Next's Internet participants over the path that started once it was raised again
            wanted = sum(n for t, p, n in planned if raised is not None and t >= raised and p in
                         ((f.user, f.dc), (f.dc, f.user)))
            out_faults.append({
                "path": f"{f.user}->{f.dc}", "loss": f.loss, "extra_delay_ms": f.extra_delay_ms,
                "extra_jitter_ms": f.extra_jitter_ms, "at_s": at, "cleared_at_s": clear,
                "call_streams_at_fault": _streams_at(series, at, at + window_s) if at is not None else None,
                "mitigated_at_s": mitigated, "time_to_mitigate_s": None if mitigated is None else mitigated - at,
                "mitigate_bound_s": bound, "raised_again_at_s": raised, "planned_internet_after_raise": wanted,
                "used_again_at_s": used,
                "calls_moved": sum(1 for mv in moves if mv["path"] in (f"{f.user}->{f.dc}", f"{f.dc}->{f.user}")),
                "lane_call_streams": series})
        for mv in moves:
            mv.pop("at", None)
        return {"policy": policy, "timeline": timeline, "faults": out_faults, "moves": moves,
                "moved_streams": moved,
                "unmovable": unmovable, "window_s": window_s, "lane_bin_s": _LANE_BIN_S,
                "internet_share_calls": float((routes == INTERNET).mean()) if len(routes) else 0.0,
                "max_backoff_steps": controller.max_backoff_steps}

    def _route_counts(self, tag: str) -> dict[str, dict[int, int]]:
        """Every route checker's counts so far: interface -> stream id -> packets (each dumps to
        ``routes-TAG-NAME.json`` in the work folder)."""
        seen: dict[str, dict[int, int]] = {}
        for name, client in self.sniffers.items():
            path = self.workdir / f"routes-{tag}-{name}.json"
            client.request(tm.Dump(path=str(path)))
            for ifname, table in json.loads(path.read_text()).items():
                seen[ifname] = {int(k): v for k, v in table.items()}
        return seen

    def _moved_streams_seen(self, moves: list[dict], calls: dict[int, "_LiveCall"]) -> dict:
        """The route counters' word on the calls moved: of the moved streams that still had
        0.1 s to run and had left on the Internet (before the move), how many left on a
        backbone link too (after it); counted by every router's and the hub's ``routecheck``."""
        time.sleep(0.3)  # what is in flight reaches the counters
        seen = self._route_counts("controller")
        wan_ifs = {ln.ifname for ln in self.lab.net.links()}
        inet_ifs = set(seen) - wan_ifs
        checked = on_wan = 0
        for mv in moves:
            c = calls[mv["call"]]
            if c.end - mv["at"] < 0.1:
                continue
            for sids in c.senders.values():
                for sid in sids:
                    if all(seen[i].get(sid, 0) == 0 for i in inet_ifs):
                        continue  # a local participant's stream: on neither route
                    checked += 1
                    on_wan += any(seen[i].get(sid, 0) > 0 for i in wan_ifs if i in seen)
        return {"checked": checked, "on_internet_then_wan": on_wan}

    def _call_paths(self, ci: int, d: int) -> dict[tuple[str, str], int]:
        """Participants of call ``ci`` per Internet path (their region -> DC ``d``; local ones have none)."""
        w, calls = self.prep.world, self.prep.calls
        out: dict[tuple[str, str], int] = {}
        for e in range(calls.ptr[ci], calls.ptr[ci + 1]):
            u = int(calls.region[e])
            if not w.local[u, d]:
                p = (w.users[u], w.dcs[d])
                out[p] = out.get(p, 0) + int(calls.count[e])
        return out

    def _start_live_call(self, ci: int, d: int, route: int, start: float, stop_t: float,
                         stream_path: dict, stream_dir: dict) -> "_LiveCall":
        prep, w, calls = self.prep, self.prep.world, self.prep.calls
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
                    stream_path[self._sid] = stream_path[self._sid + 1] = (w.users[u], w.dcs[d])
                    stream_dir[self._sid], stream_dir[self._sid + 1] = True, False
                self._sid += 2
        self._send_streams(streams)
        senders: dict[str, list[int]] = {}
        for s in streams:
            senders.setdefault(s.src_host, []).append(s.sid)
        return _LiveCall(ci, d, route, stop_t, self._call_paths(ci, d), senders)

    def _move_to_wan(self, call: "_LiveCall", stream_path: dict) -> None:
        """Every stream of ``call`` takes the WAN from its next packet; the path's quality is
        measured without them from now on."""
        for host, sids in call.senders.items():
            self.agents[host].request(tm.Reroute(sids=sids, tos=0))
            for sid in sids:
                stream_path.pop(sid, None)
        call.route = WAN

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


# A probe stream's packets a second: a window of probes alone (both directions, 1 s) holds 200
# packets, so one lost packet reads 0.5%, half the 1% loss target (at the calls' 25 packets/s
# one loss read 2%, "severe": on a path with 0.2% loss, 8 of 23 windows in one run).
_PROBE_PPS = 100.0
_LANE_SAMPLE_S = 0.05
_LANE_BIN_S = 0.2


@dataclass
class _LiveCall:
    call: int
    dc: int
    route: int
    end: float  # CLOCK_MONOTONIC
    paths: dict  # (region, DC) -> participants on that Internet path
    senders: dict  # host -> the stream ids it sends


def _in_progress(live: dict[int, _LiveCall], now: float):
    """Per path: participants on the Internet, participants in all (calls in progress); ended calls leave."""
    inet: Counter = Counter()
    every: Counter = Counter()
    for ci in [ci for ci, c in live.items() if c.end <= now]:
        del live[ci]
    for c in live.values():
        every.update(c.paths)
        if c.route == INTERNET:
            inet.update(c.paths)
    return inet, every


def _within(inet: int, every: int, n: int, fraction: float) -> bool:
    """``n`` more participants on a path's Internet keep its share within ``fraction`` (to the
    nearest participant, as Titan's counters round)."""
    return inet + n <= fraction * (every + n) + 0.5


class _LaneWatch:
    """Samples the packets entering Internet lanes (the hub's TUN devices) every 50 ms: what the
    senders put on a path, whatever the fault then does to it."""

    def __init__(self, names: list[str]):
        self.names = names
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._th: threading.Thread | None = None

    def start(self) -> "_LaneWatch":
        if self.names:
            self._th = threading.Thread(target=self._run, daemon=True)
            self._th.start()
        return self

    def _run(self) -> None:
        from pyroute2 import IPRoute

        with IPRoute(netns=f"/run/netns/{HUB_NS}", flags=0) as ipr:
            index = {n: ipr.link_lookup(ifname=n)[0] for n in self.names}
            while not self._stop.is_set():
                counts = []
                for n in self.names:
                    counts.append(ipr.get_links(index[n])[0].get_attr("IFLA_STATS64")["tx_packets"])
                self.samples.append((time.monotonic(), counts))
                self._stop.wait(_LANE_SAMPLE_S)

    def stop(self) -> list[tuple[float, list[int]]]:
        self._stop.set()
        if self._th is not None:
            self._th.join(timeout=5)
        return self.samples


def _lane_streams(samples, idx: list[int], probe_pps: float, pps: float, t0: float) -> list[list[float]]:
    """[[t, call streams]] per ``_LANE_BIN_S`` bin: the packets entering both lanes of a path over
    the bin, less the probes' (``probe_pps`` in all), in streams (every call stream sends ``pps``)."""
    if len(samples) < 2:
        return []
    times = np.array([s[0] for s in samples]) - t0
    counts = np.array([[s[1][j] for j in idx] for s in samples], dtype=np.float64).sum(axis=1)
    edges = np.arange(max(0.0, times[0]), times[-1], _LANE_BIN_S)
    at = np.interp(edges, times, counts)
    rate = (np.diff(at) / _LANE_BIN_S - probe_pps) / pps
    return [[float(t), float(r)] for t, r in zip(edges[:-1], rate)]


def _smoothed(series) -> list[tuple[float, float]]:
    """Each bin's call streams as the median of the 5 bins around it (1 s): a sender that the
    shared machine stalls sends less in one bin and what fell due in the next (a dip and a
    spike of several streams side by side), which the median leaves out."""
    vals = [r for _, r in series]
    return [(t, float(np.median(vals[max(0, j - 2):j + 3]))) for j, (t, _) in enumerate(series)]


def _streams_at(series, t_from: float, t_to: float) -> float | None:
    """The most call streams the path carried (smoothed) between two instants."""
    vals = [r for t, r in _smoothed(series) if t_from <= t < t_to]
    return float(max(vals)) if vals else None


def _mitigated_at(series, at: float, clear: float | None) -> float | None:
    """The first bin from which, until the fault clears, no call stream is left on the path
    (under half a stream, smoothed)."""
    window = [(t, r) for t, r in _smoothed(series) if t >= at and (clear is None or t + _LANE_BIN_S <= clear)]
    for j, (t, _) in enumerate(window):
        if all(r < 0.5 for _, r in window[j:]):
            return t
    return None


def _used_again_at(series, clear: float) -> float | None:
    """The first bin after the fault cleared that carries a call stream again (smoothed)."""
    return next((t for t, r in _smoothed(series) if t >= clear and r >= 0.8), None)


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
                                                          spec.faults, spec.controller_policy)
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
        "stalled_slots": pr.details.get("stalled_slots", []),
        "stall_bytes_moved": pr.details.get("stall_bytes_moved", 0),
        "sampler_gaps": pr.details.get("sampler_gaps", 0),
        "expected_slot_load_kbps": pr.details["expected_slot_load_kbps"].tolist()
        if "expected_slot_load_kbps" in pr.details else None,
        "expected_clean_sum_of_peaks_kbps": _clean_peaks(pr.details["expected_slot_load_kbps"],
                                                         pr.details.get("stalled_slots", []))
        if "expected_slot_load_kbps" in pr.details else None,
        "clean_sum_of_peaks_kbps": _clean_peaks(pr.slot_load_kbps, pr.details.get("stalled_slots", [])),
        "model_clean_sum_of_peaks_kbps": _clean_peaks(model.link_load, pr.details.get("stalled_slots", [])),
        "model_slot_load_kbps": model.link_load.tolist(),
        "participant_rtt": rtts,
        "over_bound": pr.details.get("over_bound", []),
        "participants_over_bound_min_rtt": pr.details.get("over_bound_min", 0),
    }


def stalled_slots(stalls: list[list[int]], t0: float, slot_s: float, slots: int) -> tuple[list[int], int]:
    """Slots whose bytes a sender's stall moved, and the bytes so moved: a catch-up (``media``:
    [first due ns, sent ns, packets, bytes], ``STALL_MS`` late or more) whose packets fell due
    in one slot and left in a later one marks both and those between."""
    marked: set[int] = set()
    moved = 0
    for due_ns, sent_ns, _, nbytes in stalls:
        a = max(int((due_ns / 1e9 - t0) // slot_s), 0)
        b = min(int((sent_ns / 1e9 - t0) // slot_s), slots - 1)
        if b > a:
            marked.update(range(a, b + 1))
            moved += int(nbytes)
    return sorted(marked), moved


def _clean_peaks(load, stalled: list[int]) -> float:
    """Sum over links of each link's peak over the slots no sender's stall touched."""
    load = np.asarray(load, dtype=np.float64)
    keep = [j for j in range(load.shape[1]) if j not in set(stalled)]
    return float(load[:, keep].max(axis=1).sum()) if keep else float("nan")
