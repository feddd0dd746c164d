"""Cross-entropy over logits split along the vocabulary, without gathering them.

Each rank holds ``[..., V/t]`` logits. The loss ``log(sum_j exp(z_j)) - z_target`` needs three sums
over the vocabulary, each an all-reduce of one scalar per token (Megatron, ``vocab_parallel_cross_entropy``):
the maximum (for a stable exponent), the target's logit (held by one rank, zero elsewhere) and the sum
of the exponentials. The gradient, ``softmax - onehot(target)``, is local to each rank's slice.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepshard.comm.group import CommGroup


def _all_reduce(x: torch.Tensor, group: CommGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if group.size > 1:
        group.all_reduce(x, op=op)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: CommGroup,
                ignore_index: int) -> torch.Tensor:
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # 16-bit logits: fp32 sums
        local_vocab = z.shape[-1]
        start = group.rank * local_vocab
        top = _all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
        z = z - top.unsqueeze(-1)
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < start + local_vocab)
        local_target = (target - start).masked_fill(~mine, 0)
        picked = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        picked = _all_reduce(picked, group)
        exp = z.exp_()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        loss = (sum_exp.log() - picked).masked_fill(~valid, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # the softmax, this rank's columns
        ctx.save_for_backward(exp, mine, local_target, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, mine, local_target, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss.to(grad.dtype) * valid.to(grad.dtype)).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: CommGroup,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of vocab-parallel ``logits`` (``[..., V/t]``, this rank's columns in rank order)
    against global ``target`` ids (``[...]``). ``reduction``: ``none`` (per token, 0 where ignored),
    ``sum``, or ``mean`` over the tokens whose target is not ``ignore_index`` (as ``F.cross_entropy``).
    Three all-reduces of one float per token; the logits are never gathered."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
                         f"{tuple(target.shape)} must agree on every dimension but the last")
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (target != ignore_index).sum().clamp(min=1)
    raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r}; use 'mean', 'sum' or 'none'")
