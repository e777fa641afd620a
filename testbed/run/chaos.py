"""Fault injection: a short real run, one fault at a random point, and how it ended, judged.

How it fits: ``testbed chaos`` (``cli.py``) and tests/test_faults.py drive this module.
Each injection runs ``experiments/chaos.yaml`` (two DCs of two hosts, two pipeline stages
across the WAN link, two replicas, and an extension whose processes exist: Atlas's temporal
sharing) with the faults below, one at a time, at an iteration drawn from a seeded RNG:

* ``kill-orchestrator``: SIGKILL of ``testbed run`` itself (a subprocess here), and
  ``interrupt-orchestrator``: Ctrl-C (SIGINT to its process group, as a terminal sends it);
  both at a random iteration, or at a random moment after the command starts (while the
  network is being built, say);
* ``kill-worker``, ``kill-delayline``: SIGKILL of one of the run's processes;
* what extensions add (``testbed.extension.ProcessFault``, e.g. ``kill-atlas-agent``):
  SIGKILL of one of an extension's processes, after which training must go on;
* ``link-down-short`` / ``link-down-long``: the WAN link cut (``Network.set_link_up``) for
  less than the experiment's ``training.recv_timeout_s``, or for longer;
* ``rate-drop``: both directions of the link at a tenth of their rate
  (``WanDirection.set``);
* ``disk-full``: the results folder on a small tmpfs mounted for the run, filled.

Every run but the orchestrator's is driven in this process (``runner.TrainingRun``, its
telemetry through ``subscribe``); the orchestrator is the real command, signalled from here.
The harness signals only what the testbed started: the run's own processes (by the PIDs the
run holds) and the ``testbed run`` it started itself.  When the run has ended,
``registry.leftovers()`` must find nothing (the run's own exit removes everything, but after
a SIGKILL of the orchestrator); then ``testbed clean`` runs (the command) and ``leftovers()``
must again find nothing: no process, namespace, interface (with its qdiscs), cgroup or file
under /run/gtb.  ``judge`` then says whether the run ended as ``DOCUMENTED`` says it must,
within the bound in ``BOUND_S`` (from the injection to the run's end, its teardown included):
completed with every iteration recorded exactly once and (real devices) the losses of a
single-process run of the same model, or a one-line error naming the cause; and whether
any iteration's result or loss was lost or duplicated (``metrics.json`` and
``iterations.jsonl``, the file a run appends as each iteration finishes).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from testbed import messages as m
from testbed.extension import ProcessFault
from testbed.extension import faults as _extension_faults
from testbed.registry import leftovers
from testbed.spec.shipped import shipped

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = shipped("experiments") / "chaos.yaml"

# What each fault must end in, and within how long (seconds after the injection).
DOCUMENTED: dict[str, tuple[str, str]] = {
    "kill-orchestrator": ("`testbed run` is gone; `testbed clean` removes everything it made; iterations.jsonl "
                          "holds every iteration finished before the kill, once, with its loss", "clean: 30 s"),
    "interrupt-orchestrator": ("exit 130 with one line 'interrupted (SIGINT); everything the testbed made was "
                               "removed', and nothing is left before any `testbed clean`; iterations.jsonl as "
                               "above (a Ctrl-C while Python is still starting, before the command runs, ends it "
                               "silently: nothing was made)", "30 s"),
    "kill-worker": ("error naming the worker: 'died (killed by signal 9)'", "15 s"),
    "kill-delayline": ("error naming the delay line's WAN links", "15 s"),
    "link-down-short": ("training stalls for at least the outage, resumes, completes with every iteration and "
                        "the same losses", "outage + 15 s of stall"),
    "link-down-long": ("error naming the WAN link and that it is down", "recv_timeout_s + 10 s"),
    "rate-drop": ("completes with every iteration and the same losses (slower)", "the run's own length x 10 + 30 s"),
    "disk-full": ("error naming the results folder and 'No space left on device'", "15 s"),
}
# an extension's process killed (``testbed.extension``): name -> (extension, fault)
_PROCESS_FAULTS: dict[str, tuple[str, ProcessFault]] = {n: (e.name, f) for n, (e, f) in _extension_faults().items()}
DOCUMENTED.update({n: (f.documented, "the run's own length + 30 s") for n, (_, f) in _PROCESS_FAULTS.items()})
FAULTS = tuple(DOCUMENTED)
_ORCHESTRATOR = ("kill-orchestrator", "interrupt-orchestrator")  # the `testbed run` command, signalled
# The bounds judged (seconds from the injection to the run's end, teardown included; None: the
# run completes, however long it takes, or the bound is the outage's, see judge).
BOUND_S: dict[str, float | None] = {"kill-orchestrator": 30.0, "interrupt-orchestrator": 30.0,
                                    "kill-worker": 15.0, "kill-delayline": 15.0, "disk-full": 15.0}
_DISK_BYTES = 1 << 20  # the results folder's tmpfs in disk-full


@dataclass
class Injection:
    """One fault to inject: which, where (``target``), when (after ``at_iteration``
    iterations, plus ``delay_s``; ``at_iteration`` 0: ``delay_s`` after the command
    started), and for how long (``seconds``: an outage)."""

    index: int
    fault: str
    at_iteration: int
    delay_s: float
    target: str = ""
    seconds: float = 0.0


@dataclass
class Outcome:
    """How one injected run ended, and the verdict."""

    index: int
    fault: str
    target: str
    at_iteration: int
    ended: str = ""  # completed, error, killed, interrupted, crashed (a traceback: never documented)
    message: str = ""
    after_s: float | None = None  # from the injection to the end
    run_s: float = 0.0
    iterations: int = 0  # recorded (metrics.json, else iterations.jsonl)
    lost: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    wrong_loss: list[int] = field(default_factory=list)
    stall_s: float | None = None  # the longest iteration (link-down-short)
    left_at_exit: dict = field(default_factory=dict)  # leftovers() once the run had ended, before any clean
    clean_removed: str = ""  # what `testbed clean` said it removed
    leftovers: dict = field(default_factory=dict)  # leftovers() after `testbed clean`
    documented: bool = False
    why: str = ""  # why not, when not

    def to_dict(self) -> dict:
        return asdict(self)


def chaos_experiment(device: str = "cpu", iterations: int | None = None, path: Path = EXPERIMENT):
    """The chaos job (``experiments/chaos.yaml``) on ``device`` (cpu: a real model; emulated)."""
    from testbed.spec.experiment import parse_experiment
    from testbed.spec.topology import read_yaml

    data = read_yaml(path)
    data["device"] = device
    if iterations is not None:
        data["training"]["iterations"] = iterations
    return parse_experiment(data, str(path), path.parent, strict=True)


def plan(runs: int, seed: int, exp, faults: tuple[str, ...] = FAULTS) -> list[Injection]:
    """``runs`` injections, the faults in turn, each at a random point (seeded)."""
    rng = random.Random(seed)
    n_it = exp.training.iterations
    timeout = exp.training.recv_timeout_s
    workers = [s.name for s in exp.workers()]
    dcs = sorted({s.dc for s in exp.workers()})
    links = [f"{w.a}-{w.b}" for w in exp.topo.wan]
    out = []
    for i in range(runs):
        fault = faults[i % len(faults)]
        inj = Injection(i, fault, rng.randint(2, max(2, n_it // 2)), round(rng.uniform(0.0, 0.2), 3))
        if fault in _ORCHESTRATOR and rng.random() < 0.5:  # anywhere: while building, training, ...
            inj.at_iteration, inj.delay_s = 0, round(rng.uniform(0.2, 8.0), 2)
        if fault == "kill-worker":
            inj.target = rng.choice(workers)
        elif fault == "kill-delayline":
            inj.target = rng.choice(dcs)
        elif fault in _PROCESS_FAULTS:
            inj.target = rng.choice(_PROCESS_FAULTS[fault][1].targets(exp))
        elif fault in ("link-down-short", "link-down-long", "rate-drop"):
            inj.target = rng.choice(links)
            if fault == "link-down-short":
                inj.seconds = round(rng.uniform(0.25, 0.5) * timeout, 2)
            elif fault == "link-down-long":
                inj.seconds = round(timeout + 20.0, 2)  # held until the run ends, at most this
        out.append(inj)
    return out


def reference(exp) -> list[float] | None:
    """The losses of one process training the same model on the same samples (None: emulated)."""
    from testbed.extension import device_kind

    if not device_kind(exp.device).computes_model:
        return None
    from testbed.train.reference import reference_losses

    return reference_losses(exp.model.model_dump(), exp.training.model_dump(), exp.parallel.replicas)


# -- running one injection ----------------------------------------------------------------------
class _Injector:
    """Fires the fault from a timer thread once the run has finished ``at_iteration`` iterations."""

    def __init__(self, run, inj: Injection, fill: Callable[[], None] | None = None):
        self.run, self.inj, self._fill = run, inj, fill
        self.fired_at: float | None = None
        self.error: str | None = None
        self._armed = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def on_message(self, worker: str, msg: m.Message) -> None:
        if self._armed or not (isinstance(msg, m.Events) and msg.iteration_done) or \
                self.run.iterations_done() < self.inj.at_iteration:
            return
        self._armed = True
        self._thread = threading.Thread(target=self._fire, daemon=True)
        self._thread.start()

    def _fire(self) -> None:
        inj, run = self.inj, self.run
        if self._done.wait(inj.delay_s):
            return
        try:
            self.fired_at = time.monotonic()
            if inj.fault == "kill-worker":
                os.kill(run.workers[inj.target].proc.pid, signal.SIGKILL)
            elif inj.fault == "kill-delayline":
                os.kill(run.net.delay_line_pids()[inj.target], signal.SIGKILL)
            elif inj.fault in _PROCESS_FAULTS:
                os.kill(run.pids()[f"{_PROCESS_FAULTS[inj.fault][0]}-{inj.target}"], signal.SIGKILL)
            elif inj.fault in ("link-down-short", "link-down-long"):
                a, b = inj.target.split("-", 1)
                run.net.set_link_up(a, b, False)
                self._done.wait(inj.seconds)
                if run.net.started:
                    run.net.set_link_up(a, b, True)
            elif inj.fault == "rate-drop":
                a, b = inj.target.split("-", 1)
                for src, dst in ((a, b), (b, a)):
                    link = run.net.link(src, dst)
                    link.set(rate_mbps=link.params.rate_mbps / 10)
            elif inj.fault == "disk-full":
                self._fill()
        except Exception as exc:  # the injection failed: the verdict says so
            if not self._done.is_set():
                self.error = f"injection failed: {type(exc).__name__}: {exc}"

    def finish(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(30)


def _fill(folder: Path) -> None:
    """Fill the file system under ``folder`` to the last byte."""
    block = b"\0" * 65536
    with open(folder / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(block)
        except OSError:
            pass
        try:
            while True:
                fh.write(b"\0")
        except OSError:
            pass


def _mount_tmpfs(size: int) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="gtb-chaos-disk-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "gtb-chaos-disk", str(folder)],
                   check=True, capture_output=True)
    return folder


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], capture_output=True)
    try:
        folder.rmdir()
    except OSError:
        pass


def _clean() -> str:
    """``testbed clean``, the command; what it said."""
    res = subprocess.run([sys.executable, "-m", "testbed.cli", "clean"], capture_output=True, text=True,
                         timeout=120, env=_env())
    text = " ".join((res.stdout + res.stderr).split())  # one line, however the console wrapped it
    return text or f"exit {res.returncode}"


def _default_sigint() -> None:
    """In the child: Ctrl-C acts as it does on a terminal's foreground job.  A harness started
    in the background of a non-interactive shell inherits SIGINT ignored, and so would every
    run it starts (measured: 6 of 60 Ctrl-C injections were ignored that way)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_one(exp, inj: Injection, work: Path, ref: list[float] | None,
            log: Callable[[str], None] | None = None) -> Outcome:
    """Run ``exp`` with the fault ``inj``; results under ``work``."""
    out = Outcome(inj.index, inj.fault, inj.target, inj.at_iteration)
    say = log or (lambda m: None)
    if inj.fault in _ORCHESTRATOR:
        losses = _run_orchestrator(exp, inj, work, out)
        say(f"{inj.index:3d} {inj.fault:22s} at {inj.at_iteration}+{inj.delay_s}s -> {out.ended}: {out.message[:150]}")
    else:
        losses = _run_in_process(exp, inj, work, out, say)
    out.left_at_exit = {k: v for k, v in leftovers().items() if v}
    out.clean_removed = _clean()
    out.leftovers = {k: v for k, v in leftovers().items() if v}
    judge(out, exp, inj, ref, losses)
    return out


