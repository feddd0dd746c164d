"""Launcher e2e helper for restarts: every rank meets through ``deepshard.init_distributed``, all-reduces a
few times, then says when its attempt was ready, where it met and which machine it shares with which ranks;
rank 1 exits with code 3 once every rank has said so, on every attempt before ``--attempts`` - 1 (the last
ends cleanly)."""
import argparse
import os
import time

import torch
import torch.distributed as dist

import deepshard

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--attempts", type=int, default=2)
args = parser.parse_args()
deepshard.init_distributed(verbose=False)
rank, world, attempt = dist.get_rank(), dist.get_world_size(), int(os.environ["DEEPSHARD_RESTART_COUNT"])
for _ in range(3):
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == world, (total.item(), world)
node = " ".join(f"{k}={os.environ[k]}" for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"))
print(f"rank {rank} attempt {attempt} ready at {time.time():.3f} port {os.environ['MASTER_PORT']} {node}", flush=True)
dist.barrier()  # every rank has printed its line before rank 1 fails (else the launcher may stop rank 0 first)
if rank == 1 and attempt < args.attempts - 1:
    print(f"rank 1 attempt {attempt} exits 3 at {time.time():.3f}", flush=True)
    os._exit(3)
dist.barrier()
dist.destroy_process_group()
