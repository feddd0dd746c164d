"""The optimizer side of ZeRO stages 1, 2 and 3, one component both strategies hold.

A rank's partition is cut into *pieces* (``partition.Fragment``: the owned part of one parameter, cut
again at sub-group boundaries when offloading). Each piece has a 1-D tensor the user's optimizer updates
(the fp32 master in 16-bit training, the parameter's own slice in fp32), its optimizer state and fp32
value wherever the offload policy keeps them (``ShardStates``: device, host memory or files), and the
place its reduced gradient is read from (stage 1: the full flat gradient; stage 2: the gradient shard;
stage 3: the gradient store). This component hands the pieces to the optimizer, runs the update, weighs
the gradient norm by each parameter's placement, writes and reads the pieces of a checkpoint, and
assembles a parameter's full value, gradient or state from every rank's pieces. Where parameters live
between steps (a flat buffer all-gathered after the update, or shards gathered by hooks) is the
strategy's business, reached through the ``publish`` callback of ``step``.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from deepshard.comm.group import CommGroup
from deepshard.placement import identities, saved_slice
from deepshard.shard_state import FragmentRecord, FullState, export_param_groups, restore_param_groups, slice_state
from deepshard.zero.grad_norm import Pieces
from deepshard.zero.offload.states import ShardStates
from deepshard.zero.partition import FlatLayout
from deepshard.zero.strategy import sources_by_copies

NORM_CHUNK = 1 << 22  # elements squared at a time: the norm's scratch stays a few MB, not a shard's size

Publish = Callable[[int, torch.Tensor], None]
"""``publish(shard_start, fp32_values)``: make updated values of a shard range visible to the module."""


def squared_norm(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of ``tensors`` in fp32 (a 1-element tensor), a chunk at a time so no fp32 copy of
    a whole (16-bit) gradient shard is ever made: that copy would be the largest allocation of an
    offloaded step."""
    local = torch.zeros(1, dtype=torch.float32, device=device)
    for t in tensors:
        for chunk in t.reshape(-1).split(NORM_CHUNK):
            local += chunk.float().pow(2).sum()
    return local


