"""``deepspeed.runtime.zero.utils``: the exception type DeepSpeed raises when ZeRO meets a state it cannot
work in at run time (``ZeRORuntimeException``), for code that catches it by that name."""
from __future__ import annotations

__all__ = ["ZeRORuntimeException"]


class ZeRORuntimeException(RuntimeError):
    """A ZeRO partitioning error at run time (DeepSpeed's name). A ``RuntimeError``, so code that catches
    deepshard's ZeRO runtime errors (all ``RuntimeError``) by that type catches it as well."""
