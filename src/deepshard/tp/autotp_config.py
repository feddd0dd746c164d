"""The ``"tensor_parallel"`` config section and ``tp_model_init``'s record, read by automatic TP.

DeepSpeed's keys (``runtime/tensor_parallel/config.py``)::

    "tensor_parallel": {"autotp_size": 2,
                        "partition_config": {"use_default_specs": true,
                                             "layer_specs": [{"patterns": [".*\\\\.o_proj$"],
                                                              "partition_type": "row"}]}}

``autotp_size`` 0 or 1 means off; ``tp.tp_size`` is accepted as a synonym. A ``layer_specs`` entry's
``patterns`` are regular expressions searched in the module's qualified name; ``partition_type`` is
``column``, ``row`` or ``skip`` (replicated); ``shape`` gives a fused layer's parts along the split
dimension (``[q, k, v]`` sizes), which are split one by one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

PARTITION_TYPES = ("column", "row", "skip")
IGNORED_KEYS = ("tp_overlap_comm", "vocab_parallel_lm_head", "vocab_parallel_ce_backend", "preset_model",
                "keep_module_on_host", "injection_policy_tuple")
"""DeepSpeed keys accepted but not acted on: said once, when set."""
_INIT_ATTR = "_deepshard_tp_model_init"


@dataclass(frozen=True)
class LayerRule:
    """One ``partition_config.layer_specs`` entry."""

    patterns: tuple[str, ...]
    partition_type: str
    parts: Optional[tuple[int, ...]] = None

    def matches(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.patterns)


@dataclass(frozen=True)
class AutoTPConfig:
    """What automatic TP needs: the size, the user's rules, and whether the built-in rules apply too."""

    tp_size: int = 1
    rules: tuple[LayerRule, ...] = field(default_factory=tuple)
    use_default_specs: bool = True
    dtype: Optional[torch.dtype] = None

    @property
    def enabled(self) -> bool:
        return self.tp_size > 1


def _rule(spec: Any, index: int) -> LayerRule:
    where = f"tensor_parallel.partition_config.layer_specs[{index}]"
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be an object with 'patterns' and 'partition_type', got {spec!r}")
    patterns = spec.get("patterns")
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"{where}.patterns must be a non-empty list of regular expressions, got {patterns!r}")
    for p in patterns:
        try:
            re.compile(p)
        except re.error as err:
            raise ValueError(f"{where}.patterns: {p!r} is not a regular expression ({err})") from None
    kind = str(spec.get("partition_type", "")).lower()
    if kind not in PARTITION_TYPES:
        raise ValueError(f"{where}.partition_type is {spec.get('partition_type')!r}; use one of {PARTITION_TYPES}")
    shape = spec.get("shape")
    parts = tuple(int(s) for s in shape) if shape else None
    return LayerRule(patterns=tuple(patterns), partition_type=kind, parts=parts)


def parse_tp_config(section: Any) -> AutoTPConfig:
    """The ``tensor_parallel`` section (a dict or None) as an ``AutoTPConfig``."""
    if section is None:
        return AutoTPConfig()
    if not isinstance(section, dict):
        raise ValueError(f"tensor_parallel must be an object like {{\"autotp_size\": 2}}, got {section!r}")
    size = section.get("autotp_size") or 0
    nested = section.get("tp") or {}
    nested_size = nested.get("tp_size") if isinstance(nested, dict) else None
    if nested_size and size and int(nested_size) != int(size):
        raise ValueError(f"tensor_parallel.autotp_size ({size}) and tensor_parallel.tp.tp_size ({nested_size}) "
                         "disagree; give one of them")
    size = int(size or nested_size or 1)
    if size < 1:
        raise ValueError(f"tensor_parallel.autotp_size must be >= 0, got {size}")
    ignored = [k for k in IGNORED_KEYS if section.get(k)]
    if ignored:
        from deepshard.utils.logging import logger

        logger.warning("tensor_parallel: %s accepted but not used by deepshard (the naming rules and "
                       "partition_config decide the splits; the lm_head's logits are gathered)", ", ".join(ignored))
    partition = section.get("partition_config") or {}
    specs = partition.get("layer_specs") or []
    dtype = section.get("dtype")
    return AutoTPConfig(tp_size=max(size, 1), rules=tuple(_rule(s, i) for i, s in enumerate(specs)),
                        use_default_specs=bool(partition.get("use_default_specs", True)),
                        dtype=_dtype(dtype) if dtype is not None else None)


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    names = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
    key = str(value).replace("torch.", "").lower()
    if key not in names:
        raise ValueError(f"tensor_parallel.dtype {value!r} is not a dtype; use one of {sorted(names)}")
    return names[key]


def tp_model_init(model: torch.nn.Module, tp_size: int, dtype: Any = None, config: Any = None) -> torch.nn.Module:
    """DeepSpeed's ``deepspeed.tp_model_init``: record that ``model`` is to be tensor-parallel over
    ``tp_size`` ranks (``dtype``: the dtype to cast it to; ``config``: a ``tensor_parallel`` section).
    Nothing is sharded here: ``initialize`` shards it, so the grid and the config are known. Returns
    ``model``. A later config whose ``autotp_size`` differs raises."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive integer, got {tp_size!r}")
    section = dict(config) if isinstance(config, dict) else {}
    given = section.get("autotp_size")
    if given and int(given) != tp_size:
        raise ValueError(f"tp_model_init: tp_size={tp_size} but config autotp_size={given}; make them agree")
    section["autotp_size"] = tp_size
    if dtype is not None:
        section["dtype"] = dtype
    parse_tp_config(section)  # fail now on a bad section, not later in initialize
    setattr(model, _INIT_ATTR, section)
    return model


def resolve_tp_config(model: torch.nn.Module, section: Any) -> AutoTPConfig:
    """The config's ``tensor_parallel`` section merged with a ``tp_model_init`` record on ``model``;
    the two must agree on the size."""
    recorded = getattr(model, _INIT_ATTR, None)
    from_config = parse_tp_config(section)
    if recorded is None:
        return from_config
    from_init = parse_tp_config(recorded)
    if from_config.enabled and from_config.tp_size != from_init.tp_size:
        raise ValueError(f"tp_model_init(tp_size={from_init.tp_size}) conflicts with the config's "
                         f"tensor_parallel.autotp_size={from_config.tp_size}; make them agree or drop one")
    merged = dict(recorded)
    if isinstance(section, dict):
        merged = {**section, **recorded}
    return parse_tp_config(merged)
