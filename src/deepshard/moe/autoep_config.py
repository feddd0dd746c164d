"""The ``expert_parallel`` config section (DeepSpeed's AutoEP keys), read and checked when the config loads.

deepshard acts on ``enabled`` and ``autoep_size``; ``preset_model`` names the model family whose MoE blocks are
replaced whole (see :mod:`deepshard.moe.autoep_layer`); the routing and kernel keys of DeepSpeed's AutoEP
(``use_grouped_mm``, ``score_func``, ``route_scale``, ...) describe what deepshard reads from the model itself
and are kept as given. Two keys are refused whether or not the section is enabled, as DeepSpeed refuses them:
a ``load_balance_coeff`` other than null (the auxiliary-loss-free expert bias) and an
``expert_tensor_parallel_size`` other than 1.
"""
from __future__ import annotations

from typing import Any

__all__ = ["AutoEPConfig"]


def _load_balance_refusal(value: Any) -> ValueError:
    return ValueError(
        f"expert_parallel.load_balance_coeff = {value!r} is not supported: it turns on DeepSpeed's "
        "auxiliary-loss-free balancing (a per-expert expert_bias added to the router scores), which AutoEP does "
        "not implement; set \"load_balance_coeff\": null or omit the key (the model's own router loss, "
        "output_router_logits, trains the balance)")


class AutoEPConfig:
    """The ``expert_parallel`` section as deepshard reads it (module docstring); raises ValueError for a
    value it refuses, whether or not ``enabled`` is true."""

    def __init__(self, section: Any) -> None:
        if section is not None and not isinstance(section, dict):
            raise ValueError(f"expert_parallel must be an object like {{\"enabled\": true, \"autoep_size\": 2}}, "
                             f"got {section!r}")
        section = dict(section or {})
        self.raw: dict[str, Any] = section
        """The section as given."""
        self.enabled = bool(section.get("enabled", False))
        self.size = int(section.get("autoep_size", 1) or 1)
        self.preset_model: str | None = section.get("preset_model")
        if self.enabled and self.size < 1:
            raise ValueError(f"expert_parallel.autoep_size must be >= 1, got {self.size}")
        if section.get("load_balance_coeff") is not None:
            raise _load_balance_refusal(section["load_balance_coeff"])
        self.load_balance_coeff: None = None
        """Always None: the only value deepshard accepts (and DeepSpeed without its expert bias)."""
        if int(section.get("expert_tensor_parallel_size", 1) or 1) != 1:
            raise ValueError("expert_parallel.expert_tensor_parallel_size must be 1: experts are not split over "
                             "tensor-parallel ranks")

    @property
    def autoep_size(self) -> int:
        """DeepSpeed's name of :attr:`size`."""
        return self.size
