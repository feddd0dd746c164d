"""Launcher e2e helper: each rank joins the world (gloo), then prints one JSON line with its arguments and
the variables a launcher sets, so a test can compare launchers."""
import json
import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
names = sorted(k for k in os.environ if k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_")) or k in (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
    "CROSS_RANK", "CROSS_SIZE", "DEEPSHARD_RESTART_COUNT"))
line = "ENV " + json.dumps({"argv": sys.argv[1:], "env": {k: os.environ[k] for k in names}}) + "\n"
# one write of under PIPE_BUF bytes: torchrun's ranks share one stdout pipe, and print() can split a line
# into two writes that the other rank's line lands between
os.write(1, line.encode())
dist.destroy_process_group()
