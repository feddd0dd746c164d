"""Sequence parallelism: DeepSpeed's ``sequence_parallel_size`` and deepshard's ``sequence_parallel``
section, which picks how the sequence-parallel ranks attend (``deepshard.sp``).

    "sequence_parallel_size": 4,
    "sequence_parallel": {"mode": "hybrid", "ulysses_size": 2}

``mode``: ``ulysses`` (DeepSpeed's: an all-to-all trades the sequence split for a head split around
attention; the default), ``ring`` (ring attention: key/value blocks travel around the ranks) or
``hybrid`` (heads over groups of ``ulysses_size`` ranks, the ring over the rest).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import Field

from deepshard.config.base import ConfigError, Section


class SequenceParallelConfig(Section):
    """deepshard's own section (DeepSpeed has only ``sequence_parallel_size``)."""

    section_path: ClassVar[str] = "sequence_parallel"

    mode: Literal["ulysses", "ring", "hybrid"] = "ulysses"
    ulysses_size: Optional[int] = Field(None, ge=1)
    """hybrid: the ranks that split heads (all-to-all); the ring runs over sp / ulysses_size groups."""
    load_balance: bool = True
    """ring and hybrid, causal attention: each rank holds a head chunk and a tail chunk of the sequence so
    every rank does the same work (off: contiguous chunks, rank 0 idles most)."""


def check_sequence_parallel(size: Any, section: SequenceParallelConfig) -> int:
    """The validated ``sequence_parallel_size`` (an int >= 1) and the section's fit with it."""
    if size is None:
        size = 1
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"sequence_parallel_size must be an integer >= 1, got {size!r}")
    if section.mode == "hybrid":
        u = section.ulysses_size
        if u is None or size % u != 0 or u in (1, size):
            raise ConfigError(f"sequence_parallel.mode=\"hybrid\" needs sequence_parallel.ulysses_size, a divisor "
                              f"of sequence_parallel_size={size} strictly between 1 and {size} (got {u!r}); "
                              "or use mode \"ulysses\" or \"ring\"")
    elif section.ulysses_size is not None:
        raise ConfigError(f"sequence_parallel.ulysses_size={section.ulysses_size} only applies to mode \"hybrid\" "
                          f"(mode is \"{section.mode}\"); remove it or set mode to \"hybrid\"")
    return size
