"""Launcher e2e helper: a ZeRO-3 job of 3 iterations where rank 1 leaves the others behind. ``skip``: rank 1
skips iteration 1 and ends its loop (exit 0) while rank 0 still runs its third; ``crash``: rank 1 raises in
iteration 1 while rank 0 waits in an all-reduce of its own (it prints the backend's lost-connection
traceback and lingers). The launcher's report must come first and name rank 1."""
import os
import sys
import time
import traceback

import torch

import deepshard

os.environ.setdefault("DEEPSHARD_TIMEOUT", "0.1")  # 6 s
mode = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]  # the launcher may pass --local_rank first
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
engine, *_ = deepshard.initialize(model=model, config=config)
rank = int(os.environ["RANK"])
for iteration in range(3):
    if rank == 1 and iteration == 1:
        if mode == "crash":
            raise RuntimeError("rank 1 fails on purpose in iteration 1")
        continue
    if rank == 0 and iteration == 1 and mode == "crash":
        try:
            torch.distributed.all_reduce(torch.ones(4))
        except RuntimeError:
            traceback.print_exc()
            time.sleep(30)
    loss = engine(torch.randn(2, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()
print(f"rank {rank} finished its loop", flush=True)