def _run_in_process(exp, inj: Injection, work: Path, out: Outcome, say: Callable[[str], None]) -> dict:
    from testbed.run.runner import RunError, TrainingRun

    disk = _mount_tmpfs(_DISK_BYTES) if inj.fault == "disk-full" else None
    try:
        results = (disk or work) / f"run-{inj.index}"
        run = TrainingRun(exp, results, log=lambda m: None)
        injector = _Injector(run, inj, fill=(lambda: _fill(disk)) if disk else None)
        run.subscribe(injector.on_message)
        t0 = time.monotonic()
        result = None
        try:
            result = run.run()
            out.ended = "completed"
        except RunError as exc:
            out.ended, out.message = "error", str(exc)
        except Exception as exc:  # anything else is a crash, never what is documented
            out.ended, out.message = "crashed", f"{type(exc).__name__}: {exc} | {traceback.format_exc()[-600:]}"
        end = time.monotonic()
        injector.finish()
        out.run_s = round(end - t0, 2)
        if injector.fired_at is not None:
            out.after_s = round(end - injector.fired_at, 2)
        if injector.error:
            out.ended, out.message = "crashed", injector.error
        iterations = [it.to_dict() for it in result.iterations] if result else \
            _read_jsonl(results / "iterations.jsonl")
        losses = _account(out, iterations, exp)
        if result and inj.fault == "link-down-short":
            out.stall_s = max(it.time_s for it in result.iterations)
        if out.ended == "completed":
            says = {f.log_says for _, f in _PROCESS_FAULTS.values()}  # what an extension logs as it degrades
            out.message = " | ".join(ln for ln in result.log if any(s in ln for s in says))[:300]
    finally:
        if disk is not None:
            _unmount(disk)
    say(f"{inj.index:3d} {inj.fault:22s} {inj.target:10s} -> {out.ended}: {out.message[:150]}")
    return losses


