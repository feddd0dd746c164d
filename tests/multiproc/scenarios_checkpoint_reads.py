"""What each rank reads at ``load_checkpoint``: counted with ``deepshard.checkpoint.ledger.track_io``.

A pipeline stage reads the manifest, the engine files, its own RNG file and the rank files of its own
stage, each exactly once (verified as it is read), and nothing of the other stage; a data-parallel rank
never opens another rank's RNG file and never reads a file twice. Under ZeRO 1-3 a rank reads the tensor
file of its own partition only (bytes ~ its share), and the weights and optimizer state come back equal."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import deepshard
from deepshard.checkpoint.ledger import track_io
from tests.multiproc.models import make_batches, make_model, micro_slice, optimizer_config
from tests.multiproc.scenarios_pipe import _data, _engine


def _sizes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}


def _reads(ledger: Any) -> dict[str, int]:
    return {os.path.basename(path): n for path, n in ledger.read.items()}


def _states(engine: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's full fp32 value and Adam moments (collectives: every rank calls)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = engine.strategy.full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq") if p.requires_grad else ():
            out[f"{name}/{key}"] = engine.strategy.full_optimizer_state(p, key).clone()
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def pipeline_reads(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """pp=2 x dp=world/2 at ZeRO-1: save after one batch, then a fresh engine loads while its reads are
    counted; the stage's parameters must come back equal."""
    model, engine = _engine(2, 2, zero=1)
    dp, coord = world // 2, engine.topology.coord
    engine.train_batch(_data(1, 2, dp, coord.dp))
    saved = _states(engine, model)
    engine.save_checkpoint(tmp, tag="p")
    engine.destroy()
    model, engine = _engine(2, 2, zero=1, seed_layers=False)
    with track_io() as ledger:
        engine.load_checkpoint(tmp, tag="p")
    same = _equal(saved, _states(engine, model))
    engine.destroy()
    dist.barrier()
    return {"stage": coord.pp, "reads": _reads(ledger), "sizes": _sizes(Path(tmp) / "p"), "same": same}


def data_parallel_reads(rank: int, world: int, tmp: str, stage: int = 2) -> dict[str, Any]:
    """dp=world at ZeRO ``stage`` on a model with a buffer and a frozen layer: save, load, count."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": optimizer_config(), "zero_optimization": {"stage": stage}}
    engine, *_ = deepshard.initialize(model=make_model(), config=config)
    batch = make_batches(1, 2 * world)[0]
    engine.backward(engine(*micro_slice(batch, 2, 0, rank, world)))
    engine.step()
    engine.save_checkpoint(tmp, tag="d")
    fresh, *_ = deepshard.initialize(model=make_model(seed=3), config=config)
    with track_io() as ledger:
        fresh.load_checkpoint(tmp, tag="d")
    same = all(torch.equal(a, b) for a, b in zip(engine.module.state_dict().values(), fresh.module.state_dict().values()))
    same = same and _equal(_states(engine, engine.module), _states(fresh, fresh.module))
    if stage == 3:  # the forward of the loaded engine uses the gathered weights: the same loss as the saver's
        x = micro_slice(batch, 2, 0, rank, world)
        with torch.no_grad():
            same = same and torch.equal(engine(*x), fresh(*x))
    return {"reads": _reads(ledger), "sizes": _sizes(Path(tmp) / "d"), "same": same,
            "deepspeed": _deepspeed_reads(engine, config, Path(tmp), world, stage)}


def _deepspeed_reads(engine: Any, config: dict[str, Any], tmp: Path, world: int, stage: int) -> dict[str, Any]:
    """The same tag written in DeepSpeed's layout for this grid (rank 0 converts), loaded by an engine of other
    initial weights while its reads are counted: what comes back must equal the saver's state."""
    from deepshard.checkpoint.deepspeed_format.write import read_source, write_deepspeed

    target = tmp / "deepspeed"
    if dist.get_rank() == 0:
        write_deepspeed(read_source(tmp / "d"), target, "d", world, stage, lambda items, what: items)
    dist.barrier()
    fresh, *_ = deepshard.initialize(model=make_model(seed=5), config=config)
    with track_io() as ledger:
        fresh.load_checkpoint(str(target), tag="d")
    same = _equal(_states(engine, engine.module), _states(fresh, fresh.module))
    numels = [(n, int(getattr(p, "ds_numel", p.numel()))) for n, p in fresh.module.named_parameters() if p.requires_grad]
    dist.barrier()
    return {"reads": _reads(ledger), "sizes": _sizes(target / "d"), "same": same,
            "share": fresh.strategy.load_share(), "numels": numels}


def checkpoint_reads(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Both scenarios in one world."""
    return {"pipeline": pipeline_reads(rank, world, os.path.join(tmp, "pipe")),
            "dp": data_parallel_reads(rank, world, os.path.join(tmp, "dp")),
            "dp3": data_parallel_reads(rank, world, os.path.join(tmp, "dp3"), stage=3)}
