"""What each rank runs for the hybrid sharding (MiCS) and ZeRO++ (hpZ, qwZ, qgZ) tests. Worlds of 4 ranks
fake 2 machines of 2 ranks with ``DEEPSHARD_NODE_SIZE=2`` (set before the engine is built)."""
from __future__ import annotations

import os
from typing import Any

import torch

import deepshard
from tests.multiproc.models import make_token_batches, make_transformer
from tests.multiproc.scenarios_stage0 import full_weights, run_steps
from tests.multiproc.scenarios_stage3 import z3_config

STEPS = 3


def _config(stage: int, micro: int, gas: int, dtype: str = "fp32", **zero: Any) -> dict[str, Any]:
    cfg = z3_config(micro, gas, dtype, **zero)
    cfg["zero_optimization"]["stage"] = stage
    return cfg


def _train(rank: int, world: int, cfg: dict[str, Any], steps: int = STEPS) -> dict[str, Any]:
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    engine, *_ = deepshard.initialize(model=make_transformer(), config=cfg)
    engine.comms_logger.reset()
    losses = run_steps(engine, make_token_batches(steps, 8), micro, gas, rank, world)
    comms = engine.comms_logger  # read before full_weights, whose assembly is a collective too
    out = {"losses": losses, "summary": comms.summary(), "links": comms.link_summary(),
           "inter": comms.inter_node_bytes(), "intra": comms.intra_node_bytes(), "report": engine.memory_report()}
    out["weights"] = full_weights(engine)
    return out


def layouts(rank: int, world: int, cases: list[tuple[str, int, int, int, dict[str, Any]]],
            node_size: int = 2) -> dict[str, Any]:
    """Each case ``(name, stage, micro, gas, zero keys)`` trained for ``STEPS`` steps of the global batch 8,
    on fake machines of ``node_size`` ranks."""
    os.environ["DEEPSHARD_NODE_SIZE"] = str(node_size)
    out = {}
    for name, stage, micro, gas, zero in cases:
        dtype = zero.pop("dtype", "fp32")
        out[name] = _train(rank, world, _config(stage, micro, gas, dtype, **zero))
    return out


def save_and_resume(rank: int, world: int, tmp: str, zero: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Train 2 steps with ``zero``, saving after the first; a second engine (same keys) loads the checkpoint
    and runs step 2 again: its loss and weights must equal the uninterrupted run's. A third engine, of
    another layout (``other``: its stage and keys), loads it too."""
    os.environ["DEEPSHARD_NODE_SIZE"] = "2"
    batches = make_token_batches(2, 8)
    micro = 8 // world
    engine, *_ = deepshard.initialize(model=make_transformer(), config=_config(3, micro, 1, **zero))
    first = run_steps(engine, batches[:1], micro, 1, rank, world)
    engine.save_checkpoint(tmp, tag="one")
    after_first = full_weights(engine)
    second = run_steps(engine, batches[1:], micro, 1, rank, world)
    out = {"first": first, "second": second, "after_first": after_first, "uninterrupted": full_weights(engine)}
    resumed, *_ = deepshard.initialize(model=make_transformer(seed=5), config=_config(3, micro, 1, **zero))
    resumed.load_checkpoint(tmp, tag="one")
    out["again"] = run_steps(resumed, batches[1:], micro, 1, rank, world)
    out["resumed"] = full_weights(resumed)
    out["other"] = load_elsewhere(rank, world, tmp, other)
    return out


def load_elsewhere(rank: int, world: int, tmp: str, other: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights an engine of ``other`` (``stage`` and zero keys) reads from the checkpoint ``tmp``/one."""
    other = dict(other)
    stage = other.pop("stage", 3)
    engine, *_ = deepshard.initialize(model=make_transformer(seed=6), config=_config(stage, 8 // world, 1, **other))
    engine.load_checkpoint(tmp, tag="one")
    return full_weights(engine)


def load_many(rank: int, world: int, cases: list[tuple[str, dict[str, Any]]]) -> list[dict[str, torch.Tensor]]:
    return [load_elsewhere(rank, world, tmp, other) for tmp, other in cases]


def pieces(rank: int, world: int) -> dict[str, Any]:
    """The quantized collectives alone, on fake machines of 2 ranks: a two-hop qgZ reduce-scatter and a
    hierarchical (and quantized) all-gather against their unquantized sums and gathers."""
    os.environ["DEEPSHARD_NODE_SIZE"] = "2"
    from deepshard.comm.hierarchical import hierarchical_all_gather, quantized_all_gather, quantized_reduce_scatter
    from deepshard.topology import ParallelDims, Topology
    from deepshard.zero.hierarchy import ZeroPlusPlus, build

    topo = Topology.build(ParallelDims(dp=world))
    groups = build(topo, ZeroPlusPlus(quantized_gradients=True, mics_hierarchical_params_gather=True))
    h = groups.hierarchy
    assert h is not None
    chunk = 3000
    g = torch.Generator().manual_seed(rank)
    full = torch.randn(world * chunk, generator=g)
    out: dict[str, Any] = {"intra": list(h.intra.peers), "inter": list(h.inter.peers)}
    for bits in (8, 4):
        work = quantized_reduce_scatter(full, chunk, h, bits)
        work.wait()
        out[f"rs{bits}"] = work.result
    out["input"] = full
    shard = torch.randn(chunk, generator=g)
    gathered = torch.empty(world * chunk)
    hierarchical_all_gather(h, gathered, shard).wait()
    out["hgather"] = gathered.clone()
    quantized_all_gather(topo.dp, gathered, shard).wait()
    out["qgather"] = gathered.clone()
    quantized_all_gather(topo.dp, gathered, shard, h=h).wait()
    out["qhgather"] = gathered.clone()
    out["shard"] = shard
    return out


def save_many(rank: int, world: int, runs: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    return [save_and_resume(rank, world, tmp, zero, other) for tmp, zero, other in runs]


def everything(rank: int, world: int, cases: list[tuple[str, int, int, int, dict[str, Any]]],
               runs: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The whole 4-rank part of the tests in one world (a spawned world costs more than most of its cases):
    the collectives alone, the layouts' training, then the checkpoint runs."""
    return {"pieces": pieces(rank, world), "trained": layouts(rank, world, cases), "saved": save_many(rank, world, runs)}
