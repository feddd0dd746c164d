"""What a Megatron-DeepSpeed folder's model-state files say beyond the weights: the slim per-file metadata
:class:`DeepSpeedCheckpoint` keeps (each file is read once), the checks a conversion runs on it, and the
parallel dimensions a writer records (``checkpoint_parallel_dimensions``)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from deepshard.checkpoint.deepspeed_format.constants import (AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_LAYERS_KEY,
                                                             AUTOEP_LAYERS_KEY_LEGACY, AUTOEP_ZERO12_REQUIRED_FIELDS,
                                                             CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE,
                                                             CHECKPOINT_TP_DEGREE, PARAM_SHAPES)

__all__ = ["aggregate_zero12_metadata", "checkpoint_parallel_metadata", "slim_metadata"]

DATA_BEFORE_EXPERT = "use_data_before_expert_parallelism"
_AUTOEP_FIELDS = ("moe_layer_id", "module_path") + AUTOEP_ZERO12_REQUIRED_FIELDS


def _mpu_size(mpu: Any, *names: str) -> int:
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return int(fn())
    return 1


def checkpoint_parallel_metadata(mpu: Any = None) -> dict[str, dict[str, int]]:
    """``{checkpoint_parallel_dimensions: {pp_degree, tp_degree}}`` of a Megatron-style ``mpu`` (None: 1 and
    1), as a model-state file records them so a reader knows the layout without counting files (the
    pipeline size from ``get_pipeline_model_parallel_world_size`` / ``get_pipe_parallel_world_size``, the
    tensor-parallel size from ``get_tensor_model_parallel_world_size`` / ``get_slice_parallel_world_size`` /
    ``get_model_parallel_world_size``)."""
    if mpu is None:
        pp = tp = 1
    else:
        pp = _mpu_size(mpu, "get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")
        tp = _mpu_size(mpu, "get_tensor_model_parallel_world_size", "get_slice_parallel_world_size",
                       "get_model_parallel_world_size")
    return {CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: pp, CHECKPOINT_TP_DEGREE: tp}}


def _slim(value: Any, kind: type, keep: Any) -> Any:
    """``keep(value)`` when ``value`` is a ``kind``; None stays None; anything else becomes its type's name
    (so a malformed entry is reported by the checks, without holding the file's contents)."""
    if value is None:
        return None
    return keep(value) if isinstance(value, kind) else type(value).__name__


def slim_metadata(state: Any) -> dict[str, Any]:
    """What :class:`DeepSpeedCheckpoint` keeps of one model-state file: its parallel dimensions, its
    parameter shapes (one dict), its AutoEP layer records (their identifying fields) and the expert-order
    flag of its ``ds_config``."""
    state = state if isinstance(state, dict) else {}
    autoep = state.get(AUTOEP_LAYERS_KEY, state.get(AUTOEP_LAYERS_KEY_LEGACY))
    shapes = state.get(PARAM_SHAPES)
    if isinstance(shapes, (list, tuple)) and all(isinstance(group, dict) for group in shapes):
        shapes = {name: shape for group in shapes for name, shape in group.items()}
    elif shapes is not None:
        shapes = type(shapes).__name__
    config = state.get("ds_config", {})
    return {
        CHECKPOINT_PARALLEL_DIMS: _slim(state.get(CHECKPOINT_PARALLEL_DIMS), dict,
                                        lambda d: {k: d.get(k) for k in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}),
        PARAM_SHAPES: shapes,
        AUTOEP_LAYERS_KEY: _slim(autoep, list, lambda layers: [
            {k: e[k] for k in _AUTOEP_FIELDS if k in e} if isinstance(e, dict) else type(e).__name__
            for e in layers]),
        "ds_config": _slim(config, dict, lambda c: {DATA_BEFORE_EXPERT: c.get(DATA_BEFORE_EXPERT, False)}),
    }


def aggregate_zero12_metadata(model_state_metadata: Sequence[tuple[str, dict[str, Any]]]
                              ) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]], bool]:
    """The model-state files' metadata checked and joined for converting a ZeRO 1-2 folder: the parameter
    shapes of each tensor-parallel slice, the AutoEP layers (one record per expert key prefix; the files
    must agree), and the expert-order flag (the files must agree). Raises RuntimeError naming the file and
    what is malformed."""
    shapes_by_tp: list[dict[str, Any]] = []
    layers: dict[str, dict[str, Any]] = {}
    layer_source: dict[str, str] = {}
    flags: dict[str, bool] = {}
    for model_file, meta in model_state_metadata:
        shapes = meta.get(PARAM_SHAPES)
        if not isinstance(shapes, dict):
            raise RuntimeError(f"DeepSpeed checkpoint {PARAM_SHAPES} must contain dictionaries in {model_file}.")
        shapes_by_tp.append(shapes)
        for layer in _autoep_layers(model_file, meta.get(AUTOEP_LAYERS_KEY)):
            prefix = layer[AUTOEP_EXPERT_KEY_PREFIX]
            if prefix in layers and layers[prefix] != layer:
                raise RuntimeError(f"Conflicting AutoEP metadata for {AUTOEP_EXPERT_KEY_PREFIX} {prefix!r} in "
                                   f"{layer_source[prefix]} and {model_file}.")
            layers.setdefault(prefix, layer)
            layer_source.setdefault(prefix, model_file)
        config = meta.get("ds_config")
        if not isinstance(config, dict):
            raise RuntimeError(f"DeepSpeed checkpoint ds_config must be a dictionary in {model_file}.")
        flag = config.get(DATA_BEFORE_EXPERT, False)
        if not isinstance(flag, bool):
            raise RuntimeError(f"DeepSpeed checkpoint {DATA_BEFORE_EXPERT} must be a boolean in {model_file}.")
        flags[model_file] = flag
    if len(set(flags.values())) > 1:
        raise RuntimeError(f"DeepSpeed checkpoint {DATA_BEFORE_EXPERT} disagrees across model-state files: {flags}")
    return shapes_by_tp, list(layers.values()) or None, next(iter(flags.values()), False)


def _autoep_layers(model_file: str, records: Any) -> list[dict[str, Any]]:
    if records is None:
        return []
    if not isinstance(records, list):
        raise RuntimeError(f"AutoEP metadata must be a list in {model_file}.")
    for layer in records:
        if not isinstance(layer, dict):
            raise RuntimeError(f"AutoEP layer metadata must contain dictionaries in {model_file}.")
        prefix = layer.get(AUTOEP_EXPERT_KEY_PREFIX)
        if not isinstance(prefix, str) or not prefix:
            raise RuntimeError(f"AutoEP {AUTOEP_EXPERT_KEY_PREFIX} must be a non-empty string in {model_file}.")
    return records
