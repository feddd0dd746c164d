"""``"zero_optimization": {"ignore_unused_parameters": false}`` at ZeRO stages 1 and 2: a trainable parameter
that got no gradient in any backward of an optimizer step is an error, as in DeepSpeed (the default, true,
lets such parameters step with a zero gradient). Every rank agrees before raising, so a parameter unused on
one rank only stops every rank with the same error instead of leaving the others waiting."""
from __future__ import annotations

import torch

from deepshard.comm.group import CommGroup


class UnusedParametersError(AssertionError):
    """Trainable parameters took no part in the loss while ``ignore_unused_parameters`` is false. An
    ``AssertionError``, as DeepSpeed's, so code catching DeepSpeed's error catches it."""


class UnusedParamCheck:
    """Records which parameters received a gradient since the last optimizer step; :meth:`check` raises
    :class:`UnusedParametersError` (on every rank) when any did not."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], comm: CommGroup,
                 device: torch.device, stage: int) -> None:
        self.params, self.names, self.comm, self.device, self.stage = params, names, comm, device, stage
        self.seen: set[int] = set()
        self.hooks = [p.register_post_accumulate_grad_hook(self._record) for p in params]

    def _record(self, p: torch.nn.Parameter) -> None:
        self.seen.add(id(p))

    def check(self) -> None:
        """At the accumulation boundary, before the update (a collective when there are several ranks)."""
        missing = [name for p, name in zip(self.params, self.names) if id(p) not in self.seen]
        self.seen.clear()
        flag = torch.tensor([float(len(missing))], dtype=torch.float32, device=self.device)
        self.comm.all_reduce_control(flag, "all_reduce of the unused-parameter count")
        if flag.item() == 0:
            return
        where = f"{missing[:8]}{' ...' if len(missing) > 8 else ''} on rank {self.comm.rank}" if missing else \
            f"on another rank (rank {self.comm.rank} used all of its parameters)"
        raise UnusedParametersError(
            f"ZeRO stage {self.stage}: trainable parameters got no gradient in this optimizer step's backward "
            f"passes: {where}. With \"zero_optimization\": {{\"ignore_unused_parameters\": false}} that is an "
            "error; set ignore_unused_parameters to true (the default: they step with a zero gradient), or make "
            "every trainable parameter take part in the loss (or set requires_grad=False on the unused ones)")

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
