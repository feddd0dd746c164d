"""The hooks that drive ZeRO-3: gather a module's parameter groups before its forward and again before
its backward, release them after, and prefetch the next groups while the current one computes.

The prefetch order is the order groups were first gathered in the first forward pass. Every rank runs
the same modules in the same order, so every rank records the same order and issues the same
collectives; a rank that diverges is caught by the watchdog instead of hanging silently.

Three knobs bound what is gathered at once (persistent groups do not count, they never leave):

- ``prefetch_elements`` (``stage3_prefetch_bucket_size``): the window of groups gathered ahead of use;
- ``max_live`` (``stage3_max_live_parameters``): no prefetch when the gathered groups would then hold
  more elements (a group a module needs now is always gathered);
- ``max_reuse`` (``stage3_max_reuse_distance``): at the end of forward, a group whose next use (in
  backward) is fewer than this many gathered elements away, and closer than the prefetch window, is
  kept instead of released and gathered again at once (so what is kept never exceeds the window).

Activation checkpointing runs a module's forward again inside backward (the recompute). There the
hooks gather what the recompute needs and release, when the module's forward returns, only what they
gathered themselves: a group backward has already gathered (or prefetched) stays for backward. The
recompute does not count as a user and prefetches nothing: PyTorch's non-reentrant checkpoint stops
the recompute, by an exception, as soon as the last saved tensor is rebuilt, so the post-forward
hook of the module it stops in never runs (a count would never come back down), and the groups
that follow in forward order have finished their backward already. A group the stopped module
gathered is released with the others once its gradients are reduced.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Protocol

import torch

from deepshard.zero.stage3.param_dict import install as watch_reads, uninstall as unwatch_reads, watchable
from deepshard.zero.stage3.group import GroupState, ShardedGroup
from deepshard.zero.stage3.surface import external_registry


class Stage3Hooks:
    """Forward/backward hooks over ``groups_of`` (module -> the parameter groups it needs)."""

    def __init__(self, module: torch.nn.Module, groups_of: dict[int, list[ShardedGroup]],
                 prefetch_elements: int, max_live: int = 1 << 62, max_reuse: int = 0,
                 before_backward: Callable[[], None] | None = None,
                 lifecycle: "Lifecycle | None" = None) -> None:
        """``lifecycle``: the strategy's calls at the start of a forward of the whole model and at the start
        and end of each backward, however backward is called."""
        self.groups_of = groups_of
        self.prefetch_elements = max(int(prefetch_elements), 0)
        self.max_live = max(int(max_live), 0)
        self.max_reuse = max(int(max_reuse), 0)
        self.all_groups = list({id(g): g for gs in groups_of.values() for g in gs}.values())
        # the live cap can only bind when the model's gathered groups could exceed it
        self._cap_binds = sum(g.numel for g in self.all_groups if not g.persistent) > self.max_live
        self.order: list[ShardedGroup] = []
        self._position: dict[int, int] = {}
        self._after: list[int] = []  # per order position: gathered elements used after it in forward
        self.recording = True
        self.before_backward = before_backward
        self.lifecycle = lifecycle
        # per module: the groups each of its recomputes (forward inside backward) gathered, to release
        self._recomputed: dict[int, list[list[ShardedGroup]]] = {}
        self.module = module
        self.handles: list[Any] = []
        self._group_of_param = {id(p): g for g in self.all_groups for p in g.params}
        self.stack: list[torch.nn.Module] = []  # the hooked modules whose forward is running, outermost first
        self.in_forward = False  # inside the root module's forward (not a recompute): touched parameters gather
        self._cleanup_queued = False
        self.watch_reads = watchable(module)
        if self.watch_reads:
            watch_reads(module)
        groups_of.setdefault(id(module), [])  # the root is always hooked: the caller of last resort
        self.install()

    def install(self) -> None:
        """Register the forward hooks on every module that needs groups (any registered before go first:
        generation code takes them off and puts them back, ``hook_surface.py``)."""
        self.remove()
        for m in self.module.modules():
            groups = self.groups_of.get(id(m))
            if groups or m is self.module:
                self.handles.append(m.register_forward_pre_hook(_eager(functools.partial(self._pre_forward, groups))))
                self.handles.append(m.register_forward_hook(_eager(functools.partial(self._post_forward, groups))))

    # ----------------------------------------------------------------------------------- forward
    def _pre_forward(self, groups: list[ShardedGroup], module: torch.nn.Module, args: Any) -> None:
        if in_backward():
            self._queue_cleanup()
            self._pre_recompute(groups, module)
            return
        if module is self.module:
            self._reset()
            self.in_forward = self.watch_reads
            if self.watch_reads:
                watch_reads(module)  # modules attached since the last forward
        self.stack.append(module)
        for g in groups:
            g.refresh_if_stale()  # a local write since the last gather (group.mark_stale)
            g.users += 1
            g.unshard()
        for g in groups:
            g.wait_for_unshard()
        if self.recording:
            for g in groups:
                if g.index not in self._position:
                    self._position[g.index] = len(self.order)
                    self.order.append(g)
        else:
            self._prefetch(groups, step=1)

    def _post_forward(self, groups: list[ShardedGroup], module: torch.nn.Module, args: Any, output: Any) -> None:
        training = torch.is_grad_enabled()
        if training:
            hook = functools.partial(self._pre_backward, groups)
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(hook)
        if in_backward():
            self._post_recompute(module)
            return
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        if module is self.module:
            self.in_forward = False
        else:
            self._adopt_returned(_tensors(output))
        for g in groups:
            g.users -= 1
            if g.users == 0 and not (training and self._reused_soon(g)):
                g.reshard()

    # --------------------------------------------------------------- parameters of other modules
    def touched(self, param: torch.nn.Parameter) -> None:
        """A released parameter was read (``module.weight``) during the forward of a module that does not
        gather it (``params.GatheringParameters``): gather it now, and make it an external parameter of the
        innermost running hooked module, which gathers it from now on (as ``register_external_parameter``
        would have) and releases it when its forward ends."""
        group = self._group_of_param.get(id(param))
        if group is None or not self.in_forward or not self.stack or in_backward():
            return
        self._adopt(self.stack[-1], param, group)
        group.wait_for_unshard()

    def _adopt_returned(self, outputs: list[torch.Tensor]) -> None:
        """Parameters a module returns from forward stay gathered for its caller (the innermost running hooked
        module), whose external parameters they become unless a running module has them already."""
        if not self.stack:
            return
        for t in outputs:
            group = self._group_of_param.get(id(t))
            if group is not None and not any(id(t) in external_registry(m) for m in self.stack):
                self._adopt(self.stack[-1], t, group)  # type: ignore[arg-type]

    def _adopt(self, owner: torch.nn.Module, param: torch.nn.Parameter, group: ShardedGroup) -> None:
        external_registry(owner)[id(param)] = param
        param.__dict__["is_external_param"] = True
        needed = self.groups_of[id(owner)]  # (the list its hooks were given: they see the new group)
        if group not in needed:
            needed.append(group)
            group.users += 1  # what the owner's pre-forward would have done; its post-forward undoes it
            group.unshard()

    # ------------------------------------------------------------------------- end of a backward
    def _queue_cleanup(self) -> None:
        """Once per backward: release, when autograd's engine finishes it, the frozen groups it gathered (no
        gradient reduction releases them), however backward was called (``engine.backward``,
        ``loss.backward()``, ``engine.scale(loss).backward()``)."""
        if not self._cleanup_queued:
            self._cleanup_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            if self.lifecycle is not None:
                self.lifecycle.backward_started()

    def _after_backward(self) -> None:
        self._cleanup_queued = False
        if self.lifecycle is not None:
            self.lifecycle.backward_ended()
        self._recomputed.clear()
        for g in self.all_groups:
            if g.users == 0 and not g.requires_grad:
                g.reshard()

    def _reset(self) -> None:
        """A new forward of the whole model: nothing of an earlier, interrupted forward or backward (an
        exception) may stay gathered or counted (a group gathered on purpose, by ``param.all_gather()``,
        stays when nothing was interrupted)."""
        interrupted = bool(self.stack) or bool(self._recomputed)
        for m in self.stack:
            for g in self.groups_of.get(id(m), []):
                g.users = max(g.users - 1, 0)
        self.stack.clear()
        if self.lifecycle is not None:
            self.lifecycle.forward_started()
        self._recomputed.clear()
        self._cleanup_queued = False
        if interrupted:
            for g in self.all_groups:
                if g.users == 0:
                    g.reshard()

    # ----------------------------------------------------------------- recompute (checkpointing)
    def _pre_recompute(self, groups: list[ShardedGroup], module: torch.nn.Module) -> None:
        """Gather what the recompute of ``module`` needs; remember which groups this gathered."""
        mine = [g for g in groups if g.state is GroupState.SHARDED]
        for g in groups:
            g.unshard()
        for g in groups:
            g.wait_for_unshard()
        self._recomputed.setdefault(id(module), []).append(mine)

    def _post_recompute(self, module: torch.nn.Module) -> None:
        """Release what ``module``'s recompute gathered (unless something else uses it now). Frozen groups
        stay: no gradient reduction releases them later, backward would gather them again at once (and keep
        them to the end of backward, as it keeps every frozen group it gathers), and PyTorch's
        non-reentrant checkpoint compares a parameter it saved itself with its recomputed shape after the
        recompute (a released one reads as ``[0]``: "Recomputed values ... have different metadata")."""
        stack = self._recomputed.get(id(module))
        if not stack:
            return
        for g in stack.pop():
            if g.users == 0 and g.requires_grad:
                g.reshard()

    def end_backward(self) -> None:
        """Forget recomputes that were stopped early (their groups are released by the caller)."""
        self._recomputed.clear()

    def _reused_soon(self, g: ShardedGroup) -> bool:
        """Whether ``g``'s next use, in backward, comes within the reuse distance and the prefetch
        window: the rest of forward and its mirror in backward gather ``2 * after`` elements first."""
        pos = self._position.get(g.index)
        if self.recording or pos is None or not g.requires_grad:
            return False
        return 2 * self._after[pos] < min(self.max_reuse, self.prefetch_elements)

    # ---------------------------------------------------------------------------------- backward
    def _pre_backward(self, groups: list[ShardedGroup], grad: torch.Tensor) -> None:
        self._queue_cleanup()
        if self.before_backward is not None:
            self.before_backward()
        for g in groups:
            g.unshard()
        for g in groups:
            g.wait_for_unshard()
        if not all(g.requires_grad for g in groups):  # trainable groups prefetch once released
            self._prefetch(groups, step=-1)

    def after_release(self, group: ShardedGroup) -> None:
        """A group's gradients are produced and its gathered values released: start gathering the
        groups that come before it in forward (backward's next), so backward holds one module gathered
        ahead instead of two."""
        self._prefetch([group], step=-1)

    def _prefetch(self, groups: list[ShardedGroup], step: int) -> None:
        """Start gathering the groups that come next (forward: step=1, backward: step=-1)."""
        if not self.prefetch_elements or not self.order:
            return
        positions = [self._position[g.index] for g in groups if g.index in self._position]
        if not positions:
            return
        pos = (max(positions) if step > 0 else min(positions)) + step
        budget = self.prefetch_elements
        live = (sum(g.numel for g in self.all_groups if not g.persistent and g.state is not GroupState.SHARDED)
                if self._cap_binds else 0)
        taken = 0
        while 0 <= pos < len(self.order) and budget > 0:
            g = self.order[pos]
            if g.persistent:
                pos += step
                continue
            if taken and g.numel > budget:  # the window holds whole groups; the first is always taken
                break
            pos += step
            taken += 1
            if g.state is GroupState.SHARDED:
                if self._cap_binds and live + g.numel > self.max_live:
                    break
                g.unshard()
                live += g.numel
            budget -= g.numel
        # one more window further ahead: start reading offloaded shards in (a no-op when resident), so
        # the next unshard finds its chunk in memory
        budget = self.prefetch_elements
        while 0 <= pos < len(self.order) and budget > 0:
            g = self.order[pos]
            g.prefetch_shard()
            budget -= g.numel
            pos += step

    def stop_recording(self) -> None:
        if self.recording:
            self._after, total = [0] * len(self.order), 0
            for i in range(len(self.order) - 1, -1, -1):
                self._after[i] = total
                total += 0 if self.order[i].persistent else self.order[i].numel
        self.recording = False

    def detach(self) -> None:
        """Hooks off and plain parameter dicts again (``engine.destroy()``)."""
        self.remove()
        if self.watch_reads:
            unwatch_reads(self.module)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class Lifecycle(Protocol):
    """What the strategy does at the edges of a forward and a backward (``Stage3Strategy``)."""

    def forward_started(self) -> None: ...

    def backward_started(self) -> None: ...

    def backward_ended(self) -> None: ...


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread: a module forward then is
    activation checkpointing's recompute (reentrant or not)."""
    return torch._C._current_graph_task_id() != -1


def _eager(hook: Any) -> Any:
    """``hook`` run eagerly when a ``torch.compile``d module calls it: dynamo breaks the graph there
    instead of tracing the gathers, releases and ``.data`` swaps (which compiled autograd would see as
    in-place changes of tensors saved for backward). Only when ``torch._dynamo`` is already imported
    (``torch.compile`` was called before ``initialize``): importing it costs seconds, and a model that
    is never compiled does not need it."""
    if "torch._dynamo" not in sys.modules:
        return hook
    return sys.modules["torch._dynamo"].disable(hook, recursive=True)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
