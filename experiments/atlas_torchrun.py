"""Atlas for any job, measured: fair vs temporal sharing of one WAN link among a torchrun
job's pipelines, at equal buffers.

One lab (east and west, 4 hosts each, one link of ``--rate`` Mbit/s and ``--delay`` ms each
way, its queue set to ``--queue`` bytes in each direction for every variant) runs
experiments/pipelines_job.py in ping-pong mode (D two-stage pipelines, stage 0 in east,
stage 1 in west; a round = compute, a ``--mb`` MB activation east->west, compute, a gradient
back) through ``testbed.run.torchrun.run_job``, as ``testbed torchrun`` does:

* fair: nothing changed (one FIFO of ``--queue`` bytes per direction, TCP shares it);
* temporal: ``--with atlas`` with the pipelines p0..p{D-1} in that order, strict priority,
  ``queue: share`` (the same ``--queue`` bytes split among the pipelines: equal buffers).

For each variant: the job's round time, the link's drops (HTB for fair, the delay line's
per-pipeline queues for temporal), the hosts' retransmission timeouts, retransmitted
segments and tail-loss probes (``nstat`` in each host before and after), and for temporal
the owner's share of the link while two or more pipelines are backlogged.  Prints a table
and writes JSON (``--out``).

    python experiments/atlas_torchrun.py [--pipelines 2 4] [--rounds 8] [--out FILE]

Run as root, under the shared lock (``flock /tmp/gtb-net.lock ...``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
from pathlib import Path

from testbed.run.hooks import job_extensions
from testbed.run.lab import Lab
from testbed.run.torchrun import run_job
from testbed.spec.topology import parse_topology

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "experiments" / "pipelines_job.py"
_NSTAT = ["TcpExtTCPTimeouts", "TcpRetransSegs", "TcpExtTCPLossProbes"]


def _nstat(lab: Lab, hosts: list[tuple[str, int]]) -> dict[str, dict[str, int]]:
    out = {}
    for dc, i in hosts:
        res = lab.exec(dc, i, ["nstat", "-asz", *_NSTAT], timeout=10)
        vals = {}
        for line in res.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] in _NSTAT:
                vals[parts[0]] = int(parts[1])
        out[f"{dc}:{i}"] = vals
    return out


def _delta(before: dict, after: dict) -> dict[str, int]:
    tot = {k: 0 for k in _NSTAT}
    for host, vals in after.items():
        for k in _NSTAT:
            tot[k] += vals.get(k, 0) - before[host].get(k, 0)
    return tot


def run_variant(lab: Lab, d: int, sharing: str, args, work: Path) -> dict:
    hosts = [("east", i) for i in range(d)] + [("west", i) for i in range(d)]
    exts = []
    if sharing == "temporal":
        pipes = ", ".join(f"p{i}: [{i}, {d + i}]" for i in range(d))
        exts = job_extensions([f"atlas={{pipelines: {{{pipes}}}, queue: share}}"])
    report = work / f"{sharing}-{d}.json"
    before = _nstat(lab, hosts)
    res = run_job(lab, [("east", d), ("west", d)], JOB,
                  ["--mode", "pingpong", "--mb", str(args.mb), "--compute-ms", str(args.compute_ms),
                   "--rounds", str(args.rounds), "--warmup", "1", "--out", str(report)],
                  work / f"{sharing}-{d}", echo=False, extensions=exts, timeout_s=300, master_port=29500 + d)
    if res.exit_code:
        raise SystemExit(f"{sharing} D={d}: {res.message}")
    tcp = _delta(before, _nstat(lab, hosts))
    job = json.loads(report.read_text())
    links = res.metrics["links"]
    row = {"pipelines": d, "sharing": sharing, "round_s": job["job_round_s"], "round_s_per_pipeline": job["round_s"],
           "wall_s": res.metrics["job"]["wall_s"], "tcp": tcp,
           "htb_drops": {k: v["drops"] for k, v in links.items()},
           "link_queue_bytes": {k: v["settings"]["queue_bytes"] for k, v in links.items()}}
    if sharing == "temporal":
        atlas = res.metrics["extensions"]["atlas"]
        row["atlas"] = {name: {"queue_bytes_per_pipeline": x["queue_bytes_per_pipeline"], "drops": x["drops"],
                               "owner_share": {k: x["owner_share"][k] for k in ("n", "mean", "p10")}}
                        for name, x in atlas["links"].items()}
        row["atlas_problems"] = atlas["problems"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipelines", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rate", type=float, default=50.0, help="Mbit/s each way")
    p.add_argument("--delay", type=float, default=10.0, help="one-way ms")
    p.add_argument("--queue", type=int, default=1_000_000, help="bytes per direction, every variant")
    p.add_argument("--mb", type=float, default=1.0)
    p.add_argument("--compute-ms", type=float, default=160.0)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", type=Path, default=REPO / "results" / "atlas_torchrun.json")
    args = p.parse_args()
    topo = parse_topology({"name": "atlas-torchrun", "dcs": [{"name": "east", "hosts": max(args.pipelines)},
                                                             {"name": "west", "hosts": max(args.pipelines)}],
                           "wan": [{"a": "east", "b": "west", "delay_ms": args.delay, "rate_mbps": args.rate,
                                    "queue_bytes": args.queue}]})
    transfer_s = args.mb * 8 / args.rate  # one message at the link's rate
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Lab(topo, check=False) as lab:
        for d in args.pipelines:
            for sharing in ("fair", "temporal"):
                row = run_variant(lab, d, sharing, args, Path(tmp))
                rows.append(row)
                print(json.dumps(row), flush=True)
    c, t = args.compute_ms / 1000, transfer_s
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": platform.node(), "cpus": __import__("os").cpu_count(),
           "setup": {"rate_mbps": args.rate, "delay_ms": args.delay, "queue_bytes_per_direction": args.queue,
                     "message_mb": args.mb, "compute_ms": args.compute_ms, "rounds": args.rounds,
                     "transfer_s_at_rate": round(t, 4)},
           "rows": rows, "gain": {}}
    print(f"\n{args.rate:g} Mbit/s, {args.delay:g} ms one way, {args.mb:g} MB messages (t = {t * 1e3:.0f} ms at the rate), "
          f"C = {args.compute_ms:g} ms, queue {args.queue} B per direction in both variants")
    print(f"{'D':>2} {'sharing':>9} {'round s':>8} {'ideal s':>8} {'RTOs':>5} {'retrans':>8} {'TLPs':>5} "
          f"{'drops':>6} {'owner share mean/p10 (n)':>26}")
    for r in rows:
        d = r["pipelines"]
        ideal = 2 * c + 2 * d * t if r["sharing"] == "fair" else max(2 * c + 2 * t, d * t)
        r["ideal_round_s"] = round(ideal + 2 * args.delay / 1000, 4)
        if "atlas" in r:
            drops = sum(sum(x["drops"].values()) for x in r["atlas"].values())
            sh = r["atlas"]["east->west"]["owner_share"]
            share = f"{sh['mean']}/{sh['p10']} ({sh['n']})"
        else:
            drops, share = sum(r["htb_drops"].values()), "-"
        print(f"{d:>2} {r['sharing']:>9} {r['round_s']:>8.3f} {r['ideal_round_s']:>8.3f} {r['tcp']['TcpExtTCPTimeouts']:>5} "
              f"{r['tcp']['TcpRetransSegs']:>8} {r['tcp']['TcpExtTCPLossProbes']:>5} {drops:>6} {share:>26}")
    for d in args.pipelines:
        fair = next(r for r in rows if r["pipelines"] == d and r["sharing"] == "fair")
        temp = next(r for r in rows if r["pipelines"] == d and r["sharing"] == "temporal")
        out["gain"][str(d)] = {"measured": round(fair["round_s"] / temp["round_s"], 3),
                               "ideal": round(fair["ideal_round_s"] / temp["ideal_round_s"], 3)}
        print(f"D={d}: temporal over fair {out['gain'][str(d)]['measured']:.2f}x (ideal {out['gain'][str(d)]['ideal']:.2f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
