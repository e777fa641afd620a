"""BubbleTea without a network: the workload, chunked prefill, bubble prediction, the
prefill-time profile, and the controller's accounting (every request completed or rejected)."""

from __future__ import annotations

from dataclasses import replace
import json
from pathlib import Path

import pytest
import torch

from agents.bubbletea import messages as bt
from agents.bubbletea.controller import Controller
from agents.bubbletea.inference import (PrefillState, decode, decode_batch, load_model, pack, prefill_chunk,
                                       prompt_tokens, unpack)
from agents.bubbletea.predictor import PrefillProfile, WorkerBubbles, bubbles_of
from agents.bubbletea.workload import azure_trace, poisson
from testbed import messages as m
from testbed.results.records import Interval


def test_azure_trace_keeps_real_arrivals_and_scales_them():
    one = azure_trace("conv", duration_s=30, rate_scale=1.0, token_scale=1.0, max_prompt_tokens=10**6,
                      max_output_tokens=10**6)
    fast = azure_trace("conv", duration_s=30, rate_scale=4.0, token_scale=0.5, max_prompt_tokens=256)
    assert len(fast) > 3 * len(one) > 0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(fast, fast[1:]))
    assert fast[0].prompt_tokens == min(256, round(one[0].prompt_tokens * 0.5))
    assert max(r.prompt_tokens for r in fast) <= 256
    with pytest.raises(ValueError, match="choose one of"):
        azure_trace("chat")
    p = poisson(20.0, 50.0, seed=1)
    assert 800 < len(p) < 1200  # ~ rate x duration


def test_chunked_prefill_equals_one_pass_and_the_cache_decodes_after_the_wire():
    model = load_model(2, 64, 4, 256)
    whole = PrefillState(prompt_tokens(3, 100))
    prefill_chunk(model, whole, 100)
    chunked = PrefillState(prompt_tokens(3, 100))
    while chunked.done < 100:
        prefill_chunk(model, chunked, 32)
    assert torch.allclose(whole.logits, chunked.logits, atol=1e-5)
    with torch.no_grad():  # the trainer's own forward pass gives the same next-token logits
        x = prompt_tokens(3, 100)
        h = model.tok(x) + model.pos(torch.arange(100))
        for block in model.blocks:
            h = block(h)
        ref = model.head(model.ln_f(h[:, -1]))
    assert torch.allclose(ref, whole.logits, atol=1e-5)
    cache = unpack(pack(chunked))
    assert decode(model, cache["keys"], cache["values"], cache["logits"], 6) == \
        decode(model, whole.keys, whole.values, whole.logits, 6)


def test_a_batch_decodes_the_same_tokens_as_one_request_at_a_time():
    model = load_model(2, 64, 4, 128)
    caches, steps = [], []
    for rid, n in enumerate([5, 40, 100, 127, 64]):  # 127: room for one position, two tokens
        state = PrefillState(prompt_tokens(rid, n))
        while state.done < n:
            prefill_chunk(model, state, 32)
        caches.append(unpack(pack(state)))
        steps.append(12 if rid % 2 else 5)
    alone = [decode(model, [k.clone() for k in c["keys"]], [v.clone() for v in c["values"]], c["logits"], n)
             for c, n in zip(caches, steps)]
    assert decode_batch(model, caches, steps) == alone
    assert [len(t) for t in alone] == [5, 12, 5, 2, 5]


def _iteration(it, start, busy):
    """events for one iteration: busy intervals (s, e) relative to start, recv between."""
    events, cursor = [], start
    for s, e in busy:
        if start + s > cursor:
            events.append(m.Span("recv", 0, cursor, start + s, it))
        events.append(m.Span("forward", 0, start + s, start + e, it))
        cursor = start + e
    return m.Events(it=it, events=events, iteration_done=True, end=cursor)


