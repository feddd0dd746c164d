"""What each rank runs for the stage-0 tests (importable by spawned processes)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import deepshard
from tests.multiproc.device import rank_device
from tests.multiproc.models import make_batches, make_model, micro_slice, model_inputs, optimizer_config, sgd_config


def train(rank: int, world: int, micro: int, gas: int, steps: int, *, dtype: str = "fp32", clip: float = 0.5,
          extra: dict[str, Any] | None = None, batches: Any = None, engine_out: list | None = None,
          stage: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train TinyNet with deepshard; returns per-step global-mean losses and fp32 final weights."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
        "optimizer": optimizer_config(), "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
    }
    if stage == 3:  # shard everything but the 7-element root group; prefetch one small group ahead
        config["zero_optimization"].update({"stage3_param_persistence_threshold": 10,
                                            "stage3_prefetch_bucket_size": 300})
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    config.update(extra or {})
    config = {k: v for k, v in config.items() if v is not None}
    engine, _, _, _ = deepshard.initialize(model=make_model(), config=config)
    batches = batches if batches is not None else make_batches(steps, micro * gas * world)
    losses = run_steps(engine, batches, micro, gas, rank, world)
    if engine_out is not None:
        engine_out.append(engine)
    return losses, full_weights(engine)


def run_steps(engine: Any, batches: list, micro: int, gas: int, rank: int, world: int,
              group: Any = None) -> list[float]:
    """Train ``batches``; ``rank`` / ``world`` (and ``group``, default the world) are the data-parallel
    ones: each takes its micro-slices, and the mean loss is taken over them."""
    losses = []
    for batch in batches:
        total = torch.zeros(1, device=rank_device())  # the CPU unless the suite runs with --device cuda
        for k in range(gas):
            x, y = micro_slice(batch, micro, k, rank, world)
            loss = engine(*model_inputs(engine, x, y))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total, group=group)
        losses.append(float(total) / (gas * world))
    return losses


def full_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The fp32 weights (masters where kept) by state-dict name."""
    out = {}
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    for name, value in engine.module.state_dict().items():
        p = params.get(name)
        out[name] = engine.strategy.full_fp32_param(p) if p is not None else value.float().clone()
    return out


