"""torch's fused CPU Adam with every element computed in its vector loop, so an element's update does not
depend on where the tensor holding it begins or ends.

torch's fused CPU kernel (``Adam(fused=True)``, what deepshard steps host Adam with: ``kernels.py``) runs a
vectorised loop over each tensor and a scalar loop over its last ``numel % vector width`` elements, and
the two round differently (the scalar loop works with the hyper-parameters in double precision). The
same parameter is one tensor at ZeRO stage 0, and cut into shard pieces elsewhere in stages 1-3, at
other places in stage 3 than in stages 1-2, and at others again for another data-parallel size: the
same element falls in the scalar tail in one layout and in the vector loop in another, and the weights
drift apart by a unit in the last place, then more.

``step_whole_vectors`` hands the kernel whole vectors only. For the duration of the call each parameter
whose size is not a multiple of ``WIDTH`` is narrowed to its *body* (its first multiple of ``WIDTH``
elements: ``param.data``, ``.grad`` and its state tensors become views of them, updated in place), and
the *tails* (the rest, fewer than ``WIDTH`` elements each) of a param group's parameters are copied end to
end into one zero-padded tensor of a multiple of ``WIDTH`` elements, stepped as one more parameter of
the group (the padding computes zeros) and copied back. ``WIDTH`` (64) is a multiple of every vector
width of every dtype on x86 and Arm, and of the kernel's per-thread work unit. Tails are stepped together
when their parameters have taken the same number of steps (the bias corrections depend on it), so
parameters at different step counts get a tail tensor each. The optimizer object, its hyper-parameters,
its state and what a checkpoint holds are what they would be without this; only what torch's step walks
differs, and only during the call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

WIDTH = 64


def uses_fused_host_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """True when some param group of ``optimizer`` steps with torch's fused Adam kernel on the host."""
    if not isinstance(optimizer, torch.optim.Adam):
        return False
    return any(group.get("fused") and any(p.device.type == "cpu" for p in group["params"])
               for group in optimizer.param_groups)