def test_waits_are_predicted_conservatively_from_recent_iterations():
    w = WorkerBubbles()
    start = 0.0
    for it, second in enumerate((0.10, 0.08, 0.10)):  # the second wait was shorter once
        busy = [(0.0, 0.1), (0.3, 0.4), (0.4 + second, 0.6 + second)]  # waits: 0.2, then `second`
        msg = _iteration(it, start, busy)
        for e in msg.events:
            e.mb = 1  # microbatch 1: a wait for a peer, not the end-of-iteration wait
        w.add(msg)
        start = msg.end
    assert w.predict(0) == pytest.approx(0.2)
    assert w.predict(1) == pytest.approx(0.08)  # the shortest seen, not the latest
    assert w.predict(5) == 0.0  # never seen: not relied on
    assert bubbles_of([Interval(**e.given()) for e in _iteration(0, 0.0, [(0.0, 0.1), (0.3, 0.4)]).events], 0.0, 0.4) == \
        [(pytest.approx(0.1), pytest.approx(0.2))]
    w.on_wait(m.Wait(it=3, n=0, t=10.0))  # announced live by the worker
    s0, e0 = w.window(now=10.0, margin_s=0.006, margin_frac=0.1)
    assert s0 == 10.0 and e0 == pytest.approx(10.0 + 0.2 - 0.02)
    assert w.window(now=10.5, margin_s=0.006, margin_frac=0.1) is None  # its predicted end has passed
    # a wait that outlasts its shortest length is given the next one it reached before
    w.on_wait(m.Wait(it=3, n=1, t=20.0))
    assert w.ends(now=20.0, margin_s=0.006, margin_frac=0.0) == [pytest.approx(20.074), pytest.approx(20.094),
                                                                 pytest.approx(20.094)]
    assert w.ends(now=20.08, margin_s=0.006, margin_frac=0.0) == [pytest.approx(20.094)] * 2


def test_the_all_reduce_wait_is_a_bubble_in_its_place():
    """The data-parallel all-reduce waits for the stage's other replicas: the worker announces
    it as the next wait after its receives, and its length is predicted like theirs."""
    w = WorkerBubbles()
    start = 0.0
    for it, ar in enumerate((0.30, 0.25, 0.35)):
        msg = _iteration(it, start, [(0.0, 0.1), (0.3, 0.4)])
        for e in msg.events:
            e.mb = 1
        end = msg.end
        msg.events += [m.Span("allreduce", -1, end, end + ar, it), m.Span("optimizer", -1, end + ar, end + ar + 0.01, it)]
        msg.end = end + ar + 0.01
        w.add(msg)
        start = msg.end
    assert w.predict(0) == pytest.approx(0.2)  # the receive
    assert w.predict(1) == pytest.approx(0.25)  # the all-reduce: the shortest of the three


def test_prefill_profile_fits_a_line():
    p = PrefillProfile([(16, 0.003), (64, 0.006), (256, 0.018)])
    assert p.seconds(128) == pytest.approx(0.010, rel=0.1)
    assert p.tokens_within(0.010) == pytest.approx(128, rel=0.15)


def _controller(decode: dict[str, str], rate_per_s: float = 200.0, duration_s: float = 0.4):
    """A controller of prefill servers ``decode`` (worker -> its decode worker) that records
    what it would send and what it would tell the run's log; every worker past its warm-up,
    in a wait that lasts 10 s."""
    import time

    from agents.bubbletea.config import ControllerConfig, Workload

    cfg = ControllerConfig(
        telemetry="", listen="", results="", servers={w: "/nonexistent" for w in decode},
        decoders={d: ["x", 1] for d in set(decode.values())}, decode=decode, warmup_iterations=1, interleave=False,
        slo_ttft_s=0.5, slo_tbt_s=None, margin_s=0.001, margin_frac=0.1, chunk_tokens=32, max_prompt_tokens=64,
        workload=Workload("poisson", duration_s=duration_s, rate_scale=1.0, token_scale=1.0, rate_per_s=rate_per_s,
                          max_output_tokens=16, seed=2))
    ctl = Controller(cfg)
    ctl.sent, ctl.told = [], []
    ctl._send = lambda name, msg: ctl.sent.append((name, msg))
    ctl.tell_run = ctl.told.append
    now = time.monotonic()
    for d in sorted(set(decode.values())):
        ctl.on_report(bt.DecodeReady(decoder=d))
    for w in decode:
        ctl.on_report(bt.ServerReady(worker=w, profile=[[16, 0.001], [64, 0.002]]))
        # one warm-up iteration with a long bubble, then the worker is in its next iteration
        ctl.on_telemetry(replace(_iteration(0, now - 1.0, [(0.0, 0.05), (0.95, 1.0)]), worker=w))
        ctl.bubbles[w].history.extend([[10.0], [10.0]])  # its first wait lasts 10 s every iteration
        ctl.bubbles[w].on_wait(m.Wait(it=1, n=0, t=time.monotonic()))
    assert ctl.ready and ctl.t0 is not None
    return ctl


def _prefill_all(ctl, name: str, msg: bt.Prefill, at: float) -> list[int]:
    """The server ``name`` prefilled every job of ``msg`` and shipped each cache."""
    rids = [j.rid for j in msg.jobs]
    for i, job in enumerate(msg.jobs):
        ctl.on_report(bt.Progress(worker=name, rid=job.rid, done=job.tokens, total=job.tokens,
                                  intervals=[bt.Chunk(0.0, 0.001, job.tokens)], last=i == len(rids) - 1))
        ctl.on_report(bt.Prefilled(worker=name, rid=job.rid, kv_bytes=10, kv_send_s=0.001, at=at))
    return rids


