"""The Atlas controller: from the run's live telemetry to a temporal plan, published.

How it fits: ``testbed run`` starts it (in the root namespace) when the experiment says
``atlas: {sharing: temporal | paced}``.  It connects to the run's telemetry socket like a
worker, as ``atlas-controller``; the orchestrator then forwards every worker's timeline to
it.  After the warm-up iterations it computes the plan (``plan.py``) from the measured
compute times and message sizes, sends it to the gateway agents (``temporal``: they
enforce the rank order on each WAN link) and to the orchestrator (which passes each
pipeline's start offset to its first stage), and heartbeats the agents.  It recomputes the
plan after every iteration, from the compute times, message sizes and link rate the
transfers see (so a link that changes under the run changes the plan), and republishes it
when it moves by ``replan_threshold``.

    python -m agents.atlas.controller CONFIG.json
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time

from agents.atlas.config import ControllerConfig
from agents.atlas.messages import AgentPlan, Clear, Heartbeat, LinkSchedule, PlanPublished
from testbed import messages as m
from agents.atlas.plan import TelemetryWindow, TemporalPlan, make_plan
from testbed.procutil import DatagramClient


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} atlas controller: {msg}", flush=True)


def run(cfg: ControllerConfig) -> None:
    tel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tel.connect(cfg.telemetry)
    send_lock = threading.Lock()

    def tell_orchestrator(msg: m.Message) -> None:
        with send_lock:
            tel.sendall(m.line(msg))

    tell_orchestrator(m.Hello(worker="atlas-controller"))
    agents = DatagramClient()
    agent_paths = list(cfg.agents.values())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def to_agents(msg: m.Message) -> None:
        for path in agent_paths:
            agents.send(path, msg)  # a dead agent: its links' leases run out

    def heartbeat() -> None:
        while not stop.wait(cfg.lease_s / 4):
            to_agents(Heartbeat())

    if agent_paths:
        threading.Thread(target=heartbeat, daemon=True).start()
    window = TelemetryWindow(transfer_delays=cfg.transfer_delays_s)
    plan: TemporalPlan | None = None
    workers = cfg.stages * cfg.replicas
    warmup = max(1, cfg.warmup_iterations)
    planned_at = -1
    reader = tel.makefile("rb")
    _log(f"up: {cfg.replicas} pipelines, sharing {cfg.sharing}, plan after {warmup} iteration(s)"
         + ("; one pipeline: the links stay FIFO" if cfg.replicas == 1 else ""))
    for line in reader:
        if stop.is_set():
            break
        msg = m.decode(line, expect=(m.Events, m.Bye))
        if isinstance(msg, m.Bye):
            break
        window.add(msg.worker or "", msg)
        done = window.min_iterations(workers)
        if done < warmup or done == planned_at:
            continue
        planned_at = done
        compute, per_stage = window.slowest_stage_compute()
        message = window.typical_message() or cfg.message_bytes
        link = window.link_rate() or cfg.link_bytes_s  # measured: the plan follows a changed link
        pipelines = window.pipeline_compute() if cfg.plan == "telemetry" else None
        new = make_plan(cfg.replicas, compute, message, link, pipeline_compute=pipelines,
                        previous=plan.order if plan else None, enforced=cfg.sharing == "temporal",
                        basis={"after_iteration": done, "message_bytes": message, "link_bytes_s": round(link),
                               "pipeline_compute": {str(r): round(v, 5) for r, v in (pipelines or {}).items()},
                               "stages": {str(s): {k: round(v, 5) for k, v in f.items()}
                                          for s, f in per_stage.items()}})
        if not new.moved(plan, cfg.replan_threshold):
            continue
        plan = new
        if cfg.sharing == "temporal" and cfg.replicas > 1:  # one pipeline: nothing to share
            to_agents(AgentPlan(links={name: LinkSchedule(link.classes, plan.order, cfg.class_queue)
                                       for name, link in cfg.links.items()}))
        tell_orchestrator(PlanPublished(plan=plan.as_dict()))
        _log(f"plan after iteration {done}: C={plan.compute_s * 1e3:.1f} ms, t={plan.transfer_s * 1e3:.1f} ms, "
             f"offsets {[round(v * 1e3, 1) for v in plan.offsets.values()]} ms, predicted per microbatch "
             f"{plan.lockstep_s * 1e3:.1f} -> {plan.temporal_s * 1e3:.1f} ms")
    stop.set()
    if agent_paths:
        to_agents(Clear())
    _log("done")


def main() -> int:
    run(ControllerConfig.load(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
