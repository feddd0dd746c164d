"""deepshard: ZeRO-sharded, mixed-precision, multi-process training for PyTorch.

Keeps DeepSpeed's public contract, so ``import deepshard as deepspeed`` runs a DeepSpeed user's script::

    engine, optimizer, dataloader, lr_scheduler = deepshard.initialize(args=args, model=model,
                                                                       model_parameters=model.parameters())
    loss = engine(batch); engine.backward(loss); engine.step()

Names are imported lazily so that light entry points (the ``deepshard`` launcher) do not pay for
importing torch.
"""
from __future__ import annotations

import importlib
from typing import Any

from deepshard._version import (__git_branch__, __git_hash__, __version__, __version_major__,
                                __version_minor__, __version_patch__)
from deepshard.compat.finder import install_spelling_finder

version = __version__

_LAZY = {
    "initialize": ("deepshard.bootstrap", "initialize"),
    "init_distributed": ("deepshard.distributed", "init_distributed"),
    "add_config_arguments": ("deepshard.config", "add_config_arguments"),
    "add_tuning_arguments": ("deepshard.runtime.lr_schedules", "add_tuning_arguments"),
    "load_config": ("deepshard.config", "load_config"),
    "DeepShardConfig": ("deepshard.config", "DeepShardConfig"),
    "DeepShardEngine": ("deepshard.engine", "DeepShardEngine"),
    "DeepSpeedEngine": ("deepshard.engine", "EngineCore"),  # DeepSpeed's class name: the base of both engines
    "DeepSpeedConfig": ("deepshard.runtime.ds_config", "DeepSpeedConfig"),
    "DeepSpeedConfigError": ("deepshard.config", "ConfigError"),
    "tp_model_init": ("deepshard.tp.autotp_config", "tp_model_init"),
    "get_accelerator": ("deepshard.accelerator", "get_accelerator"),
    "PipelineEngine": ("deepshard.pipe.engine", "PipelineEngine"),
    "PipelineModule": ("deepshard.pipe", "PipelineModule"),
    "OnDevice": ("deepshard.utils.init_on_device", "OnDevice"),
}
_SUBMODULES = {"comm", "checkpoint", "config", "monitor", "optim", "precision", "runtime", "utils", "zero",
               "launcher", "accelerator", "data", "profiling", "ops", "pipe", "checkpointing", "tp", "moe", "git_version_info"}

__all__ = sorted(_LAZY) + ["__version__"]

install_spelling_finder()  # deepshard.X for every deepspeed.X path (deepshard.compat.aliases is the table)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f"deepshard.{name}")
        globals()[name] = module
        return module
    from deepshard.compat.aliases import missing_attribute

    raise missing_attribute("deepshard", name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)