def test_controller_accounts_for_every_request():
    import time as _t

    from agents.bubbletea.extension import serving_figures

    ctl = _controller({"s0r0": "decode-a"})
    ctl.tick(_t.monotonic() + 0.2)
    name, first = ctl.sent[0]
    assert isinstance(first, bt.Prefill) and len(first.jobs) > 1  # several for one bubble
    jobs = first.jobs
    rid = jobs[0].rid
    for i, job in enumerate(jobs):  # the server finished the first, then its deadline came
        done = job.tokens if i == 0 else 0
        ctl.on_report(bt.Progress(worker="s0r0", rid=job.rid, done=done, total=job.tokens,
                                  intervals=[bt.Chunk(0.0, 0.001, done)] if done else [], last=i == len(jobs) - 1))
    assert ctl.servers["s0r0"]["busy"] is None and not ctl.servers["s0r0"]["sticky"] - {rid}
    assert all(job.rid in ctl.queue for job in jobs[1:])  # back in the queue, for any server
    assert ctl.counts["admitted"] == len(jobs)  # counted once each, when first sent to a server
    ctl.on_report(bt.Prefilled(worker="s0r0", rid=rid, kv_bytes=10, kv_send_s=0.001, at=ctl.t0 + 0.3))
    ctl.on_report(bt.Decoded(decoder="decode-a", rid=rid, tokens=4, received=0.0, done=ctl.t0 + 0.35,
                             token_times=[ctl.t0 + 0.31, ctl.t0 + 0.33, ctl.t0 + 0.35]))
    ctl.tick(_t.monotonic() + 0.45)
    second = [x for _n, x in ctl.sent[1:] if isinstance(x, bt.Prefill)]  # the next bubble took some: in service
    ctl.tick(_t.monotonic() + 1.0)  # the queued rest waited past the SLO
    result = ctl.finish()
    statuses = [r["status"] for r in result["requests"]]
    assert statuses.count("completed") == 1
    assert set(statuses) <= {"completed", "rejected"}
    assert all(r.get("reason") for r in result["requests"] if r["status"] != "completed")
    ended = [r for r in result["requests"] if r.get("reason", "").startswith("run ended while")]
    assert bool(ended) == bool(second)  # what the run's end found in service is rejected with why, not lost
    assert result["rejection_reasons"].get("run ended while prefilling", 0) == len(ended)
    f = serving_figures(result, slo_ttft_s=0.5)
    assert f["accounting_exact"] and f["requests_in_flight_after_run"] == 0
    assert f["requests_arrived"] == len(result["requests"]) == \
        f["requests_completed"] + f["requests_rejected"]
    assert f["requests_admitted"] < f["requests_arrived"]  # most were rejected before a server saw them
    assert f["ttft_p50_s"] == pytest.approx(0.3 - next(r["arrival_s"] for r in result["requests"]
                                                         if r["status"] == "completed"), abs=1e-4)
    assert f["tbt_p50_s"] == pytest.approx(0.02, abs=1e-4) and f["tbt_p99_s"] == pytest.approx(0.02, abs=1e-4)
    assert f["goodput_within_slo"] == pytest.approx(1 / f["requests_arrived"], abs=1e-4)  # over all arrivals


