"""Strict checks of the sections the config model keeps as given (``tensor_parallel``, ``autotuning``,
``expert_parallel``) and of
values that can only be checked against the machine (``flops_profiler.output_file``).

The config model validates every modelled section key by key; these sections are read elsewhere (automatic
TP, the autotuning launcher, the profiler at its step), so without this a misspelt key was ignored
(``"autotp_sizee": 2`` trained without TP) and a bad value failed late or never. Each check raises
:class:`ConfigError` naming the key, the value and the fix, at ``initialize``.
"""
from __future__ import annotations

import difflib
import os
from typing import Any

from deepshard.config.base import ConfigError

TP_KEYS = ("autotp_size", "tp", "partition_config", "dtype", "tp_overlap_comm", "vocab_parallel_lm_head",
           "vocab_parallel_ce_backend", "preset_model", "keep_module_on_host", "injection_policy_tuple")
TP_NESTED_KEYS = ("tp_size", "tp_grain_size", "mpu", "tp_group")
PARTITION_KEYS = ("use_default_specs", "layer_specs")
AUTOTUNING_FLAGS = ("enabled", "fast", "overwrite")
AUTOTUNING_COUNTS = ("max_train_batch_size", "min_train_batch_size", "tuner_num_trials", "tuner_early_stopping",
                     "mp_size", "start_profile_step", "end_profile_step", "min_train_micro_batch_size_per_gpu",
                     "max_train_micro_batch_size_per_gpu", "num_tuning_micro_batch_sizes")
TUNER_TYPES = ("gridsearch", "random", "model_based")


def _unknown(section: str, given: dict[str, Any], known: tuple[str, ...]) -> None:
    for key in given:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
            raise ConfigError(f"unknown config key '{section}.{key}'; {hint}")


def check_tensor_parallel(section: Any) -> None:
    """Every key of ``tensor_parallel`` known, and the section parseable by automatic TP."""
    if section is None:
        return
    if not isinstance(section, dict):
        raise ConfigError(f"tensor_parallel must be an object like {{\"autotp_size\": 2}}, got {section!r}")
    _unknown("tensor_parallel", section, TP_KEYS)
    if isinstance(section.get("tp"), dict):
        _unknown("tensor_parallel.tp", section["tp"], TP_NESTED_KEYS)
    if isinstance(section.get("partition_config"), dict):
        _unknown("tensor_parallel.partition_config", section["partition_config"], PARTITION_KEYS)
    from deepshard.tp.autotp_config import parse_tp_config

    try:
        parse_tp_config(section)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_autotuning(section: Any) -> None:
    """``autotuning``: a mapping of known keys with values of the right kind (the launcher's own reader,
    ``AutotuningSettings``, then checks how they relate)."""
    if section is None:
        return
    if not isinstance(section, dict):
        raise ConfigError(f"autotuning must be an object like {{\"enabled\": true}}, got {section!r}")
    for key in AUTOTUNING_FLAGS:
        if key in section and not isinstance(section[key], bool):
            raise ConfigError(f"autotuning.{key} = {section[key]!r}: expected true or false")
    for key in AUTOTUNING_COUNTS:
        if key in section and section[key] is not None and not _is_count(section[key]):
            raise ConfigError(f"autotuning.{key} = {section[key]!r}: expected a whole number >= 1")
    if "tuner_type" in section and section["tuner_type"] not in TUNER_TYPES:
        raise ConfigError(f"autotuning.tuner_type = {section['tuner_type']!r}: expected one of {', '.join(TUNER_TYPES)}")
    from deepshard.autotuning.settings import AutotuningSettings

    try:
        AutotuningSettings.from_config({"autotuning": section})
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err).replace("autotuning: unknown key(s)", "unknown config key(s) in autotuning:")) from None


def check_profiler_output(enabled: bool, output_file: str | None) -> None:
    """``flops_profiler.output_file`` must be writable where it points (checked now, not at the profile step).
    A directory that does not exist yet is fine when it can be made there (the profiler makes it when it
    writes, as the monitors make their ``output_path``)."""
    if not enabled or not output_file:
        return
    folder = os.path.dirname(os.path.abspath(output_file))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"flops_profiler.output_file = {output_file!r}: its directory {folder} cannot be created "
                          f"({existing} is a file); point output_file elsewhere")
    if not os.access(existing, os.W_OK) or (os.path.exists(output_file) and not os.access(output_file, os.W_OK)):
        raise ConfigError(f"flops_profiler.output_file = {output_file!r} cannot be written (no permission in "
                          f"{existing}); point output_file at a writable place")


def check_expert_parallel(section: Any) -> None:
    """``expert_parallel`` (AutoEP): the values DeepSpeed refuses are refused when the config loads, enabled or
    not (``deepshard.moe.autoep_config``)."""
    if section is None:
        return
    from deepshard.moe.autoep_config import AutoEPConfig

    try:
        AutoEPConfig(section)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None


def check_loose_sections(cfg: Any) -> None:
    """All of the above, on a loaded config."""
    check_tensor_parallel(cfg.tensor_parallel)
    check_expert_parallel(cfg.expert_parallel)
    check_autotuning(cfg.autotuning)
    check_profiler_output(cfg.flops_profiler.enabled, cfg.flops_profiler.output_file)
