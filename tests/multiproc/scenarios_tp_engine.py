"""Per-rank bodies for tensor parallelism inside the engine: ``"tensor_parallel": {"autotp_size": 2}`` on a
dp=2 x tp=2 grid with ZeRO 0-3 against single-process PyTorch; the checkpoints loaded at tp=4 and into a
plain dp=4 engine; ``save_16bit_model`` writing the full model."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import deepshard
from deepshard.tp import shard_of
from deepshard.tp.params import tp_split_dim
from tests.multiproc.tp_models import LlamaLike, LlamaLikeConfig

STEPS, MICRO, GAS = 3, 1, 2
GLOBAL = MICRO * GAS * 2  # dp = 2
CLIP = 0.5


def model_config() -> LlamaLikeConfig:
    return LlamaLikeConfig(num_key_value_heads=4)  # tp=4 must divide the kv heads too


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    return [torch.randint(0, 32, (GLOBAL, 9), generator=g) for _ in range(STEPS)]


def config(stage: int, tp: int, dtype: str = "fp32") -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                           "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                           "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: the whole global batch per step, torch's clipping."""
    torch.manual_seed(0)
    model = LlamaLike(model_config())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for ids in batches():
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def local_weights(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's tensor-parallel slice of each parameter (fp32 masters where kept), gathered over dp."""
    return {name: engine.strategy.full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}


def slice_of(full: dict[str, torch.Tensor], engine: Any, tp: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.module.named_parameters():
        dim = tp_split_dim(p)
        out[name] = full[name] if dim is None else shard_of(full[name], dim, tp.rank, tp.size)
    return out


def train(stage: int, dtype: str = "fp32") -> tuple[Any, list[float]]:
    torch.manual_seed(0)
    engine, *_ = deepshard.initialize(model=LlamaLike(model_config()), config=config(stage, 2, dtype))
    dp_rank, losses = engine.topology.coord.dp, []
    for ids in batches():
        total = torch.zeros(1)
        for k in range(GAS):
            start = (k * 2 + dp_rank) * MICRO
            chunk = ids[start:start + MICRO]
            loss = engine(chunk[:, :-1], chunk[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)  # 2 tp copies of each dp rank's loss
        losses.append(float(total) / (GAS * 4))
    return engine, losses


def reload(path: str, stage: int, tp: int) -> dict[str, float]:
    """Load the dp=2 x tp=2 checkpoint at tp=``tp`` (dp = 4 / tp) and compare with the reference."""
    _, ref = reference()
    torch.manual_seed(5)  # other initial values: the load must replace them
    engine, *_ = deepshard.initialize(model=LlamaLike(model_config()), config=config(stage, tp))
    engine.load_checkpoint(path, tag="t")
    mine = local_weights(engine)
    want = slice_of(ref, engine, engine.topology.tp)
    err = max(float((mine[k] - want[k]).abs().max()) for k in want)
    steps = engine.global_steps
    engine.destroy()
    return {"err": err, "steps": steps}


def tp_engine_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref_losses, ref = reference()
    for stage in (0, 1, 2, 3):
        engine, losses = train(stage)
        mine = local_weights(engine)
        want = slice_of(ref, engine, engine.topology.tp)
        path = os.path.join(tmp, f"stage{stage}")
        engine.save_checkpoint(path, tag="t")
        out[f"z{stage}"] = {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                            "params": max(float((mine[k] - want[k]).abs().max()) for k in want),
                            "tp_bytes": engine.comms_logger.summary().get("tp:all_reduce", {}).get("bytes", 0)}
        engine.destroy()
    out["reload_tp4"] = reload(os.path.join(tmp, "stage1"), 1, 4)
    out["reload_plain"] = reload(os.path.join(tmp, "stage2"), 2, 1)
    out["reload_tp2_z3"] = reload(os.path.join(tmp, "stage3"), 3, 2)
    return out
