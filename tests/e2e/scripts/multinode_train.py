"""Multi-node launcher e2e helper: a DeepSpeed-style training loop that resumes from its checkpoint.

Every rank trains on its own data (seeded by its global rank), so the ranks end with the same
weights only if their gradients were really averaged across every node. It loads the latest
checkpoint of ``--save_dir`` at start (none on a first run) and saves one after every step. With
``--fail_rank R --fail_after S``, rank R calls ``os._exit(3)`` right after saving step S, on the first
attempt only (``DEEPSHARD_RESTART_COUNT`` 0), or on every attempt with ``--fail_always``.
"""
import argparse
import json
import os
import time

import torch

import deepshard as deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--save_dir", type=str, required=True)
parser.add_argument("--fail_rank", type=int, default=-1)
parser.add_argument("--fail_after", type=int, default=-1)
parser.add_argument("--fail_always", action="store_true")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

config = {"train_batch_size": 4 * int(os.environ["WORLD_SIZE"]), "train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "steps_per_print": 1000}
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                       config=config)
restart = int(os.environ.get("DEEPSHARD_RESTART_COUNT", "-1"))
loaded, _ = engine.load_checkpoint(args.save_dir)
start_step = engine.global_steps
print(f"rank {engine.global_rank} attempt {restart} starts at step {start_step} "
      f"(checkpoint {'none' if loaded is None else os.path.basename(loaded)})", flush=True)
g = torch.Generator().manual_seed(1000 + engine.global_rank)
x = torch.randn(64, 8, generator=g)
y = x.sum(dim=1, keepdim=True)
while engine.global_steps < args.steps:
    i = (engine.global_steps * 4) % 64
    loss = torch.nn.functional.mse_loss(engine(x[i:i + 4]), y[i:i + 4])
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.save_dir)
    if (engine.global_rank == args.fail_rank and engine.global_steps == args.fail_after
            and (restart == 0 or args.fail_always)):
        print(f"rank {engine.global_rank} dying at step {engine.global_steps} at {time.time():.3f}", flush=True)
        os._exit(3)
checksum = sum(float(p.detach().double().sum()) for p in engine.module.parameters())
print(json.dumps({"rank": engine.global_rank, "world": engine.dp_world_size, "restart": restart,
                  "start_step": start_step, "steps": engine.global_steps, "checksum": checksum,
                  "local_rank": args.local_rank, "cross_rank": os.environ.get("CROSS_RANK"),
                  "node": {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                                          "CROSS_SIZE")},
                  "cores": sorted(os.sched_getaffinity(0))}), flush=True)
