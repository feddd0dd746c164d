"""Optimizer states off the device, stepped one sub-group at a time (ZeRO-Offload / ZeRO-Infinity).

The shard is cut into sub-groups (``subgroups.py``). Master weights (``master``) and every
elementwise optimizer state (``state.<key>``, e.g. ``state.exp_avg``) are shard-sized tensors in a
:class:`~deepshard.zero.offload.backing.Backing`: host memory (CPU offload) or swap files (NVMe). One
step walks the sub-groups in order::

    read ahead:  sub-group k+1 (k+2, ...) is read into free staging buffers while k is updated
    update k:    bind the pieces of k to their slices of the buffers (param.data, optimizer.state),
                 give them their gradients, call optimizer.step() with each param group restricted
                 to the pieces of k, copy any state the optimizer re-created back into the buffers
    publish k:   the updated fp32 values go to the model's parameters (``publish``)
    write behind: the buffers of k are written back; they return to the pool when the write is done

So resident memory is the pool (``buffer_count`` buffers of one sub-group's tensor each), never the
model. The optimizer is the user's own ``torch.optim`` object, unchanged: its param groups keep their
hyperparameters (an LR scheduler's changes apply), only their ``params`` lists are narrowed for the
duration of each sub-group's call and restored after. Any optimizer whose state is elementwise (one
value per parameter element, plus scalars such as Adam's ``step``) works; state tensors are created by
the optimizer itself on the first step and captured from it. Scalars stay in memory.

Overlap happens whenever the pool has room: read-ahead needs free buffers beyond the current
sub-group's, write-behind needs the next sub-group not to need the same buffers. DeepSpeed's
``pipeline_read`` / ``pipeline_write`` switches are therefore not needed: overlap follows from
``buffer_count`` (at least twice the tensors per sub-group to overlap at all).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from deepshard.optim.whole_vectors import step_whole_vectors

from deepshard.zero.offload.backing import Backing
from deepshard.zero.offload.buffers import BufferPool
from deepshard.zero.offload.grad_store import GRADS, LazyPieces
from deepshard.zero.offload.mapped import MappedFileBacking
from deepshard.zero.offload.states import Publish, ShardStates, StatesSpec, check_writable
from deepshard.zero.offload.subgroups import SubGroup, plan_subgroups, split_fragments
from deepshard.zero.offload.swapper import IOOp

MASTER = "master"
STAGING_ELEMENT_BYTES = 4


class _Slot:
    """One sub-group's tensors while it is resident."""

    def __init__(self, sg: SubGroup) -> None:
        self.sg = sg
        self.tensors: dict[str, torch.Tensor] = {}
        self.owned: list[str] = []          # names staged in pool buffers (written back on close)
        self.buffers: list[torch.Tensor] = []
        self.reads: list[IOOp] = []
        self.grad: torch.Tensor | None = None  # the sub-group's gradient range, when read with the states
        self.grad_buffer: list[torch.Tensor] = []


def _state_name(key: str) -> str:
    return f"state.{key}"