def test_an_idle_server_outside_a_bubble_gets_the_next_waits_jobs_ahead():
    """Between bubbles the controller sends an idle server the jobs for its worker's next wait,
    with that wait's usable lengths (counted from its start, which the server reads off the
    board) instead of deadlines; an unserved iteration's wait gets none, nor does a wait no
    chunk fits in; jobs handed back untouched return to the queue and are counted."""
    import time as _t

    from agents.bubbletea.predictor import WorkerBubbles
    from testbed.train.waitboard import wait_id

    def setup(interleave=False, ahead=True, lengths=(0.05, 0.2)):
        ctl = _controller({"s0r0": "decode-a"})
        ctl.cfg.interleave, ctl.cfg.dispatch_ahead = interleave, ahead
        w = ctl.bubbles["s0r0"] = WorkerBubbles()
        w.history.extend([list(lengths), list(lengths)])
        w.period = 0.7
        w.on_wait(m.Wait(it=1, n=0, t=_t.monotonic() - 1.0))  # wait 0 of iteration 1: long over
        ctl.tick(_t.monotonic() + 0.2)
        return ctl, [x for _n, x in ctl.sent if isinstance(x, bt.Prefill)]

    ctl, sent = setup()
    assert len(sent) == 1
    msg = sent[0]
    assert msg.wait == wait_id(1, 1) and msg.deadlines == []
    assert msg.lengths == [pytest.approx(0.2 - 0.02)] * 2  # each recent length, less max(1 ms, 10%)
    assert msg.give_up == pytest.approx(_t.monotonic() + 0.2 + 0.7, abs=0.05)  # within an iteration
    assert ctl.ahead["sent"] == 1 and ctl.servers["s0r0"]["busy"]
    for i, job in enumerate(msg.jobs):  # the wait had passed: handed back untouched
        ctl.on_report(bt.Progress(worker="s0r0", rid=job.rid, done=0, total=job.tokens, intervals=[],
                                  last=i == len(msg.jobs) - 1, handed_back="passed"))
    assert ctl.ahead["handed_back"] == ctl.ahead["passed"] == 1 and ctl.servers["s0r0"]["busy"] is None
    assert all(job.rid in ctl.queue for job in msg.jobs)
    # the telemetry saying that wait began has not come yet: it still looks ahead, but is not
    # sent again (on a loaded machine a send and hand back went round ~1,000 times in one wait)
    ctl.tick(_t.monotonic() + 0.22)
    assert len([x for _n, x in ctl.sent if isinstance(x, bt.Prefill)]) == 1
    ctl.bubbles["s0r0"].on_wait(m.Wait(it=1, n=1, t=_t.monotonic() - 1.0))  # the iteration's last wait, over
    ctl.tick(_t.monotonic() + 0.25)
    assert ctl.sent[-1][1].wait == wait_id(2, 0)  # the next iteration's first
    ctl, sent = setup()  # handed back because a message came first: the wait may still come
    for i, job in enumerate(sent[0].jobs):
        ctl.on_report(bt.Progress(worker="s0r0", rid=job.rid, done=0, total=job.tokens, intervals=[],
                                  last=i == len(sent[0].jobs) - 1, handed_back="interrupted"))
    ctl.tick(_t.monotonic() + 0.22)
    assert [x.wait for _n, x in ctl.sent if isinstance(x, bt.Prefill)] == [wait_id(1, 1)] * 2
    assert setup(interleave=True)[1] == []  # iteration 1 is not served when interleaved (warm-up 1)
    assert setup(ahead=False)[1] == []
    assert setup(lengths=(0.05, 0.0015))[1] == []  # no chunk (1 ms) fits in 1.5 ms less its margin


def test_training_waits_for_the_decode_workers_to_listen():
    """Ready (training may start) once every prefill server has profiled its model and every
    decode worker listens, or died: a cache shipped to a decode worker still loading its
    model met a refused connection ("KV transfer failed") on a loaded machine."""
    from agents.bubbletea.config import ControllerConfig, Workload

    cfg = ControllerConfig(
        telemetry="", listen="", results="", servers={"s0r0": "/x", "s1r0": "/y"},
        decoders={"decode-a": ["x", 1], "decode-b": ["y", 1]}, decode={"s0r0": "decode-a", "s1r0": "decode-b"},
        warmup_iterations=1, interleave=False, slo_ttft_s=0.5, slo_tbt_s=None, margin_s=0.001, margin_frac=0.1,
        chunk_tokens=32, max_prompt_tokens=64,
        workload=Workload("poisson", duration_s=0.1, rate_scale=1.0, token_scale=1.0, rate_per_s=10.0,
                          max_output_tokens=4, seed=2))
    ctl = Controller(cfg)
    ctl.tell_run = lambda line: None
    for w in ("s0r0", "s1r0"):
        ctl.on_report(bt.ServerReady(worker=w, profile=[[16, 0.001], [64, 0.002]]))
    assert not ctl.ready
    ctl.on_report(bt.DecodeReady(decoder="decode-a"))
    assert not ctl.ready
    ctl.on_telemetry(bt.Died(component="decode-b", reason="decode worker decode-b died (exit code 1)"))
    assert ctl.ready


