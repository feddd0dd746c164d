"""The non-tensor classes DeepSpeed 0.19.8 pickles into its checkpoint files, and deepshard's stand-ins.

Reading: ``torch.load(weights_only=True)`` accepts tensors, storages and plain containers (dict, list,
tuple, OrderedDict, int, float, str, bool, None, ``torch.Size``) by itself. DeepSpeed adds exactly the
classes of ``ALLOWED``; each is rebuilt as a deepshard stand-in that only stores what the file says (no
DeepSpeed import, no code from the file run). ``argparse.Namespace`` (Megatron-DeepSpeed's ``args`` in
its model-state files) is rebuilt as itself: a plain attribute holder, filled from the file's dict with no
code run. Any other class is refused.

Writing: the same stand-ins pickle themselves under DeepSpeed's names (``pickle_names.py``), so the
files deepshard writes load in DeepSpeed as its own objects.
"""
from __future__ import annotations

import argparse
from typing import Any

LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
DYNAMIC_LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"
FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"
MEGATRON_ARGS = "argparse.Namespace"


class DeepSpeedRecord:
    """The attributes of a DeepSpeed object as the file holds them; nothing else."""

    deepspeed_name = ""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise TypeError(f"{self.deepspeed_name}: expected a dict of attributes, got {type(state).__name__}")
        self.__dict__.update(state)

    def __reduce__(self) -> tuple:
        import copyreg

        return copyreg.__newobj__, (type(self),), dict(self.__dict__)  # type: ignore[attr-defined]

    def fields(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"{self.deepspeed_name}({self.__dict__})"


class LossScalerRecord(DeepSpeedRecord):
    """DeepSpeed's static loss scaler (``cur_scale``, ``dynamic``)."""

    deepspeed_name = LOSS_SCALER


class DynamicLossScalerRecord(DeepSpeedRecord):
    """DeepSpeed's dynamic loss scaler (``cur_scale``, ``cur_iter``, ``last_overflow_iter``,
    ``scale_factor``, ``scale_window``, ``min_scale``, ...)."""

    deepspeed_name = DYNAMIC_LOSS_SCALER


class FragmentAddressRecord(DeepSpeedRecord):
    """Where one parameter's slice sits in a rank's flat partition (``numel``, ``start``)."""

    deepspeed_name = FRAGMENT_ADDRESS


class ZeroStage(int):
    """DeepSpeed's ``ZeroStageEnum`` (an int enum): the stage number, pickled as ``ZeroStageEnum(n)``."""

    deepspeed_name = ZERO_STAGE_ENUM

    def __new__(cls, value: int = 0) -> "ZeroStage":
        if int(value) not in (0, 1, 2, 3):
            raise ValueError(f"ZeroStageEnum({value!r}): a ZeRO stage is 0, 1, 2 or 3")
        return super().__new__(cls, int(value))

    def __reduce__(self) -> tuple:
        return ZeroStage, (int(self),)


ALLOWED: dict[str, type] = {
    LOSS_SCALER: LossScalerRecord,
    DYNAMIC_LOSS_SCALER: DynamicLossScalerRecord,
    ZERO_STAGE_ENUM: ZeroStage,
    FRAGMENT_ADDRESS: FragmentAddressRecord,
    MEGATRON_ARGS: argparse.Namespace,
}
"""DeepSpeed class name -> the stand-in rebuilt in its place (documented in docs/checkpoints.md)."""
