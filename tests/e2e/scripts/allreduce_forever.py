"""Launcher e2e helper: each rank prints its pid, then all-reduces in a loop until a peer vanishes."""
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} pid={os.getpid()} sleeping", flush=True)
t = torch.ones(4)
for _ in range(600):
    dist.all_reduce(t)
    time.sleep(0.05)
