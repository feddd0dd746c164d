"""Whole tensors from tensor-parallel slices: what ``save_16bit_model`` writes under TP, so the file is
the model's own state dict (a Hugging Face model loads it with ``from_pretrained``)."""
from __future__ import annotations

import torch

from deepshard.comm.group import CommGroup
from deepshard.tp.params import unshard
from deepshard.placement import split_of


def gather_tensor_parallel(state: dict[str, torch.Tensor], module: torch.nn.Module,
                           group: CommGroup) -> dict[str, torch.Tensor]:
    """``state`` (``module``'s state dict or a subset, by name) with every tensor-parallel slice replaced by
    the full tensor (collective over ``group``: every rank calls it with the same names)."""
    if group.size == 1 or not state:
        return state
    splits = {name: split_of(p) for name, p in module.named_parameters(remove_duplicate=False)}
    out: dict[str, torch.Tensor] = {}
    for name in sorted(state):
        value, split = state[name], splits.get(name)
        if split is None:
            out[name] = value
            continue
        local = value.detach().contiguous()
        gathered = torch.empty(group.size * local.numel(), dtype=local.dtype, device=local.device)
        group.all_gather_into_tensor(gathered, local.reshape(-1))
        out[name] = unshard(list(gathered.view(group.size, *local.shape).unbind(0)), split.dim, split.fused)
    return {name: out[name] for name in state}
