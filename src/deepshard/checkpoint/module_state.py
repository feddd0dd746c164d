"""Module-level pieces of a checkpoint: names, shapes, tied-weight aliases, buffers and frozen weights."""
from __future__ import annotations

import torch

from pathlib import Path

from deepshard.checkpoint.fragments import FullState
from deepshard.checkpoint.matching import check_names
from deepshard.placement import expert_of, local_part, saved_name, saved_slice


def trainable_names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): saved_name(p, n) for n, p in module.named_parameters() if p.requires_grad}


def saved_names(module: torch.nn.Module) -> dict[str, str]:
    """State-dict name -> the name a checkpoint stores it under, where they differ: the parameters of
    experts split over expert-parallel ranks (``placement.saved_name``: their global expert id)."""
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        stored = saved_name(p, name)
        if stored != name:
            out[name] = stored
    return out


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


def module_extra_state(module: torch.nn.Module, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """Everything in the state dict that is not a trainable parameter: buffers and frozen parameters
    (the latter left out with ``exclude_frozen``)."""
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    frozen = set(frozen_param_names(module)) if exclude_frozen else set()
    renamed = saved_names(module)
    return {renamed.get(k, k): v.detach() for k, v in module.state_dict(keep_vars=True).items()
            if id(v) not in trainable and renamed.get(k, k) not in frozen}


def checkpoint_names_vs_model(module: torch.nn.Module, full: FullState) -> tuple[list[str], list[str]]:
    """(missing, unexpected): the model's state-dict names absent from ``full``, and ``full``'s tensor
    names the model does not have (tied-weight aliases count as present)."""
    renamed = saved_names(module)
    own = [renamed.get(k, k) for k in module.state_dict(keep_vars=True)]
    missing = [k for k in own if full.aliases.get(k, k) not in full.params and k not in full.module_extra]
    known = set(own) | set(full.aliases) | other_experts(module)
    # earlier ZeRO-3 checkpoints also saved non-persistent buffers (e.g. rotary inv_freq): not unexpected
    known |= {name for name, _ in module.named_buffers()}
    # a pipeline stage loads from a checkpoint of the whole model: the other stages' keys are expected
    known |= set(getattr(module, "pipeline_state_keys", lambda: ())())
    unexpected = [k for k in list(full.params) + list(full.module_extra) if k not in known]
    return missing, unexpected


@torch.no_grad()
def load_module_from_full(module: torch.nn.Module, full: FullState, strict: bool, where: Path) -> None:
    """Copy full fp32 values into the module's (whole, unsharded) parameters, buffers and frozen weights,
    after :func:`check_names` accepted the checkpoint (nothing is changed when it refuses)."""
    own = module.state_dict(keep_vars=True)
    renamed = saved_names(module)
    missing, unexpected = checkpoint_names_vs_model(module, full)
    check_names([renamed.get(k, k) for k in own], missing, unexpected, strict, where)
    for key, value in own.items():
        stored = renamed.get(key, key)
        source_name = full.aliases.get(stored, stored)
        if source_name in full.params:
            src = local_part(full.params[source_name], value)  # an AutoEP rank's slice of fused experts
        elif stored in full.module_extra:
            src = full.module_extra[stored]
        else:
            continue
        if tuple(src.shape) != tuple(value.shape):
            raise ValueError(f"checkpoint tensor '{key}' has shape {tuple(src.shape)} but the model's is "
                             f"{tuple(value.shape)}; the checkpoint was saved from a different model")
        value.data.copy_(src)
