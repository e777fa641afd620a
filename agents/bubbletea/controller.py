"""The BubbleTea controller: admit prefill requests, place them in predicted bubbles, account for each.

How it fits: ``testbed run`` starts it (root namespace) with the experiment's
``bubbletea`` section.  It connects to the run's telemetry hub as ``bubbletea-controller``
(the orchestrator forwards every worker's timeline, and the extension tells it when one of
BubbleTea's processes has died), and talks to the prefill servers (one per training worker)
and the decode workers over Unix datagrams.  Once every worker is past the warm-up
iterations it replays the workload in real time: each arriving request waits in one queue;
whenever a server is idle and its worker is in a predicted bubble (``predictor.py``), the
request already part-prefilled there, then the freshest ones, as many as the bubble holds,
are sent in one message with deadlines at the bubble's predicted ends less a margin (the
shortest the wait lasted recently, then the longer ones); the server runs them in order,
chunk by chunk, and stops between chunks at the first deadline, or at a later one while
the worker's wait board shows the wait still on.  An idle server whose worker is not in a
bubble a chunk fits in gets the jobs for the worker's *next* wait ahead (``dispatch_ahead``),
with the wait's usable lengths: it starts them when the board shows that wait begin, so a
bubble does not wait for the round trip worker -> hub -> controller -> server.  The same code
serves real devices and emulated ones (the servers differ, not the decisions).

Accounting, each counted where it happens (``counts``): an *arrival* when the workload
delivers the request; *admitted* when it is first sent to a prefill server; *completed*
when its decode worker reports its last token; *rejected*, with the reason, when the TTFT
SLO cannot be met (it waited too long, or it cannot be prefilled in time), when its prefill
server or decode worker died, when its KV transfer failed or its decode raised, and when the
run ended with it still queued or in service (after a drain of ``drain_s``: the servers ship
what they have prefilled at once, the decode workers finish; the reason says "run ended
while ..." and the state it was in).  So arrivals = completed + rejected, and after the run
nothing is in flight.  Per request the
results hold its TTFT (prefill done - arrival) and the time each later token came out
(the time between tokens, TBT).  A failure is told to the run's log once per component
(a ``Log`` message on the hub).  Every message is typed (``messages.py``).  Results go to
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

from agents.bubbletea import messages as bt
from agents.bubbletea.config import ControllerConfig
from agents.bubbletea.predictor import PrefillProfile, WorkerBubbles
from agents.bubbletea.workload import azure_trace, poisson
from testbed import messages as m
from testbed.train.waitboard import wait_id

FINAL = ("completed", "rejected")
COUNTS = ("arrivals", "admitted", "completed", "rejected")


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
        self.servers = {name: {"path": path, "busy": None, "profile": None, "sticky": set(), "dead": None}
                        for name, path in cfg.servers.items()}
        self.decoders = {name: {"addr": addr, "dead": None, "ready": False} for name, addr in cfg.decoders.items()}
        self.bubbles = {name: WorkerBubbles() for name in cfg.servers}
        self.prefill_intervals: dict[str, list] = {name: [] for name in cfg.servers}
        self.counts = dict.fromkeys(COUNTS, 0)
        # dispatches sent ahead of their wait, and those handed back unrun, by why: the wait had
        # passed when the server read its board, did not begin in time, a message came first, or
        # it began but ended before a chunk fitted ("no_room")
        self.ahead = {"sent": 0, "handed_back": 0, "passed": 0, "timeout": 0, "interrupted": 0, "no_room": 0}
        self.reasons: dict[str, int] = {}  # rejected, by reason (the text before its first colon)
        self.failures: list[dict] = []  # what failed, when, and how many requests it took
        self.t0: float | None = None
        self.t_end: float | None = None  # when serving stopped (training ended)
        self.next_arrival = 0
        self._swept = 0.0
        self._told: set[str] = set()
        self.iterations_done: dict[str, int] = {}
        self.ready = False
        self.sock = None
        self.tell_run = lambda msg: None  # a line for the run's log (set by ``run``)

    def now(self) -> float:
        """The run's clock (telemetry's, and every instant BubbleTea's messages carry)."""
        return time.monotonic() - self.cfg.clock_offset_s

    # -- inputs -------------------------------------------------------------------------
    def on_telemetry(self, msg: m.Message) -> None:
        if isinstance(msg, bt.Died):
            self.on_death(msg.component, msg.reason)
            return
        if not isinstance(msg, (m.Wait, m.Events)) or msg.worker not in self.bubbles:
            return
        name = msg.worker
        if isinstance(msg, m.Wait):
            self.bubbles[name].on_wait(msg)
            return
        self.bubbles[name].add(msg)
        if msg.iteration_done:
            self.iterations_done[name] = msg.it + 1
        if self.t0 is None and len(self.iterations_done) == len(self.bubbles) and \
                min(self.iterations_done.values()) >= self.cfg.warmup_iterations:
            self.t0 = self.now()
            _log(f"serving from now: {len(self.requests)} requests over "
                 f"{self.cfg.workload.duration_s:.0f} s")

    def on_report(self, msg: m.Message) -> None:
        if isinstance(msg, bt.ServerReady):
            self.servers[msg.worker]["profile"] = PrefillProfile([tuple(p) for p in msg.profile])
            self._check_ready()
            return
        if isinstance(msg, bt.DecodeReady):  # listening: caches may go to it from now on
            if msg.decoder in self.decoders:
                self.decoders[msg.decoder]["ready"] = True
                self._check_ready()
            return
        if isinstance(msg, bt.DecodeError):
            dec = msg.decoder
            reason = f"decode failed on {dec}: {msg.error}"
            hit = sum(self._reject(rid, reason) for rid in msg.rids)
            self._failure(dec, reason, hit)
            return
        if not isinstance(msg, (bt.Progress, bt.Prefilled, bt.Decoded, bt.KvFailed)):
            return
        rid = msg.rid
        r = self.state.get(rid)
        if r is None:
            return
        if isinstance(msg, bt.Progress):
            name = msg.worker
            srv = self.servers[name]
            srv["ran"] = srv.get("ran") or bool(msg.intervals)
            if msg.last:
                wait = srv.pop("ahead", None)
                if wait is not None and not srv["ran"]:
                    self.ahead["handed_back"] += 1
                    self.ahead[msg.handed_back if msg.handed_back in self.ahead else "no_room"] += 1
                    if msg.handed_back in ("passed", "timeout"):
                        # never again for this wait: the telemetry saying it began may still be
                        # on its way, and until it comes the wait looks ahead (on a loaded
                        # machine a send and hand back went round ~1,000 times in one wait)
                        srv["spent"] = wait
                srv["busy"] = None
            if msg.done == 0:
                srv["sticky"].discard(rid)  # not started there: any server may take it
            for c in msg.intervals:
                self.prefill_intervals[name].append([c.start, c.end, rid])
                srv["profile"].add(c.tokens, c.end - c.start)
            r["prefilled_tokens"] = msg.done
            r.setdefault("prefill_s", 0.0)
            r["prefill_s"] += sum(c.end - c.start for c in msg.intervals)
            if msg.done < msg.total and r["status"] == "prefilling":
                r["status"] = "queued"  # continues in a later bubble (on the same server if begun)
                bisect.insort(self.queue, rid, key=lambda x: self.state[x]["arrival_s"])  # its place by arrival
        elif isinstance(msg, bt.Prefilled):
            name = msg.worker
            self.servers[name]["sticky"].discard(rid)
            if r["status"] in FINAL:
                return
            r["ttft_s"] = msg.at - (self.t0 + r["arrival_s"])
            r["first_token_at"] = msg.at
            r["kv_bytes"], r["kv_transfer_s"] = msg.kv_bytes, msg.kv_send_s
            dec = self.cfg.decode[name]
            r["decoder"] = dec
            if self.decoders[dec]["dead"]:  # acknowledged just before it died
                self._reject(rid, self.decoders[dec]["dead"])
                return
            r["status"] = "decoding"
        elif isinstance(msg, bt.Decoded):
            if r["status"] != "decoding":
                return  # rejected meanwhile (its decode worker was declared dead)
            r["status"] = "completed"
            self.counts["completed"] += 1
            r["generated_tokens"] = msg.tokens
            r["completed_s"] = msg.done - self.t0
            times = [r["first_token_at"]] + list(msg.token_times)
            r["tbt_s"] = [round(b - a, 6) for a, b in zip(times, times[1:])]
        else:  # a KV transfer failed: the server itself is not held up by it
            name = msg.worker
            dec = self.cfg.decode[name]
            reason = self.decoders[dec]["dead"] or f"KV transfer to {dec} failed: {msg.error}"
            if self._reject(rid, reason):
                self._failure(f"{name} -> {dec}", reason, 1)

    def on_death(self, component: str, reason: str) -> None:
        """One of BubbleTea's processes died (the extension saw it): its requests are rejected
        with the reason, and nothing more is sent its way."""
        hit = 0
        if component in self.decoders:
            self.decoders[component]["dead"] = reason
            mine = {w for w, d in self.cfg.decode.items() if d == component}
            for rid, r in self.state.items():
                on_server = r.get("server") in mine and (r["status"] == "prefilling" or
                                                          rid in self.servers[r["server"]]["sticky"])
                if (r["status"] == "decoding" and r.get("decoder") == component) or on_server:
                    hit += self._reject(rid, reason)
        elif component in self.servers:
            srv = self.servers[component]
            srv["dead"], srv["busy"] = reason, None
            for rid, r in self.state.items():
                if r.get("server") == component and (r["status"] == "prefilling" or rid in srv["sticky"]):
                    hit += self._reject(rid, reason)
        self._check_ready()  # one that died loading its model holds nobody up
        self._failure(component, reason, hit)

    def _check_ready(self) -> None:
        """Training may start (the run waits for this) once every prefill server has profiled its
        model and every decode worker listens, or died.  A decode worker loads its model before
        it listens; under load (on CPUs it runs at 1/8 of a device's weight) that took longer than
        the servers' start, and the first caches shipped met a refused connection."""
        if self.ready:
            return
        if all(s["profile"] is not None or s["dead"] for s in self.servers.values()) and \
                all(d["ready"] or d["dead"] for d in self.decoders.values()):
            self.ready = True
            _log("every prefill server has profiled its model and every decode worker listens: ready")

    # -- decisions ----------------------------------------------------------------------
    def _failure(self, component: str, reason: str, requests: int) -> None:
        self.failures.append({"component": component, "reason": reason, "requests": requests,
                              "at_s": round(self.now() - self.t0, 3) if self.t0 else None})
        key = reason.split(":")[0]
        if key not in self._told:  # once per component and kind: the run's log names it
            self._told.add(key)
            self.tell_run(f"bubbletea: {reason} ({requests} request(s) rejected)")
            _log(f"{reason}: {requests} request(s) rejected")

    def _reject(self, rid: int, reason: str) -> int:
        """Reject a request not yet decided; 1 if it was rejected now, 0 if already decided."""
        r = self.state[rid]
        if r["status"] in FINAL or r["status"] == "future":
            return 0
        r["status"], r["reason"] = "rejected", reason
        self.counts["rejected"] += 1
        key = reason.split(":")[0]
        self.reasons[key] = self.reasons.get(key, 0) + 1
        if rid in self.queue:
            self.queue.remove(rid)
        for name, srv in self.servers.items():
            if rid in srv["sticky"]:
                srv["sticky"].discard(rid)
                self._send(name, bt.Drop(rid=rid))
        return 1

    def tick(self, now: float) -> None:
        if self.t0 is None or self.t_end is not None:
            return
        elapsed = now - self.t0
        while self.next_arrival < len(self.requests) and self.requests[self.next_arrival].arrival_s <= elapsed:
            rid = self.requests[self.next_arrival].rid
            self.state[rid]["status"] = "queued"
            self.counts["arrivals"] += 1
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
            if srv["busy"] is not None or srv["profile"] is None or srv["dead"]:
                continue
            if self.decoders[self.cfg.decode[name]]["dead"]:
                continue  # no decode worker takes this server's caches any more
            it = self.iterations_done.get(name, 0)  # the iteration this worker is in
            if self.cfg.interleave and (it - self.cfg.warmup_iterations) % 2 == 0:
                continue  # an unserved iteration: the same run measures training without prefills
            chunk = self.cfg.chunk_tokens
            ends = self.bubbles[name].ends(now, self.cfg.margin_s, self.cfg.margin_frac)
            if ends and srv["profile"].seconds(chunk) <= ends[0] - now:
                room = ends[-1] - now  # jobs for the longest the wait has lasted; the server stops at ends[0]
                ahead = None
            else:  # not in a bubble a chunk fits in: the jobs for the next one, sent ahead of it
                ahead = self._ahead(name, srv) if self.cfg.dispatch_ahead else None
                if ahead is None or ahead[0] == srv.get("spent"):
                    continue
                room = ahead[1][-1]
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
                if "server" not in r:
                    self.counts["admitted"] += 1
                    r["admitted_s"] = round(elapsed, 6)
                r["status"] = "prefilling"
                r["server"] = name
                srv["sticky"].add(rid)
            srv["busy"], srv["sent"], srv["ran"] = jobs, now, False
            decode = list(self.decoders[self.cfg.decode[name]]["addr"])
            job_list = [bt.Job(rid, self.state[rid]["prompt_tokens"], self.state[rid]["output_tokens"]) for rid in jobs]
            if ahead is None:
                wait = wait_id(*self.bubbles[name].current[:2])  # the server stops when this wait ends
                self._send(name, bt.Prefill(deadlines=[round(e, 6) for e in ends], chunk=chunk, wait=wait,
                                            decode=decode, jobs=job_list))
            else:  # the server starts them when the board shows the wait begin, at most an iteration from now
                self.ahead["sent"] += 1
                srv["ahead"] = ahead[0]
                period = self.bubbles[name].period or 1.0
                self._send(name, bt.Prefill(deadlines=[], chunk=chunk, wait=ahead[0], decode=decode, jobs=job_list,
                                            lengths=[round(x, 6) for x in ahead[1]], give_up=round(now + period, 6)))

    def _ahead(self, name: str, srv: dict) -> tuple[int, list[float]] | None:
        """(wait id, usable lengths from its start) of the worker's next wait, if a chunk fits in
        it and it is in an iteration that is served."""
        bubbles = self.bubbles[name]
        nxt = bubbles.next_wait()
        if nxt is None:
            return None
        it, n = nxt
        if self.cfg.interleave and (it - self.cfg.warmup_iterations) % 2 == 0:
            return None
        usable = bubbles.usable(n, self.cfg.margin_s, self.cfg.margin_frac)
        if not usable or srv["profile"].seconds(self.cfg.chunk_tokens) > usable[0]:
            return None
        return wait_id(it, n), usable

    def stop_serving(self) -> None:
        """Training has ended: nothing more is dispatched; the servers ship what they have."""
        if self.t_end is None:
            self.t_end = self.now()
        for name in self.servers:
            self._send(name, bt.Drain())

    def in_service(self) -> bool:
        return any(r["status"] in ("prefilling", "decoding") for r in self.state.values())

    def _send(self, name: str, msg: m.Message) -> None:
        try:
            self.sock.sendto(m.encode(msg), self.servers[name]["path"])
        except (OSError, AttributeError):
            pass

    def finish(self) -> dict:
        """Every request decided: what is still queued or in service is rejected, the reason
        naming the state the run's end found it in.  The results, with the counts as they were
        counted."""
        self.queue = []  # every queued request is decided below (and the list's removals were O(n) each)
        for rid, r in self.state.items():
            if r["status"] == "future":
                r["status"], r["reason"] = "not arrived", "arrives after the run ended"
            elif r["status"] not in FINAL:
                self._reject(rid, f"run ended while {r['status']}")
        arrived = [r for r in self.state.values() if r["status"] != "not arrived"]
        serving = (self.t_end or self.now()) - self.t0 if self.t0 is not None else 0.0
        return {"requests": arrived, "prefill_intervals": self.prefill_intervals, "t0": self.t0,
                "serving_s": round(serving, 6), "counts": dict(self.counts), "rejection_reasons": dict(self.reasons),
                "failures": self.failures, "dispatched_ahead": dict(self.ahead),
                "profiles": {n: [s["profile"].a, s["profile"].b] if s["profile"] else None
                             for n, s in self.servers.items()}}