def test_a_dead_decode_worker_takes_its_requests_with_it_and_nothing_else():
    """Its requests in service end rejected with the reason the run gave; the other DC's are
    not touched; a late report from it changes nothing; no more prefills go to its servers;
    a batch that raised elsewhere rejects its requests with the error; the run's log hears of
    each failure once."""
    import time as _t

    ctl = _controller({"s0r0": "decode-a", "s1r0": "decode-b"}, rate_per_s=400.0, duration_s=0.2)
    ctl.tick(_t.monotonic() + 0.1)
    by_server = {n: x for n, x in ctl.sent if isinstance(x, bt.Prefill)}
    assert set(by_server) == {"s0r0", "s1r0"}
    a = _prefill_all(ctl, "s0r0", by_server["s0r0"], ctl.t0 + 0.12)
    b = _prefill_all(ctl, "s1r0", by_server["s1r0"], ctl.t0 + 0.12)
    reason = "decode worker decode-a died (killed by signal 9)"
    ctl.on_telemetry(bt.Died(component="decode-a", reason=reason))
    assert all(ctl.state[r]["status"] == "rejected" and ctl.state[r]["reason"] == reason for r in a)
    assert all(ctl.state[r]["status"] == "decoding" for r in b)
    ctl.on_report(bt.Decoded(decoder="decode-a", rid=a[0], tokens=4, received=0.0, done=ctl.t0 + 0.2))
    assert ctl.state[a[0]]["status"] == "rejected"  # too late: it was declared dead
    ctl.on_report(bt.DecodeError(decoder="decode-b", rids=b[:1], error="RuntimeError: boom"))
    assert ctl.state[b[0]]["reason"] == "decode failed on decode-b: RuntimeError: boom"
    for rid in b[1:]:
        ctl.on_report(bt.Decoded(decoder="decode-b", rid=rid, tokens=4, received=0.0, done=ctl.t0 + 0.2))
    ctl.sent.clear()
    for w in ("s0r0", "s1r0"):
        ctl.bubbles[w].on_wait(m.Wait(it=2, n=0, t=_t.monotonic()))
    ctl.tick(_t.monotonic() + 0.15)
    assert {n for n, x in ctl.sent if isinstance(x, bt.Prefill)} == {"s1r0"}  # none to the server without a decoder
    assert any("decode worker decode-a died" in line for line in ctl.told)
    assert any("decode failed on decode-b" in line for line in ctl.told)
    result = ctl.finish()
    assert result["counts"]["completed"] == len(b) - 1
    assert result["rejection_reasons"][reason] == len(a)
    assert result["counts"]["arrivals"] == sum(result["counts"][k] for k in ("completed", "rejected"))


def test_the_wait_board_shows_a_wait_to_another_process(tmp_path):
    import subprocess
    import sys

    from testbed.train.waitboard import WaitBoard, create_board, wait_id

    path = tmp_path / "s0r0.board"
    create_board(path)
    board = WaitBoard(str(path))
    assert board.read() == 0
    board.show(wait_id(12, 3))
    seen = subprocess.run([sys.executable, "-c", "import sys; from testbed.train.waitboard import WaitBoard; "
                           f"print(WaitBoard({str(path)!r}).read())"], capture_output=True, text=True,
                          cwd=str(Path(__file__).resolve().parent.parent), check=True).stdout
    assert int(seen) == wait_id(12, 3) != wait_id(12, 2) != 0


_AWAIT = """
import json, sys, time
from testbed.train.waitboard import WaitBoard
board = WaitBoard(sys.argv[1])
print("ready", flush=True)
began = board.await_wait(int(sys.argv[2]), time.monotonic() + float(sys.argv[3]))
print(json.dumps({"began": began, "woke": time.monotonic()}), flush=True)
"""


def _await_in_child(path, wait: int, patience_s: float):
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", _AWAIT, str(path), str(wait), str(patience_s)],
                             stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).resolve().parent.parent))
    assert child.stdout.readline().strip() == "ready"
    return child