def _typed(buffer: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of uint8 ``buffer`` as ``dtype``."""
    return buffer[:numel * torch.empty(0, dtype=dtype).element_size()].view(dtype)


def _placeholder() -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32)


class SubGroupStates(ShardStates):
    """See the module docstring. ``backing`` owns the off-device tensors; ``buffer_count`` staging
    buffers of the largest sub-group's size (4 bytes per element) bound what is resident."""

    def __init__(self, spec: StatesSpec, backing: Backing, buffer_count: int, pin: bool,
                 sub_group_size: int, what: str = "offload_optimizer") -> None:
        self.backing = backing
        # the fp32 parameter shard's own file as the master weights (see StatesSpec.shared_masters)
        shared = spec.shared_masters if isinstance(backing, MappedFileBacking) else None
        self.masters_in_params = shared is not None
        self._master_at: tuple[Backing, str] = shared if self.masters_in_params else (backing, MASTER)  # type: ignore[assignment]
        self.shard_numel = spec.shard_numel
        self.has_masters = spec.offloaded_masters
        self.pieces = split_fragments(spec.fragments, int(sub_group_size))
        self.subgroups = plan_subgroups(self.pieces, int(sub_group_size))
        self.params = [torch.nn.Parameter(_placeholder() if self.has_masters else spec.values(p),  # type: ignore[misc]
                                          requires_grad=True) for p in self.pieces]
        if self.has_masters and not self.masters_in_params:
            backing.create(MASTER, torch.float32, spec.shard_numel)
        self.keys: dict[str, torch.dtype] = {}
        self.piece_keys: list[tuple[str, ...]] = [() for _ in self.pieces]
        self.scalars: list[dict[str, Any]] = [{} for _ in self.pieces]
        largest = max((sg.numel for sg in self.subgroups), default=1)
        self.pool = BufferPool(buffer_count, largest * STAGING_ELEMENT_BYTES, pin, what)
        # gradients read ahead with their sub-group's states (ZeRO-3's gradient shard on disk): read-only,
        # never written back, so two buffers (the sub-group being updated and the next) always suffice
        self.grad_pool = BufferPool(2, largest * STAGING_ELEMENT_BYTES, pin, what)
        self._staged_grads = False
        self._grad_buffers: list[torch.Tensor] = []  # held for one step: the fp32 gradients, a 16-bit landing
        self._stepped = False
        self.mapped_peak = 0  # the most bytes of in-place views (mapped swap files) open at once

    # ------------------------------------------------------------------------------ set-up / io
    def write_masters(self, start: int, values: torch.Tensor) -> None:
        if self.has_masters and not self.masters_in_params:  # (shared: the parameter shard has them)
            # a private copy: the write finishes in the background while the caller reuses its tensor
            self.backing.write(MASTER, start, values.detach().reshape(-1).to("cpu", torch.float32, copy=True))

    def flush(self) -> None:
        self.backing.flush()

    def _register(self, key: str, dtype: torch.dtype) -> None:
        known = self.keys.get(key)
        if known is not None:
            if known != dtype:
                raise TypeError(f"optimizer state {key!r} changed dtype from {known} to {dtype}; offloaded "
                                "optimizer states must keep one dtype")
            return
        size = torch.empty(0, dtype=dtype).element_size()
        if size > STAGING_ELEMENT_BYTES:
            raise ValueError(f"optimizer state {key!r} is {dtype} ({size} bytes per element); offloaded states "
                             f"are staged in {STAGING_ELEMENT_BYTES}-byte-per-element buffers: keep optimizer "
                             "states in fp32 or a smaller dtype")
        self.backing.create(_state_name(key), dtype, self.shard_numel)
        self.keys[key] = dtype

    # ---------------------------------------------------------------------------------- slots
    def _names(self, sg: SubGroup) -> list[str]:
        used = {k for i in sg.pieces for k in self.piece_keys[i]}
        return ([MASTER] if self.has_masters else []) + [_state_name(k) for k in self.keys if k in used]

    def _where(self, name: str) -> tuple[Backing, str]:
        """The backing and file that hold tensor ``name``."""
        return self._master_at if name == MASTER else (self.backing, name)

    def _stage(self, slot: _Slot, name: str, buffer: torch.Tensor) -> torch.Tensor:
        t = _typed(buffer, self.backing.dtypes[name], slot.sg.numel)
        slot.tensors[name] = t
        slot.owned.append(name)
        slot.buffers.append(buffer)
        return t

    def _open(self, sg: SubGroup, block: bool, read: bool) -> _Slot | None:
        slot = _Slot(sg)
        missing: list[str] = []
        for name in self._names(sg):
            backing, file = self._where(name)
            view = backing.view(file, sg.start, sg.numel)
            if view is None:
                missing.append(name)
            else:
                slot.tensors[name] = view
                backing.prefetch(file, sg.start, sg.numel)
        buffers = self.pool.acquire(len(missing), block) if missing else []
        if buffers is None:
            return None
        grad_view = self.backing.view(GRADS, sg.start, sg.numel) if self._staged_grads else None
        if grad_view is not None:  # the gradient file used in place
            slot.grad = grad_view
            self.backing.prefetch(GRADS, sg.start, sg.numel)
        elif self._staged_grads:
            grad_buffer = self.grad_pool.acquire(1, block)
            if grad_buffer is None:
                self.pool.release(buffers)
                return None
            slot.grad_buffer = grad_buffer
            slot.grad = _typed(grad_buffer[0], self.backing.dtypes[GRADS], sg.numel)
            slot.reads.append(self.backing.read(GRADS, sg.start, slot.grad))
        for name, buffer in zip(missing, buffers):
            t = self._stage(slot, name, buffer)
            if read:
                slot.reads.append(self.backing.read(name, sg.start, t))
        return slot

    def _ensure(self, slot: _Slot, name: str) -> torch.Tensor:
        t = slot.tensors.get(name)
        if t is None:
            t = self.backing.view(name, slot.sg.start, slot.sg.numel)
            if t is None:
                t = self._stage(slot, name, self.pool.acquire(1)[0])  # type: ignore[index]
            else:
                slot.tensors[name] = t
        return t

    def _count_views(self, slots: Iterable[_Slot]) -> None:
        """Track the bytes of in-place views open at once (what a mapped backing can have resident)."""
        live = sum(t.numel() * t.element_size() for slot in slots for _, _, t in self._in_place(slot))
        self.mapped_peak = max(self.mapped_peak, live)

    def _close(self, slot: _Slot, write: bool) -> None:
        ops = [self.backing.write(n, slot.sg.start, slot.tensors[n]) for n in slot.owned] if write else []
        self.pool.release_after(slot.buffers, ops)
        self.grad_pool.release(slot.grad_buffer)
        self._settle(slot)

    def _in_place(self, slot: _Slot) -> Iterator[tuple[Backing, str, torch.Tensor]]:
        """``(backing, file, view)`` of every tensor the slot uses in place (not a staging buffer)."""
        for name, t in slot.tensors.items():
            if name not in slot.owned:
                yield (*self._where(name), t)
        if slot.grad is not None and not slot.grad_buffer:
            yield self.backing, GRADS, slot.grad

    def _populate(self, slot: _Slot, write: bool) -> None:
        """Map the slot's in-place views at once before the update touches them (gradients are only read)."""
        for backing, file, t in self._in_place(slot):
            backing.populate(file, slot.sg.start, slot.sg.numel, write and file != GRADS)

    def _settle(self, slot: _Slot) -> None:
        """Let go of the views the slot used in place (a mapped backing unmaps their pages)."""
        for backing, file, _ in self._in_place(slot):
            backing.settle(file, slot.sg.start, slot.sg.numel)
        slot.tensors, slot.grad = {}, None

    def _abandon(self, slot: _Slot) -> None:
        for op in slot.reads:
            try:
                op.wait()
            except BaseException:  # noqa: BLE001 - the buffers come back either way
                pass
        self.pool.release(slot.buffers)
        self.grad_pool.release(slot.grad_buffer)
        self._settle(slot)

    def _sweep(self, visit: Callable[[_Slot], None], read: bool = True, write: bool = True,
               ahead: bool = True) -> None:
        """Open every sub-group in order (reading ahead while buffers allow), ``visit`` it, close it."""
        sgs = self.subgroups
        opened: dict[int, _Slot] = {}
        nxt = 0
        try:
            for k, sg in enumerate(sgs):
                if nxt == k:
                    opened[k] = self._open(sg, True, read)  # type: ignore[assignment]
                    nxt += 1
                while ahead and nxt < len(sgs) and (nxt == k + 1 or not self.backing.in_place):
                    # (in place: nothing to read, views of the next sub-group only ask the kernel ahead)
                    slot = self._open(sgs[nxt], False, read)
                    if slot is None:
                        break
                    opened[nxt] = slot
                    nxt += 1
                self._count_views(opened.values())
                slot = opened[k]
                for op in slot.reads:
                    op.wait()
                self._populate(slot, write)
                visit(slot)
                del opened[k]
                self._close(slot, write)
        finally:
            for slot in opened.values():
                self._abandon(slot)
            self.backing.flush()

    # ----------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], multiplier: float, publish: Publish) -> None:
        opt = self.optimizer
        if opt is None:
            raise RuntimeError("the offloaded optimizer states have no optimizer to step")
        saved = [g["params"] for g in opt.param_groups]
        lists = self._group_lists(saved)
        self._staged_grads = self._grads_on_backing(grads)
        try:
            self._sweep(lambda slot: self._update(slot, lists[slot.sg.index], grads, multiplier, publish),
                        ahead=self._stepped)
        finally:
            self._staged_grads = False
            self.grad_pool.release(self._grad_buffers)
            self._grad_buffers = []
            for group, params in zip(opt.param_groups, saved):
                group["params"] = params
        self._stepped = True

    def _grads_on_backing(self, grads: list[torch.Tensor]) -> bool:
        """Whether the gradients are this backing's gradient file laid out like the shard (ZeRO-3 with
        the gradient shard on disk): then each sub-group's gradient range is read ahead with its states,
        into a reused buffer, instead of piece by piece into fresh tensors when the update reaches it."""
        if not isinstance(grads, LazyPieces) or grads.store.backing is not self.backing:
            return False
        if len(grads.spans) != len(self.pieces) or any(
                span != (p.shard_start, p.numel) for span, p in zip(grads.spans, self.pieces)):
            return False
        grads.store.ready()  # unwritten ranges hold zeros and every gradient write is done
        return True

    def _group_lists(self, saved: list[list[torch.nn.Parameter]]) -> list[list[list[torch.nn.Parameter]]]:
        """For each sub-group, each param group's params narrowed to the sub-group's pieces."""
        where = {id(self.params[i]): sg.index for sg in self.subgroups for i in sg.pieces}
        lists: list[list[list[torch.nn.Parameter]]] = [[[] for _ in saved] for _ in self.subgroups]
        for gi, params in enumerate(saved):
            for p in params:
                k = where.get(id(p))
                if k is not None:
                    lists[k][gi].append(p)
        return lists

    def _update(self, slot: _Slot, group_params: list[list[torch.nn.Parameter]], grads: list[torch.Tensor],
                multiplier: float, publish: Publish) -> None:
        opt = self.bound()
        for group, params in zip(opt.param_groups, group_params):
            group["params"] = params
        self._bind(slot)
        if slot.grad is not None:
            self._set_staged_grads(slot, multiplier)
        else:
            self._set_grads(slot.sg, grads, multiplier)
        step_whole_vectors(opt)
        self._capture(slot.sg, slot, lambda i: opt.state.get(self.params[i], {}))
        if self.has_masters and not self.masters_in_params:  # (shared: updated in the parameter shard)
            publish(slot.sg.start, slot.tensors[MASTER])
        self._unbind(slot.sg)

    def _bind(self, slot: _Slot) -> None:
        sg, state = slot.sg, self.bound().state
        for i in sg.pieces:
            p, fp = self.pieces[i], self.params[i]
            lo = p.shard_start - sg.start
            if self.has_masters:
                fp.data = slot.tensors[MASTER][lo:lo + p.numel]
            bound = dict(self.scalars[i])
            for k in self.piece_keys[i]:
                bound[k] = slot.tensors[_state_name(k)][lo:lo + p.numel]
            if bound:
                state[fp] = bound
            else:
                state.pop(fp, None)

    def _grad_buffer(self, k: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The ``k``-th gradient buffer of this step (acquired on first use, released when the step ends)
        as ``numel`` elements of ``dtype``."""
        while len(self._grad_buffers) <= k:
            self._grad_buffers += self.grad_pool.acquire(1)  # type: ignore[operator]
        return _typed(self._grad_buffers[k], dtype, numel)

    def _set_grads(self, sg: SubGroup, grads: list[torch.Tensor], multiplier: float) -> None:
        if self.has_masters:
            self._set_fp32_grads(sg, grads, multiplier)
            return
        srcs = [grads[i] for i in sg.pieces]
        if multiplier != 1.0 and srcs:
            torch._foreach_mul_(srcs, multiplier)
        for i, src in zip(sg.pieces, srcs):
            self.params[i].grad = src

    def _set_fp32_grads(self, sg: SubGroup, grads: list[torch.Tensor], multiplier: float) -> None:
        """The sub-group's gradients as fp32 views of one reused host buffer (no memory allocated per
        step). Gradients on an accelerator cross to the host in their own dtype (a 16-bit one in half the
        bytes: ``.to("cpu", float32)`` would cast on the device first) into a second buffer, pinned when
        the offload pins, and are cast on the host; host gradients are cast in the copy."""
        if not sg.pieces:
            return
        fp32 = self._grad_buffer(0, torch.float32, sg.numel)
        first = grads[sg.pieces[0]]
        on_host = first.device.type == "cpu"
        land = fp32 if on_host or first.dtype == torch.float32 else self._grad_buffer(1, first.dtype, sg.numel)
        spans = [(i, self.pieces[i].shard_start - sg.start, self.pieces[i].numel) for i in sg.pieces]
        for i, lo, n in spans:
            land[lo:lo + n].copy_(grads[i].reshape(-1), non_blocking=not on_host)
        if not on_host:
            device = first.device
            getattr(torch, device.type).synchronize(device)  # the copies landed before the host reads them
            if land is not fp32:
                fp32.copy_(land)
        if multiplier != 1.0:
            fp32.mul_(multiplier)
        for i, lo, n in spans:
            self.params[i].grad = fp32[lo:lo + n]

    def _set_staged_grads(self, slot: _Slot, multiplier: float) -> None:
        """The gradients as views of the staged range (the same values and arithmetic as ``_set_grads``:
        a 16-bit gradient is cast to a fresh fp32 tensor, an fp32 one is scaled in the buffer, which is
        never written back)."""
        views = []
        for i in slot.sg.pieces:
            p = self.pieces[i]
            lo = p.shard_start - slot.sg.start
            g = slot.grad[lo:lo + p.numel]  # type: ignore[index]
            views.append(g if g.dtype == torch.float32 else g.to(torch.float32))
        if multiplier != 1.0 and views:
            torch._foreach_mul_(views, multiplier)
        for i, g in zip(slot.sg.pieces, views):
            self.params[i].grad = g

    def _capture(self, sg: SubGroup, slot: _Slot, state_of: Callable[[int], dict[str, Any]]) -> None:
        """Record piece states: elementwise tensors into the slot (copied unless already bound there),
        everything else as scalars kept in memory."""
        for i in sg.pieces:
            p = self.pieces[i]
            lo = p.shard_start - sg.start
            keys, scalars = [], {}
            for k, v in state_of(i).items():
                if not (torch.is_tensor(v) and v.dim() > 0):
                    scalars[k] = v
                    continue
                if v.numel() != p.numel:
                    raise ValueError(
                        f"optimizer state {k!r} of parameter '{p.name}' has {v.numel()} elements but the piece "
                        f"has {p.numel}: only elementwise optimizer states can be offloaded (factored or "
                        "per-layer states cannot); turn offload_optimizer off for this optimizer")
                self._register(k, v.dtype)
                dst = self._ensure(slot, _state_name(k))[lo:lo + p.numel]
                if dst.data_ptr() != v.data_ptr():
                    dst.copy_(v.reshape(-1))
                keys.append(k)
            self.piece_keys[i], self.scalars[i] = tuple(keys), scalars

    def _unbind(self, sg: SubGroup) -> None:
        state = self.bound().state
        for i in sg.pieces:
            fp = self.params[i]
            fp.grad = None
            if self.has_masters:
                fp.data = _placeholder()
            if self.scalars[i]:
                state[fp] = dict(self.scalars[i])
            else:
                state.pop(fp, None)

    # ----------------------------------------------------------------------------- checkpoints
    def piece_value(self, i: int) -> torch.Tensor:
        p = self.pieces[i]
        if not self.has_masters:
            return self.params[i].detach()
        backing, file = self._master_at
        return backing.read_copy(file, p.shard_start, p.numel).float()

    def piece_state(self, i: int) -> dict[str, Any]:
        p = self.pieces[i]
        out = dict(self.scalars[i])
        for k in self.piece_keys[i]:
            out[k] = self.backing.read_copy(_state_name(k), p.shard_start, p.numel)
        return out

    def records(self) -> Iterator[tuple[int, torch.Tensor, dict[str, Any]]]:
        out: list[tuple[int, torch.Tensor, dict[str, Any]]] = []

        def visit(slot: _Slot) -> None:
            sg = slot.sg
            for i in sg.pieces:
                p = self.pieces[i]
                lo = p.shard_start - sg.start
                value = slot.tensors[MASTER][lo:lo + p.numel].clone() if self.has_masters else self.params[i].detach()
                state = dict(self.scalars[i])
                for k in self.piece_keys[i]:
                    state[k] = slot.tensors[_state_name(k)][lo:lo + p.numel].clone()
                out.append((i, value, state))

        self._sweep(visit, write=False)
        return iter(out)

    @torch.no_grad()
    def load(self, values: Callable[[int], torch.Tensor | None],
             states: Callable[[int], dict[str, Any] | None] | None) -> None:
        if states is not None:
            self.piece_keys = [() for _ in self.pieces]
            self.scalars = [{} for _ in self.pieces]

        def visit(slot: _Slot) -> None:
            sg = slot.sg
            for i in sg.pieces:
                p = self.pieces[i]
                v = values(i)
                if v is not None:
                    lo = p.shard_start - sg.start
                    dst = slot.tensors[MASTER][lo:lo + p.numel] if self.has_masters else self.params[i].data
                    dst.copy_(v.reshape(-1))
            if states is not None:
                self._capture(sg, slot, lambda i: states(i) or {})

        self._sweep(visit, ahead=states is None)  # new state buffers are staged while visiting
        if self.optimizer is not None:
            for i, fp in enumerate(self.params):
                if self.scalars[i]:
                    self.optimizer.state[fp] = dict(self.scalars[i])
                else:
                    self.optimizer.state.pop(fp, None)

    @torch.no_grad()
    def write_piece(self, i: int, value: torch.Tensor | None, state: dict[str, torch.Tensor]) -> None:
        p = self.pieces[i]
        if value is not None and not self.has_masters:
            self.params[i].data.copy_(value.reshape(-1))
        elif value is not None:
            backing, file = self._master_at
            backing.write(file, p.shard_start, value.detach().reshape(-1).to("cpu", torch.float32, copy=True))
        for key, v in state.items():
            check_writable(key, self.piece_keys[i], self.scalars[i], p.name)
            copy = v.detach().reshape(-1).to("cpu", self.keys[key], copy=True)
            self.backing.write(_state_name(key), p.shard_start, copy)
        self.backing.flush()

    # ------------------------------------------------------------------------------ accounting
    def memory(self) -> dict[str, int]:
        held = self.pool.allocated_bytes + self.grad_pool.allocated_bytes
        if isinstance(self.backing, MappedFileBacking):
            held += self.mapped_peak  # mapped swap files: the views of the sub-groups open at once
        return {"master_weights": 0, "offloaded": self.backing.nbytes(), "offload_buffers": held}

    def close(self) -> None:
        self.backing.close()
        self.pool.clear()
        self.grad_pool.clear()
