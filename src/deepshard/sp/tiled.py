"""Tiled compute for long sequences (DeepSpeed's ``TiledMLP``, ``TiledFusedLogitsLoss``,
``sequence_tiled_compute``): run a function over slices of the sequence so its large intermediate (the
MLP's hidden activations, the full-vocabulary logits) exists for one slice at a time.

The forward runs without a graph; the backward recomputes each slice with one, takes its gradient, and
adds the parameters' gradients up over the slices before handing them to autograd once (so a ZeRO
gradient hook fires once per parameter, with the upstream gradient applied: DeepSpeed's tiled loss
accumulates parameter gradients inside its forward instead, without the factor a caller applies to the loss
afterwards, such as gradient accumulation's 1/steps).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch


def _params(module: Any, compute_params: Optional[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    found: dict[int, torch.Tensor] = {}
    if isinstance(module, torch.nn.Module):
        found.update((id(p), p) for p in module.parameters() if p.requires_grad)
    found.update((id(p), p) for p in (compute_params or []) if p.requires_grad)
    return list(found.values())


def _recompute_backward(pieces: Sequence[tuple[Callable[[], torch.Tensor], torch.Tensor, Any]],
                        params: list[torch.Tensor]) -> None:
    """For each ``(run, x_piece, grad_out)``: ``x_piece.grad`` gets its gradient and the parameter
    gradients are summed; then handed to autograd once."""
    sums: list[Optional[torch.Tensor]] = [None] * len(params)
    for run, x_piece, grad_out in pieces:
        with torch.enable_grad():
            out = run()
        if torch.is_tensor(grad_out) and grad_out.dim() == 0 and out.dim() > 0:
            grad_out = grad_out.expand_as(out)  # a reduction's gradient: the same for every element
        inputs = ([x_piece] if x_piece.requires_grad else []) + params
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
        if x_piece.requires_grad:
            x_piece.grad = grads[0]
            grads = grads[1:]
        for i, g in enumerate(grads):
            if g is not None:
                sums[i] = g if sums[i] is None else sums[i] + g
    ready = [(p, g) for p, g in zip(params, sums) if g is not None]
    if ready:
        torch.autograd.backward([p for p, _ in ready], [g for _, g in ready])


class TiledMLP(torch.autograd.Function):
    """``TiledMLP.apply(fn, self, x, shards, compute_params)``: ``fn(self, x)`` over ``shards`` slices of
    ``x`` along its second-to-last dimension (the sequence)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], self: Any, x: torch.Tensor, shards: int,
                compute_params: Optional[Sequence[torch.Tensor]]) -> torch.Tensor:
        ctx.fn, ctx.module, ctx.shards, ctx.compute_params = fn, self, shards, compute_params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(self, piece) for piece in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        (x,) = ctx.saved_tensors
        pieces = [p.detach().requires_grad_(x.requires_grad) for p in torch.chunk(x, ctx.shards, dim=-2)]
        grads = torch.chunk(grad, ctx.shards, dim=-2)
        _recompute_backward([(lambda p=p: ctx.fn(ctx.module, p), p, g) for p, g in zip(pieces, grads)],
                            _params(ctx.module, ctx.compute_params))
        x_grad = torch.cat([p.grad for p in pieces], dim=-2) if x.requires_grad else None
        return None, None, x_grad, None, None


