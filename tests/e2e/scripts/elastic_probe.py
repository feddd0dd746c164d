"""Launcher e2e helper for elastic runs: every rank all-reduces a one every 0.2 s for ``--steps`` steps and
says which world and attempt it is in (the world may shrink between attempts)."""
import argparse
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()
dist.init_process_group("gloo")
rank, world, attempt = dist.get_rank(), dist.get_world_size(), os.environ["TORCHELASTIC_RESTART_COUNT"]
node = " ".join(f"{k}={os.environ[k]}" for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"))
print(f"rank {rank} of {world} attempt {attempt} pid={os.getpid()} sleeping {node}", flush=True)
for _ in range(args.steps):
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == world, (total.item(), world)
    time.sleep(0.2)
print(f"rank {rank} of {world} attempt {attempt} done {node}", flush=True)
dist.destroy_process_group()
