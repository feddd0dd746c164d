"""Launcher e2e helper: every rank all-reduces (rank + 1) with gloo and checks the sum for 2 ranks."""
import argparse
import os

import torch
import torch.distributed as dist

try:
    from deepshard import init_distributed
except ImportError:  # the package's public __init__ may not re-export it yet
    from deepshard.distributed import init_distributed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=None)
parser.add_argument("--expect_local_rank_arg", action="store_true")
args, rest = parser.parse_known_args()

init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
expected = world * (world + 1) / 2
if value.item() != expected:
    raise SystemExit(f"rank {rank}: all_reduce gave {value.item()}, expected {expected}")
print(f"rank {rank} ok local_rank={args.local_rank} env_local_rank={os.environ['LOCAL_RANK']} "
      f"world={world} omp={os.environ.get('OMP_NUM_THREADS')} extra={rest}", flush=True)
dist.destroy_process_group()
