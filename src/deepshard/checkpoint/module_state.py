"""Module-level pieces of a checkpoint: names, shapes, tied-weight aliases and frozen weights, and the one
check that a checkpoint's names fit the model (before any strategy takes a value from it)."""
from __future__ import annotations

from pathlib import Path

import torch

from deepshard.checkpoint.matching import check_names
from deepshard.shard_state import FullState


def module_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Full shapes of the trainable parameters by canonical name (``ds_shape`` when sharded by stage 3)."""
    return {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters() if p.requires_grad}


def param_aliases(module: torch.nn.Module) -> dict[str, str]:
    """state_dict names that refer to an already-named parameter (tied weights) -> the canonical name."""
    canonical = {id(p): n for n, p in module.named_parameters()}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if canonical[id(p)] != name:
            aliases[name] = canonical[id(p)]
    return aliases


def frozen_param_names(module: torch.nn.Module) -> list[str]:
    """state_dict names of the frozen (``requires_grad=False``) parameters."""
    return [n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad]


def checkpoint_names_vs_model(module: torch.nn.Module, full: FullState) -> tuple[list[str], list[str]]:
    """(missing, unexpected): the model's state-dict names absent from ``full``, and ``full``'s tensor
    names the model does not have (tied-weight aliases count as present)."""
    own = list(module.state_dict(keep_vars=True))
    missing = [k for k in own if not full.has(k)]
    known = set(own) | set(full.aliases)
    # earlier ZeRO-3 checkpoints also saved non-persistent buffers (e.g. rotary inv_freq): not unexpected
    known |= {name for name, _ in module.named_buffers()}
    # a pipeline stage loads from a checkpoint of the whole model: the other stages' keys are expected
    known |= set(getattr(module, "pipeline_state_keys", lambda: ())())
    unexpected = [k for k in list(full.params) + list(full.module_extra) if k not in known]
    return missing, unexpected


def check_model_names(module: torch.nn.Module, full: FullState, strict: bool, where: Path) -> None:
    """Refuse (or, non-strict, warn about) a checkpoint whose names do not fit ``module``
    (``matching.check_names``); nothing has been changed when it refuses."""
    missing, unexpected = checkpoint_names_vs_model(module, full)
    check_names(list(module.state_dict(keep_vars=True)), missing, unexpected, strict, where)