def _run_orchestrator(exp, inj: Injection, work: Path, out: Outcome) -> dict:
    """``testbed run`` as a process in its own process group, SIGKILLed (the command alone:
    its children live on, as after a crash) or interrupted (SIGINT to the group: Ctrl-C in
    a terminal) once ``at_iteration`` iterations are in iterations.jsonl, plus ``delay_s``
    (``at_iteration`` 0: ``delay_s`` after it started)."""
    results = work / f"run-{inj.index}"
    results.mkdir(parents=True, exist_ok=True)
    data = exp.model_dump(exclude_defaults=False)
    data["topology"] = exp.topology_file
    data["compare"] = None
    path = results / "experiment.yaml"
    path.write_text(yaml.safe_dump(data))
    progress = results / "out" / "iterations.jsonl"
    stderr = results / "stderr.txt"  # a file, not a pipe: a full pipe would block the command
    t0, fired = time.monotonic(), None
    with open(stderr, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "run", str(path), "--out", str(results / "out")],
                                stdout=subprocess.DEVNULL, stderr=err, env=_env(), start_new_session=True,
                                preexec_fn=_default_sigint)
    try:
        deadline = t0 + 300
        while inj.at_iteration and time.monotonic() < deadline and proc.poll() is None:
            if len(_read_jsonl(progress)) >= inj.at_iteration:
                break
            time.sleep(0.02)
        time.sleep(inj.delay_s)
        if proc.poll() is None:
            fired = time.monotonic()
            if inj.fault == "kill-orchestrator":
                os.kill(proc.pid, signal.SIGKILL)
            else:
                os.killpg(proc.pid, signal.SIGINT)  # the group we made for it: only what it started
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:  # it outlived every bound: end it (the verdict says so)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    end = time.monotonic()
    lines = [ln for ln in stderr.read_text(errors="replace").splitlines() if ln.strip()]
    if fired is not None:
        out.after_s = round(end - fired, 2)
    if inj.fault == "kill-orchestrator" and proc.returncode == -signal.SIGKILL:
        out.ended = "killed"
    elif proc.returncode in (130, -signal.SIGINT):
        out.ended = "interrupted"
    elif proc.returncode == 0:
        out.ended = "completed"
    elif proc.returncode > 0 and not any(ln.startswith("Traceback") for ln in lines):
        out.ended = "error"
    else:
        out.ended = "crashed"
    if out.ended != "killed":  # the command's last words (a Rich console wraps long lines: join them)
        tail = lines[-8:]
        out.message = " ".join(" ".join(tail).split())[-400:] if out.ended == "crashed" else \
            _last_message(lines)
    out.run_s = round(end - t0, 2)
    prefix = out.ended != "completed"
    return _account(out, _read_jsonl(progress), exp, prefix=prefix)