def oracle_world(rank: int, world: int, stage: int = 0) -> dict[str, Any]:
    """Every accumulation split of a global batch of 8, fp32/bf16/fp16, for one ZeRO stage."""
    results: dict[str, Any] = {}
    adaptive: list = []  # stage 0 without accumulation: its engine (the reduction schedule it chose)
    for micro in (1, 2, 4):
        gas = 8 // (micro * world)
        if gas >= 1 and micro * gas * world == 8:
            results[f"fp32_m{micro}_g{gas}"] = train(rank, world, micro, gas, steps=5, stage=stage,
                                                     engine_out=adaptive if gas == 1 and stage == 0 else None)
            results[f"sgd_m{micro}_g{gas}"] = train(rank, world, micro, gas, steps=5, clip=0.5, stage=stage,
                                                    extra={"optimizer": sgd_config()})
    if stage == 0:  # both reduction schedules forced (overlap_comm unset, above, times both and keeps one)
        for overlap in (False, True):
            results[f"fp32_overlap{int(overlap)}_m1_g{8 // world}"] = train(
                rank, world, 1, 8 // world, steps=5, stage=0,
                extra={"zero_optimization": {"stage": 0, "reduce_bucket_size": 500, "overlap_comm": overlap}})
        # the split without accumulation ran 5 reducing backwards with overlap_comm unset: one untimed, then
        # both schedules in turn (2 each), then a choice; the losses and weights above match all the same
        schedule = adaptive[0].strategy.schedule if adaptive else None
        results["adaptive_decisions"] = None if schedule is None else schedule.decisions
    if stage == 3:  # the block's LayerNorm and Linears gathered and reduced as one group (units.py)
        coalesced: list = []
        results[f"fp32_units_m1_g{8 // world}"] = train(
            rank, world, 1, 8 // world, steps=5, stage=3, engine_out=coalesced,
            extra={"zero_optimization": {"stage": 3, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 10,
                                         "stage3_prefetch_bucket_size": 300, "stage3_min_gather_size": 3000}})
        results["unit_groups"] = [g.module_name for g in coalesced[0].strategy.groups]
    micro, gas = 8 // (2 * world) if world <= 4 else 1, 2
    results["bf16"] = train(rank, world, max(micro, 1), gas, steps=5, dtype="bf16", stage=stage)
    results["fp16"] = train(rank, world, max(micro, 1), gas, steps=5, dtype="fp16", stage=stage)
    results["sched"] = train(rank, world, max(micro, 1), gas, steps=5, stage=stage, extra={
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 3, "warmup_type": "linear"}}})
    # identical parameters on every rank
    w = results["fp32_m1_g" + str(8 // world)][1] if 8 // world >= 1 else None
    if w is not None:
        flat = torch.cat([t.reshape(-1) for t in w.values()])
        mx, mn = flat.clone(), flat.clone()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        dist.all_reduce(mn, op=dist.ReduceOp.MIN)
        results["rank_spread"] = float((mx - mn).abs().max())
    return results


def overflow_world(rank: int, world: int) -> dict[str, Any]:
    """An inf in one rank's gradient at step 2 skips exactly that step and halves the fp16 scale."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": optimizer_config(), "gradient_clipping": 0.0,
              "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
              "zero_optimization": {"stage": 0}}
    engine, _, _, _ = deepshard.initialize(model=make_model(), config=config)
    batches = make_batches(4, 2 * world)
    record = []
    for step, batch in enumerate(batches):
        before = {k: v.clone() for k, v in full_weights(engine).items()}
        x, y = micro_slice(batch, 2, 0, rank, world)
        loss = engine(*model_inputs(engine, x, y))
        if step == 2 and rank == world - 1:
            loss = loss * float("inf")
        engine.backward(loss)
        scale_before = engine.loss_scale
        engine.step()
        after = full_weights(engine)
        changed = any(not torch.equal(before[k], after[k]) for k in before)
        record.append({"scale_before": scale_before, "scale_after": engine.loss_scale, "changed": changed,
                       "skipped": engine.skipped_steps, "applied": engine.was_step_applied(),
                       "overflow_attr": engine.optimizer.overflow})
    return {"record": record, "global_steps": engine.global_steps}


def checkpoint_world(rank: int, world: int, tmp: str, dtype: str) -> dict[str, Any]:
    """Train 6 steps straight vs 3 + save + load into a fresh engine + 3: identical losses."""
    micro, gas = 2, 2
    batches = make_batches(6, micro * gas * world, seed=5)
    extra = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 10,
                                                               "warmup_max_lr": 1e-2}}}
    full, w_full = train(rank, world, micro, gas, 6, dtype=dtype, extra=extra, batches=batches)
    engines: list = []
    first, _ = train(rank, world, micro, gas, 3, dtype=dtype, extra=extra, batches=batches[:3],
                     engine_out=engines)
    engines[0].save_checkpoint(tmp, client_state={"epoch": 7, "note": "hi", "t": torch.arange(3)})
    fresh_engines: list = []
    train(rank, world, micro, gas, 0, dtype=dtype, extra=extra, batches=[], engine_out=fresh_engines)
    fresh = fresh_engines[0]
    path, client = fresh.load_checkpoint(tmp)
    rest = run_steps(fresh, batches[3:], micro, gas, rank, world)
    latest = (Path(tmp) / "latest").read_text().strip()
    return {"full": full, "resumed": first + rest, "w_full": w_full, "w_resumed": full_weights(fresh),
            "client": client, "path": path, "latest": latest, "global_steps": fresh.global_steps,
            "lr": fresh.get_lr()}


def oracle_stages(rank: int, world: int, stages: list[int]) -> dict[int, dict[str, Any]]:
    """:func:`oracle_world` for each of ``stages`` in one world (a spawn per stage cost as much as the
    training it ran)."""
    return {stage: oracle_world(rank, world, stage) for stage in stages}
