"""DeepSpeed's activation-checkpointing function, ``deepspeed.checkpointing.checkpoint(function, *args)``:
``function(*args)`` runs without keeping its intermediate activations, which are recomputed in backward
(``torch.utils.checkpoint``, non-reentrant). With ``cpu_checkpointing`` the saved inputs wait in host
memory (``torch.autograd.graph.save_on_cpu``).

The pipeline engine builds its checkpoint function from the config's ``activation_checkpointing``
section (``options_from_config``): ``checkpoint``, or ``non_reentrant_checkpoint`` with
``pipeline.use_reentrant: false``. ``partition_activations`` splits saved activations across
tensor-parallel ranks; with no tensor parallelism there is nothing to split and it has no effect.
``configure(...)`` (DeepSpeed's module-level setup) sets the options of the ``checkpoint`` calls that pass
none, for this process.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class CheckpointOptions:
    """How ``checkpoint`` keeps what it saves."""

    cpu_checkpointing: bool = False
    partition_activations: bool = False


class _Configured:
    """What ``configure`` set (None: not called), for the ``checkpoint`` calls that pass no options. A
    process-wide setting by DeepSpeed's design (``deepspeed.checkpointing.configure`` is module-level); it
    holds options only, no process group or tensor."""

    options: CheckpointOptions | None = None


def checkpoint(function: Callable[..., Any], *args: Any, options: CheckpointOptions | None = None) -> Any:
    """``function(*args)`` with its activations recomputed in backward instead of kept (``options``: by
    default what ``configure`` set, else none)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    opts = options or _Configured.options or CheckpointOptions()
    keep = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if opts.cpu_checkpointing
            else contextlib.nullcontext())
    with keep:
        return torch_checkpoint(function, *args, use_reentrant=False)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any,
                             options: CheckpointOptions | None = None) -> Any:
    """DeepSpeed's non-reentrant variant of ``checkpoint`` (what ``pipeline.use_reentrant: false`` picks for
    a ``PipelineModule``): the inputs need not require grad. deepshard's ``checkpoint`` is non-reentrant
    already, so the two recompute alike; the name tells the pipeline engine that the first stage's inputs
    need no gradient."""
    return checkpoint(function, *args, options=options)


def options_from_config(section: Any) -> CheckpointOptions:
    """The options of a config's ``activation_checkpointing`` section."""
    return CheckpointOptions(cpu_checkpointing=bool(section.cpu_checkpointing),
                             partition_activations=bool(section.partition_activations))


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's ``deepspeed.checkpointing.configure``: the options of later ``checkpoint`` calls that pass
    none, from ``deepspeed_config``'s ``activation_checkpointing`` section (a config file, dict, or an
    engine's ``engine.config``), overridden by the arguments given. ``checkpoint_in_cpu`` is the section's
    ``cpu_checkpointing``. ``mpu_`` (tensor-parallel partitioning of saved activations), the contiguous
    buffer (``contiguous_checkpointing``, ``num_checkpoints``), ``synchronize`` and ``profile`` change no
    result and are accepted without effect: deepshard keeps saved activations in torch's allocator."""
    base = _options_of(deepspeed_config) if deepspeed_config is not None else CheckpointOptions()
    _Configured.options = CheckpointOptions(
        cpu_checkpointing=base.cpu_checkpointing if checkpoint_in_cpu is None else bool(checkpoint_in_cpu),
        partition_activations=(base.partition_activations if partition_activations is None
                               else bool(partition_activations)))


def is_configured() -> bool:
    """Whether ``configure`` was called in this process."""
    return _Configured.options is not None


def _options_of(config: Any) -> CheckpointOptions:
    """The ``activation_checkpointing`` options of a config given as an engine's config, a dict or a file."""
    section = getattr(config, "activation_checkpointing", None)
    if section is not None and not isinstance(config, dict):
        return options_from_config(section)
    from deepshard.config.loader import read_config_source

    data, _ = read_config_source(config)
    raw = data.get("activation_checkpointing") or {}
    return CheckpointOptions(cpu_checkpointing=bool(raw.get("cpu_checkpointing", False)),
                             partition_activations=bool(raw.get("partition_activations", False)))


def __getattr__(name: str) -> Any:
    """DeepSpeed names this module does not provide: an AttributeError that says why and what to use."""
    from deepshard.compat.aliases import missing_attribute

    raise missing_attribute(__name__, name)