def _last_message(lines: list[str]) -> str:
    """The command's closing message: its last "error:" line and what wraps after it."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].lstrip().lower().startswith("error"):
            return " ".join(" ".join(lines[i:]).split())
    return " ".join(lines[-1].split()) if lines else ""


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass  # a line cut short
    except OSError:
        pass
    return rows


def _account(out: Outcome, iterations: list[dict], exp, prefix: bool = False) -> dict[int, float | None]:
    """Count what was recorded: every iteration 0..n-1 exactly once (a prefix of them when
    the run did not complete).  Returns each recorded iteration's loss."""
    seen = [it["iteration"] for it in iterations]
    out.iterations = len(set(seen))
    out.duplicated = sorted({k for k in seen if seen.count(k) > 1})
    top = max(seen, default=-1) + 1
    want = exp.training.iterations if out.ended == "completed" and not prefix else top
    out.lost = sorted(set(range(want)) - set(seen))
    return {it["iteration"]: it.get("loss") for it in iterations}


def judge(out: Outcome, exp, inj: Injection, ref: list[float] | None, losses: dict[int, float | None]) -> Outcome:
    """Did the run end as ``DOCUMENTED``, within the bound?  Sets ``documented`` and ``why``;
    ``losses``: what the run recorded per iteration, against ``ref`` (None: no model)."""
    why: list[str] = []
    timeout = exp.training.recv_timeout_s
    if ref is not None:
        out.wrong_loss = sorted(k for k, v in losses.items()
                                if k < len(ref) and (v is None or abs(v - ref[k]) > 1e-5 * abs(ref[k])))
    if out.lost:
        why.append(f"iterations lost: {out.lost[:5]}")
    if out.duplicated:
        why.append(f"iterations duplicated: {out.duplicated[:5]}")
    if out.wrong_loss:
        why.append(f"losses differ from the single-process run at {out.wrong_loss[:5]}")
    if out.leftovers:
        why.append(f"left behind after testbed clean: {out.leftovers}")
    if out.left_at_exit and inj.fault != "kill-orchestrator":
        why.append(f"left behind when the run ended (before testbed clean): {out.left_at_exit}")
    if "\n" in out.message:
        why.append("the error is more than one line")
    msg, f, after = out.message, inj.fault, out.after_s

    def ended(kind: str, *needles: str, within: float | None = None) -> None:
        if out.ended != kind:
            why.append(f"ended {out.ended}, not {kind}: {msg[:200]}")
            return
        for needle in needles:
            if needle not in msg:
                why.append(f"the message does not say {needle!r}: {msg[:200]}")
        if within is not None and (after is None or after > within):
            why.append(f"ended {after} s after the injection, bound {within} s")

    if out.ended == "crashed":
        why.append(f"crashed: {msg[:300]}")
    elif f == "kill-orchestrator":
        if out.ended != "killed":
            why.append(f"the run ended ({out.ended}) before the kill could land: {msg[:200]}")
    elif f == "interrupt-orchestrator":
        if out.ended == "interrupted" and not msg and out.iterations == 0 and not out.left_at_exit:
            pass  # before the command ran (Python still importing): it said nothing, and made nothing
        else:
            ended("interrupted", "interrupted (SIGINT)", "everything the testbed made was removed",
                  within=BOUND_S[f])
    elif f == "kill-worker":
        ended("error", inj.target, "died (killed by signal 9)", within=BOUND_S[f])
    elif f == "kill-delayline":
        ended("error", "delay line", "WAN link", f"{inj.target} ->", within=BOUND_S[f])
    elif f in _PROCESS_FAULTS:
        ext, fault = _PROCESS_FAULTS[f]
        ended("completed", f"{ext} {inj.target}", fault.log_says)
    elif f == "link-down-short":
        ended("completed")
        if out.stall_s is not None and not (0.8 * inj.seconds <= out.stall_s <= inj.seconds + 15):
            why.append(f"the longest iteration took {out.stall_s} s for a {inj.seconds} s outage")
    elif f == "link-down-long":
        a, b = inj.target.split("-", 1)
        ended("error", "WAN link", "is down", within=timeout + 10)
        if out.ended == "error" and f"{a} -> {b}" not in msg and f"{b} -> {a}" not in msg:
            why.append(f"the message does not name the link {a} - {b}: {msg[:200]}")
    elif f == "rate-drop":
        ended("completed")
    elif f == "disk-full":
        ended("error", "results folder", "No space left on device", within=BOUND_S[f])
    if not out.clean_removed.startswith("removed"):
        why.append(f"testbed clean failed: {out.clean_removed}")
    out.documented = not why
    out.why = "; ".join(why)
    return out


