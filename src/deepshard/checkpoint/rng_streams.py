"""The random state a checkpoint keeps: deepshard's own streams, not the process's generators.

DeepSpeed's ``save_checkpoint``/``load_checkpoint`` leave torch's global generators alone, so whatever a
script draws after loading (its data shuffle, its dropout) continues from where the script's own seeding
left it; deepshard does the same. What deepshard itself draws from is kept per rank: the named streams of
every :class:`~deepshard.tp.random.RngTracker` the model holds (tensor-parallel dropout), saved as
``tracker<i>/<stream>`` in ``rng_rank<r>.safetensors`` and restored on the same grid. A script that wants
its global generator back saves ``torch.get_rng_state()`` in ``client_state``.
"""
from __future__ import annotations

import torch

from deepshard.tp.random import RngTracker


def model_trackers(module: torch.nn.Module) -> list[RngTracker]:
    """The random-stream trackers ``module``'s layers draw from, each once, in module order."""
    found: dict[int, RngTracker] = {}
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, RngTracker):
                found.setdefault(id(value), value)
    return list(found.values())


def stream_states(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``tracker<i>/<stream>`` -> generator state for every stream of ``module``'s trackers."""
    return {f"tracker{i}/{name}": state for i, tracker in enumerate(model_trackers(module))
            for name, state in tracker.state_dict().items()}


def restore_streams(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Put ``module``'s tracker streams back as :func:`stream_states` recorded them. Other entries (the
    global generator states that older checkpoints kept) are ignored: a load leaves the global generators
    alone, as DeepSpeed's does."""
    for i, tracker in enumerate(model_trackers(module)):
        prefix = f"tracker{i}/"
        tracker.load_state_dict({k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)})
