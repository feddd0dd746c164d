"""A DeepSpeed-style script for `deepshard dryrun`: ZeRO (stage from argv), a tiny MLP, a loss averaged over
the ranks with torch.distributed (the dry run must make it plausible), and one checkpoint save."""
import argparse
import os

import torch
import torch.distributed as dist

import deepshard as deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=2)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--save_dir", default="checkpoints")
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": args.stage}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for step in range(args.steps):
    x, y = torch.randn(2, 16), torch.randint(0, 4, (2,))
    loss = torch.nn.functional.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    if abs(mean.item() - loss.item()) > 1e-4 * max(1.0, abs(loss.item())):
        raise SystemExit(f"implausible mean loss {mean.item()} for a local loss of {loss.item()}")
engine.save_checkpoint(args.save_dir, tag="end")
print(f"script done on rank {dist.get_rank()} of {dist.get_world_size()}, RANK={os.environ['RANK']}")
