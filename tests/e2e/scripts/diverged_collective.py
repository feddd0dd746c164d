"""Launcher e2e helper: a ZeRO-1 job whose ranks diverge. Rank 0 reduces its gradients; rank 1 skips the
backward and saves a checkpoint, so the two wait in different collectives. The watchdog (3 s here) must
end the job with a diagnosis naming both positions, and the launcher's report must show it."""
import os
import sys

import torch

import deepshard

os.environ.setdefault("DEEPSHARD_TIMEOUT", "0.05")  # 3 s
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
engine, *_ = deepshard.initialize(model=model, config=config)
rank = int(os.environ["RANK"])
x = torch.randn(2, 8)
loss = engine(x).pow(2).mean()
if rank == 1:
    engine.save_checkpoint(sys.argv[-1], tag="diverged")  # after --local_rank=N
else:
    engine.backward(loss)
    engine.step()
print(f"rank {rank} finished without noticing", flush=True)
