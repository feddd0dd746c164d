"""One ZeRO-3 parameter group: the parameters one module owns directly, communicated together.

A group is a small state machine (as in PyTorch FSDP2's ``FSDPParamGroup``)::

    SHARDED --unshard()--> GATHERING --wait_for_unshard()--> GATHERED --reshard()--> SHARDED

While SHARDED each parameter's ``.data`` is an empty placeholder (``ds_shape`` holds the real shape, as
in DeepSpeed) and the group keeps only this rank's chunk of its flat, padded values, reached through a
*shard source* (``deepshard.zero.offload.param_store``: a view of the strategy's flat shard, or, with
parameter offload, a range of a swap file read in on demand). ``unshard`` re-allocates the group's full
buffer, acquires the chunk and all-gathers the chunks into the buffer with one collective (plain,
hierarchical, quantized, or from hpZ's secondary shard: ``param_gather.ParamGather``); the parameters
then become views of that buffer, and the chunk is released once the gather is done. ``reshard`` frees
the buffer's storage (``untyped_storage().resize_(0)``), which also frees it for any view autograd saved
during forward; backward gathers it again into the same storage before those views are read. A release
outside forward and backward hands the buffer over instead (``reshard(hand_over=True)``), so tensors a user
took from the gathered parameters keep their values, as in DeepSpeed.
"""
from __future__ import annotations

import enum
from typing import Any, Callable

import torch

from deepshard.comm.group import CommGroup
from deepshard.utils.hugepages import advise_huge_pages
from deepshard.zero.offload.param_store import ShardSource
from deepshard.zero.stage3.param_gather import ParamGather
from deepshard.zero.stage3.param_status import ZeroParamStatus, set_status


