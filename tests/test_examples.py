"""The shipped torchrun examples (examples/), run as users run them: three ranks on one machine.

Each test starts ``python -m torch.distributed.run --standalone --nproc-per-node 3`` (torchrun)
on a script, gloo on CPU, and compares its JSON lines with the same script's one-process
``--reference``: losses equal to 1e-5 relative, the parity tolerance of the project's own
pipeline trainer (tests/test_trainer.py).  No network is built: these are the scripts alone;
``testbed torchrun`` puts the same scripts on the emulated WAN.  Small sizes, ~10-15 s per
torchrun on 2 cores, most of it starting Python and torch in three processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
RTOL = 1e-5  # as tests/test_trainer.py
SMALL = ["--layers", "6", "--hidden", "32", "--heads", "2", "--seq-len", "16"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)
    return env


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _torchrun(script: str, *args: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           str(EXAMPLES / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _lines(proc.stdout)


def _reference(script: str, *args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--reference", *args],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _lines(proc.stdout)


def _assert_parity(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), (what, got, want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= RTOL * abs(w), f"{what} step {k}: distributed {g!r} vs one process {w!r}"


PIPE = ["--steps", "5", "--microbatches", "6", "--microbatch-size", "2", *SMALL]


@pytest.fixture(scope="module")
def pipeline_reference():
    return [line["loss"] for line in _reference("pipeline_gpt.py", *PIPE)]


@pytest.mark.parametrize(("schedule", "split"), [  # the quick suite: a multi-stage schedule and the tracer
    pytest.param("gpipe", "manual", marks=pytest.mark.slow), pytest.param("1f1b", "manual", marks=pytest.mark.slow),
    ("interleaved1f1b", "manual"), pytest.param("loopedbfs", "manual", marks=pytest.mark.slow), ("1f1b", "trace")])
def test_pipeline_schedules_match_one_process(tmp_path, pipeline_reference, schedule, split):
    out = tmp_path / "steps.jsonl"
    lines = _torchrun("pipeline_gpt.py", "--schedule", schedule, "--split", split, "--out", str(out), *PIPE)
    assert [line["step"] for line in lines] == list(range(5))  # the last rank alone prints, once per step
    assert _lines(out.read_text()) == lines
    assert all(line["time_s"] > 0 for line in lines)
    losses = [line["loss"] for line in lines]
    _assert_parity(losses, pipeline_reference, schedule)
    assert losses[-1] < losses[0] - 0.3, losses  # it learns: 5.56 -> ~4.9 here


def test_ddp_matches_one_process_on_the_concatenated_batch(tmp_path):
    args = ["--steps", "6", "--batch-size", "2", *SMALL]
    lines = _torchrun("ddp.py", "--out", str(tmp_path / "ddp.jsonl"), *args)
    want = [line["loss"] for line in _reference("ddp.py", "--world", "3", *args)]
    assert [line["step"] for line in lines] == list(range(6))  # rank 0 alone prints
    assert _lines((tmp_path / "ddp.jsonl").read_text()) == lines
    losses = [line["loss"] for line in lines]
    _assert_parity(losses, want, "ddp")
    assert losses[-1] < losses[0] - 0.3, losses
    # one rank's share of the batch is not the whole batch: the parity is not trivially one rank's loss
    alone = [line["loss"] for line in _reference("ddp.py", "--world", "1", *args)]
    assert abs(alone[0] - want[0]) > 1e-3, (alone[0], want[0])
    assert lines[0]["allreduce_bytes"] > 0


def test_diloco_local_steps_then_one_identical_outer_step_on_every_rank(tmp_path):
    h, rounds = 3, 3
    args = ["--inner-steps", str(h), "--rounds", str(rounds), "--batch-size", "2", *SMALL]
    lines = _torchrun("diloco.py", "--out", str(tmp_path / "r0.jsonl"), *args)
    by_rank = {r: [line for line in lines if line["rank"] == r] for r in range(3)}
    assert _lines((tmp_path / "r0.jsonl").read_text()) == by_rank[0]
    outer_steps = [k * h + h - 1 for k in range(rounds)]
    for r, mine in by_rank.items():
        assert [line["step"] for line in mine] == list(range(h * rounds)), r  # H local steps per round
        assert [line["step"] for line in mine if "round" in line] == outer_steps, r  # then one outer step
    for k in range(rounds):
        outer = [next(line for line in by_rank[r] if line.get("round") == k) for r in range(3)]
        # before the outer step every rank holds its own weights; after it, the same weights
        assert len({o["local_checksum"] for o in outer}) == 3, outer
        assert len({o["checksum"] for o in outer}) == 1, outer
        assert all(o["checksum"] != o["local_checksum"] for o in outer), outer
        assert all(o["payload_bytes"] == outer[0]["payload_bytes"] > 0 for o in outer), outer
        assert all(o["outer_comm_s"] > 0 and o["round_time_s"] >= o["outer_comm_s"] for o in outer), outer
    # the same arithmetic in one process, three workers in turn: the same local losses
    ref = _reference("diloco.py", "--world", "3", *args)
    for r in range(3):
        _assert_parity([line["loss"] for line in by_rank[r]],
                       [line["loss"] for line in ref if line["rank"] == r], f"diloco rank {r}")
    first, last = (sum(line["loss"] for line in lines if k * h <= line["step"] < (k + 1) * h) / (3 * h)
                   for k in (0, rounds - 1))
    assert last < first - 0.3, (first, last)


def test_bad_input_is_one_line(tmp_path):
    # without torchrun's environment
    proc = subprocess.run([sys.executable, str(EXAMPLES / "ddp.py")], capture_output=True, text=True,
                          timeout=60, env=_env(), cwd=REPO)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "ddp: no RANK in the environment: start it with torchrun, or pass --reference"], proc.stderr
    # more stages than layers: refused before any rendezvous
    proc = subprocess.run([sys.executable, str(EXAMPLES / "pipeline_gpt.py"), "--schedule", "interleaved1f1b",
                           "--layers", "4"], capture_output=True, text=True, timeout=60,
                          env=_env(RANK="0", WORLD_SIZE="3"), cwd=REPO)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "pipeline_gpt: --layers 4 < 6 stages (3 ranks x 2 for interleaved1f1b)"], proc.stderr
