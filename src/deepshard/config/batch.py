"""Batch-size arithmetic: train_batch_size = micro batch per process * accumulation steps * DP size.

Give any two of ``train_batch_size`` (TBS), ``train_micro_batch_size_per_gpu`` (micro) and
``gradient_accumulation_steps`` (GAS) and the third is derived with integer division, exactly as
DeepSpeed does (``_set_batch_related_parameters``); with only TBS, GAS = 1 and micro = TBS // dp;
with only micro, GAS = 1 and TBS = micro * dp. The result is then checked, so a remainder lost in a
division is reported with the arithmetic instead of silently training on a different batch.
"""
from __future__ import annotations

from typing import Optional, Sequence

from deepshard.config.base import ConfigError

TBS = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
BATCH_KEYS = (TBS, MICRO, GAS)


def _derive(tbs: Optional[int], micro: Optional[int], gas: Optional[int], dp: int,
            auto_keys: Sequence[str]) -> tuple[int, int, int, str]:
    """Fill in the missing values; return them and a note saying how the derived one was computed."""
    if tbs is not None and micro is not None and gas is not None:
        return tbs, micro, gas, ""
    if tbs is not None and micro is not None:
        gas = tbs // (micro * dp)
        return tbs, micro, gas, f"{GAS} was derived as {TBS} // ({MICRO} * data-parallel size) = " \
                                f"{tbs} // ({micro} * {dp}) = {gas}"
    if tbs is not None and gas is not None:
        micro = tbs // (gas * dp)
        return tbs, micro, gas, f"{MICRO} was derived as {TBS} // ({GAS} * data-parallel size) = " \
                                f"{tbs} // ({gas} * {dp}) = {micro}"
    if micro is not None and gas is not None:
        return micro * gas * dp, micro, gas, ""
    if tbs is not None:
        micro = tbs // dp
        return tbs, micro, 1, f"{GAS} defaults to 1 and {MICRO} was derived as {TBS} // " \
                              f"data-parallel size = {tbs} // {dp} = {micro}"
    if micro is not None:
        return micro * dp, micro, 1, ""
    raise ConfigError(_missing_message(gas, auto_keys))


def _missing_message(gas: Optional[int], auto_keys: Sequence[str]) -> str:
    msg = f"Either {TBS} or {MICRO} needs to be provided"
    if gas is not None:
        msg += f" ({GAS} = {gas} alone does not fix the batch size)"
    if auto_keys:
        names = ", ".join(auto_keys)
        msg += (f"; {names} {'is' if len(auto_keys) == 1 else 'are'} \"auto\": 'auto' is filled in by "
                "the Hugging Face Trainer/Accelerate from their own arguments and deepshard.initialize "
                f"has nothing to fill it from; give numbers, e.g. \"{MICRO}\": 4")
    return msg


def _check_positive(name: str, value: Optional[int], note: str = "") -> None:
    if value is not None and value <= 0:
        extra = f" ({note})" if note else ""
        raise ConfigError(f"{name} must be greater than 0, got {value}{extra}")


def resolve_batch_sizes(train_batch_size: Optional[int], micro_batch_size: Optional[int],
                        gradient_accumulation_steps: Optional[int], dp_world_size: int,
                        auto_keys: Sequence[str] = ()) -> tuple[int, int, int]:
    """Return ``(train_batch_size, micro_batch_per_process, gradient_accumulation_steps)``.

    ``None`` means "not given" (an ``"auto"`` value counts as not given; name such keys in
    ``auto_keys`` so an underivable config says so). Raises :class:`ConfigError` with the
    arithmetic when the three values do not satisfy ``tbs == micro * gas * dp_world_size``.
    """
    if dp_world_size < 1:
        raise ConfigError(f"data-parallel size must be at least 1, got {dp_world_size}")
    for name, value in zip(BATCH_KEYS, (train_batch_size, micro_batch_size, gradient_accumulation_steps)):
        _check_positive(name, value)
    tbs, micro, gas, note = _derive(train_batch_size, micro_batch_size, gradient_accumulation_steps,
                                    dp_world_size, auto_keys)
    for name, value in zip(BATCH_KEYS, (tbs, micro, gas)):
        _check_positive(name, value, note)
    if tbs != micro * gas * dp_world_size:
        msg = (f"{TBS} ({tbs}) must equal {MICRO} ({micro}) * {GAS} ({gas}) * data-parallel size "
               f"({dp_world_size}) = {micro * gas * dp_world_size}; give any two of the three and the "
               "third is derived")
        if note:
            msg += f" ({note}, which drops a remainder)"
        raise ConfigError(msg)
    return tbs, micro, gas
