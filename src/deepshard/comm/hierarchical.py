"""Collectives that know the machine boundary: the all-gathers and reduce-scatters of MiCS and ZeRO++,
written in PyTorch on any backend (gloo, NCCL).

A group of ``N = M x L`` ranks on ``M`` nodes of ``L`` ranks each owns ``N`` equal chunks of a flat tensor,
chunk ``p`` on the group's rank ``p``. Two sub-groups of it (``Hierarchy``) carry the traffic: the *intra*
group (this rank's node, ``L`` ranks) and the *inter* group (the ranks with this rank's place in their
node, one per node, ``M`` ranks).

- :func:`hierarchical_all_gather` (MiCS's ``mics_hierarchical_params_gather``): gather across nodes
  first, then inside the node. Each rank receives ``M - 1`` chunks over the slow links instead of
  ``N - L``.
- :func:`quantized_all_gather` (ZeRO++'s qwZ): each rank sends its chunk as 8-bit integers with a scale
  per block (``deepshard.comm.quantize``), flat or hierarchical; every rank (its own chunk included)
  decodes the same values, so the replicas compute with identical weights.
- :func:`quantized_reduce_scatter` (ZeRO++'s qgZ): the sum over ranks of a flat tensor, each rank keeping
  its chunk, by two all-to-alls of quantized data with fp32 accumulation between and after them. Hop 1,
  inside the node: rank ``(m, l)`` receives from its node's ranks their parts for the chunks owned by the
  ranks of place ``l`` on every node, and sums them. Hop 2, across nodes: it sends node ``m'`` the partial
  sum of the chunk of ``(m', l)``, and sums what it receives. Each rank sends ``M - 1`` partial chunks over
  the slow links (a flat reduce-scatter sends ``N - L``), each as 4 or 8 bits. A rank's own part never
  goes through the codec: it is added exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from deepshard.comm.group import CommGroup
from deepshard.comm.quantize import BlockCodec
from deepshard.comm.staged import Stages, StagedWork

QWZ_MAX_BLOCK = 8000
"""qwZ's block: at most 8000 elements per scale, DeepSpeed's target quantization group size."""
QGZ_MAX_BLOCK = 1024
"""qgZ's block: about one weight row of DeepSpeed's per-row grouping for models of hidden size ~1k."""


@dataclass(frozen=True)
class Hierarchy:
    """The two sub-groups of ``group`` (see the module docstring). ``nodes[m]``: the global ranks of node ``m``
    in ``group``, in group order; ``intra``/``inter``: this rank's sub-groups (None when the group is on one
    node: everything is intra-node)."""

    group: CommGroup
    nodes: tuple[tuple[int, ...], ...]
    intra: CommGroup
    inter: CommGroup

    def __post_init__(self) -> None:
        sizes = {len(n) for n in self.nodes}
        if len(sizes) != 1:
            raise ValueError(f"a hierarchical collective needs the same number of ranks on every node, got nodes "
                             f"of {[len(n) for n in self.nodes]} ranks in group '{self.group.name}'")
        me = self.group.peers[self.group.rank]
        m = next(i for i, n in enumerate(self.nodes) if me in n)
        local = self.nodes[m].index(me)
        if list(self.intra.peers) != list(self.nodes[m]) or \
                list(self.inter.peers) != [n[local] for n in self.nodes]:
            raise ValueError(f"the intra-node group {self.intra.peers} and inter-node group {self.inter.peers} of "
                             f"rank {me} do not match its group's nodes {self.nodes}")

    @property
    def per_node(self) -> int:
        return len(self.nodes[0])

    def position(self, rank: int) -> int:
        """The chunk a global rank owns: its place in ``group``."""
        return list(self.group.peers).index(rank)

    def owned_by_place(self, local: int) -> list[int]:
        """The chunks owned by the ranks of place ``local`` on every node, in node order."""
        return [self.position(n[local]) for n in self.nodes]


def hierarchical_all_gather(h: Hierarchy, output: torch.Tensor, shard: torch.Tensor) -> StagedWork:
    """All-gather ``shard`` (equal on every rank) over ``h.group`` into ``output`` in group order: across
    nodes, then inside the node."""
    return StagedWork(_gather_stages(h, output, shard, None))


def quantized_all_gather(group: CommGroup, output: torch.Tensor, shard: torch.Tensor, key: int = 0,
                         h: Optional[Hierarchy] = None, max_block: int = QWZ_MAX_BLOCK) -> StagedWork:
    """All-gather ``shard`` into ``output`` (any float dtype) as 8-bit integers (flat over ``group``, or
    hierarchical over ``h``). Every chunk of ``output``, this rank's too, holds the decoded values."""
    codec = BlockCodec.spread(shard.numel(), max_block, 8)
    payload = codec.encode(shard.reshape(-1))
    if h is not None:
        return StagedWork(_gather_stages(h, output, payload, codec))
    return StagedWork(_flat_quantized_gather(group, output, payload, codec, key),
                      scratch_bytes=codec.nbytes * group.size)