def _is_elementwise(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


@dataclass
class _Cut:
    """One parameter whose size is not a multiple of ``WIDTH``: what it was, and where its tail went."""

    param: torch.nn.Parameter
    data: torch.Tensor
    grad: torch.Tensor
    state: Optional[dict[str, Any]]  # its state before the step (None: the optimizer has none yet)
    body: int
    tail: int
    offset: int = 0  # of its tail in the tail tensor
    whole: dict[str, Any] = field(default_factory=dict)  # the state tensors narrowed for the call


@dataclass
class _Tails:
    """The tails of the cut parameters at one step count, as one padded parameter."""

    cuts: list[_Cut]
    param: torch.nn.Parameter = field(init=False)

    def __post_init__(self) -> None:
        total = 0
        for cut in self.cuts:
            cut.offset = total
            total += cut.tail
        padded = -(-total // WIDTH) * WIDTH
        first = self.cuts[0]
        self.param = torch.nn.Parameter(self._gather(lambda c: c.data, padded, first.data.dtype))
        self.param.grad = self._gather(lambda c: c.grad, padded, first.grad.dtype)

    def _gather(self, source: Any, padded: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(padded, dtype=dtype, device=self.cuts[0].data.device)
        for cut in self.cuts:
            out[cut.offset:cut.offset + cut.tail] = source(cut).reshape(-1)[cut.body:]
        return out

    def state(self) -> Optional[dict[str, Any]]:
        """The tails' state (their parameters' state tensors' tails; a copy of the shared step counter)."""
        first = self.cuts[0].state
        if first is None:
            return None
        out: dict[str, Any] = {}
        for key, value in first.items():
            if _is_elementwise(value, self.cuts[0].data.numel()):
                out[key] = self._gather(lambda c, k=key: c.state[k], self.param.numel(), value.dtype)  # type: ignore[index]
            else:
                out[key] = value.clone() if torch.is_tensor(value) else value
        return out


def _step_key(state: Optional[dict[str, Any]]) -> Optional[float]:
    """What tails stepped together must share: the step count (None: no state yet)."""
    if state is None:
        return None
    step = state.get("step")
    return float(step) if step is not None else None


class _GroupPlan:
    """One param group narrowed to whole vectors for one step (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> None:
        self.group, self.params = group, group["params"]
        self.cuts: list[_Cut] = []
        self.tails: list[_Tails] = []
        if not group.get("fused"):
            return
        for p in self.params:
            n = p.numel()
            if p.grad is None or p.grad.is_sparse or p.device.type != "cpu" or n % WIDTH == 0:
                continue
            state = optimizer.state.get(p)
            self.cuts.append(_Cut(p, p.data, p.grad, state or None, n - n % WIDTH, n % WIDTH))
        by_step: dict[Optional[float], list[_Cut]] = {}
        for cut in self.cuts:
            by_step.setdefault(_step_key(cut.state), []).append(cut)
        self.tails = [_Tails(cuts) for cuts in by_step.values()]
        for tails in self.tails:
            tail_state = tails.state()
            if tail_state is not None:
                optimizer.state[tails.param] = tail_state
        for cut in self.cuts:
            self._narrow(cut)
        group["params"] = [p for p in self.params if not self._gone(p)] + [t.param for t in self.tails]

    def _gone(self, p: torch.Tensor) -> bool:
        return any(cut.param is p and cut.body == 0 for cut in self.cuts)

    @staticmethod
    def _narrow(cut: _Cut) -> None:
        if cut.body == 0:
            return
        n = cut.data.numel()
        cut.param.data = cut.data.reshape(-1)[:cut.body]
        cut.param.grad = cut.grad.reshape(-1)[:cut.body]
        if cut.state is not None:
            for key, value in list(cut.state.items()):
                if _is_elementwise(value, n):
                    cut.whole[key] = value
                    cut.state[key] = value.reshape(-1)[:cut.body]

    @torch.no_grad()
    def restore(self, optimizer: torch.optim.Optimizer, stepped: bool) -> None:
        """Put every parameter, gradient and state back whole; when ``stepped``, with the tails' updates."""
        self.group["params"] = self.params
        for tails in self.tails:
            tail_state = optimizer.state.pop(tails.param, None)
            for cut in tails.cuts:
                self._restore(optimizer, cut, tails, tail_state, stepped)

    def _restore(self, optimizer: torch.optim.Optimizer, cut: _Cut, tails: _Tails,
                 tail_state: Optional[dict[str, Any]], stepped: bool) -> None:
        n = cut.data.numel()
        body_state = optimizer.state.get(cut.param) if cut.body else None
        cut.param.data, cut.param.grad = cut.data, cut.grad
        span = slice(cut.offset, cut.offset + cut.tail)
        if stepped:
            cut.data.reshape(-1)[cut.body:] = tails.param.detach()[span]
        if cut.state is not None:  # whole again: the body views were updated in place
            cut.state.update(cut.whole)
            self._put_back(cut, tail_state, span, stepped)
            return
        if stepped and tail_state is not None:  # the first step: torch made fresh state for the parts
            optimizer.state[cut.param] = self._joined(cut, body_state, tail_state, span, n)

    @staticmethod
    def _put_back(cut: _Cut, tail_state: Optional[dict[str, Any]], span: slice, stepped: bool) -> None:
        if not stepped or tail_state is None or cut.state is None:
            return
        n = cut.data.numel()
        for key, value in cut.state.items():
            if _is_elementwise(value, n):
                value.reshape(-1)[cut.body:] = tail_state[key][span]
            elif cut.body == 0 and torch.is_tensor(value) and torch.is_tensor(tail_state.get(key)):
                value.copy_(tail_state[key])  # the tail held the only counter

    @staticmethod
    def _joined(cut: _Cut, body_state: Optional[dict[str, Any]], tail_state: dict[str, Any], span: slice,
                n: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in tail_state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                parts = ([body_state[key].reshape(-1)] if body_state else []) + [value[span]]
                out[key] = torch.cat(parts).view(cut.data.shape)
            elif body_state is not None and key in body_state:
                out[key] = body_state[key]
            else:
                out[key] = value.clone() if torch.is_tensor(value) else value
        return out


def step_whole_vectors(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer``'s own step (its class's ``step``: deepshard's guard on the instance is bypassed), with
    torch's fused host Adam given whole vectors only (see the module docstring); any other optimizer
    steps as it is."""
    own_step = type(optimizer).step
    if not uses_fused_host_kernel(optimizer):
        return own_step(optimizer)
    plans: list[_GroupPlan] = []
    stepped = False
    try:
        for group in optimizer.param_groups:
            plans.append(_GroupPlan(optimizer, group))
        result = own_step(optimizer)
        stepped = True
    finally:
        for plan in plans:
            plan.restore(optimizer, stepped)
    return result
