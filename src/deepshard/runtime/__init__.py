"""DeepSpeed-compatible module paths (``deepspeed.runtime.*``) for code that imports them.

``deepshard.runtime.lr_schedules`` is ``deepspeed.runtime.lr_schedules``: the schedules,
``VALID_LR_SCHEDULES`` and ``add_tuning_arguments``. The implementations live in
:mod:`deepshard.optim`.
"""
from deepshard.runtime import lr_schedules

__all__ = ["lr_schedules"]
