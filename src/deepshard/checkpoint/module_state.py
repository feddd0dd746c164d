"""Module-level pieces of a checkpoint: names, shapes, tied-weight aliases and frozen weights, and the one
check that a checkpoint's names fit the model (before any strategy takes a value from it)."""
from __future__ import annotations

from pathlib import Path

import torch

from deepshard.checkpoint.matching import check_names
from deepshard.placement import expert_of, saved_name, saved_names, saved_slice
from deepshard.shard_state import FullState


def other_experts(module: torch.nn.Module) -> set[str]:
    """Names of the experts other expert-parallel ranks hold: a checkpoint of the whole model has them, and
    they are this model's too."""
    every = {name for p in module.parameters() if (e := expert_of(p)) is not None for name in e.every_name}
    return every - set(saved_names(module).values())


def module_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Full shapes of the trainable parameters by canonical (saved) name (``ds_shape`` when sharded by stage 3)."""
    return {saved_name(p, n): saved_slice(p)[1] or tuple(getattr(p, "ds_shape", p.shape))
            for n, p in module.named_parameters() if p.requires_grad}


def param_aliases(module: torch.nn.Module) -> dict[str, str]:
    """state_dict names that refer to an already-named parameter (tied weights) -> the canonical name."""
    canonical = {id(p): n for n, p in module.named_parameters()}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if canonical[id(p)] != name:
            aliases[name] = canonical[id(p)]
    return aliases


def frozen_param_names(module: torch.nn.Module) -> list[str]:
    """state_dict names (as saved) of the frozen (``requires_grad=False``) parameters."""
    return [saved_name(p, n) for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad]


def checkpoint_names_vs_model(module: torch.nn.Module, full: FullState) -> tuple[list[str], list[str]]:
    """(missing, unexpected): the model's state-dict names (as saved: experts by global id) absent from
    ``full``, and ``full``'s tensor names the model does not have (tied-weight aliases and the experts other
    expert-parallel ranks hold count as present)."""
    renamed = saved_names(module)
    own = [renamed.get(k, k) for k in module.state_dict(keep_vars=True)]
    missing = [k for k in own if not full.has(k)]
    known = set(own) | set(full.aliases) | other_experts(module)
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
    renamed = saved_names(module)
    check_names([renamed.get(k, k) for k in module.state_dict(keep_vars=True)], missing, unexpected, strict, where)