def test_a_job_sent_ahead_starts_when_its_wait_begins_not_before_and_not_after_one_that_passed(tmp_path):
    """The doorbell: a server blocked on the board for wait (4, 2) wakes as the worker shows
    it, with the wait's own start, within milliseconds; an earlier wait does not wake it; a
    later wait means its wait has passed; nothing shown means a timeout."""
    import time

    from testbed.train.waitboard import WaitBoard, create_board, wait_id

    path = tmp_path / "s1r0.board"
    create_board(path)
    board = WaitBoard(str(path))
    child = _await_in_child(path, wait_id(4, 2), 5.0)
    board.show(wait_id(4, 1))  # the wait before: not the one the jobs are for
    board.show(0)
    time.sleep(0.3)
    start = time.monotonic()
    board.show(wait_id(4, 2), start)
    got = json.loads(child.stdout.readline())
    child.wait(5)
    assert got["began"] == pytest.approx(start, abs=1e-6)
    assert 0 <= got["woke"] - start < 0.05  # a wake-up, not a poll (measured here: about 0.2 ms)

    board.show(0)  # begun and over already: passed
    assert json.loads(_await_in_child(path, wait_id(4, 2), 5.0).stdout.readline())["began"] == "passed"
    board.show(wait_id(4, 3))  # a later wait under way: passed
    assert json.loads(_await_in_child(path, wait_id(4, 2), 5.0).stdout.readline())["began"] == "passed"
    t0 = time.monotonic()
    late = _await_in_child(path, wait_id(5, 0), 0.4)
    assert json.loads(late.stdout.readline())["began"] == "timeout"
    assert time.monotonic() - t0 >= 0.4


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_emulated_serving_occupies_the_devices_and_ships_caches_of_the_real_size(tmp_path):
    """A prefill server and a decode worker on emulated devices (loopback, no network built):
    each chunk takes its profiled time on the worker's device, queued in order with another
    client's op (training's, here this test's); the cache that reaches the decode worker has
    the real cache's size; decode steps take their profiled time; neither process loads torch."""
    import json
    import socket
    import subprocess
    import sys
    import time

    from agents.bubbletea.config import DecodeConfig, InferenceModel, ServerConfig
    from agents.bubbletea.extension import DEFAULT_PROFILE
    from agents.bubbletea.timing import ServingTimes
    from testbed.train.device import EmulatedDevice, create_device

    speedup = 0.02  # a device 1/50 of the profiled core: a 32-token chunk takes ~30 ms, long enough to catch
    times = ServingTimes.load(DEFAULT_PROFILE, speedup)
    model = InferenceModel(**times.model)
    worker_dev, decode_dev = tmp_path / "s0r0.device", tmp_path / "decode.device"
    create_device(worker_dev)
    create_device(decode_dev)
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ctl.bind(str(tmp_path / "ctl.sock"))
    ctl.settimeout(20)
    port = _free_port()
    common = {"serving_profile": str(DEFAULT_PROFILE), "speedup": speedup}
    dcfg = DecodeConfig(model, str(tmp_path / "ctl.sock"), "127.0.0.1", port, name="decode-a",
                        device_file=str(decode_dev), **common)
    scfg = ServerConfig("s0r0", str(tmp_path / "srv.sock"), str(tmp_path / "ctl.sock"), model,
                        device_file=str(worker_dev), **common)
    procs = []
    repo = Path(__file__).resolve().parent.parent
    try:
        for module, cfg in (("decode", dcfg), ("server", scfg)):
            path = tmp_path / f"{module}.json"
            path.write_text(json.dumps(cfg.to_dict()))
            procs.append(subprocess.Popen([sys.executable, "-m", f"agents.bubbletea.{module}", str(path)], cwd=repo))
        backlog: list[m.Message] = []

        def until(pred):
            """The first message, seen or to come, that ``pred`` accepts (taken off the backlog)."""
            for x in backlog:
                if pred(x):
                    backlog.remove(x)
                    return x
            while True:
                x = m.decode(ctl.recv(65536))
                if pred(x):
                    return x
                backlog.append(x)

        ready = until(lambda x: isinstance(x, bt.ServerReady))
        assert ready.profile == [[n, pytest.approx(times.chunk_s(n, 0))] for n in scfg.calibrate]
        until(lambda x: isinstance(x, bt.DecodeReady))
        dev = EmulatedDevice(worker_dev)
        jobs = [bt.Job(rid=1, tokens=100, output_tokens=5), bt.Job(rid=2, tokens=40, output_tokens=1)]
        ctl.sendto(m.encode(bt.Prefill(deadlines=[time.monotonic() + 30], chunk=32, wait=None,
                                       decode=["127.0.0.1", port], jobs=jobs)), str(tmp_path / "srv.sock"))
        deadline = time.monotonic() + 20
        while dev.busy_seconds() == 0 and time.monotonic() < deadline:
            time.sleep(2e-4)  # until the server has queued its first chunk
        op_start, op_end = dev.run(0.005)  # mid-way through it: a training op is issued
        progress = [until(lambda x: isinstance(x, bt.Progress) and x.rid == rid) for rid in (1, 2)]
        chunks = [(c.start, c.end, c.tokens) for c in progress[0].intervals + progress[1].intervals]
        assert [c[2] for c in chunks] == [32, 32, 32, 4, 32, 8]
        # the op queued behind the chunk running when it was issued (the first, unless this
        # test was descheduled that long), and the next chunk behind the op: no overlap
        behind = [i for i, c in enumerate(chunks) if c[1] == pytest.approx(op_start, abs=1e-6)]
        assert behind, (op_start, chunks)
        assert all(c[1] <= op_start + 1e-6 or c[0] >= op_end - 1e-6 for c in chunks)
        if behind[0] + 1 < len(chunks):
            assert chunks[behind[0] + 1][0] >= op_end - 1e-6
        starts = [0, 32, 64, 96, 0, 32]
        for (s, e, n), start in zip(chunks, starts):
            assert e - s == pytest.approx(times.chunk_s(n, start), rel=1e-6)
        assert progress[0].done == progress[0].total == 100 and progress[1].last
        failed = [x for x in backlog if isinstance(x, (bt.KvFailed, bt.DecodeError))]
        assert not failed, failed
        done = {rid: {kind: until(lambda x, rid=rid, kind=kind: isinstance(x, kind) and x.rid == rid)
                      for kind in (bt.Prefilled, bt.Decoded)} for rid in (1, 2)}
        for rid, tokens, out in ((1, 100, 5), (2, 40, 1)):
            assert done[rid][bt.Prefilled].kv_bytes == times.kv_bytes(tokens)
            d = done[rid][bt.Decoded]
            assert d.tokens == out and len(d.token_times) == out - 1
        gaps = [b - a for a, b in zip(done[1][bt.Decoded].token_times, done[1][bt.Decoded].token_times[1:])]
        assert gaps and all(g >= 0.9 * times.decode_step_s(1, 100) for g in gaps)
        for p in procs:  # no torch in either process
            assert "libtorch" not in Path(f"/proc/{p.pid}/maps").read_text()
        assert EmulatedDevice(decode_dev).busy_seconds() > 0
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        ctl.close()


