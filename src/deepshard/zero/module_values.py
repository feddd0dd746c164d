"""The module's tensors a strategy saves and restores whole: buffers and frozen weights (``module_extra``),
and every value of a :class:`FullState` copied back into an unsharded module (stages 0-2)."""
from __future__ import annotations

import torch

from deepshard.shard_state import FullState


def module_extra_state(module: torch.nn.Module, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """Everything in the state dict that is not a trainable parameter: buffers and frozen parameters
    (the latter left out with ``exclude_frozen``)."""
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    frozen = ({n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
              if exclude_frozen else set())
    return {k: v.detach() for k, v in module.state_dict(keep_vars=True).items()
            if id(v) not in trainable and k not in frozen}


@torch.no_grad()
def load_module_values(module: torch.nn.Module, full: FullState) -> None:
    """Copy ``full``'s values into the module's (whole, unsharded) parameters, buffers and frozen weights;
    a name ``full`` lacks keeps its value (``checkpoint/`` has checked the names already)."""
    for key, value in module.state_dict(keep_vars=True).items():
        source_name = full.aliases.get(key, key)
        if source_name in full.params:
            src = full.params[source_name]
        elif key in full.module_extra:
            src = full.module_extra[key]
        else:
            continue
        if tuple(src.shape) != tuple(value.shape):
            raise ValueError(f"checkpoint tensor '{key}' has shape {tuple(src.shape)} but the model's is "
                             f"{tuple(value.shape)}; the checkpoint was saved from a different model")
        value.data.copy_(src)
