"""Top-level DeepSpeed keys that deepshard accepts but does not act on.

A DeepSpeed config that uses them still loads: the value is stored as given (on the attribute of the
same name) and one warning says the feature is ignored, but only when the section is actually
switched on, so an explicitly disabled section (``"elasticity": {"enabled": false}``) stays quiet.
"""
from __future__ import annotations

from typing import Any, Callable

from deepshard.utils.logging import logger

# Scalar keys: the value that means "off" (anything else is warned about).
UNIMPLEMENTED_SCALARS: dict[str, Any] = {
    "disable_allgather": False,
    "graph_harvesting": False,
    "seq_parallel_comm_data_type": None,
    "vocabulary_size": None,
}

# Section keys (dicts): on when "enabled" is truthy, unless a rule below says otherwise.
UNIMPLEMENTED_SECTIONS: tuple[str, ...] = (
    "autotuning", "elasticity", "compile", "hybrid_engine",
    "compression_training", "data_efficiency", "curriculum_learning", "eigenvalue",
    "progressive_layer_drop", "sparse_attention", "nebula", "datastates", "weight_quantization",
    "quantize_training", "timers", "zenflow", "trackio",
)

UNIMPLEMENTED_KEYS: tuple[str, ...] = UNIMPLEMENTED_SECTIONS + tuple(UNIMPLEMENTED_SCALARS)


def _any_enabled(value: Any) -> bool:
    """A section is on when its own ``enabled`` is truthy; without one, when any sub-section's is."""
    if not isinstance(value, dict):
        return False
    if "enabled" in value:
        return bool(value["enabled"])
    return any(_any_enabled(sub) for sub in value.values())


_SECTION_RULES: dict[str, Callable[[Any], bool]] = {
    # throughput timers are on by default in DeepSpeed; not having them is no loss worth a warning
    "timers": lambda value: False,
    # read by the launcher (`deepshard --autotuning tune|run`, deepshard.autotuning), not by the engine
    "autotuning": lambda value: False,
    "compile": lambda value: isinstance(value, dict) and bool(value.get("deepcompile")
                                                              or value.get("enabled")),
    # these switch on by being present
    "sparse_attention": lambda value: bool(value),
    "zenflow": lambda value: bool(value),
}


def _scalar_on(key: str, value: Any) -> bool:
    off = UNIMPLEMENTED_SCALARS[key]
    if key == "seq_parallel_comm_data_type" and isinstance(value, str):
        return value.lower() not in ("fp32", "float32")
    if key == "vocabulary_size":
        return False  # DeepSpeed only uses it for an alignment hint
    return value != off


def is_active(key: str, value: Any) -> bool:
    """Whether an unimplemented key's value switches its feature on."""
    if value is None:
        return False
    if key in UNIMPLEMENTED_SCALARS:
        return _scalar_on(key, value)
    rule = _SECTION_RULES.get(key)
    if rule is not None:
        return rule(value)
    if isinstance(value, dict):
        return _any_enabled(value)
    return bool(value)


def warn_unimplemented(values: dict[str, Any]) -> list[str]:
    """Log one warning per switched-on unimplemented key; return those keys (in order)."""
    active = [key for key in UNIMPLEMENTED_KEYS if is_active(key, values.get(key))]
    for key in active:
        logger.warning("%s is not implemented by deepshard and is ignored", key)
    return active
