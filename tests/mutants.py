"""The mutation check: realistic bugs, put one at a time into a copy of the project, each run
against the tests that should catch it.

    .venv/bin/python tests/mutants.py                 # every mutant (about 10 min here)
    .venv/bin/python tests/mutants.py rate gradient   # those named
    .venv/bin/python tests/mutants.py --list

How it fits: each ``Mutant`` names one source file, an exact piece of it and what replaces it
(the piece must occur exactly once, so that a change to the code fails the check loudly
instead of testing nothing), and the tests that must fail on it.  The project's tracked and
untracked files (not ``.venv``, not what git ignores) are copied to a temporary folder, the
mutant applied there, and pytest run there: the copy's ``testbed`` is what its tests and every
process they start import (``procutil.python_env`` puts the copy first).  A mutant is killed
when those tests fail; a survivor is a hole in the suite.  Prints a table, writes
``results/mutants.json``, exits 1 when any mutant survives.  Needs root and the network tests'
kernel features (as the suite does); runs one mutant at a time, so nothing else should time
links meanwhile.

mutmut and cosmic-ray mutate operators in pure modules at random; what matters here is a
dozen specific physical and numerical bugs across the delay line, tc, the trainer, the
simulator and the agents, each with its own slow network test, so the list is written by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


WAN = "tests/test_wan_link.py"
MUTANTS = [
    Mutant("delay", "testbed/net/delayline.py", "due = now + lane.delay_s\n", "due = now + lane.delay_s + 0.001\n",
           (f"{WAN}::test_min_rtt_matches_configured_delay[tun-5]", f"{WAN}::test_min_rtt_matches_configured_delay[tun-25]"),
           "1 ms more on every packet in the delay line"),
    Mutant("rate", "testbed/net/shaping.py", "return int(self.rate_mbps * 1e6 / 8)",
           "return int(self.rate_mbps * 1e6 / 8 * 0.95)",
           (f"{WAN}::test_goodput_of_100_mbit_link[tun]",), "HTB at 0.95 of the link's rate"),
    Mutant("rate-high", "testbed/net/shaping.py", "return int(self.rate_mbps * 1e6 / 8)",
           "return int(self.rate_mbps * 1e6 / 8 * 1.10)",
           (f"{WAN}::test_goodput_of_100_mbit_link[tun]",), "HTB at 1.10 of the link's rate"),
    Mutant("jitter", "testbed/net/delayline.py", "        if lane.jitter_s:\n            due +=",
           "        if False:\n            due +=", (f"{WAN}::test_jitter_spreads_delay_without_reordering[tun]",),
           "jitter never applied"),
    Mutant("jitter-runtime", "testbed/net/delayline.py",
           'lane.jitter_s = float(spec["jitter_ms"]) / 1000.0', "pass",
           (f"{WAN}::test_runtime_change_of_loss_and_jitter_takes_effect[tun-delayline]",),
           "a runtime jitter change ignored"),
    Mutant("loss-delayline", "testbed/net/delayline.py", "rng.random() < lane.loss:", "rng.random() < lane.loss / 2:",
           (f"{WAN}::test_five_percent_loss[tun-delayline]",), "the delay line's loss halved"),
    Mutant("loss-iptables", "testbed/net/network.py", "--probability {loss:.6f}", "--probability {loss / 2:.6f}",
           (f"{WAN}::test_five_percent_loss[tun-iptables]",), "iptables' loss halved"),
    Mutant("loss-runtime", "testbed/net/network.py", "lambda: self._set_iptables_loss(new.loss),",
           "lambda: None,", (f"{WAN}::test_runtime_change_of_loss_and_jitter_takes_effect[tun-iptables]",),
           "a runtime loss change ignored (iptables)"),
    Mutant("gradient", "testbed/train/torch_compute.py",
           "            g.copy_(flat[off:off + g.numel()].view_as(g))\n",
           "            g.copy_(flat[off:off + g.numel()].view_as(g) / self.replicas)\n",
           ("tests/test_trainer.py::test_loss_parity_with_a_single_process_run",),
           "the data-parallel gradient divided by the replica count twice"),
    Mutant("sim-link", "testbed/sim/build.py",
           'Link(f"{s}->{d}", capacity(p) / share, p.delay_ms / 1000.0)',
           'Link(f"{s}->{d}", capacity(p) / share / 1.1, p.delay_ms / 1000.0 * 1.1)',
           ("tests/test_sim.py",), "every simulated WAN transfer 10% slower"),
    Mutant("sim-priority-walk", "testbed/sim/engine.py", "            if not left > 0:\n                break\n", "",
           ("tests/test_sim_rerating.py",),
           "strict priority visits every waiting flow behind a full link (the same rates, the speed-up gone)"),
    Mutant("sim-rerate-settle", "testbed/sim/engine.py", "                    f.updated = now  # nothing has moved since it last had one\n",
           "                    pass\n", ("tests/test_sim_rerating.py",),
           "a flow that gets a rate again is advanced from when it last had one"),
    Mutant("atlas-order", "agents/atlas/agent.py", "order=link.order, lease_s=lease",
           "order=sorted(link.order), lease_s=lease",
           ("tests/test_atlas_run.py::test_the_order_follows_the_workload_a_slow_pipeline_first",),
           "the Atlas agent sends the plan's order sorted"),
    Mutant("gateway-order", "testbed/net/delayline.py",
           "name = owner if self.queues[owner] else next((n for n in self.order if self.queues[n]), None)",
           "name = next((n for n in self.names if self.queues[n]), None)",
           ("tests/test_temporal_sharing.py::test_two_backlogged_pipelines_swap_shares_when_the_order_swaps",),
           "the gateway's scheduler ignores the order"),
    Mutant("turns-ignored", "testbed/train/worker.py", "    if turns is None:\n        return None\n    return TurnClient(",
           "    if True:\n        return None\n    return TurnClient(",
           ("tests/test_atlas_run.py::test_turns_at_the_senders_give_each_direction_to_one_pipeline_at_a_time",),
           "the trainer's channels never ask for a turn (enforce: senders does nothing)"),
    Mutant("turns-more", "testbed/net/sendturns.py", "        if more:  # its next message is ready",
           "        if False:  # its next message is ready", ("tests/test_sendturns.py",),
           "a sender with its next message ready goes to the back (pipelines alternate message by message)"),
    Mutant("turns-width", "testbed/sim/engine.py",
           "                if held and used.get(key, 0.0) >= link.bandwidth * (1 - 1e-9):",
           "                if held:", ("tests/test_atlas.py",),
           "the simulator's turns go to one pipeline at a time however little it can carry"),
    Mutant("tail-loss-queue", "testbed/sim/build.py",
           "            srtt = rtt + queue / (link.bandwidth * share)  # the full queue's delay in every sample",
           "            srtt = rtt", ("tests/test_sim.py",),
           "the simulator's tail-loss probe waits on the bare round trip, not the full queue's"),
    Mutant("bubbletea-count", "agents/bubbletea/controller.py", '        self.counts["rejected"] += 1\n', "\n",
           ("tests/test_bubbletea.py",), "a BubbleTea rejection left out of the count"),
    Mutant("waitboard-bell", "testbed/train/waitboard.py", "                os.write(self._bell, b\"\\1\")\n",
           "                pass\n", ("tests/test_bubbletea.py",),
           "the wait board's doorbell never rung: a job sent ahead starts late or not at all"),
    Mutant("titan-objective", "agents/titan/lp.py", "np.tile(np.eye(1, S).ravel(), n_p)",
           "np.concatenate((np.eye(1, S).ravel(), np.zeros((n_p - 1) * S)))",
           ("tests/test_titan.py",), "Titan-Next minimises one link's peak, not the sum"),
]


def _copy(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = REPO / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def _apply(root: Path, mutant: Mutant) -> None:
    path = root / mutant.path
    text = path.read_text()
    n = text.count(mutant.old)
    if n != 1:
        raise SystemExit(f"error: mutant {mutant.name}: {mutant.path} holds its piece {n} times (want once): "
                         f"the code changed, update tests/mutants.py")
    path.write_text(text.replace(mutant.old, mutant.new))


def run(mutant: Mutant) -> dict:
    with tempfile.TemporaryDirectory(prefix="gtb-mutant-") as tmp:
        root = Path(tmp)
        _copy(root)
        _apply(root, mutant)
        env = dict(os.environ, PYTHONPATH=str(root))
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests],
                             cwd=root, env=env, capture_output=True, text=True)
        took = time.monotonic() - t0
    tail = [ln for ln in res.stdout.splitlines() if ln.strip()][-1:] or [""]
    # pytest exits 1 when tests failed; anything else (2-5) is not a kill but a broken check
    status = {0: "SURVIVED", 1: "killed"}.get(res.returncode, f"error {res.returncode}")
    return {"mutant": mutant.name, "what": mutant.what, "status": status, "seconds": round(took, 1),
            "tests": list(mutant.tests), "pytest": tail[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args()
    known = {m.name: m for m in MUTANTS}
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:16} {m.what}")
        return
    unknown = [n for n in args.names if n not in known]
    if unknown:
        raise SystemExit(f"error: no mutant {', '.join(unknown)} (tests/mutants.py --list)")
    chosen = [known[n] for n in args.names] or MUTANTS
    for m in chosen:  # every piece before anything runs
        text = (REPO / m.path).read_text()
        if text.count(m.old) != 1:
            raise SystemExit(f"error: mutant {m.name}: {m.path} holds its piece {text.count(m.old)} times (want once)")
    rows, t0 = [], time.monotonic()
    for i, m in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {m.name}: {m.what} ...", file=sys.stderr, flush=True)
        rows.append(run(m))
        print(f"    {rows[-1]['status']} in {rows[-1]['seconds']} s ({rows[-1]['pytest']})", file=sys.stderr, flush=True)
    total = time.monotonic() - t0
    width = max(len(r["mutant"]) for r in rows)
    print(f"{'mutant':{width}}  {'status':9} {'s':>6}  what")
    for r in rows:
        print(f"{r['mutant']:{width}}  {r['status']:9} {r['seconds']:6.1f}  {r['what']}")
    killed = sum(r["status"] == "killed" for r in rows)
    print(f"{killed}/{len(rows)} killed in {total:.0f} s")
    out = REPO / "results" / "mutants.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "seconds": round(total, 1), "mutants": rows},
                              indent=1))
    sys.exit(0 if killed == len(rows) else 1)


if __name__ == "__main__":
    main()
