"""DeepSpeed-compatible module paths (``deepspeed.runtime.*``) for code that imports them.

``deepshard.runtime.lr_schedules`` is ``deepspeed.runtime.lr_schedules`` (the schedules, their
config-key constants and ``add_tuning_arguments``; the implementations live in :mod:`deepshard.optim`),
``deepshard.runtime.utils`` and ``deepshard.runtime.config_utils`` are DeepSpeed's helpers of those names.
Other ``deepspeed.runtime.X`` read as attributes (``deepspeed.runtime.zero``) resolve as their import does
(:mod:`deepshard.compat.aliases`).
"""
from __future__ import annotations

import importlib
from typing import Any

from deepshard.runtime import lr_schedules

__all__ = ["config_utils", "lr_schedules", "utils"]


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    from deepshard.compat.aliases import target_of

    try:
        target = target_of(f"deepspeed.runtime.{name}")
        return importlib.import_module(target)
    except ImportError as exc:  # a feature deepshard lacks: its message, as an AttributeError (hasattr works)
        raise AttributeError(str(exc)) from None
