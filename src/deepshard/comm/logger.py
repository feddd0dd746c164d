"""The comms logger: counts calls, elements and bytes per collective for one communication group.

Figures are what this process sends into each collective (the tensor it contributes), so a step's
total can be compared with the analytic ZeRO volumes (2Ψ elements for stages 0-2, 3Ψ for stage 3).

Bytes are also split by link (``intra_node_bytes``, ``inter_node_bytes``) where the group knows which of
its ranks share a machine (``deepshard.comm.nodes``): the volume is spread evenly over the group's peers,
as a direct exchange sends it (each peer gets ``1/n``), and each peer's part counts on the link it
crosses. A rank's own part crosses no link, so the two add up to ``(n-1)/n`` of the volume.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OpStats:
    """``elements``/``bytes``: the size of the tensors handed to the collective; ``volume_elements``:
    the data each process moves by the ZeRO paper's accounting (all-reduce 2x, all-gather and
    reduce-scatter 1x the full tensor)."""

    calls: int = 0
    elements: int = 0
    bytes: int = 0
    volume_elements: int = 0
    volume_bytes: int = 0
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0


@dataclass
class CommsLogger:
    """Per-op counters. ``enabled`` only affects verbose printing; counting is always on (it is cheap).

    ``by_group`` counts the same calls per ``(op, group size)``: what a step costs at a given grid
    (``deepshard dryrun`` prints it, and compares it with a real run's)."""

    enabled: bool = False
    verbose: bool = False
    ops: dict[str, OpStats] = field(default_factory=dict)
    name: str = "comm"
    by_group: dict[tuple[str, int], OpStats] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _LIVE.add(self)

    def __hash__(self) -> int:
        return id(self)

    def record(self, op: str, elements: int, element_size: int, volume_factor: float = 1.0,
               group_size: int = 0, shares: tuple[float, float] = (0.0, 0.0)) -> None:
        """Count one collective of ``elements`` elements (``group_size``: the ranks taking part; 0 unknown;
        ``shares``: the ``(intra-node, inter-node)`` fractions of its volume, ``NodeMap.shares``; zero where
        the caller does not know its group's nodes)."""
        volume = elements * element_size * volume_factor
        for stats in (self.ops.setdefault(op, OpStats()), self.by_group.setdefault((op, group_size), OpStats())):
            stats.calls += 1
            stats.elements += elements
            stats.bytes += elements * element_size
            stats.volume_elements += int(elements * volume_factor)
            stats.volume_bytes += int(volume)
            stats.intra_node_bytes += int(volume * shares[0])
            stats.inter_node_bytes += int(volume * shares[1])

    def reset(self) -> None:
        self.ops.clear()
        self.by_group.clear()

    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.ops.values())

    def total_elements(self) -> int:
        return sum(s.elements for s in self.ops.values())

    def total_volume_elements(self) -> int:
        """Elements moved per process by the ZeRO paper's accounting (2x per all-reduce)."""
        return sum(s.volume_elements for s in self.ops.values())

    def total_volume_bytes(self) -> int:
        """Bytes moved per process by the same accounting (what compression reduces)."""
        return sum(s.volume_bytes for s in self.ops.values())

    def intra_node_bytes(self) -> int:
        """Bytes this process sent to ranks on its own machine (see the module docstring)."""
        return sum(s.intra_node_bytes for s in self.ops.values())

    def inter_node_bytes(self) -> int:
        """Bytes this process sent to ranks on other machines: what slow links between nodes carry."""
        return sum(s.inter_node_bytes for s in self.ops.values())

    def summary(self) -> dict[str, dict[str, int]]:
        return {op: {"calls": s.calls, "elements": s.elements, "bytes": s.bytes,
                     "volume_elements": s.volume_elements, "volume_bytes": s.volume_bytes}
                for op, s in sorted(self.ops.items())}

    def link_summary(self) -> dict[str, dict[str, int]]:
        """Per collective, the bytes sent within this machine and to other machines."""
        return {op: {"intra_node_bytes": s.intra_node_bytes, "inter_node_bytes": s.inter_node_bytes}
                for op, s in sorted(self.ops.items())}

    def format_summary(self) -> str:
        lines = [f"{'collective':<22}{'calls':>8}{'elements':>16}{'MB':>12}{'intra MB':>12}{'inter MB':>12}"]
        for op, s in sorted(self.ops.items()):
            lines.append(f"{op:<22}{s.calls:>8}{s.elements:>16}{s.bytes / 2**20:>12.2f}"
                         f"{s.intra_node_bytes / 2**20:>12.2f}{s.inter_node_bytes / 2**20:>12.2f}")
        return "\n".join(lines)


# every live logger, weakly held: what deepshard.comm.log_summary() reports (several engines may coexist)
_LIVE: "weakref.WeakSet[CommsLogger]" = weakref.WeakSet()


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    """DeepSpeed's ``deepspeed.comm.log_summary``: print (rank 0 of each group) or return the per-op
    counters of every live engine's comms logger. ``show_straggler`` is accepted for compatibility."""
    summaries = {f"{lg.name}#{i}": lg.summary() for i, lg in enumerate(sorted(_LIVE, key=id))}
    if return_dict:
        return summaries
    from deepshard.utils.logging import logger

    for i, lg in enumerate(sorted(_LIVE, key=id)):
        logger.info("comms summary (%s #%d):\n%s", lg.name, i, lg.format_summary())
    return None