# -- a campaign ---------------------------------------------------------------------------------
def campaign(runs: int, seed: int, out_dir: Path, device: str = "cpu", faults: tuple[str, ...] = FAULTS,
             batch: int | None = None, log: Callable[[str], None] | None = None) -> list[Outcome]:
    """``runs`` injections; each outcome is appended to ``out_dir/chaos.jsonl`` as it ends, and
    injections already there are not run again (``batch``: run at most this many now)."""
    exp = chaos_experiment(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = out_dir / "chaos.jsonl"
    done = {o["index"] for o in _read_jsonl(record)}
    todo = [inj for inj in plan(runs, seed, exp, faults) if inj.index not in done][:batch]
    ref = reference(exp) if todo else None
    with tempfile.TemporaryDirectory(prefix="gtb-chaos-") as work:
        for inj in todo:
            o = run_one(exp, inj, Path(work), ref, log=log)
            with open(record, "a") as fh:
                fh.write(json.dumps(o.to_dict()) + "\n")
    return [Outcome(**o) for o in _read_jsonl(record)]


def table(outcomes: list[Outcome]) -> str:
    """The reliability table (markdown), one row per fault and a total."""
    rows = ["| fault | documented outcome | bound | injected | ended as documented | slowest end (s) | "
            "iterations lost or duplicated | wrong losses | left when the run ended | left after clean |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    total = [0] * 6
    for fault, (what, bound) in DOCUMENTED.items():
        mine = [o for o in outcomes if o.fault == fault]
        if not mine:
            continue
        counts = [len(mine), sum(o.documented for o in mine), sum(bool(o.lost or o.duplicated) for o in mine),
                  sum(bool(o.wrong_loss) for o in mine),
                  sum(bool(o.left_at_exit) for o in mine if fault != "kill-orchestrator"),
                  sum(bool(o.leftovers) for o in mine)]
        total = [t + c for t, c in zip(total, counts)]
        slowest = max((o.after_s for o in mine if o.after_s is not None), default=None)
        n, ok, lost, wrong, at_exit, left = counts
        at_exit_cell = "(expected)" if fault == "kill-orchestrator" else str(at_exit)
        rows.append(f"| {fault} | {what} | {bound} | {n} | {ok} | {'' if slowest is None else slowest} | {lost} | "
                    f"{wrong} | {at_exit_cell} | {left} |")
    rows.append("| **all** | | | " + " | ".join(f"**{t}**" for t in total[:2]) + " | | "
                + " | ".join(f"**{t}**" for t in total[2:]) + " |")
    return "\n".join(rows)


def summary_line(outcomes: list[Outcome]) -> str:
    ok = sum(o.documented for o in outcomes)
    return f"{ok}/{len(outcomes)} injected faults ended as documented"

