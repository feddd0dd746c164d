"""The model file ``deepshard plan`` reads, and the training run it dry-runs for each choice.

A model file is a Python file that defines:

* ``build_model()`` -> ``nn.Module`` whose ``forward(*batch)`` returns the loss; it may take
  ``activation_checkpointing: bool`` (then the plan tries both);
* ``sample_batch(micro_batch_size)`` -> the tuple of tensors one micro-batch passes to ``forward``;
* optionally ``pipeline_layers()`` (a ``PipelineModule``'s layer list), ``pipeline_loss(outputs, labels)``
  and ``pipeline_batch(micro_batch_size)`` -> ``(inputs, labels)``: then pipeline stages are tried too;
* optionally ``tensor_parallel = False`` when the model must not be split by automatic tensor parallelism.
"""
from __future__ import annotations

import inspect
import runpy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from deepshard.dryrun.plan_space import Choice


@dataclass(frozen=True)
class ModelFile:
    """What a model file provides (see the module docstring)."""

    path: Path
    build_model: Callable[..., torch.nn.Module]
    sample_batch: Callable[[int], tuple]
    pipeline_layers: Optional[Callable[[], list]] = None
    pipeline_loss: Optional[Callable[..., torch.Tensor]] = None
    pipeline_batch: Optional[Callable[[int], tuple]] = None
    tensor_parallel: bool = True

    @property
    def checkpointable(self) -> bool:
        return "activation_checkpointing" in inspect.signature(self.build_model).parameters

    @property
    def pipeline(self) -> bool:
        return None not in (self.pipeline_layers, self.pipeline_loss, self.pipeline_batch)


def load_model_file(path: str | Path) -> ModelFile:
    """Run ``path`` and take its functions; a ``ValueError`` names what is missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"deepshard plan: no model file at {path}")
    names = runpy.run_path(str(path), run_name="deepshard_plan_model")
    missing = [n for n in ("build_model", "sample_batch") if not callable(names.get(n))]
    if missing:
        raise ValueError(f"{path} defines no {' and no '.join(missing)}: a model file needs build_model() returning "
                         "a module whose forward(*batch) is the loss, and sample_batch(micro_batch_size) returning "
                         "that batch (see deepshard.dryrun.plan_model)")
    return ModelFile(path, names["build_model"], names["sample_batch"], names.get("pipeline_layers"),
                     names.get("pipeline_loss"), names.get("pipeline_batch"), bool(names.get("tensor_parallel", True)))


def _build(model: ModelFile, choice: Choice) -> torch.nn.Module:
    torch.manual_seed(0)
    if choice.pp > 1:
        from deepshard.pipe import PipelineModule

        if model.pipeline_layers is None:
            raise ValueError(f"{model.path} has no pipeline_layers(): pipeline stages cannot be tried")
        return PipelineModule(model.pipeline_layers(), num_stages=choice.pp, loss_fn=model.pipeline_loss,
                              activation_checkpoint_interval=1 if choice.checkpointing else 0)
    if model.checkpointable:
        return model.build_model(activation_checkpointing=choice.checkpointing)
    return model.build_model()


def training(model: ModelFile, choice: Choice, config: dict[str, Any], steps: int) -> Callable[[], None]:
    """A training script for ``choice`` as a function: ``steps`` optimizer steps on sample batches."""
    import deepshard

    def run() -> None:
        engine, *_ = deepshard.initialize(model=_build(model, choice), config=config)
        gas = engine.gradient_accumulation_steps()
        for step in range(steps):
            torch.manual_seed(1000 + step)  # every tensor-parallel rank draws the same batch
            if choice.pp > 1 and model.pipeline_batch is not None:
                engine.train_batch(iter([model.pipeline_batch(choice.micro) for _ in range(gas)]))
                continue
            for _ in range(gas):
                engine.backward(engine(*model.sample_batch(choice.micro)))
                engine.step()
        engine.destroy()

    return run
