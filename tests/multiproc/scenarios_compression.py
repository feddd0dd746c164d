"""What each rank runs for the 1-bit Adam tests (importable by spawned processes)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import deepshard
from deepshard.comm.group import CommGroup
from deepshard.compression import CompressedAverage
from tests.multiproc.models import make_batches, make_model
from tests.multiproc.scenarios_stage0 import full_weights, run_steps

FREEZE, STEPS, LR = 3, 10, 1e-2
TEACHER_FREEZE = 15


def onebit_config(freeze: int = FREEZE, micro: int = 2, gas: int = 2, dtype: str = "fp32") -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                       "weight_decay": 0.01, "freeze_step": freeze,
                                                       "cuda_aware": False, "comm_backend_name": "nccl"}},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 500}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def train_onebit(rank: int, world: int, exact: bool, dtype: str = "fp32") -> dict[str, Any]:
    """TinyNet, global batch 8 (micro 2 x accumulation 2 x 2 ranks), STEPS steps; the comm volume per step."""
    engine, _, _, _ = deepshard.initialize(model=make_model(), config=onebit_config(dtype=dtype))
    engine.optimizer.exact_exchange = exact
    batches = make_batches(STEPS, 8)
    losses, volumes, local = [], [], []
    for batch in batches:
        engine.comms_logger.reset()
        local.append(engine.strategy._local_gradients())
        losses += run_steps(engine, [batch], 2, 2, rank, world)
        volumes.append(engine.comms_logger.summary())
    weights = full_weights(engine)
    flat = torch.cat([t.reshape(-1) for t in weights.values()])
    spread = [flat.clone(), flat.clone()]
    dist.all_reduce(spread[0], op=dist.ReduceOp.MAX)
    dist.all_reduce(spread[1], op=dist.ReduceOp.MIN)
    return {"losses": losses, "weights": weights, "volumes": volumes, "local": local,
            "memory": engine.memory_report(), "rank_spread": float((spread[0] - spread[1]).abs().max())}


def teacher_run(rank: int, world: int, optimizer: dict[str, Any], exact: bool = False, steps: int = 60
                ) -> dict[str, Any]:
    """A learnable task (a 64-256-64 MLP, 33k parameters, fitting a fixed random teacher) with micro batch
    16 per rank: the per-step losses and comm volume (bytes moved per process)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    teacher = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)) / 8
    engine, _, _, _ = deepshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "optimizer": optimizer,
        "zero_optimization": {"stage": 0}})
    if exact:
        engine.optimizer.exact_exchange = True
    losses, volumes = [], []
    for step in range(steps):
        engine.comms_logger.reset()
        x = torch.randn(16 * world, 64, generator=torch.Generator().manual_seed(100 + step))
        mine = x[16 * rank:16 * (rank + 1)]
        loss = (engine(mine) - torch.tanh(mine @ teacher)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        volumes.append(engine.comms_logger.total_volume_bytes())
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return {"losses": losses, "volumes": volumes, "numel": sum(p.numel() for p in model.parameters()),
            "last": engine.comms_logger.summary()}


def teacher_world(rank: int, world: int) -> dict[str, Any]:
    adam = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}}
    onebit = {"type": "OneBitAdam", "params": {"lr": 3e-3, "freeze_step": TEACHER_FREEZE}}
    return {"adam": teacher_run(rank, world, adam), "onebit": teacher_run(rank, world, onebit),
            "exact": teacher_run(rank, world, onebit, exact=True)}


def raw_exchange(rank: int, world: int, rounds: int = 60) -> dict[str, Any]:
    """CompressedAverage alone: every rank ends with the same tensors; the running sum of its outputs
    tracks the running sum of the exact averages (the errors are carried, not lost)."""
    comm = CommGroup(name="dp")
    shapes = [(5, 7), (3,), (40,)]
    exchange = CompressedAverage(comm, [int(torch.Size(s).numel()) for s in shapes], torch.device("cpu"))
    gen = torch.Generator().manual_seed(10 + rank)
    drift = [torch.randn(s, generator=torch.Generator().manual_seed(5)) for s in shapes]
    sent_sum = [torch.zeros(s) for s in shapes]
    exact_sum = [torch.zeros(s) for s in shapes]
    gaps = []
    for _ in range(rounds):
        mine = [d * (1 + rank) + 0.5 * torch.randn(d.shape, generator=gen) for d in drift]
        exact = [t.clone() for t in mine]
        for t in exact:
            dist.all_reduce(t)
            t.div_(world)
        exchange(mine)
        for s, e, m, x in zip(sent_sum, exact_sum, mine, exact):
            s += m
            e += x
        gaps.append(float(torch.cat([(s - e).reshape(-1) for s, e in zip(sent_sum, exact_sum)]).norm()))
    flat = torch.cat([t.reshape(-1) for t in mine])
    copies = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    exact_norm = float(torch.cat([e.reshape(-1) for e in exact_sum]).norm())
    return {"identical": all(torch.equal(c, copies[0]) for c in copies), "gaps": gaps, "exact_norm": exact_norm,
            "summary": comm.logger.summary(), "wire": exchange.wire_bytes(), "state_bytes": exchange.state_bytes()}


def onebit_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Every 1-bit Adam check of one 2-process world."""
    return {"resume": resume(rank, world, tmp), "raw": raw_exchange(rank, world), "exact": train_onebit(rank, world, exact=True),
            "compressed": train_onebit(rank, world, exact=False),
            "bf16": train_onebit(rank, world, exact=False, dtype="bf16"),
            "teacher": teacher_world(rank, world), "refused": refused_stage(rank, world)}


def refused_stage(rank: int, world: int) -> str:
    config = onebit_config()
    config["zero_optimization"]["stage"] = 2
    try:
        deepshard.initialize(model=make_model(), config=config)
    except ValueError as exc:
        return str(exc)
    return "not refused"



def resume(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Save after a compressed step, load into a fresh engine: the state (momentum, frozen variance, step)
    comes back, the compression errors start from zero, and training goes on compressed."""
    config = onebit_config()
    engine, _, _, _ = deepshard.initialize(model=make_model(), config=config)
    batches = make_batches(6, 8)
    run_steps(engine, batches[:5], 2, 2, rank, world)
    engine.save_checkpoint(tmp, tag="t")
    saved_state = {k: v.clone() for k, v in engine.optimizer.state[engine.optimizer.param_groups[0]["params"][0]].items()}
    fresh, _, _, _ = deepshard.initialize(model=make_model(seed=7), config=config)
    fresh.load_checkpoint(tmp, tag="t")
    loaded = fresh.optimizer.state[fresh.optimizer.param_groups[0]["params"][0]]
    same_state = all(torch.equal(saved_state[k], loaded[k]) for k in saved_state)
    out = {"same_state": same_state, "errors_reset": fresh.optimizer.exchange is None,
           "compressing": fresh.optimizer.reduces_gradients,
           "same_weights": all(torch.equal(a, b) for a, b in zip(full_weights(engine).values(),
                                                                  full_weights(fresh).values()))}
    out["losses"] = run_steps(fresh, batches[5:], 2, 2, rank, world)
    out["volume"] = fresh.comms_logger.summary()
    return out
