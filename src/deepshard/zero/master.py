"""fp32 master weights for 16-bit training, and pointing the optimizer at them.

The optimizer is built over the module's parameters (by the user or from the config). When the module
computes in fp16/bf16, each trainable parameter gets an fp32 master copy, made *before* the module is
cast so no precision is lost at initialization, and the optimizer's param groups are rewritten to hold
the masters. After each update the masters are copied back into the 16-bit parameters.
"""
from __future__ import annotations

import torch

from deepshard.placement import saved_name


def trainable_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters with ``requires_grad``, each once (tied weights appear once), in registration order."""
    return [p for p in module.parameters() if p.requires_grad]


def param_names(module: torch.nn.Module) -> dict[int, str]:
    """id(param) -> its first (canonical) name in ``named_parameters()``, as checkpoints store it (an expert
    split over expert-parallel ranks: with its global expert id, ``placement.saved_name``)."""
    return {id(p): saved_name(p, name) for name, p in module.named_parameters()}


def check_optimizer_params(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every tensor the optimizer updates must be one of the module's parameters."""
    known = {id(p) for p in module.parameters()}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in known:
                raise ValueError(
                    f"optimizer param_groups[{gi}] holds a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the model passed to deepshard.initialize; build the optimizer from "
                    "model.parameters() (or pass model_parameters=...) of that same model")


class MasterWeights:
    """fp32 copies of the trainable parameters that the optimizer updates in place of them."""

    def __init__(self, params: list[torch.nn.Parameter], master_dtype: torch.dtype = torch.float32) -> None:
        self.params = params
        self.masters: list[torch.nn.Parameter] = [
            torch.nn.Parameter(p.detach().to(master_dtype).clone(), requires_grad=True) for p in params]
        self._master_of = {id(p): m for p, m in zip(params, self.masters)}

    def master_of(self, param: torch.nn.Parameter) -> torch.nn.Parameter | None:
        return self._master_of.get(id(param))

    def swap_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Rewrite the optimizer's param groups (and any existing state) to hold the masters."""
        for group in optimizer.param_groups:
            group["params"] = [self._master_of.get(id(p), p) for p in group["params"]]
        for p in list(optimizer.state.keys()):
            m = self._master_of.get(id(p))
            if m is not None:
                state = optimizer.state.pop(p)
                optimizer.state[m] = {k: (v.to(m.dtype) if torch.is_tensor(v) and v.is_floating_point()
                                          and v.dim() > 0 else v) for k, v in state.items()}

    def set_grads(self, grads: list[torch.Tensor], multiplier: float) -> None:
        """master.grad = fp32(grad) * multiplier (a fresh tensor, freed again by ``clear_grads``)."""
        for m, g in zip(self.masters, grads):
            mg = g.detach().to(m.dtype, copy=True)
            if multiplier != 1.0:
                mg.mul_(multiplier)
            m.grad = mg

    def clear_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """Copy the updated masters back into the (16-bit) model parameters."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def nbytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.masters)