def test_the_emulated_experiment_replays_the_shipped_profile_and_refuses_another_model(tmp_path):
    """experiments/bubbletea-emulated.yaml quotes the training times of the serving profile it
    replays (one device for both); the profile gives its measured points back (on a device
    ``speedup`` times as fast) and interpolates between them; a profile of another model is a
    one-line error."""
    import json

    from agents.bubbletea.extension import DEFAULT_PROFILE, serving_profile
    from agents.bubbletea.timing import ServingTimes
    from testbed.spec.experiment import load_experiment
    from testbed.spec.topology import SpecError

    repo = Path(__file__).resolve().parent.parent
    exp = load_experiment(repo / "experiments" / "bubbletea-emulated.yaml")
    data = json.loads(DEFAULT_PROFILE.read_text())
    assert [t.model_dump() for t in exp.sim.stage_times] == [
        {"forward_s": t["forward_s"], "backward_s": t["backward_s"], "optimizer_s": t["optimizer_s"]}
        for t in data["training"]]
    assert data["training_model"] == exp.model.model_dump() | {"microbatch_size": exp.training.microbatch_size,
                                                               "stages": exp.parallel.stages}
    assert serving_profile(exp) == DEFAULT_PROFILE and data["measured"] and data["device"]["name"]
    times = ServingTimes(data, speedup=0.25)
    n, start, t = data["prefill"]["points"][5]
    assert times.chunk_s(n, start) == pytest.approx(t / 0.25)
    lo = next(p for p in data["prefill"]["points"] if p[:2] == [32, 0])[2]
    hi = next(p for p in data["prefill"]["points"] if p[:2] == [48, 0])[2]
    assert times.chunk_s(40, 0) == pytest.approx((lo + hi) / 2 / 0.25)
    assert times.kv_bytes(100) - times.kv_bytes(99) == 2 * exp.bubbletea.model.layers * exp.bubbletea.model.hidden * 4
    assert times.prefill_s(100, 32) == pytest.approx(sum(times.chunk_s(k, s) for k, s in
                                                         ((32, 0), (32, 32), (32, 64), (4, 96))))
    other = dict(data, model=dict(data["model"], hidden=128))
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps(other))
    exp.bubbletea.serving_profile = str(bad)
    with pytest.raises(SpecError, match="was measured for model") as err:
        serving_profile(exp)
    assert "\n" not in str(err.value)


def test_the_back_to_back_slowdown_comes_with_its_confidence_interval():
    """``training_slowdown`` (on over off, the means of the runs) beside the pairs' own mean and
    its 95% interval (Student's t over the pairs)."""
    from types import SimpleNamespace

    from agents.bubbletea.backtoback import ci95, summarise

    runs = []
    for off, on in ((1.00, 1.01), (1.00, 1.03), (1.00, 1.02)):
        runs += [{"bubbletea": False, "mean_iteration_time_s": off, "utilization": 0.4},
                 {"bubbletea": True, "mean_iteration_time_s": on, "utilization": 0.8}]
    r = summarise(SimpleNamespace(name="x", device="emulated", time_dilation=2.0), runs)
    assert r["training_slowdown"] == pytest.approx(0.02) and r["pairs"] == 3 and r["time_dilation"] == 2.0
    assert r["training_slowdown_per_pair"] == pytest.approx([0.01, 0.03, 0.02])
    half = 4.303 * 0.01 / 3 ** 0.5  # t(0.975, 2 df) x sd / sqrt(n)
    assert r["training_slowdown_ci95"] == pytest.approx([0.02 - half, 0.02 + half], abs=1e-5)
    assert ci95([0.5]) is None
    assert ci95([0.0, 1.0] * 50) == pytest.approx([0.5 - 1.984 * 0.50252 / 10, 0.5 + 1.984 * 0.50252 / 10], abs=2e-4)


