"""``ZeroParamStatus``: whether a ZeRO-3 parameter's full values are present, as DeepSpeed names it.

Code written for DeepSpeed asks ``param.ds_status`` before gathering (TRL's lm-head gather, OpenRLHF's and
LLaVA's ``_z3_params_to_fetch`` / ``maybe_zero_3``): only parameters ``NOT_AVAILABLE`` are gathered. deepshard
keeps the attribute true on every transition of the parameter's group (``group.py``): ``SHARDED`` is
``NOT_AVAILABLE``, ``GATHERING`` is ``INFLIGHT``, ``GATHERED`` is ``AVAILABLE`` (persistent groups stay
``AVAILABLE``). A parameter ``zero.Init`` partitioned before ``initialize`` is ``NOT_AVAILABLE`` except
inside ``GatheredParameters``.
"""
from __future__ import annotations

import enum
from typing import Iterable

import torch


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's three states of a partitioned parameter (same names and values)."""

    AVAILABLE = 1
    """The full values are in ``param.data`` on every rank."""
    NOT_AVAILABLE = 2
    """Only this rank's shard is held; ``param.data`` is an empty placeholder."""
    INFLIGHT = 3
    """A gather has started and not yet been waited for."""


def set_status(params: Iterable[torch.nn.Parameter], status: ZeroParamStatus) -> None:
    """Record ``status`` on each parameter (``param.ds_status``)."""
    for p in params:
        p.ds_status = status  # type: ignore[attr-defined]
