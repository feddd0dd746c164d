"""The module's tensors a strategy saves and restores whole: buffers and frozen weights (``module_extra``),
and every value of a :class:`FullState` copied back into an unsharded module (stages 0-2)."""
from __future__ import annotations

import torch

from deepshard.placement import local_part, saved_names
from deepshard.shard_state import FullState


def module_extra_state(module: torch.nn.Module, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """Everything in the state dict that is not a trainable parameter: buffers and frozen parameters
    (the latter left out with ``exclude_frozen``)."""
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    frozen = ({n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
              if exclude_frozen else set())
    renamed = saved_names(module)  # a frozen expert split over expert-parallel ranks: by its global id
    return {renamed.get(k, k): v.detach() for k, v in module.state_dict(keep_vars=True).items()
            if id(v) not in trainable and k not in frozen}


@torch.no_grad()
def load_module_values(module: torch.nn.Module, full: FullState) -> None:
    """Copy ``full``'s values into the module's (whole, unsharded) parameters, buffers and frozen weights;
    a name ``full`` lacks keeps its value (``checkpoint/`` has checked the names already)."""
    renamed = saved_names(module)  # experts split over expert-parallel ranks are saved by global id
    for key, value in module.state_dict(keep_vars=True).items():
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
