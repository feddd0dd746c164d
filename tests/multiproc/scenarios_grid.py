"""What each rank runs for the process-grid tests: the groups of a 2 x 2 x 2 grid, a Megatron-style
``mpu`` (dp=2 x tp=2, a data-parallel model replicated over tp) against single-process PyTorch with its
checkpoint loaded back on dp=4, and engines created and destroyed in a loop."""
from __future__ import annotations

import gc
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist

import deepshard
from deepshard.topology import ParallelDims, Topology
from deepshard.placement import owner_of
from tests.multiproc.models import make_batches, make_model, micro_slice, optimizer_config
from tests.multiproc.scenarios_stage0 import full_weights, run_steps

GLOBAL_BATCH = 8


def grid_groups(rank: int, world: int) -> dict[str, Any]:
    """Every group's members as torch sees them, and a sum over each group that proves it is one."""
    topo = Topology.build(ParallelDims(pp=2, dp=2, tp=2))
    out: dict[str, Any] = {"coord": (topo.coord.pp, topo.coord.dp, topo.coord.tp)}
    for name in ("dp", "tp", "pp", "model_parallel"):
        group = getattr(topo, name)
        value = torch.tensor([float(rank)])
        group.all_reduce(value)
        out[name] = (list(group.peers), group.rank, float(value.item()))
    out["labels"] = sorted(topo.world.logger.summary())
    return out


