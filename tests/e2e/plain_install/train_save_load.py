"""A user's first script, run by ``check.sh`` in a venv holding only a no-extras install's (``pip install .``)
dependencies: ZeRO-3 bf16 training on 2 processes, a checkpoint saved, loaded into a fresh engine,
and the full fp32 weights consolidated from it. Exits non-zero on any mismatch."""
import argparse
import json
import sys
from pathlib import Path

import torch

import deepshard

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--out", type=str, required=True)
args = parser.parse_args()

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "csv_monitor": {"enabled": True, "output_path": args.out, "job_name": "plain"},
          "steps_per_print": 2}


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


deepshard.init_distributed()
engine, *_ = deepshard.initialize(model=build(), config=CONFIG)
g = torch.Generator().manual_seed(engine.global_rank)
for _ in range(4):
    x = torch.randn(4, 8, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), x.sum(dim=1, keepdim=True))
    engine.backward(loss)
    engine.step()
ckpt = Path(args.out) / "ckpt"
engine.save_checkpoint(str(ckpt), tag="plain", client_state={"note": "plain"})
saved = {n: deepshard.utils.safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}

fresh, *_ = deepshard.initialize(model=build(), config=CONFIG)
_, client = fresh.load_checkpoint(str(ckpt), tag="plain")
for n, p in fresh.module.named_parameters():
    if not torch.equal(deepshard.utils.safe_get_full_fp32_param(p), saved[n]):
        sys.exit(f"parameter {n} differs after load_checkpoint")
if fresh.global_steps != 4 or client.get("note") != "plain":
    sys.exit(f"resumed at step {fresh.global_steps} with client state {client}")
if engine.global_rank == 0:
    from deepshard.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    full = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="plain")
    for n, value in saved.items():
        if not torch.equal(full[n], value):
            sys.exit(f"zero_to_fp32 gives another value for {n}")
    print(json.dumps({"ok": True, "loss": loss.item(), "params": len(full)}), flush=True)
