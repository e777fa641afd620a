"""D two-stage pipelines that cross one WAN link: a plain torch.distributed (gloo) job.

Run it with ``testbed torchrun`` (or torchrun on a real cluster): ``--ranks A=D,B=D`` puts
stage 0 of pipeline i on rank i (DC A) and stage 1 on rank D + i (DC B).  Each pipeline
moves real tensors point to point (``dist.send`` / ``dist.recv``); compute is a sleep of
``--compute-ms`` (the time a GPU would take: this machine's shared cores cannot time it).

``--mode pingpong`` (GPipe-like, a microbatch at a time): stage 0 computes, sends an
activation of ``--mb`` MB to stage 1, which computes and sends a gradient of the same size
back; one round = both transfers and both computes.  All pipelines start together (a
barrier), so under fair sharing their transfers collide.  ``--mode stream``: stage 0 sends
``--mb`` MB messages back to back for ``--seconds`` (a backlogged pipeline), then one more.

Rank 0 prints ``RESULT {json}`` and writes it to ``--out``: per pipeline its round times
(pingpong) or the bytes stage 1 received in the window (stream), and the job's wall time.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["pingpong", "stream"], default="pingpong")
p.add_argument("--mb", type=float, default=1.0, help="message size, MB")
p.add_argument("--compute-ms", type=float, default=100.0)
p.add_argument("--rounds", type=int, default=10)
p.add_argument("--warmup", type=int, default=2, help="rounds not counted")
p.add_argument("--seconds", type=float, default=4.0, help="stream: how long stage 0 sends")
p.add_argument("--out")
a = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if world % 2:
    raise SystemExit(f"pipelines_job: an even world size expected (two stages per pipeline), got {world}")
D = world // 2
pipe, stage = rank % D, rank // D
peer = pipe + D if stage == 0 else pipe
nbytes = int(a.mb * 1e6)
buf = torch.zeros(nbytes, dtype=torch.uint8)
compute = a.compute_ms / 1000
mine: dict = {"pipeline": pipe, "stage": stage, "dc": os.environ.get("TESTBED_DC")}

dist.barrier()
t_start = time.time()
if a.mode == "pingpong":
    rounds = []
    for i in range(a.warmup + a.rounds):
        if i == a.warmup:
            dist.barrier()  # the counted rounds start together: lockstep, as DP pipelines do
        t0 = time.time()
        if stage == 0:
            time.sleep(compute)
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            time.sleep(compute)
            dist.send(buf, peer)
        if i >= a.warmup:
            rounds.append(time.time() - t0)
    mine["rounds_s"] = rounds
    mine["counted_s"] = sum(rounds)
else:
    # the first byte of each message says whether another follows (no separate small message:
    # a packet that small would bypass the pipelines' queues at the gateway and overtake its flow)
    deadline = time.time() + a.seconds
    received, times = 0, []
    if stage == 0:
        while time.time() < deadline:
            buf[0] = 1
            dist.send(buf, peer)
        buf[0] = 0
        dist.send(buf, peer)
    else:
        while True:
            dist.recv(buf, peer)
            now = time.time()
            if now <= deadline:
                received += nbytes
            times.append(now - t_start)
            if not buf[0]:
                break
        mine["bytes_in_window"] = received
        mine["arrivals_s"] = [round(t, 4) for t in times]
mine["wall_s"] = time.time() - t_start

everyone = [None] * world
dist.all_gather_object(everyone, mine)
if rank == 0:
    result = {"mode": a.mode, "pipelines": D, "mb": a.mb, "compute_ms": a.compute_ms, "ranks": everyone}
    if a.mode == "pingpong":
        firsts = [r for r in everyone if r["stage"] == 0]
        result["round_s"] = {f"p{r['pipeline']}": round(sum(r["rounds_s"]) / len(r["rounds_s"]), 4) for r in firsts}
        result["job_round_s"] = round(max(r["counted_s"] for r in firsts) / a.rounds, 4)
    else:
        result["bytes_in_window"] = {f"p{r['pipeline']}": r["bytes_in_window"] for r in everyone if r["stage"] == 1}
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "ranks"}), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh)
dist.barrier()
dist.destroy_process_group()
