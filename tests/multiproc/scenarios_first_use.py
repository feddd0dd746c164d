"""What each rank runs for test_first_use.py: zero.Init with a class first imported inside the context,
bf16 training that keeps buffers' dtypes (stages 0-3, and data_types.buffer_dtype when set), and disk
offload with its default sizes next to the same run in memory."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch

import deepshard
from tests.multiproc.scenarios_stage0 import train

LATE_MODULE = '''
import torch


class LateNorm(torch.nn.Module):
    """Defined in a module first imported inside zero.Init (as transformers imports model classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(301, dtype=torch.float32))
        self.proj = torch.nn.Linear(6, 5)
'''


def late_import(rank: int, tmp: str) -> dict[str, Any]:
    """Build a model whose class is imported inside zero.Init; report how its parameters were kept."""
    Path(tmp, "late_import_mod.py").write_text(LATE_MODULE)
    sys.path.insert(0, tmp)
    try:
        torch.manual_seed(0)
        with deepshard.zero.Init():
            mod = importlib.import_module("late_import_mod")
            model = mod.LateNorm()
        after = mod.LateNorm()  # built after the context: an ordinary module again
    finally:
        sys.path.remove(tmp)
    shards = {n: (tuple(p.ds_shape), p.ds_tensor.numel(), p.numel()) if hasattr(p, "ds_tensor") else None
              for n, p in model.named_parameters()}
    with deepshard.zero.GatheredParameters(list(model.parameters())):
        weight = model.weight.detach().clone()
    return {"shards": shards, "weight_ok": torch.equal(weight, torch.arange(301, dtype=torch.float32)),
            "after_whole": all(not hasattr(p, "ds_tensor") for p in after.parameters()),
            "hook_removed": "__init_subclass__" not in torch.nn.Module.__dict__}


class Rotary(torch.nn.Module):
    """A float buffer whose bf16 rounding would change the output (like LLaMA's rotary inv_freq), and
    an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, dtype=torch.float32) / 8)))
        self.register_buffer("count", torch.tensor(7, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x).float() * torch.cos(self.inv_freq * 3.0)).sum()


def buffers(rank: int) -> dict[str, Any]:
    """bf16 engines at stages 0-3: each buffer's dtype and value, and the forward against plain torch
    (bf16 parameters, fp32 rotary buffer); then data_types.buffer_dtype = bf16."""
    out: dict[str, Any] = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    for stage, buffer_dtype in ((0, None), (1, None), (2, None), (3, None), (1, "bf16"), (3, "bf16")):
        torch.manual_seed(0)
        reference = Rotary().to(torch.bfloat16) if buffer_dtype else _bf16_params_only(Rotary())
        torch.manual_seed(0)
        model = Rotary()
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                  "zero_optimization": {"stage": stage}}
        if buffer_dtype:
            config["data_types"] = {"buffer_dtype": buffer_dtype}
        engine, *_ = deepshard.initialize(model=model, config=config)
        with torch.no_grad():
            got = float(engine(x.to(torch.bfloat16)))  # inputs reach the model as given, as in DeepSpeed
            want = float(reference(x.to(torch.bfloat16)))
        out[(stage, buffer_dtype)] = {
            "dtypes": {n: str(b.dtype) for n, b in engine.module.named_buffers()},
            "inv_freq_exact": torch.equal(engine.module.inv_freq.float(), reference.inv_freq.float()),
            "count": int(engine.module.count), "forward": (got, want)}
        engine.destroy()
    return out


def _bf16_params_only(model: torch.nn.Module) -> torch.nn.Module:
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


def default_offload(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """ZeRO-3 with parameters and optimizer states on disk and no sizes in the config, next to the same
    run in memory (fp32 and bf16)."""
    out: dict[str, Any] = {}
    for dtype in ("fp32", "bf16"):
        zero = {"stage": 3, "stage3_param_persistence_threshold": 10, "stage3_prefetch_bucket_size": 300}
        ref = train(rank, world, 2, 2, 2, dtype=dtype, stage=3, extra={"zero_optimization": zero})
        engines: list = []
        nvme = {"device": "nvme", "nvme_path": tmp}
        got = train(rank, world, 2, 2, 2, dtype=dtype, stage=3, engine_out=engines,
                    extra={"zero_optimization": {**zero, "offload_optimizer": nvme, "offload_param": nvme}})
        report = engines[0].memory_report()
        states = engines[0].strategy.states
        out[dtype] = {"ref": ref, "got": got, "offload_buffers": report["offload_buffers"],
                      "shard_numel": states.shard_numel, "pool_count": states.pool.count,
                      "subgroups": len(states.subgroups)}
        engines[0].destroy()
    return out


def first_use(rank: int, world: int, tmp: str) -> dict[str, Any]:
    return {"late_import": late_import(rank, tmp), "buffers": buffers(rank),
            "default_offload": default_offload(rank, world, tmp)}
