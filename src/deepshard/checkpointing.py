"""DeepSpeed's activation-checkpointing function, ``deepspeed.checkpointing.checkpoint(function, *args)``:
``function(*args)`` runs without keeping its intermediate activations, which are recomputed in backward
(``torch.utils.checkpoint``, non-reentrant). With ``cpu_checkpointing`` the saved inputs wait in host
memory (``torch.autograd.graph.save_on_cpu``).

The pipeline engine builds its checkpoint function from the config's ``activation_checkpointing``
section (``options_from_config``). ``partition_activations`` splits saved activations across
tensor-parallel ranks; with no tensor parallelism there is nothing to split and it has no effect.
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


def checkpoint(function: Callable[..., Any], *args: Any, options: CheckpointOptions | None = None) -> Any:
    """``function(*args)`` with its activations recomputed in backward instead of kept."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    opts = options or CheckpointOptions()
    keep = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if opts.cpu_checkpointing
            else contextlib.nullcontext())
    with keep:
        return torch_checkpoint(function, *args, use_reentrant=False)


def options_from_config(section: Any) -> CheckpointOptions:
    """The options of a config's ``activation_checkpointing`` section."""
    return CheckpointOptions(cpu_checkpointing=bool(section.cpu_checkpointing),
                             partition_activations=bool(section.partition_activations))


def __getattr__(name: str) -> Any:
    """DeepSpeed names this module does not provide: an AttributeError that says why and what to use."""
    from deepshard.compat.aliases import missing_attribute

    raise missing_attribute(__name__, name)
