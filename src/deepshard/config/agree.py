"""The config values every rank must share, compared across the ranks at ``initialize``.

Ranks that disagree on the batch arithmetic issue different numbers of collectives or pipeline transfers
per step (a stage with more micro-batches waits for transfers its neighbour never sends; a data-parallel
rank with more accumulation steps reduces gradients at other times), which ends in a hang or a timeout far
from the cause. One exchange at start-up turns that into an error naming the key and each rank's value.
"""
from __future__ import annotations

import zlib
from typing import Any

from deepshard.comm.group import CommGroup
from deepshard.config.base import ConfigError


def shared_values(cfg: Any) -> dict[str, Any]:
    """The values that must be equal on every rank."""
    return {"train_micro_batch_size_per_gpu": cfg.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "train_batch_size": cfg.train_batch_size,
            "zero_optimization.stage": cfg.zero_optimization.stage,
            "pipeline.schedule": cfg.pipeline.schedule}


def disagreements(values: list[dict[str, Any]]) -> list[str]:
    """One line per key whose value differs between ranks (``values[r]`` is rank ``r``'s)."""
    lines = []
    for key in values[0]:
        seen = [v.get(key) for v in values]
        if any(s != seen[0] for s in seen):
            by_value: dict[str, list[int]] = {}
            for rank, value in enumerate(seen):
                by_value.setdefault(repr(value), []).append(rank)
            lines.append(f"{key}: " + ", ".join(f"{value} on rank(s) {ranks}" for value, ranks in by_value.items()))
    return lines


def fingerprint(values: dict[str, Any]) -> int:
    """A 31-bit digest of ``values`` (the same values give the same digest on every rank)."""
    return zlib.crc32(repr(sorted(values.items())).encode("utf-8")) & 0x7FFFFFFF


def check_same_on_every_rank(cfg: Any, world: CommGroup) -> None:
    """Raise the same :class:`ConfigError` on every rank when the ranks' configs disagree on a shared value.

    One all-reduce of two numbers (the largest and the smallest digest) at any world size; the values
    themselves are gathered from every rank only when the digests differ, to name who has what."""
    if world.size == 1:
        return
    import torch
    import torch.distributed as dist

    mine = shared_values(cfg)
    digest = float(fingerprint(mine))
    bounds = torch.tensor([digest, -digest], dtype=torch.float64, device=world._device())
    world.all_reduce_control(bounds, "the config agreement at initialize", op="max")
    if bounds[0].item() == -bounds[1].item():
        return
    gathered: list[Any] = [None] * world.size
    dist.all_gather_object(gathered, mine, group=world.group)
    lines = disagreements(gathered)
    if lines:
        raise ConfigError("the ranks were given different configs; every rank (every pipeline stage) must run "
                          "the same batch arithmetic, or their collectives and transfers never match: "
                          + "; ".join(lines) + ". Pass every rank the same config")