class TiledFusedLogitsLoss(torch.autograd.Function):
    """``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)``: the
    mean (or sum) over ``shards`` slices of ``fn(self, x_slice, y_slice[, mask_slice])``, where ``x`` is
    [batch, seq, ...] flattened to tokens, so the logits of one slice exist at a time."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], self: Any, x: torch.Tensor, y: torch.Tensor,
                mask: Optional[torch.Tensor], shards: int, compute_params: Optional[Sequence[torch.Tensor]],
                output_reduction: str) -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"output_reduction={output_reduction!r}: use \"mean\" or \"sum\"")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must both be [batch, seq, ...]")
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(f"mask {tuple(mask.shape)} must be [batch, seq] = {tuple(x.shape[:2])}")
        ctx.fn, ctx.module, ctx.shards, ctx.compute_params = fn, self, shards, compute_params
        ctx.reduction, ctx.has_mask = output_reduction, mask is not None
        ctx.save_for_backward(x, y, mask if mask is not None else torch.empty(0))
        with torch.no_grad():
            outs = [fn(*args) for args in _loss_pieces(self, x, y, mask, shards)]
        stacked = torch.stack([o.reshape(()) for o in outs])
        return stacked.mean() if output_reduction == "mean" else stacked.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, y, mask = ctx.saved_tensors
        mask = mask if ctx.has_mask else None
        flat = x.detach().reshape(-1, *x.shape[2:])
        pieces = [p.detach().requires_grad_(x.requires_grad) for p in torch.chunk(flat, ctx.shards, dim=0)]
        weight = grad / len(pieces) if ctx.reduction == "mean" else grad
        jobs = []
        for piece, (_, _, *rest) in zip(pieces, _loss_pieces(ctx.module, x, y, mask, ctx.shards)):
            jobs.append((lambda piece=piece, rest=rest: ctx.fn(ctx.module, piece, *rest), piece, weight))
        _recompute_backward(jobs, _params(ctx.module, ctx.compute_params))
        x_grad = torch.cat([p.grad for p in pieces]).view_as(x) if x.requires_grad else None
        return None, None, x_grad, None, None, None, None, None


def _loss_pieces(module: Any, x: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor],
                 shards: int) -> list[tuple[Any, ...]]:
    xs = torch.chunk(x.reshape(-1, *x.shape[2:]), shards, dim=0)
    ys = torch.chunk(y.reshape(-1, *y.shape[2:]), shards, dim=0)
    if mask is None:
        return [(module, a, b) for a, b in zip(xs, ys)]
    return [(module, a, b, m) for a, b, m in zip(xs, ys, torch.chunk(mask.reshape(-1), shards, dim=0))]


class SequenceTiledCompute(torch.autograd.Function):
    """The generic form behind :func:`sequence_tiled_compute`."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], seqlen: int, shards: int, keys_to_shard: list[str],
                keys_to_pass: list[str], grad_requiring_tensor_key: str, compute_params: Any,
                output_unshard_dimension: int, output_reduction: Optional[str], *args: Any) -> torch.Tensor:
        values = list(args)
        sharded = dict(zip(keys_to_shard, values[:len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, values[len(keys_to_shard):]))
        step = math.ceil(seqlen / shards)
        ctx.fn, ctx.step, ctx.shards, ctx.key = fn, step, shards, grad_requiring_tensor_key
        ctx.sharded, ctx.passed, ctx.compute_params = sharded, passed, compute_params
        ctx.dim, ctx.reduction, ctx.nargs = output_unshard_dimension, output_reduction, len(values)
        ctx.index = (keys_to_shard + keys_to_pass).index(grad_requiring_tensor_key)
        with torch.no_grad():
            outs = [fn(**{k: v[:, i * step:(i + 1) * step] for k, v in sharded.items()}, **passed)
                    for i in range(shards)]
            result = _reduce(outs, output_unshard_dimension, output_reduction)
        ctx.total = sum(o.numel() for o in outs)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        full = ctx.sharded[ctx.key] if ctx.key in ctx.sharded else ctx.passed[ctx.key]
        if ctx.key not in ctx.sharded:
            raise NotImplementedError(f"sequence_tiled_compute: grad_requiring_tensor_key={ctx.key!r} must be one "
                                      "of kwargs_to_shard")
        jobs, pieces = [], []
        for i in range(ctx.shards):
            piece = full[:, i * ctx.step:(i + 1) * ctx.step].detach().requires_grad_(True)
            kwargs = {k: v[:, i * ctx.step:(i + 1) * ctx.step] for k, v in ctx.sharded.items()}
            kwargs[ctx.key] = piece
            g = _grad_piece(grad, i, ctx)
            jobs.append((lambda kwargs=kwargs: ctx.fn(**kwargs, **ctx.passed), piece, g))
            pieces.append(piece)
        _recompute_backward(jobs, _params(None, ctx.compute_params))
        out: list[Optional[torch.Tensor]] = [None] * (9 + ctx.nargs)
        out[9 + ctx.index] = torch.cat([p.grad for p in pieces], dim=1)
        return tuple(out)


def _reduce(outs: list[torch.Tensor], dim: int, reduction: Optional[str]) -> torch.Tensor:
    joined = torch.cat([o.unsqueeze(0) for o in outs], dim=0) if dim == 0 else torch.cat(outs, dim=dim)
    if reduction is None:
        return joined
    if reduction == "mean":
        return joined.mean()
    if reduction == "sum":
        return joined.sum()
    raise ValueError(f"output_reduction={reduction!r}: use None, \"mean\" or \"sum\"")


def _grad_piece(grad: torch.Tensor, i: int, ctx: Any) -> torch.Tensor:
    """The gradient of piece ``i``'s output: its slice of ``grad``, or a reduction's per-element factor."""
    if ctx.reduction is None:
        if ctx.dim == 0:
            return grad[i]
        return grad.narrow(ctx.dim, i * ctx.step, min(ctx.step, grad.shape[ctx.dim] - i * ctx.step))
    return grad / ctx.total if ctx.reduction == "mean" else grad


def sequence_tiled_compute(fn: Callable[..., torch.Tensor], seqlen: int, shards: int, kwargs_to_shard: dict[str, Any],
                           kwargs_to_pass: dict[str, Any], grad_requiring_tensor_key: str, compute_params: Any = None,
                           output_unshard_dimension: int = 1, output_reduction: Optional[str] = "mean") -> torch.Tensor:
    """``fn(**kwargs)`` over ``shards`` slices of the sequence (dimension 1 of every ``kwargs_to_shard``
    value), outputs joined along ``output_unshard_dimension`` then reduced (None, "mean", "sum"). Parameters
    get gradients when listed in ``compute_params``."""
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())
