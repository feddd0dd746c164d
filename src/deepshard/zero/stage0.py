"""ZeRO stage 0: plain data parallelism.

Every process holds the whole model, its gradients and the whole optimizer state. Gradients are
all-reduced in buckets of ``reduce_bucket_size`` elements, either as backward produces them (overlapped
with the rest of backward) or once backward has finished: ``zero_optimization.overlap_comm`` chooses;
left unset, stage 0 times both while training and keeps the faster (``zero/schedule.py``: overlapping wins
with a core to spare, reducing afterwards when other processes compete for the cores). With fp16/bf16 the optimizer
updates fp32 master weights that are copied back into the module after each step.
"""
from __future__ import annotations

from typing import Iterable

import torch

from deepshard.compression.onebit_adam import CompressedCommOptimizer
from deepshard.optim.kernels import fuse_host_adam
from deepshard.optim.whole_vectors import step_whole_vectors, uses_fused_host_kernel
from deepshard.placement import expert_of, identities, local_part, saved_slice
from deepshard.precision.cast import cast_module
from deepshard.shard_state import (FragmentRecord, FullState, ShardState, export_param_groups, restore_param_groups,
                                   slice_state)
from deepshard.zero.buckets import BucketedAllReduce
from deepshard.zero.fragment_access import WholeAccess
from deepshard.zero.canonical import contiguous_split
from deepshard.zero.master import MasterWeights, param_names, trainable_params
from deepshard.zero.grad_norm import Pieces, exact_norm
from deepshard.zero.module_values import load_module_values, module_extra_state
from deepshard.zero.schedule import AdaptiveOverlap
from deepshard.zero.strategy import Capabilities, StrategyContext, ZeroStrategy, sources_by_copies


