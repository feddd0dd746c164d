"""What each rank runs for the offload tests: the same runs with and without offload, checkpoints with
offload on, and what is left on disk afterwards."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import deepshard
from deepshard.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_get_local_fp32_param,
                             safe_set_full_fp32_param, safe_set_full_optimizer_state)
from deepshard.zero.offload.policy import FORCE_CPU_OFFLOAD_ENV
from tests.multiproc.models import make_batches, make_token_batches, make_transformer
from tests.multiproc.scenarios_stage0 import full_weights, run_steps, train

SUB_GROUP = 60  # elements: TinyNet's ~600-element shard becomes ~10 sub-groups
AIO = {"block_size": 256, "queue_depth": 3, "thread_count": 2}


def zero_section(stage: int, optimizer: str = "none", param: str = "none", path: str = "",
                 buffer_count: int = 6) -> dict[str, Any]:
    """``train()``'s zero_optimization section plus offload (the whole section: ``extra`` replaces it)."""
    z: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 500, "sub_group_size": SUB_GROUP}
    if stage == 3:
        z.update({"stage3_param_persistence_threshold": 10, "stage3_prefetch_bucket_size": 300})
    if optimizer != "none":
        z["offload_optimizer"] = {"device": optimizer, "nvme_path": path, "buffer_count": buffer_count}
    if param != "none":
        z["offload_param"] = {"device": param, "nvme_path": path}
    return z


def _run(rank: int, world: int, stage: int, dtype: str, z: dict[str, Any], extra: dict[str, Any] | None = None,
         keep: list | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    engines: list = []
    out = train(rank, world, 2, 2, 4, dtype=dtype, stage=stage, engine_out=engines,
                extra={"zero_optimization": z, "aio": AIO, **(extra or {})})
    if keep is not None:
        keep.append(engines[0])
    else:
        engines[0].destroy()
    return out


def equivalence(rank: int, world: int, tmp: str) -> dict[Any, Any]:
    """Every offload combination next to the same run without offload."""
    out: dict[Any, Any] = {}
    sched = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                          "warmup_num_steps": 3}}}
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}
    cases: list[tuple[str, int, str, str, str, dict[str, Any] | None]] = [
        ("nvme-opt", 1, "fp32", "nvme", "none", None), ("nvme-opt", 1, "bf16", "nvme", "none", None),
        ("nvme-opt", 2, "fp32", "nvme", "none", None), ("nvme-opt", 2, "bf16", "nvme", "none", None),
        ("nvme-opt", 3, "fp32", "nvme", "none", None), ("nvme-opt", 3, "bf16", "nvme", "none", None),
        ("nvme-both", 3, "fp32", "nvme", "nvme", None), ("nvme-both", 3, "bf16", "nvme", "nvme", None),
        ("nvme-param", 3, "bf16", "none", "nvme", None), ("nvme-param", 3, "fp32", "none", "nvme", None),
        ("nvme-sched", 2, "fp32", "nvme", "none", sched), ("nvme-sgd", 3, "fp32", "nvme", "nvme", sgd),
        ("nvme-fp16", 2, "fp16", "nvme", "none", None),
    ]
    for name, stage, dtype, opt, param, extra in cases:
        ref = _run(rank, world, stage, dtype, zero_section(stage), extra)
        got = _run(rank, world, stage, dtype, zero_section(stage, opt, param, tmp), extra)
        out[(name, stage, dtype)] = (ref, got)
    os.environ[FORCE_CPU_OFFLOAD_ENV] = "1"  # the CUDA CPU-offload code path, on the CPU
    try:
        for stage in (2, 3):
            ref = _run(rank, world, stage, "bf16", zero_section(stage))
            got = _run(rank, world, stage, "bf16", zero_section(stage, "cpu", "cpu" if stage == 3 else "none"))
            out[("cpu-forced", stage, "bf16")] = (ref, got)
    finally:
        del os.environ[FORCE_CPU_OFFLOAD_ENV]
    dist.barrier()
    out["left_on_disk"] = sorted(os.listdir(tmp))
    return out


