"""Writing a parameter's sharded training state, and reading this rank's part of it: what DeepSpeed's
``safe_set_full_*``, ``safe_update_full_grad_vectorized`` and ``safe_get/set_local_*`` do
(``deepshard.utils``), on ZeRO stages 1-3.

A rank holds its *pieces* of each trainable parameter (``sharded_optimizer.ShardedOptimizer``): the fp32
value the optimizer updates, its optimizer state, its reduced gradient. A *full* write is given the whole
tensor on every rank (as DeepSpeed's are) and each rank keeps the ranges of its own pieces: no
communication. A *local* read or write is this rank's part only: at ZeRO-3 the range of the parameter
``param.ds_tensor`` holds (its pieces end to end), as in DeepSpeed, where the local value has
``ds_tensor.numel()`` elements (deepshard's part of a parameter may be of any length, 0 included: see
``stage3/surface.py``).

A new value also reaches the model's parameters (``publish``): stages 1-2 copy the full value into the
parameter every rank holds; stage 3 writes the pieces into this rank's parameter shard (``ds_tensor``), and
a full write also into the gathered values where a group is held gathered; after a local write such a
group is gathered again at its next forward, so the model computes with the new value there, as it does
for a parameter gathered on demand (every rank calls the local writer for the same parameters, each with
its part: that re-gather is a collective). Frozen parameters have no pieces: writes to them are ignored and
the local readers answer None, as DeepSpeed's do.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from deepshard.zero.offload.states import check_writable
from deepshard.zero.sharded_optimizer import ShardedOptimizer

Publish = Callable[[torch.nn.Parameter, list[tuple[int, torch.Tensor]], Optional[torch.Tensor]], None]
"""``publish(param, [(piece index, fp32 part)], full value or None)``: a new value into the model."""
GradWrite = Callable[[int, torch.Tensor], None]
"""``write(piece index, part)``: a piece's reduced gradient replaced."""


