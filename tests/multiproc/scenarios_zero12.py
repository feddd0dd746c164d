"""What each rank runs for the ZeRO stage 1/2 specific tests: accounting, the safe_get/set_* helpers
and checkpoints that move between process counts and stages."""
from __future__ import annotations

from typing import Any

import torch

import deepshard
from deepshard.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                             safe_get_local_fp32_param, safe_get_local_optimizer_state, safe_set_full_fp32_param,
                             safe_set_full_grad, safe_set_full_optimizer_state, safe_set_local_fp32_param,
                             safe_set_local_optimizer_state)
from tests.multiproc.models import make_batches, make_model, micro_slice, optimizer_config
from tests.multiproc.scenarios_stage0 import full_weights, run_steps

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 processes


def _config(stage: int, micro: int, gas: int = 1, dtype: str = "fp32", bucket: int = 500) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
                           "optimizer": optimizer_config(), "gradient_clipping": 0.5,
                           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def accounting(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (1, 2):
        for dtype in ("fp32", "bf16"):
            engine, *_ = deepshard.initialize(model=make_model(), config=_config(stage, 2, 1, dtype, bucket=10**6))
            batch = make_batches(1, 2 * world)[0]
            run_steps(engine, [batch], 2, 1, rank, world)  # warm: optimizer state exists
            engine.comms_logger.reset()
            run_steps(engine, [batch], 2, 1, rank, world)
            model = engine.module
            out[(stage, dtype)] = {
                "report": engine.memory_report(),
                "psi": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad),
                "comms": engine.comms_logger.summary(),
                "volume": engine.comms_logger.total_volume_elements(),
            }
    return out


def safe_getters(rank: int, world: int, stage: int) -> dict[str, Any]:
    """safe_get_full_* on every rank equal the single-process reference's values."""
    engine, *_ = deepshard.initialize(model=make_model(), config=_config(stage, 2, 1, "fp32"))
    batches = make_batches(3, 2 * world, seed=21)
    run_steps(engine, batches[:2], 2, 1, rank, world)
    x, y = micro_slice(batches[2], 2, 0, rank, world)
    engine.backward(engine(x, y))
    params = dict(engine.module.named_parameters())  # (stage 3: read between backward and step)
    out = {"grad": {n: safe_get_full_grad(p) for n, p in params.items() if p.requires_grad},
           "fp32": {n: safe_get_full_fp32_param(p) for n, p in params.items()},
           "exp_avg": {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in params.items()
                       if p.requires_grad}}
    out["writes"] = safe_writers(engine, rank, world, stage)
    return out


def written(params: dict[str, torch.nn.Parameter], seed: int) -> dict[str, torch.Tensor]:
    """A value for each trainable parameter, the same on every rank (and in the test's reference)."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.rand(tuple(getattr(p, "ds_shape", p.shape)), generator=g) for n, p in params.items()
            if p.requires_grad}


def safe_writers(engine: Any, rank: int, world: int, stage: int) -> dict[str, Any]:
    """DeepSpeed's safe_set_full_* (and at stage 3 the local calls) between backward and step and after it;
    then one more step from the written state (the test repeats it on single-process PyTorch)."""
    params = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    values, grads = written(params, 1), written(params, 2)
    for n, p in params.items():
        safe_set_full_fp32_param(p, values[n])
        safe_set_full_grad(p, grads[n])
    out: dict[str, Any] = {"fp32": {n: safe_get_full_fp32_param(p) for n, p in params.items()},
                           "grad": {n: safe_get_full_grad(p) for n, p in params.items()}}
    x, y = micro_slice(make_batches(1, 2 * world, seed=22)[0], 2, 0, rank, world)
    with torch.no_grad():  # the model computes with the written values (stage 3: kept-gathered groups too)
        out["loss_after_full_write"] = float(engine(x, y))
    engine.step()
    out["stepped"] = {n: safe_get_full_fp32_param(p) for n, p in params.items()}
    states = {"exp_avg": written(params, 3), "exp_avg_sq": written(params, 4)}
    for key, by_name in states.items():
        for n, p in params.items():
            safe_set_full_optimizer_state(p, by_name[n], key)
    out["states"] = {key: {n: safe_get_full_optimizer_state(p, key) for n, p in params.items()} for key in states}
    if stage == 3:  # this rank's parts: read, doubled and written back (fp32 value, exp_avg), read again
        out["local"] = {n: (safe_get_local_fp32_param(p), p.ds_tensor.detach().clone()) for n, p in params.items()}
        for n, p in params.items():
            safe_set_local_fp32_param(p, 2 * out["local"][n][0])
            safe_set_local_optimizer_state(p, 2 * safe_get_local_optimizer_state(p, "exp_avg"), "exp_avg")
        out["local_after"] = {n: (safe_get_local_fp32_param(p), p.ds_tensor.detach().clone(),
                                  safe_get_local_optimizer_state(p, "exp_avg")) for n, p in params.items()}
    x, y = micro_slice(make_batches(1, 2 * world, seed=22)[0], 2, 0, rank, world)
    out["persistent"] = sorted(n for n, p in params.items() if getattr(p, "ds_persist", False))
    engine.scale(engine(x, y)).backward()  # PyTorch-style: allreduce_gradients() finishes the reduction
    engine.allreduce_gradients()
    out["scaled_grad"] = {n: safe_get_full_grad(p) for n, p in params.items()}
    engine.allreduce_gradients()  # again: reduces nothing twice
    out["scaled_grad_again"] = {n: safe_get_full_grad(p) for n, p in params.items()}
    engine.step()
    out["final"] = {n: safe_get_full_fp32_param(p) for n, p in params.items()}
    return out


def save_world(rank: int, world: int, stage: int, dtype: str, tmp: str) -> list[float]:
    micro = GLOBAL_BATCH // world
    engine, *_ = deepshard.initialize(model=make_model(), config=_config(stage, micro, 1, dtype))
    losses = run_steps(engine, make_batches(6, GLOBAL_BATCH, seed=31)[:3], micro, 1, rank, world)
    engine.save_checkpoint(tmp, client_state={"saved_by": world})
    return losses


def resume_world(rank: int, world: int, stage: int, dtype: str, tmp: str) -> dict[str, Any]:
    gas = 2 if world == 1 else 1  # a different accumulation split of the same global batch too
    micro = GLOBAL_BATCH // (world * gas)
    engine, *_ = deepshard.initialize(model=make_model(seed=99), config=_config(stage, micro, gas, dtype))
    _, client = engine.load_checkpoint(tmp)
    losses = run_steps(engine, make_batches(6, GLOBAL_BATCH, seed=31)[3:], micro, gas, rank, world)
    return {"losses": losses, "weights": full_weights(engine), "client": client, "steps": engine.global_steps}
