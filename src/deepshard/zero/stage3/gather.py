"""``deepshard.zero.GatheredParameters``: use partitioned parameters outside forward.

Every rank must enter the context with the same parameters (it is a collective). Inside, the parameters
hold their full values. With ``modifier_rank=r``, the values rank r leaves at exit become everyone's
(and are written back into the shards, fp32 masters included); with ``modifier_rank=None`` changes are
discarded. Parameters that are not partitioned (ZeRO stages 0-2, or plain tensors) are left alone, as
DeepSpeed does.

Inside backward (a custom autograd function that reads a weight directly, as TRL's fused LM-head loss
does in its forward and again in its backward) the gathered values are kept at exit: the gradient the
function returns is accumulated into the parameter after the function returns, which needs the full
shape, and the reduction releases the group once its gradients are reduced (the end of backward, for
frozen ones).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from deepshard.zero.stage3.hooks import in_backward
from deepshard.zero.stage3.init import _InitGather, is_init_partitioned


class GatheredParameters:
    def __init__(self, params: torch.nn.Parameter | Iterable[Any], modifier_rank: int | None = None,
                 fwd_module: torch.nn.Module | None = None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if isinstance(p, torch.nn.Parameter)] if params is not None else []
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._groups: list[tuple[Any, Any]] = []
        self._init_gathers: list[_InitGather] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        from deepshard.zero.strategy import owner_of

        seen: set[int] = set()
        init_params = []
        for p in self.params:
            strategy = owner_of(p)
            group = strategy.group_of(p) if strategy is not None and hasattr(strategy, "group_of") else None
            if group is not None:
                if id(group) not in seen:
                    seen.add(id(group))
                    self._groups.append((strategy, group))
            elif is_init_partitioned(p):
                init_params.append(p)
        for _, g in self._groups:
            g.users += 1
            g.unshard()
        for _, g in self._groups:
            g.wait_for_unshard()
        if init_params:
            from deepshard.comm.group import CommGroup

            # the group zero.Init partitioned them over (recorded on the parameter), else the world
            comm = getattr(init_params[0], "ds_comm", None) or CommGroup()
            gather = _InitGather(init_params, comm, self.modifier_rank)
            gather.__enter__()
            self._init_gathers.append(gather)
        return self

    @torch.no_grad()
    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        for gather in self._init_gathers:
            gather.__exit__(*exc)
        for strategy, g in self._groups:
            if self.modifier_rank is not None:
                g.comm.broadcast(g.full, src=self.modifier_rank)
                g.write_full([p.data for p in g.params])
                strategy.after_external_update(g)
            g.users -= 1
            if g.users == 0 and not in_backward():
                g.reshard(hand_over=True)  # what the user took from the parameters inside keeps its values
        self._groups.clear()
        self._init_gathers.clear()
