"""The gradient norm of a tensor-parallel model: split parameters summed over the group, replicated
parameters counted once.

Each rank's split parameters hold disjoint slices of the full tensors, so their squared norms add up
over the tensor-parallel group; a replicated parameter (a norm, a row-parallel bias) has the same
gradient on every rank and is counted from this rank only, before the sum would multiply it by t.
"""
from __future__ import annotations

from typing import Iterable

import torch

from deepshard.comm.group import CommGroup
from deepshard.tp.params import is_tp_split


def tp_grad_norm_squared(params: Iterable[torch.Tensor], group: CommGroup) -> torch.Tensor:
    """The squared 2-norm of the full model's gradient (fp32), the same on every rank of ``group``."""
    split = torch.zeros((), dtype=torch.float32)
    replicated = torch.zeros((), dtype=torch.float32)
    for p in params:
        if p.grad is None:
            continue
        sq = p.grad.detach().float().pow(2).sum().cpu()
        if is_tp_split(p):
            split += sq
        else:
            replicated += sq
    if group.size > 1:
        split = group.all_reduce_sum_scalar(split)
    return split + replicated


def clip_tp_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, group: CommGroup,
                       eps: float = 1e-6) -> torch.Tensor:
    """Scale the gradients so the full model's norm is at most ``max_norm`` (``torch.nn.utils.
    clip_grad_norm_`` across the tensor-parallel group); returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    norm = tp_grad_norm_squared(params, group).sqrt()
    coef = float(max_norm) / (float(norm) + eps)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
    return norm
