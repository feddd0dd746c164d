"""A DeepSpeed-style training script for the autotuner's end-to-end test: an MLP of 100k parameters,
random data, the micro batch the config gives, 30 steps (a trial ends earlier, at end_profile_step).
Writes ``trained.json`` (the config it ran with) next to the config when it finishes on its own. With
``AUTOTUNE_OOM_STAGE=N`` in the environment, a run at ZeRO stage N fails as an out-of-memory would."""
import argparse
import json
import os
from pathlib import Path

import torch

import deepshard

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser = deepshard.add_config_arguments(parser)
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 768), torch.nn.GELU(), torch.nn.Linear(768, 64))
engine, _, _, _ = deepshard.initialize(args=args, model=model)
micro = engine.train_micro_batch_size_per_gpu()
if os.environ.get("AUTOTUNE_OOM_STAGE") == str(engine.zero_optimization_stage()):
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated by the test)")
for step in range(30 * engine.gradient_accumulation_steps()):
    x = torch.randn(micro, 64)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
if engine.global_rank == 0:
    out = Path(args.deepspeed_config).parent / "trained.json"
    out.write_text(json.dumps({"stage": engine.zero_optimization_stage(), "micro": micro,
                               "gas": engine.gradient_accumulation_steps(), "steps": engine.global_steps}))
