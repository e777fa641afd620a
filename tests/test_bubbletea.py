"""BubbleTea without a network: the workload, chunked prefill, bubble prediction, the
prefill-time profile, and the controller's accounting (every request completed or rejected)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agents.bubbletea.controller import Controller
from agents.bubbletea.inference import (PrefillState, decode, decode_batch, load_model, pack, prefill_chunk,
                                       prompt_tokens, unpack)
from agents.bubbletea.predictor import PrefillProfile, WorkerBubbles, bubbles_of
from agents.bubbletea.workload import azure_trace, poisson


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
            events.append(["recv", 0, cursor, start + s, it])
        events.append(["forward", 0, start + s, start + e, it])
        cursor = start + e
    return {"type": "events", "it": it, "events": events, "iteration_done": True, "end": cursor}


def test_waits_are_predicted_conservatively_from_recent_iterations():
    w = WorkerBubbles()
    start = 0.0
    for it, second in enumerate((0.10, 0.08, 0.10)):  # the second wait was shorter once
        busy = [(0.0, 0.1), (0.3, 0.4), (0.4 + second, 0.6 + second)]  # waits: 0.2, then `second`
        msg = _iteration(it, start, busy)
        for e in msg["events"]:
            e[1] = 1  # microbatch 1: a wait for a peer, not the end-of-iteration wait
        w.add(msg)
        start = msg["end"]
    assert w.predict(0) == pytest.approx(0.2)
    assert w.predict(1) == pytest.approx(0.08)  # the shortest seen, not the latest
    assert w.predict(5) == 0.0  # never seen: not relied on
    assert bubbles_of(_iteration(0, 0.0, [(0.0, 0.1), (0.3, 0.4)])["events"], 0.0, 0.4) == \
        [(pytest.approx(0.1), pytest.approx(0.2))]
    w.on_wait({"it": 3, "n": 0, "t": 10.0})  # announced live by the worker
    s0, e0 = w.window(now=10.0, margin_s=0.006, margin_frac=0.1)
    assert s0 == 10.0 and e0 == pytest.approx(10.0 + 0.2 - 0.02)
    assert w.window(now=10.5, margin_s=0.006, margin_frac=0.1) is None  # its predicted end has passed


def test_prefill_profile_fits_a_line():
    p = PrefillProfile([(16, 0.003), (64, 0.006), (256, 0.018)])
    assert p.seconds(128) == pytest.approx(0.010, rel=0.1)
    assert p.tokens_within(0.010) == pytest.approx(128, rel=0.15)


def test_controller_accounts_for_every_request():
    from agents.bubbletea.config import ControllerConfig, Workload

    cfg = ControllerConfig(
        telemetry="", listen="", results="", servers={"s0r0": "/nonexistent"}, decode={"s0r0": ["x", 1]},
        warmup_iterations=1, interleave=False, slo_ttft_s=0.5, margin_s=0.001, margin_frac=0.1, chunk_tokens=32,
        max_prompt_tokens=64, workload=Workload("poisson", duration_s=0.4, rate_scale=1.0, token_scale=1.0,
                                                rate_per_s=200.0, max_output_tokens=16, seed=2))
    ctl = Controller(cfg)
    ctl.sock = None
    ctl._send = lambda name, msg: sent.append(msg)
    sent = []
    ctl.on_report({"type": "ready", "worker": "s0r0", "profile": [[16, 0.001], [64, 0.002]]})
    import time as _t
    now = _t.monotonic()
    # one warm-up iteration with a long bubble, then the worker is in its next iteration
    ctl.on_telemetry(dict(_iteration(0, now - 1.0, [(0.0, 0.05), (0.95, 1.0)]), worker="s0r0"))
    assert ctl.t0 is not None
    ctl.bubbles["s0r0"].history.extend([[10.0], [10.0]])  # its first wait lasts 10 s every iteration
    ctl.bubbles["s0r0"].on_wait({"it": 1, "n": 0, "t": _t.monotonic()})
    ctl.tick(_t.monotonic() + 0.2)
    assert sent and sent[0]["type"] == "prefill" and len(sent[0]["jobs"]) > 1  # several for one bubble
    jobs = sent[0]["jobs"]
    rid = jobs[0]["rid"]
    for i, job in enumerate(jobs):  # the server finished the first, then its deadline came
        done = job["tokens"] if i == 0 else 0
        ctl.on_report({"type": "progress", "worker": "s0r0", "rid": job["rid"], "done": done, "total": job["tokens"],
                       "intervals": [[0.0, 0.001, done]] if done else [], "last": i == len(jobs) - 1})
    assert ctl.servers["s0r0"]["busy"] is None and not ctl.servers["s0r0"]["sticky"] - {rid}
    assert all(job["rid"] in ctl.queue for job in jobs[1:])  # back in the queue, for any server
    ctl.on_report({"type": "prefilled", "worker": "s0r0", "rid": rid, "kv_bytes": 10, "kv_send_s": 0.001,
                   "at": ctl.t0 + 0.3})
    ctl.on_report({"type": "decoded", "worker": "decode", "rid": rid, "tokens": 4, "received": 0.0,
                   "done": ctl.t0 + 0.35})
    ctl.tick(_t.monotonic() + 1.0)  # the rest waited past the SLO
    result = ctl.finish()
    statuses = [r["status"] for r in result["requests"]]
    assert statuses.count("completed") == 1
    assert set(statuses) <= {"completed", "rejected"}
    assert all(r.get("reason") for r in result["requests"] if r["status"] == "rejected")


def test_the_wait_board_shows_a_wait_to_another_process(tmp_path):
    import subprocess
    import sys

    from agents.trainer.waitboard import WaitBoard, wait_id

    path = tmp_path / "s0r0.board"
    path.write_bytes(bytes(8))
    board = WaitBoard(str(path))
    assert board.read() == 0
    board.show(wait_id(12, 3))
    seen = subprocess.run([sys.executable, "-c", "import sys; from agents.trainer.waitboard import WaitBoard; "
                           f"print(WaitBoard({str(path)!r}).read())"], capture_output=True, text=True,
                          cwd=str(Path(__file__).resolve().parent.parent), check=True).stdout
    assert int(seen) == wait_id(12, 3) != wait_id(12, 2) != 0