class FragmentAccess:
    """The writers and local readers of one strategy's pieces (see the module docstring). ``local``: whether
    the strategy partitions parameters (ZeRO-3), the only stage DeepSpeed's local calls are defined for."""

    def __init__(self, opt_shard: ShardedOptimizer, publish: Publish, write_grad: GradWrite, stage: int,
                 local: bool, grads_kept: bool = True) -> None:
        """``grads_kept``: False when no gradient is kept between backward and step (ZeRO-3's
        optimizer_step_in_backward applies each one as it is reduced)."""
        self.opt_shard, self.publish, self.write_grad = opt_shard, publish, write_grad
        self.stage, self.local_ok, self.grads_kept = stage, local, grads_kept

    # ------------------------------------------------------------------------------------ full
    @torch.no_grad()
    def set_full_fp32_param(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        if not self._trainable(param, value, full=True):
            return
        written: list[tuple[int, torch.Tensor]] = []
        self.opt_shard.scatter(param, value, lambda i, part: self._write_value(i, part, written))
        self.publish(param, written, value.detach().float())

    @torch.no_grad()
    def set_full_optimizer_state(self, param: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
        if self._trainable(param, value, full=True):
            self.opt_shard.scatter(param, value, lambda i, part: self.opt_shard.states.write_piece(i, None, {key: part}))

    @torch.no_grad()
    def set_full_grad(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        if self._trainable(param, value, full=True) and self._grads():
            self.opt_shard.scatter(param, value, self.write_grad)

    # ----------------------------------------------------------------------------------- local
    def local_fp32_param(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return self.opt_shard.local(param, self.opt_shard.states.piece_value) if self._local(param) else None

    def local_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        if not self._local(param):
            return None
        self._grads()
        return self.opt_shard.local(param, lambda i: self.opt_shard.grad_src[i])

    def local_optimizer_state(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        if not self._local(param):
            return None
        return self.opt_shard.local(param, lambda i: self.opt_shard.states.piece_state(i).get(key))

    @torch.no_grad()
    def set_local_fp32_param(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        if self._local(param):
            written: list[tuple[int, torch.Tensor]] = []
            self.opt_shard.write_local(param, value, lambda i, part: self._write_value(i, part, written))
            self.publish(param, written, None)

    @torch.no_grad()
    def set_local_optimizer_state(self, param: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
        if self._local(param):
            self.opt_shard.write_local(param, value, lambda i, part: self.opt_shard.states.write_piece(i, None, {key: part}))

    @torch.no_grad()
    def set_local_grad(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        if self._local(param) and self._grads():
            self.opt_shard.write_local(param, value, self.write_grad)

    # --------------------------------------------------------------------------------- helpers
    def _write_value(self, i: int, part: torch.Tensor, written: list[tuple[int, torch.Tensor]]) -> None:
        part = part.float()
        self.opt_shard.states.write_piece(i, part, {})
        written.append((i, part))

    def _trainable(self, param: torch.nn.Parameter, value: torch.Tensor, full: bool) -> bool:
        """Whether ``param`` has pieces to write (a frozen one has none: the write is ignored, as in
        DeepSpeed); a full value must have the parameter's number of elements."""
        if not self.opt_shard.owns(param):
            return False
        numel = int(getattr(param, "ds_numel", param.numel()))
        if full and value.numel() != numel:
            raise ValueError(f"the full value has {value.numel()} elements (shape {tuple(value.shape)}) but the "
                             f"parameter has {numel} (shape {tuple(getattr(param, 'ds_shape', param.shape))}): "
                             "pass a tensor of the parameter's full shape, on every rank")
        return True

    def _grads(self) -> bool:
        if not self.grads_kept:
            raise RuntimeError("with zero_optimization.optimizer_step_in_backward each gradient is applied and "
                               "dropped during backward, so there is none to read or write; turn the option off "
                               "to use the gradient calls")
        return True

    def _local(self, param: torch.nn.Parameter) -> bool:
        if not self.local_ok:
            raise TypeError(f"the safe_*_local_* calls are defined for ZeRO stage 3 parameters only (DeepSpeed's "
                            f"too); this parameter is trained at ZeRO stage {self.stage}, where every rank holds "
                            "it whole: use the safe_get_full_* / safe_set_full_* calls")
        return self.opt_shard.owns(param)


class WholeAccess:
    """The writers at ZeRO stage 0, where every rank holds every parameter, its fp32 master (16-bit
    training) and its optimizer state whole: a full write replaces them on this rank (the caller gives
    every rank the same value). ``target(param)``: the tensor the optimizer updates (master or parameter).
    There is no local part to read or write (``deepshard.utils`` refuses the local calls below stage 3)."""

    def __init__(self, optimizer: Optional[torch.optim.Optimizer],
                 target: Callable[[torch.nn.Parameter], torch.Tensor]) -> None:
        self.optimizer, self.target = optimizer, target

    @torch.no_grad()
    def set_full_fp32_param(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        if param.requires_grad:
            _check_numel(param, value)
            self.target(param).copy_(value.reshape(param.shape))
            param.copy_(value.reshape(param.shape))

    @torch.no_grad()
    def set_full_optimizer_state(self, param: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
        if not param.requires_grad or self.optimizer is None:
            return
        _check_numel(param, value)
        held = self.optimizer.state.get(self.target(param), {})
        check_writable(key, [k for k, v in held.items() if torch.is_tensor(v) and v.dim() > 0], held,
                       f"of shape {tuple(param.shape)}")
        held[key].copy_(value.reshape(held[key].shape))

    @torch.no_grad()
    def set_full_grad(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        if not param.requires_grad:
            return
        _check_numel(param, value)
        if param.grad is None:
            param.grad = value.detach().reshape(param.shape).to(param.dtype, copy=True)
        else:
            param.grad.copy_(value.reshape(param.shape))


def _check_numel(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    if value.numel() != param.numel():
        raise ValueError(f"the full value has {value.numel()} elements (shape {tuple(value.shape)}) but the parameter "
                         f"has {param.numel()} (shape {tuple(param.shape)}): pass a tensor of the parameter's shape")


def stage12_access(opt_shard: ShardedOptimizer, stage: int) -> FragmentAccess:
    """Stages 1-2: every rank holds each parameter whole in the model (views of its flat buffer), so a full
    value is copied there; a piece's gradient is a view of the reducer's buffer."""
    def publish(param: torch.nn.Parameter, written: list[tuple[int, torch.Tensor]], full: torch.Tensor | None) -> None:
        if full is not None:
            param.copy_(full.reshape(param.shape))

    def write_grad(i: int, part: torch.Tensor) -> None:
        opt_shard.grad_src[i].copy_(part)

    return FragmentAccess(opt_shard, publish, write_grad, stage, local=False)
