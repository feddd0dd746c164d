"""Which deepshard module answers for each ``deepspeed.*`` module name.

A name resolves through the longest matching prefix of :data:`RENAMED` (``deepspeed.X.Y`` ->
``deepshard.X.Y`` by default); a prefix in :data:`MISSING` raises an ImportError that names the DeepSpeed
feature deepshard lacks.
"""
from __future__ import annotations

RENAMED: dict[str, str] = {
    "deepspeed": "deepshard",
    "deepspeed.runtime.engine": "deepshard.engine",
    "deepspeed.runtime.zero": "deepshard.zero",
    "deepspeed.runtime.zero.partition_parameters": "deepshard.compat.partition_parameters",
    "deepspeed.runtime.config": "deepshard.config",
    "deepspeed.checkpoint.utils": "deepshard.compat.checkpoint_utils",
    "deepspeed.profiling": "deepshard.profiling",
    "deepspeed.runtime.sequence_parallel": "deepshard.sp",
    "deepspeed.runtime.sequence_parallel.ulysses_sp": "deepshard.sp.hf",
    "deepspeed.sequence": "deepshard.sp",
    "deepspeed.sequence.layer": "deepshard.sp.ulysses",
}
"""DeepSpeed module path -> the deepshard module that implements it (where the paths differ)."""

MISSING: dict[str, str] = {
    "deepspeed.moe": "mixture-of-experts layers",
    "deepspeed.inference": "the inference engine",
    "deepspeed.module_inject": "kernel injection for inference",
    "deepspeed.compression": "compression training",
    "deepspeed.autotuning": "DeepSpeed's autotuner module API (deepshard's autotuner is the launcher's "
                            "--autotuning tune|run and deepshard.autotuning)",
    "deepspeed.elasticity": "elastic training",
}
"""DeepSpeed module paths deepshard has no counterpart for, and what they are."""


def target_of(fullname: str) -> str:
    """The deepshard module name for the DeepSpeed module ``fullname``; raises ImportError for a
    feature deepshard does not implement (an ImportError, not ModuleNotFoundError, so that the message
    reaches the user through ``from deepspeed.x import y`` too)."""
    for prefix, feature in MISSING.items():
        if fullname == prefix or fullname.startswith(prefix + "."):
            raise ImportError(
                f"No module named {fullname!r}: this 'deepspeed' is deepshard (deepshard.compat), which does not "
                f"implement {feature}; use the real DeepSpeed for it", name=fullname)
    parts = fullname.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in RENAMED:
            return ".".join([RENAMED[prefix], *parts[cut:]])
    raise ModuleNotFoundError(f"{fullname!r} is not a deepspeed module name", name=fullname)