class Stage0Strategy(ZeroStrategy):
    """Bucketed, overlapped all-reduce data parallelism (DDP semantics)."""

    stage = 0
    capabilities = Capabilities(optimizer_offload=False, compressed_comm=True, partitioned_states=False)

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 ctx: StrategyContext) -> None:
        super().__init__(module, optimizer, ctx)
        self.params = trainable_params(module)
        self.names = param_names(module)
        self.split_experts = any(expert_of(p) is not None for p in self.params)
        """Experts split over expert-parallel ranks: reduced over their own groups, counted once in the norm."""
        policy = ctx.precision
        self.masters: MasterWeights | None = None
        if policy.keeps_master_weights:
            # masters come from the fp32 weights, before the module is cast to 16 bits
            self.masters = MasterWeights(self.params, policy.master_dtype)
            if optimizer is not None:
                self.masters.swap_into(optimizer)
        if optimizer is not None and ctx.device.type == "cpu":
            # the kernel stages 1-3 step their shards with on the host, so that every stage computes the same
            # update bit for bit (torch's for-loop and fused Adam differ in the last place)
            fuse_host_adam(optimizer, "zero_optimization")
        cast_module(module, policy.param_dtype, policy.buffer_dtype)
        predivide = ctx.gradient_predivide_factor
        if ctx.prescale_gradients and predivide == 1.0:
            predivide = float(ctx.comm.size)
        self.compressed = optimizer if isinstance(optimizer, CompressedCommOptimizer) else None
        if self.compressed is not None:  # e.g. OneBitAdam: after its warm-up it averages its momentum itself
            self.compressed.attach(ctx.comm)
        self.reducer = BucketedAllReduce(
            self.params, ctx.comm, int(ctx.zero_config.reduce_bucket_size),
            comm_dtype=policy.comm_dtype, predivide=predivide, average=ctx.average_gradients,
            overlap=overlap_for(ctx.zero_config), group_of=ctx.reduction_group if self.split_experts else None,
            canonical=(ctx.comm.pairwise and ctx.device.type == "cpu") or ctx.deterministic_steps > 0,
            **self._deterministic_sum(ctx))
        self.schedule: AdaptiveOverlap | None = None
        """Times both reduction schedules and keeps the faster, when ``overlap_comm`` is unset."""
        if adaptive_overlap(ctx.zero_config) and ctx.comm.size > 1 and ctx.deterministic_steps == 0:
            self.schedule = AdaptiveOverlap(agree=self._summed_over_ranks)

    def _summed_over_ranks(self, overlapped: float, after: float) -> tuple[float, float]:
        """The schedule timings summed over the data-parallel group, so every rank keeps the same schedule."""
        times = torch.tensor([overlapped, after], dtype=torch.float32, device=self.ctx.device)
        self.ctx.comm.all_reduce_control(times, "the reduction schedule's timings (overlap_comm unset)")
        return float(times[0]), float(times[1])

    def _deterministic_sum(self, ctx: StrategyContext) -> dict[str, float]:
        """The deterministic mode's sum over micro-steps (``zero/canonical.py``): contiguous where it can be
        (one reduction per step), else interleaved; none without accumulation or outside the mode."""
        policy = ctx.precision
        self.atoms_contiguous = contiguous_split(0, ctx.deterministic_steps, policy.param_dtype, policy.comm_dtype)
        if ctx.deterministic_steps <= 1:
            return {}
        return {"local_factor" if self.atoms_contiguous else "tree_factor": ctx.final_factor()}

    # ------------------------------------------------------------------------------------ backward
    def begin_backward(self, reduce: bool) -> None:
        if self.reducer.tree is not None or self.reducer.locals:  # the deterministic mode, on one process too
            self.reducer.begin_backward(reduce)
            return
        reducing = reduce and self.ctx.comm.size > 1 and not self._local_gradients()
        if reducing and self.schedule is not None:
            self.reducer.overlap = self.schedule.next_overlap()
        self.reducer.begin_backward(reducing)

    def _local_gradients(self) -> bool:
        """True when the optimizer exchanges compressed state instead: gradients stay on this rank."""
        return self.compressed is not None and self.compressed.reduces_gradients

    def end_backward(self) -> None:
        self.reducer.end_backward()
        if self.schedule is not None:
            self.schedule.finished()

    # ---------------------------------------------------------------------------------------- step
    grads_sharded = False

    def norm_sources(self, by_copies: bool) -> dict[int, list[Pieces]]:
        return sources_by_copies(self.params, lambda idx: self.reducer.grads_of([self.params[i] for i in idx]),
                                 by_copies)

    def global_grad_norm(self, loss_scale: float) -> float:
        if self.split_experts:
            return self._norm_with_experts() / loss_scale
        if not self._local_gradients():
            return super().global_grad_norm(loss_scale)
        # each rank holds its own gradient: the root mean square of the ranks' norms, an upper bound of the
        # averaged gradient's norm (so clipping is never weaker) and inf on every rank if on any
        comm = self.ctx.comm
        return exact_norm(self.norm_sources(False), [comm] if comm.size > 1 else [], self.ctx.device,
                          self._norm_scratch(), divisor=comm.size) / loss_scale

    def _norm_with_experts(self) -> float:
        """The norm of the whole model's gradient when experts are split over expert-parallel ranks: the
        dense gradients (the same on every rank) plus every expert's once. Summed exactly over the
        data-parallel group (``zero/grad_norm.py``), each rank's dense squares counted as one of
        ``comm.size`` copies and its expert squares as one of its expert-data-parallel size (the replicas
        of the same experts). (DeepSpeed's stage 0 averages the ranks' own norms instead, so its clipping
        depends on ep_size; this is the norm its ZeRO 1/2 and bf16 paths take: docs/moe.md.)"""
        comm = self.ctx.comm
        keys: dict[int, list[int]] = {}
        for i, p in enumerate(self.params):
            keys.setdefault(comm.size if expert_of(p) is None else self.ctx.reduction_group(p).size, []).append(i)
        sources: dict[int, list[Pieces]] = {
            c: [lambda idx=idx: self.reducer.grads_of([self.params[i] for i in idx])] for c, idx in keys.items()}
        return exact_norm(sources, [comm] if comm.size > 1 else [], self.ctx.device, self._norm_scratch(),
                          copies_max=max(keys))

    def remove_hooks(self) -> None:
        """Detach from the module (``engine.destroy``): the gradient hooks go."""
        self.reducer.remove_hooks()

    def step(self, grad_multiplier: float) -> None:
        optimizer = self.require_optimizer()
        if self.masters is not None:
            self.masters.set_grads(self.reducer.grads_of(self.masters.params), grad_multiplier)
            self._optimizer_step(optimizer)
            self.masters.clear_grads()
            self.masters.publish()
        else:
            if grad_multiplier != 1.0:
                torch._foreach_mul_(self.reducer.grads(), grad_multiplier)
            self._optimizer_step(optimizer)

    @staticmethod
    def _optimizer_step(optimizer: torch.optim.Optimizer) -> None:
        """torch's fused host Adam steps whole vectors only (``optim/whole_vectors.py``), so each element's
        update is the one stages 1-3 compute on their shard pieces; any other optimizer steps as it is."""
        if uses_fused_host_kernel(optimizer):
            step_whole_vectors(optimizer)
        else:
            optimizer.step()

    def zero_grad(self) -> None:
        self.reducer.zero_()
        for p in self.module.parameters():
            if not p.requires_grad and p.grad is not None:
                p.grad = None

    # --------------------------------------------------------------------------------- checkpoints
    def _master_or_param(self, p: torch.nn.Parameter) -> torch.Tensor:
        if self.masters is not None:
            m = self.masters.master_of(p)
            if m is not None:
                return m
        return p

    def shard_state(self, exclude_frozen: bool = False) -> ShardState | None:
        # every replica holds the same states: the first data-parallel rank writes them whole, and the first
        # rank of each expert-data-parallel group the experts it holds (under their global names)
        first = self.ctx.comm.rank == 0
        mine = [p for p in self.params if self.ctx.reduction_group(p).rank == 0] if self.split_experts else \
            (self.params if first else [])
        if not mine:
            return None
        records = []
        for p in mine:
            target = self._master_or_param(p)
            state = self.optimizer.state.get(target, {}) if self.optimizer is not None else {}
            offset = saved_slice(p)[0]  # an AutoEP rank's experts: their place in the whole fused tensor
            records.append(FragmentRecord(self.names[id(p)], offset, p.numel(), target.detach().float(), dict(state)))
        groups = None
        if self.optimizer is not None and first:
            groups = export_param_groups(self.optimizer, {id(self._master_or_param(p)): self.names[id(p)]
                                                          for p in self.params})
        return ShardState(records, groups, module_extra_state(self.module, exclude_frozen) if first else None,
                          {"zero_stage": 0, "dp_world_size": self.ctx.comm.size})

    @torch.no_grad()
    def load_state(self, full: FullState, load_optimizer_states: bool) -> None:
        load_module_values(self.module, full)
        for p in self.params:
            name = self.names[id(p)]
            if name in full.params and self.masters is not None:
                m = self.masters.master_of(p)
                if m is not None:
                    m.copy_(local_part(full.params[name], p))
        if self.compressed is not None:
            self.compressed.reset_exchange()
        if load_optimizer_states and self.optimizer is not None:
            names = {id(self._master_or_param(p)): identities(p, self.names[id(p)]) for p in self.params}
            restore_param_groups(self.optimizer, full.param_groups, lambda t: names.get(id(t), set()))
            self.optimizer.state.clear()
            for p in self.params:
                name = self.names[id(p)]
                if name in full.optim:
                    target = self._master_or_param(p)
                    self.optimizer.state[target] = slice_state(full, name, saved_slice(p)[0], p.numel(), target)

    # ---------------------------------------------------------------------------------- accounting
    def memory_report(self) -> dict[str, int]:
        return {
            "parameters": tensor_bytes(self.module.parameters()),
            "gradients": self.reducer.buffer_bytes(),
            "master_weights": self.masters.nbytes() if self.masters is not None else 0,
            "optimizer_state": optimizer_state_bytes(self.optimizer),
            "buffers": tensor_bytes(self.module.buffers()),
            "comm_buckets": self.compressed.exchange_state_bytes() if self.compressed is not None else 0,
        }

    def full_fp32_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        return self._master_or_param(param).detach().float().clone()

    def fragment_access(self) -> WholeAccess:
        return WholeAccess(self.optimizer, self._master_or_param)

    def full_optimizer_state(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        if self.optimizer is None:
            return None
        value = self.optimizer.state.get(self._master_or_param(param), {}).get(key)
        return None if value is None else value.detach().clone()


def overlap_for(zero_config: object) -> bool:
    """Whether stage 0 starts out overlapping its all-reduces with backward: ``overlap_comm`` where the
    config sets it (for good), else yes until :func:`adaptive_overlap`'s timing has chosen."""
    if getattr(zero_config, "overlap_comm_given", True):
        return bool(getattr(zero_config, "overlap_comm"))
    return True


def adaptive_overlap(zero_config: object) -> bool:
    """True when the config leaves ``overlap_comm`` unset: stage 0 then times both schedules while training
    and keeps the faster (``zero/schedule.py``). Overlapping wins when a core (or the GPU) is free for the
    reduction; when other processes compete for the cores, the reduction thread takes turns with backward
    and reducing once afterwards wins. DeepSpeed's own default, reducing after backward at stage 0, is
    the ``overlap_comm: false`` setting."""
    return not getattr(zero_config, "overlap_comm_given", True)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights and views count once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if torch.is_tensor(v) and v.dim() > 0)
