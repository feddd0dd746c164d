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
from deepshard.topology import Coord, Topology, own_group
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
    """Create this rank's tied groups (every rank calls it, same order: see ``topology.own_group``) and mark
    the tied parameters."""
    dims = topology.dims
    tied = TiedWeights(module)
    for key, stages in sorted(module.tied_stages().items()):
        for p in module.tied_parameters(key):
            mark_tied(p, len(stages))
        if len(stages) < 2:
            continue
        c = topology.coord  # this rank's copy of the key is tied with the same (dp, sp, tp) on the other stages
        mine = [dims.rank(Coord(pp=s, dp=c.dp, tp=c.tp, sp=c.sp)) for s in stages] if c.pp in stages else None
        group = own_group(mine, topology.rank, logger=topology.world.logger, name="pp",
                          nodes=topology.world.nodes)
        if group is not None:
            tied.groups[key] = group
    return tied
