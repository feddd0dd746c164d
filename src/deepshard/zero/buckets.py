"""Gradient buckets: parameters' ``.grad`` are views into flat buffers that are all-reduced either as
backward produces them, overlapped with the rest of backward (``overlap=True``), or all at once when
backward has finished (``overlap=False``).

``overlap`` may change between backwards: with ``overlap_comm`` unset, stage 0 times both schedules and
keeps the faster (``deepshard.zero.schedule``): NCCL reduces on the GPU while the host keeps computing;
gloo reduces on a thread of its own, which on a busy host takes turns with backward.

After ``zero_()`` the buffers are not cleared: every ``.grad`` is set to None (as DeepSpeed's
``zero_grad`` leaves it), so the next backward's autograd hands over a fresh gradient that is copied
once into its view, instead of being added into a zero-filled buffer (a pass to clear, then a read of
both). Views whose parameter got no gradient are cleared when that backward ends. When that backward
also reduces, the copy multiplies by the averaging factor on the way in (as DDP's reducer does), so no
separate pass scales the buckets after the all-reduce; a gradient that arrives twice in one backward
(a weight shared across reentrant checkpointed segments) is added in, scaled the same way.

Buckets are fixed at construction (parameters in reverse registration order, which approximates the
order backward produces them, split by dtype and ``reduce_bucket_size`` elements) and are launched
strictly in index order: a bucket that becomes ready early waits for the buckets before it. Every rank
therefore issues the same collectives in the same order whatever order its hooks fire in, which is what
keeps gloo/NCCL from mismatching (the same rule DDP uses).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from deepshard.comm.group import CommGroup
from deepshard.zero.canonical import StepTree
from deepshard.zero.local_steps import LocalSteps
from deepshard.zero.in_flight import averaging_factor


@dataclass
class GradBucket:
    """One flat gradient buffer and the parameters whose ``.grad`` are views into it."""

    index: int
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    ready: set[int] = field(default_factory=set)
    filled: set[int] = field(default_factory=set)  # slots written, already scaled, in this backward
    work: Any = None
    comm_buffer: torch.Tensor | None = None
    comm: Optional[CommGroup] = None
    """The group this bucket is summed over (None: the reducer's own)."""
    gathered: bool = False  # canonical form: the reduce-scatter is done, the all-gather is in flight

    @property
    def numel(self) -> int:
        return self.buffer.numel()


def plan_buckets(params: list[torch.nn.Parameter], bucket_elements: int,
                 group_of: Optional[Callable[[torch.nn.Parameter], Any]] = None) -> list[list[torch.nn.Parameter]]:
    """Group ``params`` (already in launch order) into buckets of at most ``bucket_elements`` elements
    (a parameter larger than that gets a bucket of its own), never mixing dtypes nor reduction groups
    (``group_of``: experts split over expert-parallel ranks are summed over their own group)."""
    if bucket_elements <= 0:
        raise ValueError(f"reduce_bucket_size ({bucket_elements}) must be a positive number of elements")
    plans: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        other_group = group_of is not None and current and group_of(p) is not group_of(current[0])
        if current and (size + p.numel() > bucket_elements or p.dtype != current[0].dtype or other_group):
            plans.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        plans.append(current)
    return plans


class BucketedAllReduce:
    """Owns the gradient buffers of ``params`` and all-reduces them in buckets during backward.

    ``group_of`` names the group a parameter's gradient is summed over when it is not ``comm`` (an
    expert's expert-data-parallel group); every sum is divided by ``comm.size`` all the same."""

    def __init__(self, params: list[torch.nn.Parameter], comm: CommGroup, bucket_elements: int,
                 comm_dtype: torch.dtype | None = None, predivide: float = 1.0,
                 average: bool = True, overlap: bool = True,
                 group_of: Optional[Callable[[torch.nn.Parameter], CommGroup]] = None,
                 canonical: bool = False, tree_factor: float | None = None,
                 local_factor: float | None = None) -> None:
        """``canonical``: all-reduce as a reduce-scatter in the canonical order (``comm/tree_sum.py``) and an
        all-gather of the same chunks, the reduction stages 1-3 perform, so that every stage sums each
        element alike; the averaging is applied after the sum, to this rank's chunk. Buffers are then
        padded to a multiple of their group's size. Otherwise the backend's all-reduce. ``tree_factor``: the
        deterministic mode with accumulation (``zero/canonical.py``): every micro-step is reduce-scattered,
        the chunks summed over micro-steps in the canonical tree, times this factor, then all-gathered.
        ``local_factor``: its contiguous split: each bucket sums this rank's micro-steps in the tree
        (``zero/local_steps.py``) and is reduced once, at the boundary, times this factor."""
        self.comm = comm
        self.overlap = overlap
        self.canonical = canonical or tree_factor is not None or local_factor is not None
        self.local_factor = local_factor
        self.locals: list[LocalSteps] = []
        self.tree_factor = tree_factor
        self.tree: StepTree | None = None
        self._boundary = True
        self._stale = False  # after zero_(): the buffers hold old values and every .grad is None
        self.comm_dtype = comm_dtype
        self.predivide = predivide
        self.average = average
        self.buckets: list[GradBucket] = []
        self._bucket_of: dict[int, tuple[int, int]] = {}
        self._hooks: list[Any] = []
        self.reduce_enabled = False
        self._next_launch = 0
        self._in_backward = False
        self._fold = 0.0  # the factor the hooks' copies scale by in this backward; 0.0: not folding
        for index, plan in enumerate(plan_buckets(list(reversed(params)), bucket_elements, group_of)):
            group = group_of(plan[0]) if group_of is not None else None
            bucket = self._make_bucket(index, plan, (group or comm).size if canonical else 1)
            bucket.comm = group
            self.buckets.append(bucket)
        for b in self.buckets:
            for slot, p in enumerate(b.params):
                self._bucket_of[id(p)] = (b.index, slot)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._tree_offsets: list[int] = []
        if tree_factor is not None:
            chunks = [b.numel // (b.comm or comm).size for b in self.buckets]
            self._tree_offsets = [sum(chunks[:i]) for i in range(len(chunks))]
            first = self.buckets[0].buffer if self.buckets else torch.zeros(0)
            self.tree = StepTree(torch.zeros(sum(chunks), dtype=first.dtype, device=first.device))
        if local_factor is not None:
            for b in self.buckets:
                starts = [sum(p.numel() for p in b.params[:i]) for i in range(len(b.params))]
                self.locals.append(LocalSteps(b.buffer, list(zip(b.params, starts)), predivide))
                self.locals[-1].finish()  # every .grad a view the tree knows
                b.views = self.locals[-1].views(0)

    @staticmethod
    def _make_bucket(index: int, params: list[torch.nn.Parameter], multiple: int = 1) -> GradBucket:
        total = sum(p.numel() for p in params)
        padded = -(-total // multiple) * multiple
        buffer = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            view = buffer[offset:offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            views.append(view)
            offset += p.numel()
        return GradBucket(index=index, params=params, buffer=buffer, views=views)

    # ------------------------------------------------------------------------------------ backward
    def begin_backward(self, reduce: bool) -> None:
        if self.tree is not None:  # the canonical tree needs every micro-step reduced on its own
            self._boundary, reduce = reduce, True
        if self.locals:  # contiguous split: a later micro-step gets cleared buffers of its own
            self._boundary = reduce
            if self.locals[0].depth > 0:
                for b, local in zip(self.buckets, self.locals):
                    local.begin()
                    b.views = local.views()
                self._stale = False
        self.reduce_enabled = reduce
        self._in_backward = True
        self._next_launch = 0
        for b in self.buckets:
            b.ready.clear()
            b.filled.clear()
        post = averaging_factor(self.predivide, self.comm.size, self.average)
        # fold the averaging into the copies only when every gradient of this backward arrives fresh
        # (after zero_()) and is reduced as it is: no pre-division, no cast for the collective
        foldable = (reduce and self._stale and self.predivide == 1.0 and self.comm_dtype is None
                    and not self.canonical)
        self._fold = post if foldable and post != 1.0 else 0.0
        if not self._stale:  # accumulating: .grad must be the views autograd adds into
            self._restore_views()

    def _restore_views(self) -> None:
        """Point every ``.grad`` at its view: a view whose parameter has no gradient is cleared, a gradient
        autograd (or the user) put elsewhere is copied in. The buffers are current afterwards."""
        self._stale = False
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                if p.grad is None:
                    view.zero_()
                    p.grad = view
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        b_index, slot = self._bucket_of[id(p)]
        bucket = self.buckets[b_index]
        view = bucket.views[slot]
        if self._fold:
            self._fold_in(bucket, slot, p, view)
        elif p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            # autograd made a fresh tensor (the user set .grad to None mid-accumulation)
            view.copy_(p.grad)
            p.grad = view
        if not self.reduce_enabled or not self.overlap:
            return
        bucket.ready.add(slot)
        self._launch_ready()

    def _fold_in(self, bucket: GradBucket, slot: int, p: torch.nn.Parameter, view: torch.Tensor) -> None:
        """Write the fresh gradient into its view already multiplied by the averaging factor. ``.grad``
        goes back to None until backward ends, so a second arrival is a fresh tensor too, added in."""
        if p.grad is None:
            return
        if slot in bucket.filled:
            view.add_(p.grad, alpha=self._fold)
        else:
            torch.mul(p.grad, self._fold, out=view)
            bucket.filled.add(slot)
        p.grad = None

    def _end_fold(self) -> None:
        """After a folding backward: every ``.grad`` is its view again; views no gradient reached are
        cleared."""
        self._stale = False
        for b in self.buckets:
            for slot, (p, view) in enumerate(zip(b.params, b.views)):
                if slot not in b.filled:
                    if p.grad is None:
                        view.zero_()
                    else:
                        torch.mul(p.grad, self._fold, out=view)
                p.grad = view

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: GradBucket) -> None:
        if self.locals:  # contiguous split: this rank's sum over its micro-steps first
            self.locals[bucket.index].close()
        tensor = bucket.buffer
        if self.comm_dtype is not None and self.comm_dtype != tensor.dtype:
            bucket.comm_buffer = tensor.to(self.comm_dtype)
            tensor = bucket.comm_buffer
        if self.predivide != 1.0 and not self.locals:
            tensor.div_(self.predivide)
        group = bucket.comm or self.comm
        if self.canonical and group.size > 1:
            bucket.work = group.reduce_scatter_tensor(self._own_chunk(tensor, group), tensor, async_op=True)
        else:
            bucket.work = group.all_reduce(tensor, async_op=True)

    @staticmethod
    def _own_chunk(tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
        return tensor.view(group.size, -1)[group.rank]

    def _gather(self, bucket: GradBucket, post: float) -> None:
        """Canonical form, once a bucket's reduce-scatter is done: average this rank's chunk (in the
        gradient's dtype, as stages 1-3 do) and start the all-gather that gives every rank every chunk."""
        group = bucket.comm or self.comm
        if group.size == 1:
            return
        bucket.work.wait()
        tensor = bucket.comm_buffer if bucket.comm_buffer is not None else bucket.buffer
        if post != 1.0 and bucket.comm_buffer is None:
            self._own_chunk(tensor, group).mul_(post)
        bucket.work = group.all_gather_inplace(tensor, async_op=True)
        bucket.gathered = True

    def end_backward(self) -> None:
        """Launch the buckets not launched yet (parameters that got no gradient), in order, then wait
        for all and apply the post-reduction scaling."""
        if not self._in_backward:
            return
        self._in_backward = False
        folded = self._fold
        if folded:
            self._end_fold()
        elif self._stale:  # the first backward since zero_(): clear the views no gradient reached
            self._restore_views()
        if self.locals and not self._boundary:
            for local in self.locals:
                local.commit()
        if not self.reduce_enabled:
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        post = 1.0 if folded else averaging_factor(self.predivide, self.comm.size, self.average)
        if self.local_factor is not None:
            post = self.local_factor
        self._fold = 0.0
        if self.tree is not None:
            self._tree_step()
            self.reduce_enabled = False
            return
        if self.canonical:
            for bucket in self.buckets:
                self._gather(bucket, post)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            scaled = bucket.gathered and bucket.comm_buffer is None
            bucket.gathered = False
            if bucket.comm_buffer is not None:
                bucket.buffer.copy_(bucket.comm_buffer)
                bucket.comm_buffer = None
            if post != 1.0 and not scaled:
                bucket.buffer.mul_(post)
        self.reduce_enabled = False
        for bucket, local in zip(self.buckets, self.locals):
            local.finish()
            bucket.views = local.views(0)

    def _tree_step(self) -> None:
        """Deterministic mode: this micro-step's reduced chunks join the tree and the buckets are cleared for
        the next micro-step; at the boundary the tree's sum is every rank's chunk, all-gathered."""
        tree = self.tree
        assert tree is not None
        current = tree.current()
        for bucket, off in zip(self.buckets, self._tree_offsets):
            bucket.work.wait()
            bucket.work = None
            reduced = bucket.comm_buffer if bucket.comm_buffer is not None else bucket.buffer
            chunk = self._own_chunk(reduced, bucket.comm or self.comm)
            current[off:off + chunk.numel()].copy_(chunk)
            bucket.comm_buffer = None
        tree.commit()
        if not self._boundary:
            self.zero_()
            return
        result = tree.finish(self.tree_factor)  # type: ignore[arg-type]
        for bucket, off in zip(self.buckets, self._tree_offsets):
            group = bucket.comm or self.comm
            own = self._own_chunk(bucket.buffer, group)
            own.copy_(result[off:off + own.numel()])
            bucket.work = group.all_gather_inplace(bucket.buffer, async_op=True)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None

    # ------------------------------------------------------------------------------------- helpers
    def zero_(self) -> None:
        """Forget the gradients: ``.grad`` becomes None; the buffers are overwritten by the next backward
        (or cleared by the first reader, ``grads``)."""
        for b, local in zip(self.buckets, self.locals):
            if local.depth:  # mid-accumulation: the partial sums go too
                local.finish()
                b.views = local.views(0)
        for b in self.buckets:
            for p in b.params:
                p.grad = None
        self._stale = True

    def grads(self) -> list[torch.Tensor]:
        """The gradient views in bucket order."""
        if self._stale and not self._in_backward:
            self._restore_views()
        return [v for b in self.buckets for v in b.views]

    def grads_of(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The gradient views of ``params``, in the order given."""
        if self._stale and not self._in_backward:
            self._restore_views()
        out = []
        for p in params:
            b_index, slot = self._bucket_of[id(p)]
            out.append(self.buckets[b_index].views[slot])
        return out

    def params(self) -> list[torch.nn.Parameter]:
        return [p for b in self.buckets for p in b.params]

    def buffer_bytes(self) -> int:
        partial = sum(local.nbytes() for local in self.locals)
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets) + partial

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
