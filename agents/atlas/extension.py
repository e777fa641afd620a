"""Atlas's side of a training run: its controller and gateway agents, and their plans.

How it fits: the run makes this class (``plugin.py`` names it) when the experiment says
``atlas: {sharing: temporal | paced}``.  With temporal sharing it asks the network for the delay
line's per-pipeline scheduler on every WAN path and starts one agent per gateway that has
pipelines to schedule (``agent.py``), on that DC's machine (``Launcher.start(near=dc)``: its
delay line is there), and always the controller (``controller.py``, on the first DC's
machine), which connects to the run's telemetry hub as ``atlas-controller`` and reaches the
agents at ``Launcher.socket`` paths (relayed between machines by the cluster's agents).  The extension forwards
every worker's timeline to the controller, passes each plan's start offsets to the first
stage of each pipeline, and writes ``atlas-plans.json`` and the processes' logs into the
results.  A dead controller or agent is logged and training goes on under fair sharing
(the agents' leases run out in the delay lines).  The summary counts from the first
iteration after the first plan (the plan is then in force).  With ``enforce: senders`` no
delay line schedules anything: each worker's cross-DC channels take their turns from their
DC's agent (``worker_options``; ``testbed/net/sendturns.py``), and the agents' counters go
to ``atlas-turns.json``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from agents.atlas.config import AgentConfig, AgentLink, ControllerConfig, LinkPlan
from agents.atlas.messages import PlanPublished
from testbed.sim.build import PAYLOAD_FRACTION
from testbed.train.config import SendTurns
from testbed import messages as m
from testbed.results.metrics import RunSummary
from testbed.run.hooks import RunContext, RunExtension


class AtlasExtension(RunExtension):
    name = "atlas"
    peers = ("atlas-controller",)

    def __init__(self, exp):
        self.exp = exp
        self.plans: list[dict] = []  # every plan the controller published, with when
        self._steady_from = 0
        self._ctx: RunContext | None = None
        self._controller_up = False
        self._dead: set[str] = set()
        self._names: list[str] = []
        self.turns: dict[str, dict] = {}  # turns at the senders: per link, the agents' counters
        self.gateway: dict[str, dict] = {}  # turns at the gateway: per link, each pipeline's queue drops

    def network_options(self) -> dict:
        return {"scheduling": True} if self._at_gateway() else {}

    def _at_gateway(self) -> bool:
        return self.exp.atlas.sharing == "temporal" and self.exp.atlas.enforce == "gateway"

    def _at_senders(self) -> bool:
        return self.exp.atlas.sharing == "temporal" and self.exp.atlas.enforce == "senders"

    @staticmethod
    def _turn_server(ctx: RunContext, dc: str) -> str:
        """Its DC's agent's turn server (the DC's workers connect to it: on its machine)."""
        return str(ctx.launcher.file(f"atlas-turns-{dc}.sock"))

    def worker_options(self, ctx: RunContext, slot) -> dict:
        """Turns at the senders: each outgoing cross-DC channel asks its own DC's agent for
        its pipeline's turn on the WAN directions it crosses."""
        if not self._at_senders() or self.exp.parallel.replicas < 2:
            return {}
        exp, wire = self.exp, ctx.net.topo  # the wire's rates (under time dilation, the dilated ones)
        slots = {(s.stage, s.replica): s for s in exp.workers()}
        out = {}
        for key, peer in (("turns_next", slots.get((slot.stage + 1, slot.replica))),
                          ("turns_prev", slots.get((slot.stage - 1, slot.replica)))):
            if peer is None or peer.dc == slot.dc:
                continue
            hops = wire.path(slot.dc, peer.dc)
            pairs = list(zip(hops, hops[1:]))
            rate = min(wire.direction(x, y).rate_mbps for x, y in pairs) * 1e6 / 8
            bdp = rate * wire.rtt_ms(slot.dc, peer.dc) / 1000
            path = self._turn_server(ctx, slot.dc)
            window = exp.parallel.tcp_window_bytes  # clamped: what its connections can carry, exactly
            ceiling = exp.parallel.connections * window / (wire.rtt_ms(slot.dc, peer.dc) / 1000) if window else 0.0
            out[key] = SendTurns(path, f"r{slot.replica}", [f"{x}->{y}" for x, y in pairs], int(bdp), rate,
                                 ceiling)
        return out

    # -- starting -----------------------------------------------------------------------
    def start(self, ctx: RunContext) -> None:
        """The controller and (temporal sharing) one agent per gateway with WAN links to enforce."""
        self._ctx = ctx
        exp, net = self.exp, ctx.net
        links, delays = self._links(ctx)
        agents: dict[str, str] = {}
        wire = net.topo  # under time dilation, the links as the wire carries them (the controller's clock)
        if exp.atlas.sharing == "temporal":
            for dc in sorted({x for x, _ in links}):
                mine = {f"{x}->{y}": (x, y) for x, y in links if x == dc}
                # the agent runs on its DC's machine (its gateway's delay line is there); the
                # controller reaches its socket from wherever it runs
                listen = str(ctx.launcher.socket(f"atlas-agent-{dc}.sock", near=dc))
                if self._at_senders():
                    cfg = AgentConfig(dc, listen, exp.atlas.lease_s, {}, turns=self._turn_server(ctx, dc),
                                      turn_links=sorted(mine), stats=str(ctx.launcher.file(f"atlas-turns-{dc}.json")),
                                      turn_rates={n: wire.direction(*k).rate_mbps * 1e6 / 8 * PAYLOAD_FRACTION
                                                  for n, k in mine.items()})
                    mine = {}
                else:
                    cfg = AgentConfig(dc, listen, exp.atlas.lease_s,
                                      {n: AgentLink(net.link(*k).control_path, net.link(*k).lane)
                                       for n, k in mine.items()})
                for i in range(len(mine)):  # its own socket per delay line (the line answers there)
                    ctx.launcher.file(f"atlas-agent-{dc}.sock.{i}")
                self._start(ctx, f"agent-{dc}", "agents.atlas.agent", cfg.to_dict(), near=dc)
                agents[dc] = listen
        rates = [wire.direction(x, y).rate_mbps for x, y in links]
        cfg = ControllerConfig(
            telemetry=str(ctx.telemetry_path), agents=agents, sharing=exp.atlas.sharing,
            lease_s=exp.atlas.lease_s, replan_threshold=exp.atlas.replan_threshold,
            stages=exp.parallel.stages, replicas=exp.parallel.replicas,
            warmup_iterations=exp.training.warmup_iterations,
            message_bytes=exp.training.microbatch_size * exp.model.seq_len * exp.model.hidden * 4,
            link_bytes_s=min(rates) * 1e6 / 8 if rates else 0.0, transfer_delays_s=delays,
            class_queue="share" if exp.atlas.class_queue == "share" else None, plan=exp.atlas.plan,
            links={f"{x}->{y}": LinkPlan(classes, wire.direction(x, y).rate_mbps)
                   for (x, y), classes in links.items()})
        self._start(ctx, "controller", "agents.atlas.controller", cfg.to_dict())
        self._controller_up = True
        ctx.log(f"atlas: controller and {len(agents)} agent(s) started ({exp.atlas.sharing} sharing, "
                f"{len(links)} WAN direction(s) carry pipelines)")

    def _links(self, ctx: RunContext) -> tuple[dict, dict]:
        """Per WAN direction crossed by a stage boundary: pipeline -> (src, dst) host address
        pairs; and the one-way WAN delay of each cross-DC transfer (by kind and receiving stage)."""
        exp = self.exp
        links: dict[tuple[str, str], dict[str, list]] = {}
        delays: dict[str, float] = {}
        slots = {(s.stage, s.replica): s for s in exp.workers()}
        wire = ctx.net.topo  # dilated delays under time dilation: the controller's clock is the wall's
        for (stage, r), a in slots.items():
            b = slots.get((stage + 1, r))
            if b is None or a.dc == b.dc:
                continue
            ip_a, ip_b = ctx.workers[a.name].host.ip, ctx.workers[b.name].host.ip
            hops = wire.path(a.dc, b.dc)
            for x, y in zip(hops, hops[1:]):  # activations one way, gradients the other
                links.setdefault((x, y), {}).setdefault(f"r{r}", []).append([ip_a, ip_b])
                links.setdefault((y, x), {}).setdefault(f"r{r}", []).append([ip_b, ip_a])
            pairs = list(zip(hops, hops[1:]))
            delays[f"xfer_act:{stage + 1}"] = sum(wire.direction(x, y).delay_ms for x, y in pairs) / 1e3
            delays[f"xfer_grad:{stage}"] = sum(wire.direction(y, x).delay_ms for x, y in pairs) / 1e3
        return links, delays

    def _start(self, ctx: RunContext, name: str, module: str, cfg: dict, near: str | None = None) -> None:
        ctx.launcher.start(f"atlas-{name}", module, cfg, near=near)
        self._names.append(f"atlas-{name}")

    # -- during the run -------------------------------------------------------------------
    def on_worker_message(self, worker: str, msg: m.Message) -> None:
        if self._controller_up and isinstance(msg, m.Events):
            if not self._ctx.send_to_peer("atlas-controller", replace(msg, worker=worker)):
                self._controller_gone("stopped reading")

    def on_peer_message(self, peer: str, msg: m.Message) -> None:
        if not isinstance(msg, PlanPublished):
            return
        ctx = self._ctx
        plan = msg.plan
        at = ctx.iterations_done()
        self.plans.append(dict(_emulated_plan(plan, self.exp.time_dilation), published_at_iteration=at))
        if len(self.plans) == 1:  # iterations under way when it came are not the plan's
            self._steady_from = max(w.iterations_done for w in ctx.workers.values()) + 1
        self._send_offsets({int(r): v for r, v in plan["offsets"].items()})
        ctx.log(f"atlas plan at iteration {at}: order {plan['order']}, offsets "
                f"{[round(v * 1e3, 1) for v in self.plans[-1]['offsets'].values()]} ms")

    def on_peer_gone(self, peer: str) -> None:
        self._controller_gone("closed its connection")

    def _send_offsets(self, offsets: dict[int, float]) -> None:
        for name, w in self._ctx.workers.items():
            if w.slot.stage == 0:
                self._ctx.send_to_worker(name, m.StartOffset(offset_s=offsets.get(w.slot.replica, 0.0)))

    def _controller_gone(self, how: str) -> None:
        if not self._controller_up:
            return
        self._controller_up = False
        self._dead.add("atlas-controller")
        self._send_offsets({})
        self._ctx.log(f"atlas controller {how} at iteration {self._ctx.iterations_done()}: training continues "
                      f"under fair sharing (offsets reset; the agents restore FIFO within "
                      f"{self.exp.atlas.lease_s:.1f} s)")

    def check(self) -> None:
        procs = self._ctx.launcher.processes
        for name in self._names:
            proc = procs[name]
            if name in self._dead or proc.alive():
                continue
            code = proc.returncode
            if name == "atlas-controller":
                self._controller_gone(f"died (exit {code})")
            else:
                self._dead.add(name)
                how = ("its DC's senders send without turns (fair sharing) from their next message"
                       if self._at_senders() else f"its links fall back to fair sharing when their lease ends "
                                                  f"({self.exp.atlas.lease_s:.1f} s)")
                self._ctx.log(f"{name.replace('-', ' ', 1)} died (exit {code}) at iteration "
                              f"{self._ctx.iterations_done()}: {how}; training continues")

    def steady_state_from(self) -> int:
        return self._steady_from

    # -- after the run ------------------------------------------------------------------
    def training_done(self) -> None:
        if self._at_gateway():  # the gateways' per-pipeline queues: what each pipeline lost there
            for x, y in self._links(self._ctx)[0]:
                try:
                    sched = self._ctx.net.link(x, y).delay_line_stats()["sched"]
                except (OSError, RuntimeError, KeyError, TypeError):
                    sched = None
                if sched is not None:
                    self.gateway[f"{x}->{y}"] = {"drops": sched["drops"], "queue_bytes": sched["queue_bytes"],
                                                 "bytes": sched.get("bytes_out", {})}
        if self._controller_up:
            self._ctx.send_to_peer("atlas-controller", m.Bye())

    def stop(self, out_dir: Path) -> None:
        if self._ctx is None or not self._names:
            return
        self._ctx.launcher.stop(self._names)
        self._ctx.launcher.copy_logs(out_dir / "atlas-logs", self._names, rename=lambda n: n.removeprefix("atlas-"))
        (out_dir / "atlas-plans.json").write_text(json.dumps(self.plans, indent=1))
        if self._at_senders():  # each agent's turn server's counters, per link and pipeline
            k = self.exp.time_dilation
            for dc in sorted({x for x, _ in self._links(self._ctx)[0]}):
                raw = self._ctx.launcher.read(self._ctx.launcher.file(f"atlas-turns-{dc}.json"), near=dc)
                for link, data in (json.loads(raw) if raw else {}).items():
                    for c in data["pipelines"].values():  # in emulated seconds
                        c["waited_s"], c["held_s"] = round(c["waited_s"] / k, 4), round(c["held_s"] / k, 4)
                    go = self._ctx.go_time  # each turn's instants: emulated seconds since the go
                    data["turns"] = [[p] + [None if t is None else round((t - go) / k, 6) for t in (a, g, h)] + [n, x]
                                     for p, a, g, h, n, x in data["turns"]]
                    self.turns[link] = data
            (out_dir / "atlas-turns.json").write_text(json.dumps(self.turns, indent=1))

    def summarise(self, record, result: RunSummary, out_dir: Path) -> dict:
        last = self.plans[-1] if self.plans else None
        out = {"sharing": self.exp.atlas.sharing, "plans_published": len(self.plans),
               "order": last["order"] if last else None, "steady_state_from_iteration": self._steady_from}
        if self.exp.atlas.sharing == "temporal":
            out["enforce"] = self.exp.atlas.enforce
        if self.gateway:
            out["gateway_drops"] = {link: g["drops"] for link, g in self.gateway.items()}
            out["gateway_bytes"] = {link: g["bytes"] for link, g in self.gateway.items()}  # each pipeline's, sent
        if self.turns:
            out["turns"] = {link: {p: {"turns": c["turns"], "waited_s": c["waited_s"], "held_s": c["held_s"]}
                                   for p, c in data["pipelines"].items()} for link, data in self.turns.items()}
        return {"atlas": out}


def predict_options(exp, run_dir: Path) -> dict:
    """The simulator's arguments for predicting a variant run with Atlas (``compare:``): the
    start offsets of the last plan its controller published, and under temporal sharing that
    plan's order: strict priority where the gateway enforces it, a message at a time where the
    senders take turns."""
    from testbed.sim.engine import TurnPolicy

    plans_file = run_dir / "atlas-plans.json"
    if exp.atlas.sharing == "fair" or not plans_file.exists():
        return {}
    plans = json.loads(plans_file.read_text())
    if not plans:
        return {}
    out: dict = {"start_offsets": {int(r): v for r, v in plans[-1]["offsets"].items()}}
    if exp.atlas.sharing == "temporal" and exp.parallel.replicas > 1:  # (one pipeline: the links stay FIFO)
        order = plans[-1]["order"]
        out["policy"] = (TurnPolicy(order) if exp.atlas.enforce == "senders"
                         else _gateway_policy(order, exp.atlas.class_queue))
        if exp.atlas.enforce != "senders" and all("after_iteration" in p.get("basis", {}) for p in plans):
            # when each plan reached the gateways: the links are FIFO through the warm-up
            # iterations, and the TCP windows those leave carry on (the packet model replays it)
            out["priority_plans"] = [(int(p["basis"]["after_iteration"]), list(p["order"])) for p in plans]
    return out


def _gateway_policy(order: list[str], class_queue: str = "deep"):
    """Strict priority as the gateway's delay line enforces it: at ``delayline.RATE_FACTOR`` of
    each link's rate (its token bucket paces a little under the HTB behind it), which lengthened
    the emulated runs' transfers by as much (the validation matrix's temporal cells read 1.5 points
    closer with it, docs/benchmarks.md)."""
    from testbed.net.delayline import RATE_FACTOR
    from testbed.sim.engine import PriorityPolicy

    return PriorityPolicy(order, rate_factor=RATE_FACTOR, class_queue=class_queue)


def simulate_options(exp) -> dict:
    """``testbed sim`` of an experiment with temporal sharing, where there is no run to read a
    plan from: the plan the controller would make from the experiment's own figures (the
    slowest stage's compute per microbatch, one activation, the slowest WAN link's capacity)
    and its order as the policy (turns at the senders or the gateway's strict priority, as
    ``enforce`` says), every pipeline simulated (neither can be folded).  Where the
    pipelines' transfers can never contend for a link (``wan_can_contend``), there is
    nothing to take turns over: fair sharing's result, folded, exactly."""
    from testbed.sim.build import link_capacity, flops_stage_times, wan_can_contend

    if exp.atlas.sharing != "temporal" or exp.parallel.replicas < 2 or not wan_can_contend(exp):
        return {}
    from agents.atlas.plan import make_plan
    from testbed.sim.engine import TurnPolicy

    spec = exp.sim.stage_times
    compute = (max(t.forward_s + t.backward_s for t in spec) if spec
               else max(t.forward + t.backward for t in flops_stage_times(exp)))
    act = exp.training.microbatch_size * exp.model.seq_len * exp.model.hidden * exp.sim.dtype_bytes
    capacity = link_capacity(exp)
    link = min(capacity(p) for _s, _d, p in exp.topo.directions())
    plan = make_plan(exp.parallel.replicas, compute, act, link, enforced=True)
    policy = (TurnPolicy(plan.order) if exp.atlas.enforce == "senders"
              else _gateway_policy(plan.order, exp.atlas.class_queue))
    return {"policy": policy, "fold_replicas": False}


def _emulated_plan(plan: dict, k: float) -> dict:
    """A plan as the controller made it (on the wall clock, from wall-clock telemetry and the
    wire's links) in the emulated world's terms under time dilation ``k``: its times / k, its
    rates x k; the order and the bytes as they are.  (The offsets the workers were sent are the
    controller's own: they act on the wall clock, where its figures are consistent.)"""
    if k == 1:
        return plan
    out = dict(plan)
    out["offsets"] = {r: round(v / k, 6) for r, v in plan["offsets"].items()}
    for key in ("transfer_s", "compute_s", "lockstep_s", "temporal_s"):
        out[key] = round(plan[key] / k, 6)
    basis = dict(plan.get("basis") or {})
    if "link_bytes_s" in basis:
        basis["link_bytes_s"] = round(basis["link_bytes_s"] * k)
    if "pipeline_compute" in basis:
        basis["pipeline_compute"] = {r: round(v / k, 6) for r, v in basis["pipeline_compute"].items()}
    if "stages" in basis:
        basis["stages"] = {st: {name: round(v / k, 6) for name, v in f.items()} for st, f in basis["stages"].items()}
    out["basis"] = dict(basis, time_dilation=k)
    return out