class ShardedOptimizer:
    """This rank's optimizer partition: pieces, their states, their gradient sources (see the module
    docstring). ``params`` are the trainable parameters in ``layout``'s order."""

    def __init__(self, states: ShardStates, layout: FlatLayout, params: list[torch.nn.Parameter],
                 comm: CommGroup, device: torch.device,
                 group_of: Optional[Callable[[torch.Tensor], CommGroup]] = None) -> None:
        """``group_of``: the group a parameter's pieces are spread over, when not ``comm`` (experts)."""
        self.states, self.layout, self.params, self.comm, self.device = states, layout, params, comm, device
        self.group_of = group_of
        self.fragments = states.pieces
        self.frag_params: list[torch.nn.Parameter] = states.params
        self.grad_src: list[torch.Tensor] = []
        self.user_groups: list[list[torch.nn.Parameter]] = [list(params)]
        """The trainable parameters of each of the optimizer's parameter groups, as the user gave them (``bind``
        replaces them in the optimizer by the pieces); all in one group without an optimizer."""
        self.pieces_of_param: dict[int, list[int]] = {}
        for i, f in enumerate(self.fragments):
            self.pieces_of_param.setdefault(id(params[layout.slots[f.slot].param_index]), []).append(i)

    def set_grad_sources(self, sources: list[torch.Tensor]) -> None:
        """Where each piece's reduced gradient is read from (one tensor per piece, in piece order)."""
        if len(sources) != len(self.fragments):
            raise ValueError(f"{len(sources)} gradient sources for {len(self.fragments)} pieces")
        self.grad_src = sources

    def bind(self, optimizer: torch.optim.Optimizer, stage: int) -> None:
        """Hand the pieces to ``optimizer`` in place of the parameters (group by group)."""
        if optimizer.state:
            raise ValueError(f"the optimizer already holds state; ZeRO stage {stage} partitions a fresh "
                             "optimizer: create it before training, or load its state with engine.load_checkpoint")
        self.user_groups = [[p for p in group["params"] if self.owns(p)] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["params"] = [self.frag_params[i] for p in group["params"]
                               for i in self.pieces_of_param.get(id(p), [])]
        self.states.bind(optimizer)

    @torch.no_grad()
    def step(self, grad_multiplier: float, publish: Publish) -> None:
        """The update of every piece from its gradient times ``grad_multiplier`` (unscale x clip)."""
        self.states.step(self.grad_src, grad_multiplier, publish)

    def norm_sources(self, module: torch.nn.Module) -> dict[int, list[Pieces]]:
        """The pieces' gradients keyed by their parameter's copies over the model-parallel group (a
        replicated or tied parameter counts once in the norm)."""
        params = [self.params[self.layout.slots[f.slot].param_index] for f in self.fragments]  # (experts: the
        return sources_by_copies(params, lambda idx: (self.grad_src[i] for i in idx), True)  # names are global)

    # ----------------------------------------------------------------------------------- checkpoints
    def records(self) -> list[FragmentRecord]:
        """Every piece's fp32 value and optimizer state (read back from host memory or disk when
        offloaded, one sub-group at a time)."""
        return [FragmentRecord(self.fragments[i].name, self._saved_start(i), self.fragments[i].numel,
                               value.float(), state) for i, value, state in self.states.records()]

    def _saved_start(self, i: int) -> int:
        """Piece ``i``'s offset in the tensor it is saved as (its parameter's own offset there: AutoEP's slices
        of fused experts start past the other ranks' experts)."""
        f = self.fragments[i]
        return saved_slice(self.params[self.layout.slots[f.slot].param_index])[0] + f.start

    def share(self, names: list[str]) -> dict[str, list[tuple[int, int]]]:
        """This rank's pieces as saved ranges by name: ``names`` (every trainable parameter's saved name,
        in ``params`` order) each map to the ranges this rank owns of it, an empty list when none."""
        out: dict[str, list[tuple[int, int]]] = {name: [] for name in names}
        for i, f in enumerate(self.fragments):
            start = self._saved_start(i)
            out.setdefault(f.name, []).append((start, start + f.numel))
        return out

    def param_groups_for_save(self, optimizer: Optional[torch.optim.Optimizer]) -> list[dict] | None:
        """The optimizer's hyper-parameters by parameter name, from the first data-parallel rank only."""
        if self.comm.rank != 0 or optimizer is None:
            return None
        return export_param_groups(optimizer, {id(self.frag_params[i]): f.name for i, f in enumerate(self.fragments)})

    def load(self, full: FullState, optimizer: Optional[torch.optim.Optimizer], with_states: bool) -> None:
        """Piece values (and, with ``with_states``, optimizer state) from a reassembled checkpoint."""
        def value(i: int) -> torch.Tensor | None:
            f, start = self.fragments[i], self._saved_start(i)
            return full.params[f.name].reshape(-1)[start:start + f.numel] if f.name in full.params else None

        def state(i: int) -> dict | None:
            f = self.fragments[i]
            return slice_state(full, f.name, self._saved_start(i), f.numel, self.frag_params[i]) if f.name in full.optim \
                else None

        with_states = with_states and optimizer is not None
        if with_states and optimizer is not None:
            names = {id(self.frag_params[i]): identities(self.params[self.layout.slots[f.slot].param_index], f.name)
                     for i, f in enumerate(self.fragments)}
            restore_param_groups(optimizer, full.param_groups, lambda t: names.get(id(t), set()))  # type: ignore[arg-type]
        self.states.load(value, state if with_states else None)

    # ---------------------------------------------------------------------------------- full values
    def assemble(self, param: torch.nn.Parameter, piece: Callable[[int], torch.Tensor | None],
                 shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Sum per-rank pieces of ``param`` into a full fp32 tensor on every rank (a collective)."""
        shape = tuple(param.shape) if shape is None else shape
        full = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float32, device=self.device)
        for i in self.pieces_of_param.get(id(param), []):
            value = piece(i)
            if value is not None:
                f = self.fragments[i]
                full[f.start:f.start + f.numel] = value.float()
        (self.group_of(param) if self.group_of is not None else self.comm).all_reduce(full)
        return full.view(shape)

    def full_value(self, param: torch.nn.Parameter, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return self.assemble(param, self.states.piece_value, shape)

    def full_grad(self, param: torch.nn.Parameter, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return self.assemble(param, lambda i: self.grad_src[i], shape)

    def full_state(self, param: torch.nn.Parameter, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return self.assemble(param, lambda i: self.states.piece_state(i).get(key), shape)

    # ------------------------------------------------------------------------- writes, this rank's part
    def owns(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` is one of the trainable parameters this optimizer partitions (with or without
        pieces on this rank)."""
        ids = self.__dict__.get("_param_ids")
        if ids is None:
            ids = self._param_ids = {id(p) for p in self.params}
        return id(param) in ids

    def scatter(self, param: torch.nn.Parameter, value: torch.Tensor,
                write: Callable[[int, torch.Tensor], None]) -> None:
        """The inverse of ``assemble``, without communication: ``write(i, part)`` for each of this rank's pieces
        of ``param``, ``part`` the piece's range of the full ``value`` (the same on every rank)."""
        flat = value.detach().reshape(-1)
        for i in self.pieces_of_param.get(id(param), []):
            f = self.fragments[i]
            write(i, flat[f.start:f.start + f.numel])

    def local(self, param: torch.nn.Parameter, piece: Callable[[int], torch.Tensor | None]) -> torch.Tensor:
        """This rank's part of ``param`` (its pieces end to end, fp32, 1-D; empty when it holds none)."""
        parts = [piece(i) for i in self._ordered(param)]
        if any(v is None for v in parts):
            raise KeyError("a piece of the parameter has no such value (an optimizer state before the first step?)")
        return torch.cat([v.reshape(-1).float() for v in parts]) if parts else \
            torch.zeros(0, dtype=torch.float32, device=self.device)

    def write_local(self, param: torch.nn.Parameter, value: torch.Tensor,
                    write: Callable[[int, torch.Tensor], None]) -> None:
        """Split ``value`` (as long as ``local`` of ``param``) over this rank's pieces of it: ``write(i, part)``."""
        flat, offset = value.detach().reshape(-1), 0
        ordered = self._ordered(param)
        numel = sum(self.fragments[i].numel for i in ordered)
        if flat.numel() != numel:
            raise ValueError(f"this rank holds {numel} elements of the parameter (its ds_tensor), the value given "
                             f"has {flat.numel()}: pass a tensor of this rank's part, as the local readers return")
        for i in ordered:
            n = self.fragments[i].numel
            write(i, flat[offset:offset + n])
            offset += n

    def _ordered(self, param: torch.nn.Parameter) -> list[int]:
        return sorted(self.pieces_of_param.get(id(param), []), key=lambda i: self.fragments[i].start)
