"""Modelled sections that deepshard validates but does not act on: refused or warned about.

A section switched on in the config must either act, or say that it does not. Those whose absence
would change the numbers a user trains with (a precision mode, a dtype) are refused, with the setting
that does the same thing in deepshard; those that only lose a convenience (a monitor backend, a
checkpoint-writer option, activation-checkpointing settings for an API deepshard does not have) log
one warning each. Sections the DeepSpeed keys of which are fully implemented are not listed here;
features deepshard does not model at all are in ``unimplemented.py``.
"""
from __future__ import annotations

from typing import Any

import torch

from deepshard.config.base import ConfigError, dtype_from_name
from deepshard.precision.policy import param_dtype_problem
from deepshard.utils.logging import logger

_CHECKPOINT_DEFAULTS: dict[str, Any] = {"use_node_local_storage": False, "serialization": True,
                                        "writer": None}


def refused(cfg: Any) -> list[str]:
    """One sentence per switched-on setting that deepshard would ignore and that changes numerics."""
    problems = []
    if cfg.torch_autocast.enabled:
        problems.append(
            "torch_autocast.enabled is true, but deepshard does not run forward under torch.autocast (training "
            "would silently stay in fp32); use \"bf16\": {\"enabled\": true} (bf16 parameters, fp32 master "
            "weights) or set torch_autocast.enabled to false")
    if cfg.amp.enabled:
        problems.append(
            "amp.enabled is true, but NVIDIA Apex AMP is not supported (training would silently stay in "
            "fp32); use \"bf16\": {\"enabled\": true} or \"fp16\": {\"enabled\": true} instead")
    model_dtype = cfg.model_dtype
    param_problem = param_dtype_problem(cfg.data_types.param_dtype, cfg.fp16.enabled, cfg.bf16.enabled)
    if param_problem is not None:
        problems.append(param_problem)
    accum = cfg.data_types.grad_accum_dtype
    if accum is not None and dtype_from_name(accum) not in (model_dtype, torch.float32) \
            and cfg.gradient_accumulation_steps > 1:
        problems.append(f"data_types.grad_accum_dtype is {accum!r}, but deepshard accumulates gradients over the "
                        f"{cfg.gradient_accumulation_steps} micro-batches in the training dtype ({model_dtype}) or, "
                        "in pipelines, in fp32; remove the key or set it to one of those")
    return problems


def _activation_checkpointing_set(cfg: Any) -> list[str]:
    section = cfg.activation_checkpointing
    defaults = type(section)()
    return [f"activation_checkpointing.{key}" for key in type(section).model_fields
            if getattr(section, key) != getattr(defaults, key)]


def _checkpoint_set(cfg: Any) -> list[str]:
    section = cfg.checkpoint
    keys = [f"checkpoint.{key}" for key, off in _CHECKPOINT_DEFAULTS.items() if getattr(section, key) != off]
    if section.parallel_write.pipeline_stage:
        keys.append("checkpoint.parallel_write.pipeline_stage")
    return keys


def ignored(cfg: Any) -> list[tuple[str, str]]:
    """``(keys, why)`` for every switched-on setting deepshard does not act on but that changes no
    numbers (warned about)."""
    out = []
    keys = _activation_checkpointing_set(cfg)
    if keys:
        out.append((", ".join(keys), "they configure deepspeed.checkpointing, which deepshard does not "
                    "implement; wrap blocks with torch.utils.checkpoint.checkpoint in the model instead"))
    if cfg.comet.enabled:
        out.append(("comet.enabled", "the Comet monitor is not implemented; use tensorboard, csv_monitor or wandb"))
    keys = _checkpoint_set(cfg)
    if keys:
        out.append((", ".join(keys), "deepshard writes every checkpoint as safetensors + JSON under the "
                    "save_checkpoint directory (no node-local storage, writer or per-stage options)"))
    accum = cfg.data_types.grad_accum_dtype
    if accum is not None and dtype_from_name(accum) != cfg.model_dtype and cfg.gradient_accumulation_steps == 1:
        out.append(("data_types.grad_accum_dtype", "gradients are accumulated in the training dtype, which makes "
                    "no difference with gradient_accumulation_steps 1"))
    if cfg.fp16.auto_cast and not cfg.fp16.enabled:
        out.append(("fp16.auto_cast", "it casts the inputs to fp16 only in fp16 training (DeepSpeed would cast them "
                    f"to fp16 for this {cfg.model_dtype} model too, which then refuses them); cast the inputs "
                    "yourself or remove the key"))
    if cfg.checkpoint.load_universal:
        out.append(("checkpoint.load_universal", "deepshard checkpoints load on any number of processes as they "
                    "are; DeepSpeed universal-checkpoint folders are not read"))
    return out


def check_inert(cfg: Any) -> None:
    """Refuse (``ConfigError``) or warn about the settings above."""
    problems = refused(cfg)
    if problems:
        raise ConfigError("; ".join(problems))
    for keys, why in ignored(cfg):
        logger.warning("%s: ignored by deepshard: %s", keys, why)


def warn_unused_pipeline(cfg: Any, model: Any) -> None:
    """The ``pipeline`` section only configures a pipeline model (``PipelineModule``, which has
    ``num_stages``); given with another model it changes nothing, so say so."""
    if "pipeline" in cfg.raw and not hasattr(model, "num_stages"):
        logger.warning("pipeline: ignored: the section configures a pipeline-parallel model (PipelineModule) and "
                       "%s is not one; remove the section, or build the model as a PipelineModule",
                       type(model).__name__)
