"""Launcher e2e helper: initialize through deepshard, all-reduce once, and end at once, leaving the
process group to deepshard's exit-time teardown (the case that used to abort with SIGABRT)."""
import torch
import torch.distributed as dist

import deepshard

deepshard.init_distributed(verbose=False)
value = torch.ones(2)
dist.all_reduce(value)
assert value[0].item() == dist.get_world_size()
