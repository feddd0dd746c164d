"""Tied weights across pipeline stages (``TiedLayerSpec``): one process group per tied key and per
(data, tensor) coordinate over the stages holding a copy. The copies start equal (broadcast from the
lowest stage), their gradients are summed over those stages before the data-parallel reduction, and each
copy is marked so the global gradient norm counts the weight once (``placement.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepshard.comm.group import CommGroup
from deepshard.pipe.module import PipelineModule
from deepshard.topology import Coord, Topology, new_groups
from deepshard.placement import mark_tied


@dataclass
class TiedWeights:
    """This rank's tied keys and, for each, the group of stages sharing it."""

    module: PipelineModule
    groups: dict[str, CommGroup] = field(default_factory=dict)

    def parameters(self, key: str) -> list[torch.nn.Parameter]:
        return self.module.tied_parameters(key)

    @torch.no_grad()
    def broadcast(self) -> None:
        """Make every copy equal to the lowest stage's."""
        for key, group in self.groups.items():
            for p in self.parameters(key):
                group.broadcast(p.data, src=0)

    @torch.no_grad()
    def all_reduce_grads(self) -> None:
        """Sum each tied parameter's gradient over the stages that hold it (a missing one counts as 0)."""
        for key, group in self.groups.items():
            for p in self.parameters(key):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                group.all_reduce(p.grad)


def build_tied_weights(module: PipelineModule, topology: Topology) -> TiedWeights:
    """Create the tied groups (collective: every rank, same order) and mark the tied parameters."""
    dims = topology.dims
    tied = TiedWeights(module)
    for key, stages in sorted(module.tied_stages().items()):
        for p in module.tied_parameters(key):
            mark_tied(p, len(stages))
        if len(stages) < 2:
            continue
        rank_lists = [[dims.rank(Coord(pp=s, dp=dp, tp=tp)) for s in stages]
                      for dp in range(dims.dp) for tp in range(dims.tp)]
        group = new_groups(rank_lists, topology.rank, logger=topology.world.logger, name="pp",
                           nodes=topology.world.nodes)
        if group is not None:
            tied.groups[key] = group
    return tied
