"""The same workloads measured two ways: every rank of a real gloo world (``dryrun.runner.measure``), and
each rank alone over the fake process group (``dryrun.runner.run_callable``). ``test_dryrun.py`` compares."""
from __future__ import annotations

import dataclasses
import gc
import os
import tempfile
from typing import Any, Callable

import torch.distributed as dist

STEPS = 3
WIDTH = 48  # TinyNet width: tensors, not Python objects, dominate the peak

WORKLOADS: dict[str, dict[str, Any]] = {
    "zero0_fp32": {"zero_optimization": {"stage": 0}},
    "zero1_bf16": {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}},
    "zero2_gas2": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 2000}, "gradient_accumulation_steps": 2},
    "zero3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
    "tp2_zero1": {"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}, "model": "llama"},
    "pp2_zero1": {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2, "model": "pipe"},
}


def _model(kind: str) -> Any:
    import torch

    torch.manual_seed(0)
    if kind == "pipe":
        from deepshard.pipe import PipelineModule
        from tests.multiproc.scenarios_pipe import layers, lm_loss

        return PipelineModule(layers(), num_stages=2, loss_fn=lm_loss, seed_layers=True)
    if kind == "llama":
        from tests.multiproc.tp_models import LlamaLike, LlamaLikeConfig

        return LlamaLike(LlamaLikeConfig(num_key_value_heads=4))
    from tests.multiproc.models import TinyNet

    return TinyNet(WIDTH)


def _batch(kind: str, step: int, rows: int) -> tuple[Any, ...]:
    import torch

    g = torch.Generator().manual_seed(100 + step)
    if kind == "llama":
        ids = torch.randint(0, 32, (rows, 9), generator=g)
        return ids[:, :-1], ids[:, 1:]
    from tests.multiproc.models import CLASSES, IN_FEATURES

    return torch.randn(rows, IN_FEATURES, generator=g), torch.randint(0, CLASSES, (rows,), generator=g)


def workload(name: str, save_dir: str) -> Callable[[], None]:
    """A training script as a function: the workload's model and config, STEPS optimizer steps, one save."""

    def body() -> None:
        # Python's cycle collector runs when its allocation counters say, which differ between the real rank
        # and the dry run (other Python objects): a tensor held by a reference cycle would count in one
        # peak and not the other. Off while the script runs, both sides free exactly the same tensors.
        gc.collect()
        gc.disable()
        try:
            _train(name, save_dir)
        finally:
            gc.enable()

    return body


def _train(name: str, save_dir: str) -> None:
    import deepshard
    from tests.multiproc.models import model_inputs

    extra = dict(WORKLOADS[name])
    kind = extra.pop("model", "tiny")
    gas = int(extra.pop("gradient_accumulation_steps", 1))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0, **extra}
    engine, *_ = deepshard.initialize(model=_model(kind), config=config)
    dp, dp_rank = engine.topology.dims.dp, engine.topology.coord.dp
    if kind == "pipe":
        from tests.multiproc.scenarios_pipe import _data

        for step in range(STEPS):
            engine.train_batch(_data(1, gas, dp, dp_rank))
        engine.save_checkpoint(save_dir, tag="end")
        return
    for step in range(STEPS):
        batch = _batch(kind, step, 2 * gas * dp)
        for k in range(gas):
            rows = slice((k * dp + dp_rank) * 2, (k * dp + dp_rank) * 2 + 2)
            engine.backward(engine(*model_inputs(engine, *(t[rows] for t in batch))))
            engine.step()
    engine.save_checkpoint(save_dir, tag="end")


def real_world(rank: int, world: int, names: list[str], tmp: str, memory: bool = True) -> dict[str, Any]:
    """This rank of a real world running each workload, watched as a dry run watches (on the transport a
    dry run imitates: gloo's pairwise exchanges, not the one-host shared memory)."""
    from deepshard.dryrun.runner import measure

    os.environ["DEEPSHARD_SHM"] = "0"
    return {name: dataclasses.asdict(measure(workload(name, os.path.join(tmp, name)), max_steps=0, name=name,
                                             memory=memory)) for name in names}


def dry_ranks(names: list[str], world: int, ranks: list[int], memory: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Each rank of ``ranks`` dry-run alone for each workload, one after the other in this process."""
    import torch

    from deepshard.dryrun.runner import run_callable

    torch.set_num_threads(1)  # as the real world's processes run: several threads on a shared machine are far slower

    out: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out[name] = [dataclasses.asdict(run_callable(workload(name, tmp), world, rank, max_steps=0, name=name,
                                                         memory=memory)) for rank in ranks]
    return out
