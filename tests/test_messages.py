"""The typed protocol between processes (``testbed/messages.py``): every kind, core and
extensions', survives encode -> decode; a bad message is one line naming the kind and the
field; and a real channel (the run's telemetry hub, a Unix socket) says so too.  Also the
typed run summary: it reads by attribute, and its JSON is metrics.json as it was."""

from __future__ import annotations

import dataclasses
import json
import socket
import typing
from pathlib import Path

import pytest

import agents.atlas.messages  # noqa: F401  (their kinds register on import)
import agents.bubbletea.messages  # noqa: F401
import agents.titan.messages  # noqa: F401
from testbed import messages as m

REPO = Path(__file__).resolve().parent.parent


def _sample(tp, depth: int = 0):
    """A value of annotation ``tp`` that is not its default (so a dropped field shows)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is __import__("types").UnionType:
        return _sample(next(a for a in typing.get_args(tp) if a is not type(None)), depth)
    if tp is typing.Any:
        return {"any": [1, "two", None]}
    if tp is bool:
        return True
    if tp is int:
        return 7 + depth
    if tp is float:
        return 2.5 + depth
    if tp is str:
        return f"s{depth}"
    if tp is list or origin is list:
        args = typing.get_args(tp)
        return [_sample(args[0], depth + 1) if args else 1, _sample(args[0], depth + 2) if args else "x"]
    if tp is dict or origin is dict:
        args = typing.get_args(tp)
        return {"k": _sample(args[1], depth + 1) if args else [1, 2]}
    if isinstance(tp, type) and issubclass(tp, m.Message):
        return m.Wait(it=1, n=2, t=3.5, worker="s0r0")  # a message inside a message
    if isinstance(tp, type) and issubclass(tp, m.Record):
        return _instance(tp, depth + 1)
    raise AssertionError(f"no sample for {tp!r}")


def _instance(cls, depth: int = 0):
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample(hints[f.name], depth) for f in dataclasses.fields(cls) if f.init})


def test_every_kind_round_trips_with_every_field():
    kinds = m.kinds()
    # the core's channels and each extension's: all of them are here
    assert {"hello", "ready", "go", "start_offset", "bye", "events", "wait", "done", "error", "log", "lane",
            "lane_stats", "lane_stats_reply", "ok", "refused", "call", "answer", "telemetry", "exited",
            "network_failed", "agent_gone"} <= set(kinds)
    assert {k.split(".")[0] for k in kinds if "." in k} == {"atlas", "bubbletea", "titan"}
    for kind, cls in sorted(kinds.items()):
        msg = _instance(cls)
        data = m.encode(msg)
        assert json.loads(data)["kind"] == kind
        back = m.decode(data)
        assert type(back) is cls and back == msg, kind
        assert m.decode(m.line(msg).decode()) == msg  # the stream framing, and text in
        assert m.decode(json.loads(data)) == msg  # an already parsed object (a nested one)


def test_positional_lists_are_named_fields_on_the_wire():
    ev = m.Events(it=3, events=[m.Span("forward", 1, 0.5, 0.75, 3)], transfers=[m.Xfer("xfer_act", 1, 0.25, 0.5, 4096, 3)],
                  iteration_done=True, end=0.75, loss=2.0)
    wire = json.loads(m.encode(ev))
    assert wire["events"] == [{"kind": "forward", "mb": 1, "start": 0.5, "end": 0.75, "iteration": 3}]
    assert wire["transfers"][0]["nbytes"] == 4096
    assert m.decode(wire).events[0].end == 0.75


def test_a_partial_update_sends_only_what_it_sets():
    msg = m.LaneSet(lane="e-w", classes=None, lease_s=1.5)
    assert json.loads(m.encode(msg)) == {"kind": "lane", "lane": "e-w", "classes": None, "lease_s": 1.5}
    back = m.decode(m.encode(msg))
    assert back.given() == {"lane": "e-w", "classes": None, "lease_s": 1.5}  # null is "remove", absent is "keep"
    assert back.delay_ms is m.UNSET and not back.delay_ms


@pytest.mark.parametrize("data, says", [
    ({"kind": "events", "events": []}, "message 'events': field 'it': missing"),
    ({"kind": "evnts", "it": 1}, "unknown message kind 'evnts'"),
    ({"it": 1, "events": []}, "a message without 'kind' (fields: events, it)"),
    ({"kind": "events", "it": "one", "events": []}, "message 'events': field 'it': expected int, got str 'one'"),
    ({"kind": "events", "it": True, "events": []}, "message 'events': field 'it': expected int, got bool True"),
    ({"kind": "events", "it": 1, "events": [{"kind": "forward", "mb": 0, "start": "x", "end": 1.0, "iteration": 1}]},
     "message 'events': field 'events[0].start': expected float, got str 'x'"),
    ({"kind": "events", "it": 1, "events": [], "evnets": []}, "message 'events': field 'evnets': unknown"),
    ({"kind": "lane", "lane": "a", "classes": {"r0": [[1, None]]}},
     "message 'lane': field 'classes.r0[0][0]': expected str | None, got int 1"),
    ({"kind": "telemetry", "name": "s0r0", "t": 1.0, "msg": {"kind": "wait", "it": 1, "t": 2.0}},
     "message 'telemetry': field 'msg': message 'wait': field 'n': missing"),
    ({"kind": "bubbletea.prefill", "deadlines": [1.0], "chunk": 32, "wait": None, "decode": ["h", 1],
      "jobs": [{"rid": 1, "tokens": 8}]}, "message 'bubbletea.prefill': field 'jobs[0].output_tokens': missing"),
    ('{"kind": "go"', "a message that is not JSON"),
    ("[1, 2]", "a message must be a JSON object, not list"),
])
def test_a_bad_message_is_one_line_naming_the_kind_and_the_field(data, says):
    with pytest.raises(m.MessageError) as err:
        m.decode(data)
    assert str(err.value).startswith(says), str(err.value)
    assert "\n" not in str(err.value)


def test_a_channel_takes_only_its_kinds():
    with pytest.raises(m.MessageError, match="message 'go' not expected here \\(expected lane, lane_stats\\)"):
        m.decode(m.encode(m.Go()), expect=(m.LaneSet, m.LaneStats))


def test_a_kind_is_defined_once():
    with pytest.raises(TypeError, match="message kind 'events' is already testbed.messages.Events"):
        @dataclasses.dataclass
        class Mine(m.Message):
            kind: typing.ClassVar[str] = "events"


def test_the_hub_names_the_sender_of_a_bad_line(tmp_path):
    """A real Unix socket: a worker's hello, a good line, then one with a field missing."""
    from testbed.run.hub import TelemetryHub

    hub = TelemetryHub(tmp_path / "tel.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(tmp_path / "tel.sock"))
        sock.sendall(m.line(m.Hello(worker="s1r0", pid=1)) + m.line(m.Wait(it=0, n=0, t=1.0)))
        got = []
        for _ in range(20):
            got += hub.poll(0.1)
            if got:
                break
        assert got == [("s1r0", m.Wait(it=0, n=0, t=1.0))]
        assert hub.send("s1r0", m.StartOffset(offset_s=0.25))
        assert m.decode(sock.recv(4096)) == m.StartOffset(offset_s=0.25)
        sock.sendall(b'{"kind":"wait","it":1,"t":2.0}\n')
        with pytest.raises(m.MessageError, match="^telemetry from s1r0: message 'wait': field 'n': missing$"):
            for _ in range(20):
                hub.poll(0.1)
    finally:
        sock.close()
        hub.close()


def test_the_run_summary_is_typed_and_its_json_is_metrics_json():
    from testbed.results.metrics import RunSummary, summarise, write_outputs
    from testbed.sim.build import simulate
    from testbed.spec.experiment import load_experiment

    run = simulate(load_experiment(REPO / "experiments" / "default.yaml"), iterations=5, record=True)
    run.device = {"kind": "emulated", "computes_model": False}  # as the emulated device kind describes itself
    result = summarise(run)
    assert isinstance(result, RunSummary)
    s = result.summary
    assert s.steady_state_iterations == [it.iteration for it in result.iterations][2:]
    assert s.bubble_fraction == pytest.approx(1 - s.mean_busy_fraction)
    assert result.iterations[3].workers["s0r0"].window_s > 0
    result.summary.extra["mine"] = {"figure": 1}  # an extension's figures: after the core's
    result.extra["cluster"] = {"machines": 2}
    d = json.loads(json.dumps(result.to_dict()))
    assert list(d) == ["experiment", "topology", "parallel", "model", "training", "workers", "device", "iterations",
                       "summary", "wan_check", "tcp_per_host", "log", "cluster"]
    assert list(d["summary"]) == ["iterations", "steady_state_iterations", "mean_iteration_time_s",
                                  "mean_busy_fraction", "bubble_fraction", "busy_fraction_per_worker", "tokens_per_s",
                                  "final_loss", "time_dilation", "loss_note", "warnings", "mine"]  # no TCP counters read: no tcp_*
    assert list(d["iterations"][0]) == ["iteration", "time_s", "loss", "tokens_per_s", "mean_busy_fraction",
                                        "workers"]
    # the readers not yet converted read it by key, and get the same
    assert result["summary"]["mean_iteration_time_s"] == s.mean_iteration_time_s == d["summary"]["mean_iteration_time_s"]
    assert result["summary"]["mine"] == {"figure": 1} and "tcp_timeouts" not in result["summary"]
    assert result["iterations"][1]["workers"]["s1r0"]["busy_fraction"] == d["iterations"][1]["workers"]["s1r0"][
        "busy_fraction"]