def test_the_control_arm_splits_the_slowdown_into_the_hosts_and_the_devices():
    """A third arm per pair (BubbleTea on, its chunks on devices of their own): control over
    off is the host's share, on over control the device's."""
    from types import SimpleNamespace

    from agents.bubbletea.backtoback import summarise

    runs = []
    for off, on, control in ((1.00, 1.03, 1.01), (1.00, 1.05, 1.02)):
        runs += [{"bubbletea": False, "mean_iteration_time_s": off, "utilization": 0.4},
                 {"bubbletea": True, "mean_iteration_time_s": on, "utilization": 0.8},
                 {"bubbletea": True, "control": True, "mean_iteration_time_s": control, "utilization": 0.4}]
    r = summarise(SimpleNamespace(name="x", device="emulated"), runs)
    assert r["training_slowdown_per_pair"] == pytest.approx([0.03, 0.05]) and r["utilization_on"] == 0.8
    assert r["host_slowdown_per_pair"] == pytest.approx([0.01, 0.02])
    assert r["device_slowdown_per_pair"] == pytest.approx([1.03 / 1.01 - 1, 1.05 / 1.02 - 1], abs=1e-5)


def test_the_control_arm_needs_emulated_devices():
    from testbed.spec.experiment import parse_experiment
    from testbed.spec.topology import SpecError, read_yaml

    data = read_yaml(Path(__file__).resolve().parents[1] / "experiments" / "bubbletea.yaml")
    data["bubbletea"]["control"] = True
    with pytest.raises(SpecError, match="bubbletea.control needs device: emulated"):
        parse_experiment(data, "x.yaml")


def test_the_slowdown_within_an_alignment_is_apart_from_which_alignment_a_run_fell_into():
    """Two alignments 0.74 and 0.83 s apart by 12%: BubbleTea 1% slower inside each, its runs
    mostly in the fast one.  The pairs' mean mixes the two; within the alignments it reads 1%."""
    from types import SimpleNamespace

    from agents.bubbletea.backtoback import alignments, summarise

    assert alignments([0.74, 0.741, 0.83, 0.829, 0.7405]) == [[0.74, 0.741], [0.829, 0.83]]
    offs = [0.740, 0.741, 0.830, 0.831, 0.829, 0.830]
    ons = [x * 1.01 for x in (0.740, 0.741, 0.739, 0.740, 0.830, 0.831)]
    runs = []
    for a, b in zip(offs, ons):
        runs += [{"bubbletea": False, "mean_iteration_time_s": a, "utilization": 0.4},
                 {"bubbletea": True, "mean_iteration_time_s": b, "utilization": 0.8}]
    r = summarise(SimpleNamespace(name="x", device="emulated"), runs)
    assert r["training_slowdown"] < 0  # on reads faster overall: it fell into the fast alignment more often
    assert len(r["alignments"]) == 2 and r["training_slowdown_within_alignments"] == pytest.approx(0.01, abs=1e-4)
    lo, hi = r["training_slowdown_within_alignments_ci95"]
    assert lo < 0.01 < hi and hi - lo < 0.01


def test_a_prefill_past_its_bubbles_end_is_counted_with_its_overrun():
    from types import SimpleNamespace

    from agents.bubbletea.extension import _overruns

    w = SimpleNamespace(events=[["forward", 0, 0.0, 0.1, 0], ["recv", 0, 0.1, 0.3, 0], ["backward", 0, 0.3, 0.5, 0],
                                ["allreduce", -1, 0.5, 0.7, 0], ["optimizer", -1, 0.7, 0.75, 0]])
    run = SimpleNamespace(workers={"s0r0": w})
    data = {"prefill_intervals": {"s0r0": [[0.12, 0.29, 1], [0.2, 0.302, 2], [0.55, 0.71, 3], [0.9, 1.0, 4]]}}
    r = _overruns(run, data)
    assert (r["chunks"], r["past_bubble_end"]) == (3, 2)  # the last started after the record's last op
    assert r["fraction"] == pytest.approx(2 / 3, abs=1e-4)
    assert r["overrun_max_ms"] == pytest.approx(10.0)  # past the optimizer's issue at 0.7 s; the other by 2 ms