class GroupState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class ShardedGroup:
    """``params`` (with full ``shapes``) whose flat values, padded to a multiple of the world size, are
    split in equal chunks across ranks; ``source`` gives this rank's chunk."""

    def __init__(self, index: int, module_name: str, params: list[torch.nn.Parameter],
                 shapes: list[tuple[int, ...]], source: ShardSource, comm: CommGroup, device: torch.device,
                 waiter: Callable[[Any, str], None] | None = None, gather: ParamGather | None = None) -> None:
        self.index, self.module_name = index, module_name
        self.params, self.shapes = params, shapes
        self.numels = [int(torch.Size(s).numel()) for s in shapes]
        self.numel = sum(self.numels)
        self.comm = comm
        self.chunk = source.numel
        self.padded = self.chunk * comm.size
        self.source = source
        self.dtype, self.device = source.dtype, device
        self.full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        self._full_bytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.state = GroupState.SHARDED
        self.persistent = False
        self.users = 0
        self._work: Any = None
        self._from_primary = False
        self._waiter = waiter
        self.gather = gather if gather is not None else ParamGather(comm)
        self.secondary: torch.Tensor | None = None
        """hpZ's secondary shard: this rank's part of the last gathered values in its hpZ group."""
        self.secondary_valid = False
        self.stale = False
        """The shard changed under a gathered copy this rank cannot rewrite alone (a local write): the next
        forward of the group's module gathers it again (``refresh_if_stale``)."""
        self.requires_grad = any(p.requires_grad for p in params)
        for p, shape in zip(params, shapes):
            # DeepSpeed's names for the real shape and size (its users read them)
            for name, value in (("ds_shape", torch.Size(shape)), ("ds_numel", int(torch.Size(shape).numel())),
                                ("ds_persist", False)):
                setattr(p, name, value)
            p.data = _placeholder(self.dtype, self.device)
        set_status(params, ZeroParamStatus.NOT_AVAILABLE)

    # ------------------------------------------------------------------------------ transitions
    def unshard(self, async_op: bool = True) -> None:
        """Start gathering the full values (no-op when gathered or on the way)."""
        if self.state is not GroupState.SHARDED:
            return
        if self.full.numel() != self.padded:  # the last release handed the buffer over: a fresh one
            self.full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        else:
            self.full.untyped_storage().resize_(self._full_bytes)
        advise_huge_pages(self.full)  # written whole by the gather: 2 MiB faults instead of 4 KiB ones
        self._work, self._from_primary = self.gather.start(self, key=2 * self.index + 1)
        self.state = GroupState.GATHERING
        set_status(self.params, ZeroParamStatus.INFLIGHT)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Finish the gather and point every parameter at its slice of the full buffer."""
        if self.state is GroupState.SHARDED:
            self.unshard(async_op=True)
        if self.state is GroupState.GATHERING:
            if self._waiter is not None:
                self._waiter(self._work, f"all_gather of parameter group {self.index} ({self.module_name})")
            else:
                self._work.wait()
            self._work = None
            if self._from_primary:
                self.source.release()
                self.gather.landed(self, True)
            offset = 0
            for p, shape, n in zip(self.params, self.shapes, self.numels):
                p.data = self.full[offset:offset + n].view(shape)
                offset += n
            self.state = GroupState.GATHERED
            set_status(self.params, ZeroParamStatus.AVAILABLE)

    def reshard(self, force: bool = False, hand_over: bool = False) -> None:
        """Drop the full values (kept for persistent groups unless ``force``).

        By default the buffer's storage is freed in place, which also frees it for the views autograd saved
        in forward (backward gathers into the same storage again before reading them). With ``hand_over``
        (a release outside forward and backward: ``GatheredParameters``' exit, ``param.partition()``) the group
        lets go of the buffer instead, as DeepSpeed's ``free_param`` swaps ``param.data`` for an empty tensor:
        a tensor taken from a parameter while it was gathered (``param.detach().cpu()`` on a CPU device is
        the same storage, so is a ``state_dict()`` entry) keeps its values, and the memory goes with the last
        such tensor (at once when there is none); the next ``unshard`` allocates a new buffer."""
        if self.persistent and not force:
            return
        if self.state is GroupState.GATHERING:
            self.wait_for_unshard()
        if self.state is GroupState.GATHERED:
            for p in self.params:
                p.data = _placeholder(self.dtype, self.device)
            if hand_over:
                self.full = _placeholder(self.dtype, self.device)
            else:
                self.full.untyped_storage().resize_(0)
            self.state = GroupState.SHARDED
            self.stale = False
            set_status(self.params, ZeroParamStatus.NOT_AVAILABLE)

    def make_persistent(self) -> None:
        """Gather now and keep the full values for good (``stage3_param_persistence_threshold``)."""
        self.persistent = True
        for p in self.params:
            p.ds_persist = True  # type: ignore[attr-defined]
        self.unshard(async_op=False)

    def prefetch_shard(self) -> None:
        """Start reading this rank's chunk in (parameter offload) so a later ``unshard`` need not wait."""
        if self.state is GroupState.SHARDED:
            self.source.prefetch()

    def invalidate_secondary(self) -> None:
        """The primary shard changed (an update, a load): hpZ's secondary shard no longer matches it."""
        self.secondary_valid = False

    def mark_stale(self) -> None:
        """This rank's part of the shard was rewritten while the full values are held (a persistent group):
        they are gathered again at the group's next forward. Not a collective: the re-gather is one, run by
        every rank where each marked the group, so the local writers must be called on every rank for the
        same parameters (as DeepSpeed's users do, each rank writing its own part)."""
        if self.state is not GroupState.SHARDED:
            self.stale = True

    def refresh_if_stale(self) -> None:
        """Re-gather a group marked stale (a collective: see ``mark_stale``)."""
        if self.stale:
            self.refresh()

    def refresh(self) -> None:
        """Re-gather after the shard changed (an optimizer step) if the full values are held."""
        self.invalidate_secondary()
        if self.state is not GroupState.SHARDED:
            self.reshard(force=True)
            self.unshard(async_op=False)

    # ---------------------------------------------------------------------------------- helpers
    @torch.no_grad()
    def read_values(self) -> list[torch.Tensor]:
        """Copies of the parameters' full values, exact (a collective: every rank calls it for the same
        group). Quantized gathers (qwZ) give approximations to compute with; a checkpoint, a 16-bit save or
        a load's merge needs the values themselves, gathered here in full precision."""
        if self.gather.quantized and not self.persistent:
            full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
            work = self.comm.all_gather_into_tensor(full, self.source.acquire(), async_op=True)
            if self._waiter is not None:
                self._waiter(work, f"all_gather of parameter group {self.index} ({self.module_name}), exact")
            else:
                work.wait()
            self.source.release()
            out, offset = [], 0
            for shape, n in zip(self.shapes, self.numels):
                out.append(full[offset:offset + n].view(shape).clone())
                offset += n
            return out
        was = self.state
        self.refresh_if_stale()
        self.unshard(async_op=False)
        values = [p.detach().clone() for p in self.params]
        if was is GroupState.SHARDED:
            self.reshard()
        return values

    @torch.no_grad()
    def write_full(self, values: list[torch.Tensor]) -> None:
        """Set this rank's chunk from full per-parameter values (used by loading and GatheredParameters)."""
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        offset = 0
        for v, n in zip(values, self.numels):
            flat[offset:offset + n] = v.reshape(-1).to(self.dtype)
            offset += n
        r = self.comm.rank
        self.source.write(flat[r * self.chunk:(r + 1) * self.chunk])
        self.invalidate_secondary()
        if self.state is GroupState.GATHERED:
            self.full.copy_(flat)

    def live_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()


def _placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor: what a sharded parameter's ``.data`` is (shape ``[0]``, like DeepSpeed)."""
    return torch.empty(0, dtype=dtype, device=device)


def shard_of(values: list[torch.Tensor], world: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's chunk of the padded concatenation of ``values``."""
    numel = sum(v.numel() for v in values)
    chunk = max(-(-numel // world), 1)
    flat = torch.zeros(chunk * world, dtype=dtype, device=values[0].device if values else "cpu")
    offset = 0
    for v in values:
        flat[offset:offset + v.numel()] = v.detach().reshape(-1).to(dtype)
        offset += v.numel()
    return flat[rank * chunk:(rank + 1) * chunk].clone()
