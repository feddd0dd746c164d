"""Launcher e2e helper: the script's last act is a collective on a tensor nothing else holds, so the gloo
worker thread that finishes it releases the last reference and needs the GIL just as the main thread
reaches interpreter exit (the abort that deepshard's exit-time settling prevents). ``--old`` swaps the
settling for a bare ``destroy_process_group`` at exit, the behaviour before the fix."""
import atexit
import sys

import torch
import torch.distributed as dist

import deepshard
from deepshard.utils import teardown

deepshard.init_distributed(verbose=False)
if "--old" in sys.argv:
    atexit.unregister(teardown.destroy_if_initialized)
    atexit.register(dist.destroy_process_group)
for _ in range(3):
    dist.all_reduce(torch.ones(4096))
