"""``OneBitAdam``: Adam whose momentum, not its gradient, crosses the network after a warm-up, 1-bit
compressed with error feedback (Tang et al. 2021, arXiv 2102.02888; DeepSpeed's ``OneBitAdam`` config
type and parameter names).

- Steps ``1 .. freeze_step`` (warm-up): plain Adam on the gradient the ZeRO-0 strategy all-reduced in
  full precision. The update is torch's ``AdamW`` (decoupled weight decay, bias correction), so a
  warm-up step equals ``torch.optim.AdamW``'s.
- After: the variance ``v`` is frozen (with its bias correction at ``freeze_step``); the strategy no
  longer reduces gradients (``reduces_gradients``); each rank folds its *local* gradient into the
  momentum, ``m = b1 m + (1 - b1) g``, and the momenta are averaged with :class:`CompressedAverage`
  (1/32 of the fp32 volume). Because ``m`` is linear in ``g``, an exact average of the momenta is the
  momentum of the averaged gradient: compression is the only approximation, and its error is fed back.

Works with ZeRO stage 0 only (the strategy's gradient reduction is what it replaces), as DeepSpeed's.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from deepshard.comm.group import CommGroup
from deepshard.compression.exchange import CompressedAverage, ExactAverage


class CompressedCommOptimizer(torch.optim.Optimizer):
    """An optimizer that, from some step on, averages its own state over the data-parallel group, so the
    ZeRO-0 strategy must leave the gradients local (``reduces_gradients``)."""

    def attach(self, comm: CommGroup) -> None:
        """Bind the data-parallel group (the strategy calls it once)."""
        raise NotImplementedError

    @property
    def reduces_gradients(self) -> bool:
        """True when the next step exchanges state itself: gradients must not be all-reduced."""
        raise NotImplementedError

    def exchange_state_bytes(self) -> int:
        """Bytes of state the exchange carries between steps (compression errors)."""
        return 0

    def reset_exchange(self) -> None:
        """Drop the carried exchange state (after a checkpoint load)."""


class OneBitAdam(CompressedCommOptimizer):
    """DeepSpeed's ``{"type": "OneBitAdam", "params": {...}}``: see the module docstring.

    Args:
        params: parameters or parameter groups.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        freeze_step: warm-up steps of full-precision Adam before the variance is frozen and the
            compressed momentum exchange starts (DeepSpeed's default: 100000).
        bias_correction: Adam's bias correction (on, as in DeepSpeed).
        eps_inside_sqrt: ``sqrt(v + eps)`` instead of ``sqrt(v) + eps``.
        cuda_aware: accepted for DeepSpeed configs. comm_backend_name: 'nccl' (DeepSpeed's default) or
            'gloo'; the exchange runs over the engine's data-parallel group, whatever its backend; 'mpi',
            'hccl' and 'compressed' are refused.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl") -> None:
        if amsgrad:
            raise ValueError("optimizer OneBitAdam: amsgrad=true is not supported (as in DeepSpeed): its running "
                             "maximum of v is not frozen by 1-bit Adam; remove optimizer.params.amsgrad")
        if not isinstance(freeze_step, int) or isinstance(freeze_step, bool) or freeze_step < 1:
            raise ValueError(f"optimizer.params.freeze_step = {freeze_step!r} is invalid: expected a whole number "
                             ">= 1 of warm-up steps (DeepSpeed's default is 100000)")
        if str(comm_backend_name).lower() not in ("nccl", "gloo"):
            raise ValueError(f"optimizer.params.comm_backend_name = {comm_backend_name!r}: deepshard runs 1-bit "
                             "Adam's exchange over the engine's data-parallel process group (gloo or nccl) and has "
                             "no MPI, HCCL or 'compressed' backend; remove comm_backend_name (or set 'nccl')")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt)
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.comm_backend_name = comm_backend_name
        self.cuda_aware = cuda_aware
        self.comm: Optional[CommGroup] = None
        self.exchange: Optional[Callable[[list[torch.Tensor]], None]] = None
        self.exact_exchange = False
        """True: average the momenta with an uncompressed fp32 all-reduce (a reference for tests)."""

    # -------------------------------------------------------------------------------- the strategy's
    def attach(self, comm: CommGroup) -> None:
        self.comm = comm
        self.exchange = None

    @property
    def steps_done(self) -> int:
        """Optimizer steps applied so far (restored with the optimizer state from a checkpoint)."""
        steps = [int(state["step"]) for state in self.state.values() if "step" in state]
        return max(steps, default=0)

    @property
    def reduces_gradients(self) -> bool:
        return self.steps_done >= self.freeze_step

    def exchange_state_bytes(self) -> int:
        """Bytes of the carried compression errors."""
        state_bytes = getattr(self.exchange, "state_bytes", None)
        return int(state_bytes()) if state_bytes is not None else 0

    def reset_exchange(self) -> None:
        self.exchange = None  # the errors are not checkpointed (as in DeepSpeed): start them from zero

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.reset_exchange()

    # ------------------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressed = self.reduces_gradients
        if compressed:
            # every rank must exchange the same tensors: a parameter without a gradient here contributes zero
            # to the average, as it would to an all-reduced gradient
            pairs = [(p, group) for group in self.param_groups for p in group["params"] if p.requires_grad]
        else:
            pairs = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p, group in pairs:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            self._fold_gradient(p, grad, group, frozen=compressed)
        if compressed:
            self._average_momenta([self.state[p]["exp_avg"] for p, _ in pairs])
        for p, group in pairs:
            self._update(p, group)
        return loss

    def _fold_gradient(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], frozen: bool) -> None:
        """Decay the weights, count the step, fold the gradient into ``m`` (and into ``v`` unless frozen)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        p.mul_(1 - group["lr"] * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        if not frozen:
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        variance_step = min(step, float(self.freeze_step))  # v stopped changing at freeze_step
        bc1, bc2_sqrt = 1.0, 1.0
        if group["bias_correction"]:
            bc1 = 1 - beta1 ** step
            bc2_sqrt = (1 - beta2 ** variance_step) ** 0.5
        if group["eps_inside_sqrt"]:
            denom = (state["exp_avg_sq"] / bc2_sqrt ** 2).add_(group["eps"]).sqrt_()
        else:
            denom = (state["exp_avg_sq"].sqrt() / bc2_sqrt).add_(group["eps"])
        if step <= self.freeze_step:
            p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bc1)
            return
        # a coordinate with no gradient in the whole warm-up has v = 0: its compressed momentum is the sign
        # compressor's noise (+-scale where the true value is 0), and dividing that by eps would throw the
        # weight away, so such coordinates are held where they are
        update = (state["exp_avg"] / denom).masked_fill_(state["exp_avg_sq"] == 0, 0.0)
        p.add_(update, alpha=-group["lr"] / bc1)

    def _average_momenta(self, momenta: list[torch.Tensor]) -> None:
        if self.comm is None or self.comm.size == 1 or not momenta:
            return  # one process: its momentum is the average
        if self.exchange is None:
            self.exchange = (ExactAverage(self.comm) if self.exact_exchange else
                             CompressedAverage(self.comm, [m.numel() for m in momenta], momenta[0].device))
        self.exchange(momenta)
