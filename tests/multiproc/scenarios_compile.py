"""What each rank runs for the torch.compile tests: compiled models at every ZeRO stage, and checkpoints
that move between compiled and plain models."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import deepshard
from torch.utils.checkpoint import checkpoint

from tests.multiproc.models import CLASSES, TinyNet, make_batches, make_model, optimizer_config
from tests.multiproc.scenarios_stage0 import full_weights, run_steps

GLOBAL_BATCH, STEPS = 8, 3
BACKEND = "aot_eager"  # dynamo + AOTAutograd, as inductor, without a C++ build per process


def _config(stage: int, world: int) -> dict[str, Any]:
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
            "optimizer": optimizer_config(), "gradient_clipping": 0.5,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                  "stage3_param_persistence_threshold": 0}}


def _engine(stage: int, world: int, compiled: bool) -> Any:
    torch._dynamo.reset()
    model = make_model()
    engine, *_ = deepshard.initialize(model=torch.compile(model, backend=BACKEND) if compiled else model,
                                      config=_config(stage, world))
    return engine


def _saved_names(directory: Path) -> list[str]:
    names = set()
    for path in directory.rglob("zero_rank*.json"):
        names.update(fragment[0] for fragment in json.loads(path.read_text())["fragments"])
    return sorted(names)


class ReadsChildWeight(torch.nn.Module):
    """Reads ``proj``'s weight without calling ``proj``: needs to be a ZeRO-3 leaf module."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.proj.weight.t()).pow(2).mean()


def leaf_module_hint(world: int) -> dict[str, Any]:
    """A module that reads a child's weight trains: marked as a leaf, and unmarked too (the read gathers the
    weight, as in DeepSpeed); compiled, where reads are not watched, its error names set_z3_leaf_modules."""
    out: dict[str, Any] = {}
    for leaf in (False, True, "compiled"):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = ReadsChildWeight()
        if leaf is True:
            deepshard.utils.set_z3_leaf_modules(model, [ReadsChildWeight])
        model = torch.compile(model, backend=BACKEND) if leaf == "compiled" else model
        engine, *_ = deepshard.initialize(model=model, config=_config(3, world))
        try:
            loss = engine(torch.randn(GLOBAL_BATCH // world, 8))
            engine.backward(loss)
            engine.step()
            out[leaf] = "trained"
        except RuntimeError as exc:
            out[leaf] = str(exc)
    return out


class CheckpointedNet(TinyNet):
    """TinyNet with its block under activation checkpointing (recomputed in backward)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + torch.tanh(self.frozen(h))
        h = h + checkpoint(self.block, h, use_reentrant=False)
        logits = self.head(h * self.scale) + self.odd[:CLASSES]
        return torch.nn.functional.cross_entropy(logits.float(), y)


def checkpointed_stages(rank: int, world: int) -> dict[Any, Any]:
    """Activation checkpointing (``use_reentrant=False``) at stages 0-3: losses and weights."""
    out: dict[Any, Any] = {}
    batches = make_batches(STEPS, GLOBAL_BATCH)
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = CheckpointedNet()
        engine, *_ = deepshard.initialize(model=model, config=_config(stage, world))
        losses = run_steps(engine, batches, GLOBAL_BATCH // world, 1, rank, world)
        out[stage] = {"losses": losses, "weights": full_weights(engine)}
    return out


def compiled_stages(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Losses and weights of a compiled model at stages 0-3 (stage 2 through ``engine.compile()``),
    and checkpoint round trips at stages 2 and 3: compiled -> plain and plain -> compiled, each
    resumed for the last step."""
    out: dict[str, Any] = {}
    batches = make_batches(STEPS, GLOBAL_BATCH)
    micro = GLOBAL_BATCH // world
    for stage in (0, 1, 2, 3):
        engine = _engine(stage, world, compiled=stage != 2)
        if stage == 2:
            engine.compile(backend=BACKEND)
        losses = run_steps(engine, batches, micro, 1, rank, world)
        out[("run", stage)] = {"losses": losses, "weights": full_weights(engine),
                               "is_compiled": engine.is_compiled}
    try:
        engine.compile(backend=BACKEND)
        out["stage3_engine_compile"] = "accepted"
    except NotImplementedError as exc:
        out["stage3_engine_compile"] = str(exc)
    out["leaf_hint"] = leaf_module_hint(world)
    out["checkpointed"] = checkpointed_stages(rank, world)
    for stage in (2, 3):  # 2: where the _orig_mod. keys were reported; 3: partitioned parameters
        for save_compiled in (True, False):
            save_dir = Path(tmp) / f"s{stage}-{save_compiled}"
            first = _engine(stage, world, compiled=save_compiled)
            head = run_steps(first, batches[:-1], micro, 1, rank, world)
            first.save_checkpoint(save_dir)
            second = _engine(stage, world, compiled=not save_compiled)
            second.load_checkpoint(save_dir)
            tail = run_steps(second, batches[-1:], micro, 1, rank, world)
            out[("resume", stage, save_compiled)] = {"losses": head + tail, "weights": full_weights(second),
                                                     "names": _saved_names(save_dir)}
    return out