class GridMPU:
    """A Megatron-style model-parallel unit over dp x tp with tensor-parallel peers adjacent, built with
    plain ``dist.new_group`` as a Megatron script would."""

    def __init__(self, tp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, world // tp
        self._tp_group = self._dp_group = None
        for start in range(0, world, tp):  # tensor groups [0,1] [2,3]
            group = dist.new_group(list(range(start, start + tp)))
            if rank in range(start, start + tp):
                self._tp_group = group
        for offset in range(tp):  # data groups [0,2] [1,3]
            ranks = list(range(offset, world, tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self._dp_group = group

    def get_data_parallel_group(self) -> Any:
        return self._dp_group

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank() // self.tp

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_model_parallel_group(self) -> Any:
        return self._tp_group

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank() % self.tp

    def get_model_parallel_world_size(self) -> int:
        return self.tp


def _config(stage: int, micro: int, gas: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "optimizer": optimizer_config(), "gradient_clipping": 0.5,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500}}


def mpu_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """dp=2 x tp=2: stages 0-3 trained with the mpu (each tp pair sees the same data), then each
    checkpoint loaded into a plain 4-process data-parallel engine."""
    mpu = GridMPU(tp=2)
    dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    micro, gas = 2, GLOBAL_BATCH // (2 * dp)
    batches = make_batches(5, GLOBAL_BATCH)
    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        engine, *_ = deepshard.initialize(model=make_model(), config=_config(stage, micro, gas), mpu=mpu)
        assert engine.dp_world_size == 2 and engine.topology.tp.size == 2
        if stage == 0:  # the dataloader shards over dp (2 shards of the 16 samples), not over the world (4)
            samples = torch.utils.data.TensorDataset(torch.arange(16))
            out["loader"] = {"dp_rank": dp_rank, "ids": [int(i) for (ids,) in engine.deepspeed_io(samples) for i in ids]}
        losses = run_steps(engine, batches, micro, gas, dp_rank, dp, group=mpu.get_data_parallel_group())
        saved = full_weights(engine)
        path = os.path.join(tmp, f"stage{stage}")
        engine.save_checkpoint(path, tag="t")
        engine.destroy()
        plain, *_ = deepshard.initialize(model=make_model(seed=7), config=_config(stage, 2, 1))
        assert plain.dp_world_size == 4
        plain.load_checkpoint(path, tag="t")
        loaded = full_weights(plain)
        out[stage] = {"losses": losses, "weights": saved,
                      "reload_err": max(float((loaded[k] - saved[k]).abs().max()) for k in saved),
                      "global_steps": plain.global_steps}
        plain.destroy()
    return out


def _hook_count(model: torch.nn.Module) -> int:
    count = 0
    for m in model.modules():
        count += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        count += len(getattr(m, "_backward_pre_hooks", {}))
    for p in model.parameters():
        count += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        count += len(p._backward_hooks or {})
    return count


def destroy_cycles(rank: int, world: int, cycles: int = 50) -> dict[str, Any]:
    """Two engines (stage 2 and stage 3) created, trained one step and destroyed ``cycles`` times."""
    import psutil

    proc = psutil.Process()
    batch = make_batches(1, 4 * world)[0]
    refs: list[weakref.ref] = []
    fds_before, leftovers = None, []
    for cycle in range(cycles):
        models = [make_model(), make_model()]
        engines = [deepshard.initialize(model=m, config=_config(stage, 4, 1))[0] for m, stage in zip(models, (2, 3))]
        for engine in engines:
            x, y = micro_slice(batch, 4, 0, rank, world)
            engine.backward(engine(x, y))
            engine.step()
        for engine, model in zip(engines, models):
            engine.destroy()
            leftovers.append(_hook_count(model) + sum(owner_of(p) is not None for p in model.parameters()))
            refs.append(weakref.ref(engine))
        del engines, models, engine, model
        gc.collect()
        if cycle == 1:  # after the first cycles: lazily opened files (imports, stores) are open
            fds_before = proc.num_fds()
    gc.collect()
    return {"alive": sum(r() is not None for r in refs), "leftovers": max(leftovers),
            "fds_before": fds_before, "fds_after": proc.num_fds()}


def _strip_to_v1(tag_dir: str) -> None:
    """Rewrite a checkpoint as version 1 wrote it: no grid, no splits, no coordinates, no version keys."""
    import json
    from pathlib import Path

    from deepshard.checkpoint import io as ckpt_io

    root = Path(tag_dir)
    for path in root.glob("zero_rank*.json"):
        info = json.loads(path.read_text())
        for key in ("version", "splits", "coord"):
            info.pop(key)
        path.write_text(json.dumps(info))
    engine_json = root / "engine.json"
    meta = json.loads(engine_json.read_text())
    meta.pop("grid")
    meta["version"] = 1
    engine_json.write_text(json.dumps(meta))
    files = sorted(p.name for p in root.iterdir() if p.name != ckpt_io.MANIFEST_NAME)
    ckpt_io.write_manifest(root, files)


def engine_seams(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """The torch optimizer a stage-2 engine took over (initialize returns the ZeRO optimizer over it, its
    ``.optimizer``) refuses a direct step; two engines in one process keep their own parameters; a version-1
    checkpoint still loads."""
    out: dict[str, Any] = {}
    batch = make_batches(1, 4 * world)[0]
    a, opt_a, _, _ = deepshard.initialize(model=make_model(), config=_config(2, 4, 1))
    b, _, _, _ = deepshard.initialize(model=make_model(seed=3), config=_config(1, 4, 1))
    x, y = micro_slice(batch, 4, 0, rank, world)
    a.backward(a(x, y))
    try:
        opt_a.optimizer.step()
        out["direct_step"] = "no error"
    except RuntimeError as exc:
        out["direct_step"] = str(exc)
    opt_a.zero_grad()
    out["grads_after_zero_grad"] = float(sum(g.abs().sum() for g in a.strategy.reducer.shard_grads()))
    out["owners"] = (all(owner_of(p) is a.strategy for p in a.module.parameters()),
                     all(owner_of(p) is b.strategy for p in b.module.parameters()))
    a.backward(a(x, y))
    a.step()
    saved = full_weights(a)
    a.save_checkpoint(os.path.join(tmp, "v1"), tag="t")
    if rank == 0:
        _strip_to_v1(os.path.join(tmp, "v1", "t"))
    dist.barrier()
    module_a = a.module
    a.destroy()
    out["after_destroy"] = (all(owner_of(p) is None for p in module_a.parameters()),
                            all(owner_of(p) is b.strategy for p in b.module.parameters()))
    fresh, *_ = deepshard.initialize(model=make_model(seed=5), config=_config(3, 4, 1))
    fresh.load_checkpoint(os.path.join(tmp, "v1"), tag="t")
    loaded = full_weights(fresh)
    out["v1_reload_err"] = max(float((loaded[k] - saved[k]).abs().max()) for k in saved)
    out["v1_steps"] = fresh.global_steps
    return out