def _flat_quantized_gather(group: CommGroup, output: torch.Tensor, payload: torch.Tensor, codec: BlockCodec,
                           key: int) -> Stages:
    gathered = torch.empty(group.size * codec.nbytes, dtype=torch.uint8, device=payload.device)
    yield group.all_gather_into_tensor(gathered, payload, async_op=True, key=key)
    _decode_rows(gathered.view(group.size, -1), output.view(group.size, -1), codec)
    return output


def _gather_stages(h: Hierarchy, output: torch.Tensor, shard: torch.Tensor, codec: Optional[BlockCodec]) -> Stages:
    """Across nodes (``inter``: M rows), then inside the node (``intra``: L rows of M); the result is laid
    out [place][node] and written to ``output`` in group order (decoded when ``codec`` is given)."""
    m_count, l_count = len(h.nodes), h.per_node
    row = shard.numel()
    across = torch.empty(m_count * row, dtype=shard.dtype, device=shard.device)
    yield h.inter.all_gather_into_tensor(across, shard.reshape(-1), async_op=True)
    inside = torch.empty(l_count * m_count * row, dtype=shard.dtype, device=shard.device)
    yield h.intra.all_gather_into_tensor(inside, across, async_op=True)
    rows = inside.view(l_count, m_count, row)
    out_rows = output.view(h.group.size, -1)
    for local in range(l_count):
        for m, position in enumerate(h.owned_by_place(local)):
            if codec is None:
                out_rows[position].copy_(rows[local, m])
            else:
                codec.decode_into(rows[local, m], out_rows[position])
    return output


def _decode_rows(payloads: torch.Tensor, out_rows: torch.Tensor, codec: BlockCodec) -> None:
    for r in range(payloads.shape[0]):
        codec.decode_into(payloads[r], out_rows[r])


def quantized_reduce_scatter(full: torch.Tensor, chunk: int, h: Hierarchy, bits: int,
                             max_block: int = QGZ_MAX_BLOCK) -> StagedWork:
    """Start the sum over ``h.group`` of ``full`` (``group.size * chunk`` elements, every rank the same
    size); ``result`` after ``wait()``: this rank's chunk of the sum, in ``full``'s dtype, accumulated in fp32.
    ``full`` is read at once (it may be reused when this returns)."""
    if full.numel() != h.group.size * chunk:
        raise ValueError(f"quantized_reduce_scatter: {full.numel()} elements for {h.group.size} chunks of {chunk}")
    return StagedWork(_reduce_stages(full, chunk, h, bits, max_block),
                      scratch_bytes=2 * full.numel() * 4 // max(h.per_node, 1))


def _reduce_stages(full: torch.Tensor, chunk: int, h: Hierarchy, bits: int, max_block: int) -> Stages:
    m_count, l_count = len(h.nodes), h.per_node
    rows = full.view(h.group.size, chunk)
    my_place = h.intra.rank
    # hop 1, inside the node: to each local peer, its place's chunks of every node, quantized
    codec1 = BlockCodec.spread(m_count * chunk, max_block, bits)
    send1 = torch.empty(l_count, codec1.nbytes, dtype=torch.uint8, device=full.device)
    own = torch.empty(m_count * chunk, dtype=torch.float32, device=full.device)
    for local in range(l_count):
        part = torch.cat([rows[p] for p in h.owned_by_place(local)]).float()
        if local == my_place:
            own.copy_(part)
        else:
            codec1.encode(part, out=send1[local])
    recv1 = torch.empty_like(send1)
    if l_count > 1:
        yield h.intra.all_to_all_single(recv1, send1, async_op=True)
    for local in range(l_count):  # the node's partial sums of the chunks of place my_place, node by node
        if local != my_place:
            codec1.decode_add(recv1[local], own)
    partial = own.view(m_count, chunk)
    # hop 2, across nodes: to each node, the partial sum of the chunk its rank of my place owns
    my_node = h.inter.rank
    codec2 = BlockCodec.spread(chunk, max_block, bits)
    send2 = torch.empty(m_count, codec2.nbytes, dtype=torch.uint8, device=full.device)
    for m in range(m_count):
        if m != my_node:
            codec2.encode(partial[m], out=send2[m])
    recv2 = torch.empty_like(send2)
    if m_count > 1:
        yield h.inter.all_to_all_single(recv2, send2, async_op=True)
    total = partial[my_node].clone()
    for m in range(m_count):
        if m != my_node:
            codec2.decode_add(recv2[m], total)
    return total.to(full.dtype)