def transformer(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """ZeRO-3 with tied weights and a module run twice, parameters and optimizer on disk."""
    out: dict[str, Any] = {}
    for key, z in (("ref", zero_section(3)), ("nvme", zero_section(3, "nvme", "nvme", tmp))):
        z["stage3_param_persistence_threshold"] = 0
        cfg = {"train_micro_batch_size_per_gpu": 4 // world, "gradient_accumulation_steps": 2,
               "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "gradient_clipping": 0.5,
               "zero_optimization": z, "aio": AIO}
        engine, *_ = deepshard.initialize(model=make_transformer(), config=cfg)
        out[key] = (run_steps(engine, make_token_batches(3, 8), 4 // world, 2, rank, world), full_weights(engine))
        engine.destroy()
    return out


def accounting_and_getters(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """memory_report with offload, and safe_get_full_* reading offloaded state back."""
    out: dict[str, Any] = {}
    for stage in (2, 3):
        for key, z in (("ref", zero_section(stage)), ("nvme", zero_section(stage, "nvme", "nvme", tmp))):
            engines: list = []
            train(rank, world, 2, 1, 2, dtype="bf16", stage=stage, engine_out=engines,
                  extra={"zero_optimization": z, "aio": AIO})
            engine = engines[0]
            params = dict(engine.module.named_parameters())
            out[(stage, key)] = {
                "report": engine.memory_report(),
                "shard": engine.strategy.layout.shard_numel,
                "fp32": {n: safe_get_full_fp32_param(p) for n, p in params.items() if p.requires_grad},
                "exp_avg_sq": {n: safe_get_full_optimizer_state(p, "exp_avg_sq") for n, p in params.items()
                               if p.requires_grad},
                "files": sorted(p.name for d in Path(tmp).iterdir() if d.name.endswith(f"-rank{rank}")
                                for p in d.iterdir()) if key == "nvme" else [],  # (the other rank's may go)
            }
            out[(stage, key)]["written"] = write_back(params, stage)
            engine.destroy()
    return out


def write_back(params: dict[str, torch.nn.Parameter], stage: int) -> dict[str, Any]:
    """safe_set_full_fp32_param / safe_set_full_optimizer_state into the offloaded (or resident) fp32 masters
    and states of a bf16 run, read back; at stage 3 also this rank's local parts and its bf16 ds_tensor."""
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    g = torch.Generator().manual_seed(7)
    values = {n: torch.rand(tuple(getattr(p, "ds_shape", p.shape)), generator=g) for n, p in trainable.items()}
    for n, p in trainable.items():
        safe_set_full_fp32_param(p, values[n])
        safe_set_full_optimizer_state(p, values[n] / 2, "exp_avg_sq")
    out = {n: (values[n], safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg_sq"))
           for n, p in trainable.items()}
    if stage == 3:
        return {"full": out, "local": {n: (safe_get_local_fp32_param(p), p.ds_tensor.detach().clone())
                                       for n, p in trainable.items()}}
    return {"full": out, "model": {n: p.detach().clone() for n, p in trainable.items()}}


def everything(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """One world for the equivalence, transformer and accounting scenarios (a world costs seconds to
    start)."""
    swap = Path(tmp)
    out = {"equivalence": equivalence(rank, world, str(swap / "equivalence"))}
    out["transformer"] = transformer(rank, world, str(swap / "transformer"))
    out["accounting"] = accounting_and_getters(rank, world, str(swap / "accounting"))
    return out


def checkpoints(rank: int, world: int, tmp: str) -> dict[int, dict[str, Any]]:
    return {stage: checkpoint(rank, world, str(Path(tmp) / f"swap{stage}"), str(Path(tmp) / f"ckpt{stage}"), stage)
            for stage in (2, 3)}


def checkpoint(rank: int, world: int, tmp: str, ckpt: str, stage: int) -> dict[str, Any]:
    """6 steps straight vs 3 + save + load into a fresh engine + 3, offload on in both halves; and the
    offloaded checkpoint loaded into an engine without offload."""
    micro, gas = 2, 2
    batches = make_batches(6, micro * gas * world, seed=5)
    extra = {"zero_optimization": zero_section(stage, "nvme", "nvme" if stage == 3 else "none", tmp), "aio": AIO,
             "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 10,
                                                               "warmup_max_lr": 1e-2}}}
    full = _run_batches(rank, world, stage, extra, batches)
    engines: list = []
    first, _ = train(rank, world, micro, gas, 3, dtype="bf16", stage=stage, extra=extra, batches=batches[:3],
                     engine_out=engines)
    engines[0].save_checkpoint(ckpt, tag="t")
    engines[0].destroy()
    resumed = _run_batches(rank, world, stage, extra, batches[3:], ckpt)
    plain = dict(extra, zero_optimization=zero_section(stage))
    into_plain = _run_batches(rank, world, stage, plain, batches[3:], ckpt)
    dist.barrier()
    return {"full": full, "resumed": (first + resumed[0], resumed[1]), "into_plain": into_plain,
            "left_on_disk": sorted(os.listdir(tmp))}


def _run_batches(rank: int, world: int, stage: int, extra: dict[str, Any], batches: list,
                 load_from: str | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    engines: list = []
    train(rank, world, 2, 2, 0, dtype="bf16", stage=stage, extra=extra, batches=[], engine_out=engines)
    engine = engines[0]
    if load_from is not None:
        engine.load_checkpoint(load_from, tag="t")
    losses = run_steps(engine, batches, 2, 2, rank, world)
    weights = full_weights(engine)
    engine.destroy()
    return losses, weights