def _drain_reports(ctl: Controller, sock: socket.socket) -> None:
    while True:
        try:
            ctl.on_report(m.decode(sock.recv(65536)))
        except BlockingIOError:
            return


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
    tel.sendall(m.line(m.Hello(worker="bubbletea-controller")))

    def tell_run(line: str) -> None:
        try:
            tel.sendall(m.line(m.Log(msg=line)))
        except OSError:
            pass

    ctl.tell_run = tell_run
    stopping = [False]
    signal.signal(signal.SIGTERM, lambda *_: stopping.__setitem__(0, True))
    buf = b""
    told_ready = False
    _log(f"up: {len(ctl.requests)} requests, {len(ctl.servers)} prefill servers, {len(ctl.decoders)} decode workers")
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
                msg = m.decode(line)
                if isinstance(msg, m.Bye):
                    done = True
                    break
                ctl.on_telemetry(msg)
            if done:
                break
        if sock in ready:
            _drain_reports(ctl, sock)
        if ctl.ready and not told_ready:
            tel.sendall(m.line(m.Ready()))
            told_ready = True
        ctl.tick(ctl.now())
    # training is over: the servers ship what is prefilled, the decode workers finish (briefly)
    ctl.stop_serving()
    deadline = time.monotonic() + cfg.drain_s
    while time.monotonic() < deadline and ctl.in_service():
        ready, _, _ = select.select([sock], [], [], 0.05)
        if ready:
            _drain_reports(ctl, sock)
    result = ctl.finish()
    with open(cfg.results, "w") as fh:
        json.dump(result, fh)
    _log(f"done: {result['counts']}")
    for name in ctl.servers:
        ctl._send(name, bt.Stop())


def main() -> int:
    run(ControllerConfig.load(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
