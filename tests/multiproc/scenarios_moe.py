"""What each rank runs for the expert-parallel tests (tests/multiproc/test_moe.py)."""
from __future__ import annotations

from typing import Any

import torch

import deepshard
from deepshard.placement import expert_of
from tests.multiproc.models import make_batches, optimizer_config
from tests.multiproc.moe_models import make_moe_model, uneven_slice
from tests.multiproc.scenarios_stage0 import run_steps

GLOBAL_BATCH = 16


def _config(stage: int, micro: int, gas: int = 1, dtype: str = "fp32", clip: float = 0.5,
            bucket: int = 500) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
                           "optimizer": optimizer_config(), "gradient_clipping": clip,
                           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                                 "stage3_gather_16bit_weights_on_model_save": True}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def global_expert_weights(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 value under its global name (experts by global id), from this rank."""
    out = {}
    for name, p in engine.module.named_parameters():
        found = expert_of(p)
        out[found.saved_name if found is not None else name] = engine.strategy.full_fp32_param(p)
    return out


def train_cases(rank: int, world: int, cases: list[tuple], steps: int = 4) -> dict[Any, Any]:
    """Each (stage, ep_size, dtype, gas[, sizes]): ``steps`` steps; the losses and every weight by global name.
    ``sizes``: rank r trains on ``sizes[r]`` samples of each batch (uneven token counts per rank, gas 1)."""
    out: dict[Any, Any] = {}
    batches = make_batches(steps, GLOBAL_BATCH, seed=5)
    for case in cases:
        stage, ep, dtype, gas, *sizes = case
        micro = GLOBAL_BATCH // (world * gas)
        model = make_moe_model(rank, world, ep)
        engine, *_ = deepshard.initialize(model=model, config=_config(stage, micro, gas, dtype))
        losses = uneven_steps(engine, batches, sizes[0], rank) if sizes else run_steps(engine, batches, micro, gas,
                                                                                        rank, world)
        out[case] = {"losses": losses, "weights": global_expert_weights(engine), "comms": engine.comms_logger.summary()}
        engine.destroy()
    return out


def uneven_steps(engine: Any, batches: list, sizes: tuple[int, ...], rank: int) -> list[float]:
    """One micro-batch a step, of ``sizes[rank]`` samples on this rank; the mean of the ranks' losses."""
    losses = []
    for batch in batches:
        loss = engine(*uneven_slice(batch, sizes, rank))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        torch.distributed.all_reduce(total)
        losses.append(float(total) / len(sizes))
    return losses


def layout_and_accounting(rank: int, world: int) -> dict[str, Any]:
    """ep 2 on this world: DeepSpeed's group accessors, the layers' groups, the per-rank parameter and
    optimizer-state bytes at stages 0 and 1, and the all-to-all traffic of one step."""
    from deepshard.utils import groups as ds_groups  # deepspeed.utils.groups under the shim

    out: dict[str, Any] = {}
    batch = make_batches(1, GLOBAL_BATCH, seed=7)
    for stage in (0, 1):
        engine, *_ = deepshard.initialize(model=make_moe_model(rank, world, 2), config=_config(stage, GLOBAL_BATCH // world))
        run_steps(engine, batch, GLOBAL_BATCH // world, 1, rank, world)  # optimizer state exists
        engine.comms_logger.reset()
        run_steps(engine, batch, GLOBAL_BATCH // world, 1, rank, world)
        params = list(engine.module.parameters())
        out[stage] = {"report": engine.memory_report(), "comms": engine.comms_logger.summary(),
                      "dense": sum(p.numel() for p in params if expert_of(p) is None),
                      "experts": sum(p.numel() for p in params if expert_of(p) is not None),
                      "groups": {name: engine.optimizer.param_groups[i]["name"]
                                 for i, name in enumerate(["first", "second"][:len(engine.optimizer.param_groups)])}}
        engine.destroy()
    out["accessors"] = {
        "ep_ranks": ds_groups._get_expert_parallel_group_ranks("ep_size_2"),
        "edp_ranks": ds_groups._get_expert_data_parallel_group_ranks("ep_size_2"),
        "ep_rank": ds_groups._get_expert_parallel_rank("ep_size_2"),
        "ep_world": ds_groups._get_expert_parallel_world_size("ep_size_2"),
        "edp_world": ds_groups._get_expert_data_parallel_world_size("ep_size_2"),
        "src": ds_groups._get_expert_broadcast_src_rank("ep_size_2"),
        "max": ds_groups._get_max_expert_size_name(),
    }
    return out


def save_moe_world(rank: int, world: int, stage: int, ep: int, tmp: str) -> list[float]:
    """3 steps, then a checkpoint and the 16-bit weights (``tmp``/ckpt, ``tmp``/weights)."""
    micro = GLOBAL_BATCH // world
    engine, *_ = deepshard.initialize(model=make_moe_model(rank, world, ep), config=_config(stage, micro))
    losses = run_steps(engine, make_batches(6, GLOBAL_BATCH, seed=9)[:3], micro, 1, rank, world)
    engine.save_checkpoint(f"{tmp}/ckpt", client_state={"by": world})
    engine.save_16bit_model(f"{tmp}/weights", "model.safetensors")
    return losses


def resume_moe_world(rank: int, world: int, stage: int, ep: int, gas: int, tmp: str) -> dict[str, Any]:
    """A model of other initial weights loads the checkpoint and trains the next 3 steps."""
    micro = GLOBAL_BATCH // (world * gas)
    engine, *_ = deepshard.initialize(model=make_moe_model(rank, world, ep, seed=77), config=_config(stage, micro, gas))
    _, client = engine.load_checkpoint(f"{tmp}/ckpt")
    losses = run_steps(engine, make_batches(6, GLOBAL_BATCH, seed=9)[3:], micro, gas, rank, world)
    return {"losses": losses, "weights": global_expert_weights(engine), "client": client}


def _autoep_config(stage: int, micro: int, ep: int, dtype: str = "fp32") -> dict[str, Any]:
    cfg = _config(stage, micro, clip=1.0)
    cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def autoep_cases(rank: int, world: int, cases: list[tuple[str, int, int, str]], steps: int = 3) -> dict[Any, Any]:
    """Each (model kind, stage, ep, dtype): ``steps`` steps of the HF model with AutoEP; its losses and each
    parameter as (offset in the saved tensor, fp32 value)."""
    from deepshard.moe.autoep_layer import AutoEPMoELayer
    from deepshard.placement import saved_slice
    from tests.multiproc.moe_models import make_hf_moe, token_batches

    out: dict[Any, Any] = {}
    batches = token_batches(steps, 4)
    for kind, stage, ep, dtype in cases:
        engine, *_ = deepshard.initialize(model=make_hf_moe(kind), config=_autoep_config(stage, 4 // world, ep, dtype))
        losses = _hf_steps(engine, batches, rank, world)
        weights = {name: (saved_slice(p)[0], engine.strategy.full_fp32_param(p))
                   for name, p in engine.module.named_parameters()}
        layers = [(m.module_path, m.ep_size, m.num_local_experts, m.num_experts, type(m.router).__name__)
                  for m in engine.module.modules() if isinstance(m, AutoEPMoELayer)]
        placement = {name: (p.ds_zero_placement_family, p.ds_zero_partition_group_name,
                            p.ds_zero_partition_world_size, p.ds_zero_partition_rank)
                     for name, p in engine.module.named_parameters() if hasattr(p, "ds_zero_placement_family")}
        out[(kind, stage, ep, dtype)] = {"losses": losses, "weights": weights, "layers": layers,
                                         "placement": placement,
                                         "local_experts": engine.module.model.layers[0].mlp.experts.gate_up_proj.shape[0]}
        engine.destroy()
    return out


def _hf_steps(engine: Any, batches: list, rank: int, world: int) -> list[float]:
    micro = batches[0].shape[0] // world
    losses = []
    for ids in batches:
        mine = ids[rank * micro:(rank + 1) * micro]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        torch.distributed.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def autoep_save(rank: int, world: int, kind: str, stage: int, ep: int, tmp: str) -> list[float]:
    """2 steps with AutoEP (ep 1: without), then a checkpoint and the 16-bit weights."""
    from tests.multiproc.moe_models import make_hf_moe, token_batches

    config = _autoep_config(stage, 4 // world, ep) if ep > 1 else _config(stage, 4 // world, clip=1.0)
    engine, *_ = deepshard.initialize(model=make_hf_moe(kind), config=config)
    losses = _hf_steps(engine, token_batches(3, 4)[:2], rank, world)
    engine.save_checkpoint(f"{tmp}/ckpt")
    engine.save_16bit_model(f"{tmp}/weights", "model.safetensors")
    return losses


def autoep_resume(rank: int, world: int, kind: str, stage: int, ep: int, tmp: str) -> list[float]:
    """Another initial model loads the checkpoint (ep 1: the experts whole, no AutoEP) and takes step 3."""
    from tests.multiproc.moe_models import make_hf_moe, token_batches

    config = _autoep_config(stage, 4 // world, ep) if ep > 1 else _config(stage, 4 // world, clip=1.0)
    engine, *_ = deepshard.initialize(model=make_hf_moe(kind, seed=5), config=config)
    engine.load_checkpoint(f"{tmp}/ckpt")
    return _hf_steps(engine, token_batches(3, 4)[2:], rank, world)
