"""The BubbleTea controller: admit prefill requests, place them in predicted bubbles.

How it fits: ``testbed run`` starts it (root namespace) with the experiment's
``bubbletea`` section.  It connects to the run's telemetry socket as
``bubbletea-controller`` (the orchestrator forwards every worker's timeline), and talks to
the prefill servers (one per training worker) and the decode workers over Unix datagrams.
Once every worker is past the warm-up iterations it replays the workload in real time:
each arriving request waits in one queue; whenever a server is idle and its worker is in a
predicted bubble (``predictor.py``), the request already part-prefilled there, then the
freshest ones, as many as the bubble holds, are sent in one message with a deadline at the
bubble's end less a margin; the server runs them in order, chunk by chunk, and stops
between chunks at the deadline.  A request that has waited longer than the TTFT SLO, or
that cannot fit, is rejected with the reason; when the run ends the rest are rejected ("run
ended").  Every request ends completed or rejected: none is lost.  Results go to
``results`` (JSON).

    python -m agents.bubbletea.controller CONFIG.json
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import select
import signal
import socket
import sys
import time

from agents.bubbletea.config import ControllerConfig
from agents.bubbletea.predictor import PrefillProfile, WorkerBubbles
from agents.bubbletea.workload import azure_trace, poisson
from agents.trainer.waitboard import wait_id


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} bubbletea controller: {msg}", flush=True)


class Controller:
    def __init__(self, cfg: ControllerConfig):
        self.cfg = cfg
        w = cfg.workload
        if w.source == "poisson":
            self.requests = poisson(w.rate_per_s, w.duration_s, seed=w.seed,
                                    prompt_tokens=(16, cfg.max_prompt_tokens))
        else:
            self.requests = azure_trace(w.source, w.duration_s, w.rate_scale, w.token_scale,
                                        cfg.max_prompt_tokens, w.max_output_tokens)
        self.state = {r.rid: {"rid": r.rid, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                              "arrival_s": r.arrival_s, "status": "future"} for r in self.requests}
        self.queue: list[int] = []
        self.servers = {name: {"path": path, "busy": None, "profile": None, "sticky": set()}
                        for name, path in cfg.servers.items()}
        self.bubbles = {name: WorkerBubbles() for name in cfg.servers}
        self.prefill_intervals: dict[str, list] = {name: [] for name in cfg.servers}
        self.t0: float | None = None
        self.next_arrival = 0
        self._swept = 0.0
        self.iterations_done: dict[str, int] = {}
        self.ready = False

    # -- inputs -------------------------------------------------------------------------
    def on_telemetry(self, msg: dict) -> None:
        name = msg.get("worker")
        if name not in self.bubbles:
            return
        if msg.get("type") == "wait":
            self.bubbles[name].on_wait(msg)
            return
        if msg.get("type") != "events":
            return
        self.bubbles[name].add(msg)
        if msg.get("iteration_done"):
            self.iterations_done[name] = msg["it"] + 1
        if self.t0 is None and len(self.iterations_done) == len(self.bubbles) and \
                min(self.iterations_done.values()) >= self.cfg.warmup_iterations:
            self.t0 = time.monotonic()
            _log(f"serving from now: {len(self.requests)} requests over "
                 f"{self.cfg.workload.duration_s:.0f} s")

    def on_report(self, msg: dict) -> None:
        kind, name = msg.get("type"), msg.get("worker")
        if kind == "ready":
            self.servers[name]["profile"] = PrefillProfile([tuple(p) for p in msg["profile"]])
            if all(s["profile"] is not None for s in self.servers.values()):
                self.ready = True  # training may start: the run waits for this
                _log("every prefill server has profiled its model: ready")
            return
        if kind == "decode_ready" or kind == "decode_error":
            return
        rid = msg.get("rid")
        r = self.state.get(rid)
        if r is None:
            return
        if kind == "progress":
            srv = self.servers[name]
            if msg.get("last", True):
                srv["busy"] = None
            if msg["done"] == 0:
                srv["sticky"].discard(rid)  # not started there: any server may take it
            for s, e, n in msg["intervals"]:
                self.prefill_intervals[name].append([s, e, rid])
                srv["profile"].add(n, e - s)
            r["prefilled_tokens"] = msg["done"]
            r.setdefault("prefill_s", 0.0)
            r["prefill_s"] += sum(e - s for s, e, _ in msg["intervals"])
            if msg["done"] < msg["total"] and r["status"] == "prefilling":
                r["status"] = "queued"  # continues in a later bubble (on the same server if begun)
                bisect.insort(self.queue, rid, key=lambda x: self.state[x]["arrival_s"])  # its place by arrival
        elif kind == "prefilled":
            r["status"] = "decoding"
            r["ttft_s"] = msg["at"] - (self.t0 + r["arrival_s"])
            r["kv_bytes"], r["kv_transfer_s"] = msg["kv_bytes"], msg["kv_send_s"]
            self.servers[name]["sticky"].discard(rid)
        elif kind == "decoded":
            r["status"] = "completed"
            r["generated_tokens"] = msg["tokens"]
            r["completed_s"] = msg["done"] - self.t0
        elif kind == "error":  # from a KV transfer: the server itself is not held up by it
            self._reject(rid, msg["error"])

    # -- decisions ----------------------------------------------------------------------
    def _reject(self, rid: int, reason: str) -> None:
        r = self.state[rid]
        if r["status"] in ("completed", "rejected"):
            return
        r["status"], r["reason"] = "rejected", reason
        if rid in self.queue:
            self.queue.remove(rid)
        for name, srv in self.servers.items():
            if rid in srv["sticky"]:
                srv["sticky"].discard(rid)
                self._send(name, {"type": "drop", "rid": rid})

    def tick(self, now: float) -> None:
        if self.t0 is None:
            return
        elapsed = now - self.t0
        while self.next_arrival < len(self.requests) and self.requests[self.next_arrival].arrival_s <= elapsed:
            rid = self.requests[self.next_arrival].rid
            self.state[rid]["status"] = "queued"
            self.queue.append(rid)
            self.next_arrival += 1
        slo = self.cfg.slo_ttft_s
        if now - self._swept >= 0.05:  # the queue can hold thousands under overload: sweep it 20x a second
            self._swept = now
            for rid in [rid for rid in self.queue if elapsed - self.state[rid]["arrival_s"] > slo]:
                self._reject(rid, f"TTFT SLO: not prefilled within {slo:.2f} s (no bubble room in time)")
        if not self.queue:
            return
        for name, srv in self.servers.items():
            if srv["busy"] is not None or srv["profile"] is None:
                continue
            it = self.iterations_done.get(name, 0)  # the iteration this worker is in
            if self.cfg.interleave and (it - self.cfg.warmup_iterations) % 2 == 0:
                continue  # an unserved iteration: the same run measures training without prefills
            window = self.bubbles[name].window(now, self.cfg.margin_s, self.cfg.margin_frac)
            if window is None:
                continue
            room = window[1] - now
            chunk = self.cfg.chunk_tokens
            if srv["profile"].seconds(chunk) > room:
                continue  # not even one chunk fits before the bubble ends
            mine = [rid for rid in srv["sticky"] if rid in self.queue]
            # under overload serve the freshest request (the stale ones reach the SLO and are
            # rejected): the requests served keep a short TTFT.  Lazily, and as many as the
            # bubble holds (the last may be cut at a chunk boundary): no round trip between them
            sticky = set().union(*(x["sticky"] for x in self.servers.values()))
            free = (rid for rid in reversed(self.queue) if rid not in sticky)
            jobs, planned = [], 0.0
            for cand in itertools.chain(mine, free):
                if planned >= room or len(jobs) >= self.cfg.max_jobs:
                    break
                r = self.state[cand]
                left = r["prompt_tokens"] - r.get("prefilled_tokens", 0)
                if elapsed - r["arrival_s"] + srv["profile"].seconds(left) > slo:
                    self._reject(cand, f"TTFT SLO: {left} tokens cannot be prefilled within {slo:.2f} s")
                    continue
                jobs.append(cand)
                planned += srv["profile"].seconds(left)
            if not jobs:
                continue
            for rid in jobs:
                r = self.state[rid]
                self.queue.remove(rid)
                r["status"] = "prefilling"
                r.setdefault("worker", name)
                srv["sticky"].add(rid)
            srv["busy"], srv["sent"] = jobs, now
            wait = wait_id(*self.bubbles[name].current[:2])  # the server stops when this wait ends
            self._send(name, {"type": "prefill", "deadline": window[1], "chunk": chunk, "wait": wait,
                              "decode": self.cfg.decode[name],
                              "jobs": [{"rid": rid, "tokens": self.state[rid]["prompt_tokens"],
                                        "output_tokens": self.state[rid]["output_tokens"]} for rid in jobs]})

    def _send(self, name: str, msg: dict) -> None:
        try:
            self.sock.sendto(json.dumps(msg).encode(), self.servers[name]["path"])
        except OSError:
            pass

    def finish(self) -> dict:
        for rid, r in self.state.items():
            if r["status"] == "future":
                r["status"], r["reason"] = "not arrived", "arrives after the run ended"
            elif r["status"] not in ("completed", "rejected"):
                self._reject(rid, f"run ended while {r['status']}")
        arrived = [r for r in self.state.values() if r["status"] != "not arrived"]
        return {"requests": arrived, "prefill_intervals": self.prefill_intervals, "t0": self.t0,
                "profiles": {n: [s["profile"].a, s["profile"].b] if s["profile"] else None
                             for n, s in self.servers.items()}}


def run(cfg: ControllerConfig) -> None:
    ctl = Controller(cfg)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if os.path.exists(cfg.listen):
        os.unlink(cfg.listen)
    sock.bind(cfg.listen)
    sock.setblocking(False)
    ctl.sock = sock
    tel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tel.connect(cfg.telemetry)
    tel.sendall(b'{"type":"hello","worker":"bubbletea-controller"}\n')
    stopping = [False]
    signal.signal(signal.SIGTERM, lambda *_: stopping.__setitem__(0, True))
    buf = b""
    told_ready = False
    _log(f"up: {len(ctl.requests)} requests, {len(ctl.servers)} prefill servers")
    while not stopping[0]:
        ready, _, _ = select.select([tel, sock], [], [], 0.004)
        if tel in ready:
            chunk = tel.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
            done = False
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if msg.get("type") == "bye":
                    done = True
                    break
                ctl.on_telemetry(msg)
            if done:
                break
        if sock in ready:
            while True:
                try:
                    ctl.on_report(json.loads(sock.recv(65536)))
                except BlockingIOError:
                    break
        if ctl.ready and not told_ready:
            tel.sendall(b'{"type":"ready"}\n')
            told_ready = True
        ctl.tick(time.monotonic())
    # let prefills and decodes under way finish (briefly), then account for everything
    deadline = time.monotonic() + cfg.drain_s
    while time.monotonic() < deadline and any(
            r["status"] in ("prefilling", "decoding") for r in ctl.state.values()):
        ready, _, _ = select.select([sock], [], [], 0.05)
        if ready:
            while True:
                try:
                    ctl.on_report(json.loads(sock.recv(65536)))
                except BlockingIOError:
                    break
    result = ctl.finish()
    with open(cfg.results, "w") as fh:
        json.dump(result, fh)
    counts = {}
    for r in result["requests"]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    _log(f"done: {counts}")
    for name in ctl.servers:
        ctl._send(name, {"type": "stop"})


def main() -> int:
    run(ControllerConfig.load(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
