"""A DeepSpeed user's training script, unchanged except for the import line."""
import argparse
import json
import os

import torch

import deepshard as deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save_dir", type=str, required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
engine, optimizer, _, lr_scheduler = deepspeed.initialize(args=args, model=model,
                                                          model_parameters=model.parameters())
assert isinstance(engine, deepspeed.DeepSpeedEngine)
g = torch.Generator().manual_seed(engine.global_rank)
x = torch.randn(64, 16, generator=g)
y = x.sum(dim=1, keepdim=True)
micro = engine.train_micro_batch_size_per_gpu()
model_dtype = engine.get_data_types()[0]  # the engine feeds inputs to the model as given: cast them
losses = []
for step in range(args.steps * engine.gradient_accumulation_steps()):
    i = (step * micro) % 64
    loss = torch.nn.functional.mse_loss(engine(x[i:i + micro].to(model_dtype)).float(), y[i:i + micro])
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
engine.save_checkpoint(args.save_dir, client_state={"losses": losses})
_, client = engine.load_checkpoint(args.save_dir)
print(json.dumps({"rank": engine.global_rank, "local_rank": args.local_rank, "first": losses[0],
                  "last": losses[-1], "steps": engine.global_steps, "lr": engine.get_lr()[0],
                  "client_first": client["losses"][0], "client_len": len(client["losses"]), "world": engine.dp_world_size,
                  "env_rank": os.environ["RANK"]}), flush=True)
