"""Measured FLOPs per module and per phase (forward / backward), on torch's own formulas.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op that runs, forward and
backward alike, so the backward is counted as it happens rather than assumed to be twice the forward
(it is not: a first layer whose input needs no gradient costs 1x, activation recomputation adds a
forward). The per-op formulas are ``torch.utils.flop_counter.flop_registry`` (matmul, addmm, bmm,
convolution and its backward, attention kernels), plus the CPU flash-attention kernels that registry
lacks. Like torch's ``FlopCounterMode`` (and MFU as usually quoted), element-wise ops are not counted;
MACs are FLOPs / 2 for every op counted.

Which module an op belongs to is tracked with hooks on the profiled model's own modules: forward hooks
mark the module as running; during backward, gradient hooks on its outputs and inputs mark when its
backward starts and ends. An op is credited to every module on the stack (a parent's count includes its
children), and to the root. Latency is each module's forward wall time, synchronized with the device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _cpu_flash_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                       out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _formulas() -> dict[Any, Callable[..., int]]:
    table: dict[Any, Callable[..., int]] = dict(flop_registry)
    for name, fn in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_forward),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_backward)):
        if hasattr(aten, name):
            table[getattr(aten, name)] = fn
    return table


def full_numel(param: torch.nn.Parameter) -> int:
    """A parameter's full element count, also when ZeRO-3 holds only a shard (``ds_numel``)."""
    return int(getattr(param, "ds_numel", param.numel()))


def unique_param_count(module: torch.nn.Module) -> int:
    """Parameters of ``module`` and its children at full size, each shared (tied) tensor counted once."""
    seen: set[int] = set()
    total = 0
    for p in module.parameters():  # parameters() already yields a tied tensor once
        if id(p) not in seen:
            seen.add(id(p))
            total += full_numel(p)
    return total


@dataclass
class ModuleStats:
    """What was measured for one module over the profiled window."""

    name: str
    type_name: str
    depth: int
    params: int
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_latency: float = 0.0
    calls: int = 0

    @property
    def fwd_macs(self) -> int:
        return self.fwd_flops // 2


class _CountMode(TorchDispatchMode):
    """Adds each counted op's FLOPs to every module on the tracker's stack, by phase."""

    def __init__(self, counter: "FlopCounter") -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.counter.formulas.get(func._overloadpacket)
        if formula is not None:
            self.counter.add(int(formula(*args, **kwargs, out_val=out)))
        return out


class FlopCounter:
    """Hooks on ``model``'s modules plus a dispatch mode; ``start()`` / ``stop()`` bracket a window."""

    def __init__(self, model: torch.nn.Module, synchronize: Callable[[], None],
                 ignore: tuple[type, ...] = ()) -> None:
        self.formulas = _formulas()
        self.synchronize = synchronize
        self.root = model
        self.stats: dict[str, ModuleStats] = {}
        self._module_name: dict[torch.nn.Module, str] = {}
        for fqn, mod in model.named_modules():
            if ignore and isinstance(mod, ignore):
                continue
            self._module_name[mod] = fqn
            self.stats[fqn] = ModuleStats(fqn, type(mod).__name__, fqn.count(".") + 1 if fqn else 0,
                                          unique_param_count(mod))
        self._active: list[str] = []
        self._starts: dict[str, list[float]] = {}
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []
        self._mode: _CountMode | None = None
        self._priming = False
        self._reset_queued = False

    # ---------------------------------------------------------------- window
    def start(self) -> None:
        """Install the hooks and enter the counting mode (idempotent)."""
        if self._mode is not None:
            return
        for mod in self._module_name:
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook))
            self._handles.append(mod.register_forward_hook(self._post_hook))
        self._mode = _CountMode(self)
        self._mode.__enter__()
        # the first op under a new Python dispatch mode pays one-off set-up (~1 s on CPU): pay it here,
        # uncounted, so it does not land in the first module's latency
        self._priming = True
        torch.mm(torch.ones(1, 1), torch.ones(1, 1))
        self._priming = False

    def stop(self) -> None:
        """Leave the counting mode and remove every hook; the counts stay."""
        if self._mode is None:
            return
        self._mode.__exit__(None, None, None)
        self._mode = None
        for handle in self._handles + self._grad_handles:
            handle.remove()
        self._handles.clear()
        self._grad_handles.clear()
        self._active.clear()

    def reset(self) -> None:
        for s in self.stats.values():
            s.fwd_flops = s.bwd_flops = s.calls = 0
            s.fwd_latency = 0.0

    # ---------------------------------------------------------------- counting
    def add(self, flops: int) -> None:
        if self._priming:
            return
        backward = torch._C._current_graph_task_id() != -1
        names = set(self._active) | {""}
        for name in names:
            stats = self.stats.get(name)
            if stats is None:
                continue
            if backward:
                stats.bwd_flops += flops
            else:
                stats.fwd_flops += flops

    def _enter(self, name: str) -> Callable[..., None]:
        def fn(*_: Any) -> None:
            if not self._reset_queued:
                # a module whose inputs need no gradient (an embedding) never signals its backward's end:
                # clear the stack when this backward finishes
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
                self._reset_queued = True
            self._active.append(name)
        return fn

    def _end_backward(self) -> None:
        self._active.clear()
        self._reset_queued = False

    def _leave(self, name: str) -> Callable[..., None]:
        def fn(*_: Any) -> None:
            if name in self._active:
                self._active.remove(name)
        return fn

    def _grad_hook(self, tensors: Any, fn: Callable[..., None], mode: str) -> None:
        flat, _ = tree_flatten(tensors)
        wanted = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        if wanted and torch.is_grad_enabled():
            self._grad_handles.append(torch.autograd.graph.register_multi_grad_hook(wanted, fn, mode=mode))

    def _pre_hook(self, mod: torch.nn.Module, inputs: Any) -> None:
        name = self._module_name[mod]
        if name != "":
            self._active.append(name)
        self._grad_hook(inputs, self._leave(name), "all")  # all input grads done: this module's backward ended
        self.synchronize()
        self._starts.setdefault(name, []).append(time.perf_counter())

    def _post_hook(self, mod: torch.nn.Module, inputs: Any, output: Any) -> None:
        name = self._module_name[mod]
        self.synchronize()
        stats = self.stats[name]
        stats.fwd_latency += time.perf_counter() - self._starts[name].pop()
        stats.calls += 1
        if name in self._active:
            self._active.remove(name)
        self._grad_hook(output, self._enter(name), "any")  # first output grad: this module's backward began
