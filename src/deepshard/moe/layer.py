"""``deepspeed.moe.layer`` under deepshard: ``MoE`` exists so that importing it works, and building one
raises NotImplementedError with the reason: deepshard has no expert layers, gating or expert-parallel
all-to-all."""
from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["MoE"]

REASON = ("deepspeed.moe.layer.MoE is not implemented by deepshard: it has no mixture-of-experts layers "
          "(gating, expert parallelism, all-to-all). Build the model without MoE layers (a dense nn.Module "
          "trains under every ZeRO stage), or use the real DeepSpeed for MoE training")


class MoE(nn.Module):
    """DeepSpeed's mixture-of-experts layer; constructing it raises NotImplementedError (see ``REASON``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(REASON)
