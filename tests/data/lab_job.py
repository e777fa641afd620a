"""A tiny torch.distributed job for tests/test_lab.py, run by ``testbed torchrun``.

Every rank all-reduces a small tensor and checks the sum (the job works across the WAN);
with ``--send-mb S`` rank 0 also sends S MB to the last rank and rank 1 sends S/2 MB to rank 0
(point to point, so the bytes each WAN direction must carry are known), and rank 0 writes
what was sent, by (source DC, destination DC), to ``--report``.  ``--fail-rank R`` makes rank
R exit with ``--exit-code``, ``--kill-rank R`` kills rank R with SIGKILL, ``--sleep S``
holds every rank S seconds after the all-reduce.
"""

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--send-mb", type=float, default=0.0)
p.add_argument("--report")
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--exit-code", type=int, default=3)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--sleep", type=float, default=0.0)
a = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
assert t[0].item() == world * (world + 1) / 2, t[0].item()
print(f"rank {rank} of {world} in {os.environ['TESTBED_DC']} ({os.environ['GLOO_SOCKET_IFNAME']}): all_reduce ok",
      flush=True)
if rank == a.fail_rank:
    sys.exit(a.exit_code)
if rank == a.kill_rank:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(a.sleep)
if a.send_mb > 0 and world >= 3:
    big, half = int(a.send_mb * 1e6), int(a.send_mb * 1e6 / 2)
    if rank == 0:
        dist.send(torch.zeros(big, dtype=torch.uint8), dst=world - 1)
        dist.recv(torch.empty(half, dtype=torch.uint8), src=1)
    elif rank == world - 1:
        dist.recv(torch.empty(big, dtype=torch.uint8), src=0)
    elif rank == 1:
        dist.send(torch.zeros(half, dtype=torch.uint8), dst=0)
    dcs = [None] * world
    dist.all_gather_object(dcs, os.environ["TESTBED_DC"])
    if rank == 0 and a.report:
        with open(a.report, "w") as fh:
            json.dump({f"{dcs[0]}->{dcs[world - 1]}": big, f"{dcs[1]}->{dcs[0]}": half}, fh)
dist.barrier()
dist.destroy_process_group()
