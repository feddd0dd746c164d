"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned (Rajbhandari et al. 2020).

Each module's direct parameters form a group (trainable and frozen ones apart; ``stage3_min_gather_size``
coalesces small modules' subtrees into one group each: ``units.py``) whose flat, padded values
are split in equal chunks across ranks (``partition.FlatLayout`` with one bucket per group). A rank
holds its chunks of every group (``param_store``), the fp32 masters of its trainable chunks in 16-bit
training and its chunk of the optimizer state (``states``), and its chunk of the gradients: 16Ψ/N bytes
with fp32 Adam. The offload policies decide where the shard and the optimizer side live (device,
host memory, disk; see ``deepshard.zero.offload``); this class is the same code for all of them. Hooks
(``hooks.py``) gather a group just before the module that needs it runs forward or backward and
release it after; gradients are reduce-scattered group by group (``reduce.py``). Groups smaller than
``stage3_param_persistence_threshold`` elements stay gathered.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from deepshard.placement import local_part, saved_name
from deepshard.precision.cast import cast_buffers
from deepshard.shard_state import FullState, ShardState
from deepshard.zero.offload.factory import make_grad_shard, make_param_store, make_shard_states
from deepshard.zero.canonical import StepTree
from deepshard.zero.offload.grad_store import GradShard, ResidentGradShard
from deepshard.zero.offload.param_store import ParamStore
from deepshard.zero.offload.policy import NoOffload
from deepshard.zero.optimizer_guard import guard
from deepshard.zero.offload.states import ShardStates, StatesSpec
from deepshard.zero.partition import FlatLayout
from deepshard.zero.stage0 import optimizer_state_bytes, tensor_bytes
from deepshard.zero.grad_norm import Pieces
from deepshard.zero.sharded_optimizer import NORM_CHUNK, ShardedOptimizer, squared_norm
from deepshard.zero.fragment_access import FragmentAccess
from deepshard.zero.stage3 import hook_surface, surface
from deepshard.zero.stage3.fragment_writes import stage3_access
from deepshard.zero.stage3.group import GroupState, ShardedGroup
from deepshard.zero.stage3.hooks import Stage3Hooks
from deepshard.zero.stage3.init import full_value
from deepshard.zero.stage3.param_gather import ParamGather, param_gathers
from deepshard.zero.stage3.reduce import Stage3Reducer
from deepshard.zero.stage3.units import discover_groups
from deepshard.zero.strategy import Capabilities, StrategyContext, ZeroStrategy


class Stage3Strategy(ZeroStrategy):
    """Everything partitioned; see the module docstring. The optimizer side (pieces, states, update,
    checkpoint records) is the ``ShardedOptimizer`` stages 1 and 2 hold too; parameters and gradients
    are this class's own (sharded groups, hooks, reduce-scatter)."""

    stage = 3
    capabilities = Capabilities(pipeline=False, param_offload=True, step_in_backward=True, no_sync=False,
                                partitioned_parameters=True)

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 ctx: StrategyContext) -> None:
        """``ctx.optimizer_offload`` places the master weights and optimizer state, ``ctx.param_offload``
        the parameter shard between uses (default for both: on the device). ``ctx.step_in_backward``:
        update each group as soon as its gradient is reduced and keep no gradient shard (the plan check
        has made sure that nothing needs every gradient first: ``deepshard.plan``)."""
        super().__init__(module, optimizer, ctx)
        step_in_backward = ctx.step_in_backward
        self.steps_in_backward = step_in_backward
        comm, policy, zcfg = ctx.comm, ctx.precision, ctx.zero_config
        self.watchdog = comm.watchdog
        discovered, self.units = discover_groups(module, zcfg.gather_unit_size,
                                                 lambda p: id(ctx.reduction_group(p)))
        trainable = [d for d in discovered if d[1][0].requires_grad]
        frozen = [d for d in discovered if not d[1][0].requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
        self.params = [p for _, ps, _ in trainable for p in ps]
        self.names = [n for _, _, ns in trainable for n in ns]
        self.layout = self._layout(trainable)
        self.frozen_layout = self._layout(frozen) if frozen else None
        param_offload = ctx.param_offload or NoOffload()
        self.param_store = make_param_store(param_offload, self.layout.shard_numel, policy.param_dtype, ctx.device,
                                            comm.rank)
        frozen_numel = self.frozen_layout.shard_numel if self.frozen_layout is not None else 0
        self.frozen_store = make_param_store(param_offload if frozen else NoOffload(), frozen_numel,
                                             policy.param_dtype, ctx.device, comm.rank)
        store = self.param_store
        values = (lambda f: store.view(f.shard_start, f.numel)) if store.resident else None
        self.states: ShardStates = make_shard_states(ctx.optimizer_offload or NoOffload(), StatesSpec(
            self.layout.fragments, self.layout.shard_numel, ctx.device, policy.keeps_master_weights, values,
            comm.rank, store.fp32_file()))
        cast_buffers(module, policy.buffer_dtype)
        self.gather, frozen_gather = param_gathers(comm, ctx.zero_groups)
        self.groups = self._build_groups(trainable, self.layout, self.param_store, self.states, self.gather)
        self.frozen_groups = (self._build_groups(frozen, self.frozen_layout, self.frozen_store, None, frozen_gather)
                              if frozen else [])
        threshold = int(zcfg.stage3_param_persistence_threshold)
        for g in self.groups + self.frozen_groups:
            if g.numel <= threshold:
                g.make_persistent()
        offsets = [self.layout.shard_offset(b) for b in self.layout.buckets]
        self.grads: GradShard = make_grad_shard(
            self.states, 0 if step_in_backward else self.layout.shard_numel, policy.param_dtype, ctx.device,
            [(off, g.chunk) for off, g in zip(offsets, self.groups)], NORM_CHUNK)
        self._fused_sq = torch.zeros(1, dtype=torch.float32, device=ctx.device)  # sum of squares, step in backward
        predivide = ctx.gradient_predivide_factor
        grad_reduce = ctx.grad_reduce()
        if ctx.prescale_gradients and predivide == 1.0:
            predivide = float(grad_reduce.world)
        self.tree = self._step_tree()
        self._boundary = True
        self.reducer = Stage3Reducer(self.groups, offsets, comm, self._accumulate, policy.comm_dtype, predivide,
                                     ctx.average_gradients, self.watchdog.wait,
                                     on_reduced=self._step_group if step_in_backward else None,
                                     on_release=lambda g: self.hooks.after_release(g), grad_reduce=grad_reduce,
                                     deferred=self._leaf_group_indices(module), average_chunks=self.tree is None)
        self.hooks = Stage3Hooks(module, self._groups_by_module(module), self._prefetch_window(),
                                 int(zcfg.stage3_max_live_parameters), int(zcfg.stage3_max_reuse_distance),
                                 before_backward=self.reducer.finish_in_flight, lifecycle=self)
        self.opt_shard = ShardedOptimizer(self.states, self.layout, self.params, comm, ctx.device,
                                          group_of=ctx.reduction_group)
        pieces = self.opt_shard.fragments
        self.opt_shard.set_grad_sources(  # none kept with a step in backward: each chunk is applied as it comes
            [torch.zeros(0, dtype=policy.param_dtype, device=ctx.device) for _ in pieces] if step_in_backward
            else self.grads.pieces([(f.shard_start, f.numel) for f in pieces]))
        self._pieces_of_group: list[list[int]] = [[] for _ in self.layout.buckets]
        for i, f in enumerate(pieces):
            self._pieces_of_group[self.layout.slots[f.slot].bucket].append(i)
        if optimizer is not None:
            self.opt_shard.bind(optimizer, 3)
            guard(optimizer, self)  # a direct optimizer.step() would update nothing: say so
        self._attach_deepspeed_surface()

    # -------------------------------------------------------------------------------- construction
    def _attach_deepspeed_surface(self) -> None:
        """DeepSpeed's per-parameter / per-module attributes and ``engine.optimizer.parameter_offload``, which
        libraries written for DeepSpeed read (``surface.py``, ``hook_surface.py``)."""
        layouts = [(self.groups, self.layout, self.param_store)]
        if self.frozen_layout is not None:
            layouts.append((self.frozen_groups, self.frozen_layout, self.frozen_store))
        views = {}
        for groups, layout, store in layouts:
            for g, bucket in zip(groups, layout.buckets):
                views[id(g)] = store.host_view(layout.shard_offset(bucket), g.chunk)
        surface.attach(self.module, self.groups + self.frozen_groups, lambda g: views[id(g)])
        self.hook_surface: hook_surface.HookSurface | None = hook_surface.HookSurface(self.module, self.hooks,
                                                                                      self.release_unused)

    def release_unused(self) -> None:
        """Release every gathered group that no forward or ``GatheredParameters`` is using."""
        for g in self.groups + self.frozen_groups:
            if g.users == 0:
                g.reshard()

    def _step_tree(self) -> StepTree | None:
        """The deterministic mode's sum over micro-steps (``zero/canonical.py``), with accumulation only."""
        if self.ctx.deterministic_steps <= 1 or self.steps_in_backward:
            return None
        if not isinstance(self.grads, ResidentGradShard):  # refused by the plan check (grads_on_disk)
            raise ValueError("the deterministic mode with accumulation keeps ZeRO-3's gradient shard in memory; "
                             "offload_optimizer to nvme keeps it on disk: offload to cpu, or accumulate 1 step")
        return StepTree(self.grads.tensor)

    def _accumulate(self, start: int, values: torch.Tensor, factor: float) -> None:
        """A group's reduced chunk into the gradient shard (or this micro-step's partial sum)."""
        if self.tree is None:
            self.grads.accumulate(start, values, factor)
        else:
            self.tree.current()[start:start + values.numel()].copy_(values)

    def _prefetch_window(self) -> int:
        """``stage3_prefetch_bucket_size``, or by default the largest gathered group (one module ahead),
        at most DeepSpeed's default of 5e7 elements."""
        given = self.ctx.zero_config.stage3_prefetch_bucket_size
        if given is not None:
            return int(given)
        sizes = [g.numel for g in self.groups + self.frozen_groups if not g.persistent]
        return min(max(sizes, default=0), DEFAULT_PREFETCH_CAP)

    def _layout(self, groups: list[tuple[str, list[torch.nn.Parameter], list[str]]]) -> FlatLayout:
        params = [p for _, ps, _ in groups for p in ps]
        names = [n for _, _, ns in groups for n in ns]
        index, members = 0, []
        for _, ps, _ in groups:
            members.append(list(range(index, index + len(ps))))
            index += len(ps)
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in params]
        # experts split over expert-parallel ranks are sharded over their expert-data-parallel group
        domains, comms = self.ctx.domains(params)
        return FlatLayout(params, names, 1 << 62, self.ctx.comm.size, self.ctx.comm.rank, groups=members,
                          shapes=shapes, domains=domains, domain_shapes=[(g.size, g.rank) for g in comms])

    @torch.no_grad()
    def _build_groups(self, discovered: list[tuple[str, list[torch.nn.Parameter], list[str]]], layout: FlatLayout,
                      store: ParamStore, states: ShardStates | None, gather: ParamGather) -> list[ShardedGroup]:
        """One group at a time: take each parameter's full fp32 value (gathering it if zero.Init
        partitioned it), keep this rank's chunk (in ``store``; its fp32 masters in ``states``), drop the
        full value. Peak memory: one group."""
        groups = []
        domains, comms = self.ctx.domains([p for _, ps, _ in discovered for p in ps])
        for (mod_name, params, _), bucket in zip(discovered, layout.buckets):
            comm = comms[bucket.domain] if domains else self.ctx.comm
            values = [full_value(p, comm) for p in params]
            flat = torch.zeros(bucket.padded, dtype=torch.float32, device=self.ctx.device)
            offset = 0
            for v in values:
                flat[offset:offset + v.numel()] = v.reshape(-1).float()
                offset += v.numel()
            off, r = layout.shard_offset(bucket), comm.rank
            mine = flat[r * bucket.chunk:(r + 1) * bucket.chunk]
            store.write(off, mine)
            if states is not None:
                states.write_masters(off, mine)
            shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in params]
            for p in params:  # adopted: no longer a zero.Init shard (``surface.attach`` sets ds_tensor anew)
                for name in ("ds_tensor", "ds_comm"):
                    p.__dict__.pop(name, None)
            groups.append(ShardedGroup(len(groups), mod_name, params, shapes, store.source(off, bucket.chunk),
                                       comm, self.ctx.device, self.watchdog.wait,
                                       gather if comm is self.ctx.comm else None))  # experts: plain, over their group
        store.flush()
        if states is not None:
            states.flush()
        return groups

    def _leaf_group_indices(self, module: torch.nn.Module) -> set[int]:
        """The trainable groups holding parameters of leaf modules' subtrees (their reduction waits for the
        end of backward: see ``reduce.py``)."""
        group_of = {id(p): gi for gi, g in enumerate(self.groups) for p in g.params}  # the reducer's numbering
        return {group_of[id(p)] for m in module.modules() if is_z3_leaf(m) for p in m.parameters()
                if id(p) in group_of}

    def _groups_by_module(self, module: torch.nn.Module) -> dict[int, list[ShardedGroup]]:
        """The groups each module's forward needs: its own parameters and registered external ones; a
        *leaf* module (see ``is_z3_leaf``) needs its whole subtree and its descendants get no hooks; a
        *unit* (``units.py``) needs its whole subtree too (one group), and its descendants keep theirs."""
        group_of = {id(p): g for g in self.groups + self.frozen_groups for p in g.params}
        out: dict[int, list[ShardedGroup]] = {}
        inside_leaf: set[int] = set()
        for m in module.modules():
            if id(m) in inside_leaf:
                continue
            leaf = is_z3_leaf(m)
            whole = leaf or id(m) in self.units
            params = list(m.parameters(recurse=whole)) + list(m.__dict__.get(surface.EXTERNAL, {}).values())
            if leaf:
                inside_leaf.update(id(d) for d in m.modules() if d is not m)
            needed: list[ShardedGroup] = []
            for p in params:
                g = group_of[id(p)]
                if g not in needed:
                    needed.append(g)
            if needed:
                out[id(m)] = needed
        return out

    # ------------------------------------------------------------------------------------ backward
    def begin_backward(self, reduce: bool) -> None:
        if self.steps_in_backward and not reduce:
            raise RuntimeError("zero_optimization.optimizer_step_in_backward updates the model in every backward; "
                               "an accumulation boundary of False (set_gradient_accumulation_boundary(False)) "
                               "cannot be honoured: turn the option off to accumulate gradients")
        self.hooks.stop_recording()
        self.reducer.begin_backward()
        self._boundary = reduce

    def hold_gradients(self, hold: bool) -> None:
        super().hold_gradients(hold)
        self.reducer.holding = hold

    # ------------------------------------------------ backward without engine.backward (the hooks call)
    _implicit = False

    def backward_started(self) -> None:
        """A backward begins that ``engine.backward`` / ``engine.scale`` did not announce (``loss.backward()``
        on the engine's output): open the reduction as they would."""
        if not self.reducer.open:
            self._implicit = True
            self.begin_backward(True)

    def backward_ended(self) -> None:
        """Autograd finished a backward: close an unannounced one (its reductions, its gathered groups)."""
        if self._implicit:
            self._implicit = False
            self.end_backward()

    def forward_started(self) -> None:
        """A forward of the whole model while a backward is still open: the backward was interrupted (an
        exception): finish its reductions, so nothing of it stays gathered or in flight."""
        if self.reducer.open:
            self._implicit = False
            self.end_backward()

    @torch.no_grad()
    def _step_group(self, gi: int, chunk: torch.Tensor) -> None:
        """Step in backward: update group ``gi``'s pieces from its averaged, reduced chunk."""
        self.require_optimizer()
        self._fused_sq += squared_norm([chunk], chunk.device)
        self.groups[gi].invalidate_secondary()
        indices = self._pieces_of_group[gi]
        if not indices:
            return
        base = self.layout.shard_offset(self.layout.buckets[gi])
        pieces = self.opt_shard.fragments
        grads = [chunk[pieces[i].shard_start - base:][:pieces[i].numel] for i in indices]
        self.states.step_pieces(indices, grads, 1.0, self._publish)

    def end_backward(self) -> None:
        closed = self.reducer.end_backward()
        if self.tree is not None and closed:
            self.tree.commit()
            if self._boundary:
                self.tree.finish(self.ctx.final_factor())
        self.hooks.end_backward()
        for g in self.groups + self.frozen_groups:
            if g.users == 0:
                g.reshard()

    def _grad_shards(self) -> Iterable[torch.Tensor]:
        return self.grads.norm_sources()

    def norm_sources(self, by_copies: bool) -> dict[int, list[Pieces]]:
        if not by_copies:
            return {1: [self._grad_shards]}
        return self.opt_shard.norm_sources(self.module)

    def global_grad_norm(self, loss_scale: float) -> float:
        if not self.steps_in_backward:
            return super().global_grad_norm(loss_scale)
        # the update was applied group by group in backward: the norm is only reported, from the sums of
        # squares taken as each group's chunk came in
        total = self.ctx.comm.all_reduce_sum_scalar(self._fused_sq)
        return float(total.sqrt().item()) / loss_scale

    def model_grad_norm(self, loss_scale: float) -> float:
        return self.global_grad_norm(loss_scale) if self.steps_in_backward else super().model_grad_norm(loss_scale)

    @torch.no_grad()
    def step(self, grad_multiplier: float) -> None:
        if not self.steps_in_backward:
            self.require_optimizer()
            self.opt_shard.step(grad_multiplier, self._publish)
            self._after_update()
            return
        if grad_multiplier != 1.0:  # the plan check rules out clipping and loss scaling
            raise RuntimeError(f"optimizer_step_in_backward: the update was applied in backward, so a gradient "
                               f"multiplier of {grad_multiplier} (clipping or loss scaling) cannot be")
        self._after_update()

    def _after_update(self) -> None:
        """Parameters are gathered lazily by the hooks; only groups held gathered are refreshed."""
        self.param_store.flush()
        for g in self.groups:
            g.invalidate_secondary()
            if g.state is not GroupState.SHARDED:
                g.refresh()

    def _publish(self, start: int, values: torch.Tensor) -> None:
        """Updated fp32 values of shard range ``[start, start + numel)`` into the parameter shard."""
        self.param_store.write(start, values)

    def zero_grad(self) -> None:
        self.grads.zero_()
        self.reducer.held.clear()
        self._fused_sq.zero_()
        for p in self.params:
            p.grad = None

    # --------------------------------------------------------------------------------- checkpoints
    def gathered_module_extra(self, rank: int, exclude_frozen: bool) -> dict[str, torch.Tensor] | None:
        """Buffers and (gathered) frozen parameters; a collective: every rank calls it."""
        extra: dict[str, torch.Tensor] = {}
        frozen_names = {id(p): n for n, p in self.module.named_parameters() if not p.requires_grad}
        for g in self.frozen_groups:
            values = g.read_values()
            if not exclude_frozen:
                for p, value in zip(g.params, values):
                    extra[frozen_names[id(p)]] = value
        persistent = set(self.module.state_dict(keep_vars=True))  # non-persistent buffers are not state
        for name, b in self.module.named_buffers():
            if name in persistent:
                extra[name] = b.detach()
        return extra if rank == 0 else None

    def shard_state(self, exclude_frozen: bool = False) -> ShardState | None:
        extra = self.gathered_module_extra(self.ctx.comm.rank, exclude_frozen)
        if self.ctx.replica_rank != 0:  # hybrid sharding: replica 0 of each shard writes it
            return None
        return ShardState(self.opt_shard.records(), self.opt_shard.param_groups_for_save(self.optimizer), extra,
                          {"zero_stage": 3, "dp_world_size": self.ctx.comm.size,
                           **({"zero_groups": self.ctx.zero_groups.describe()} if self.ctx.zero_groups is not None
                              else {})})

    def load_share(self) -> dict[str, list[tuple[int, int]]]:
        """This rank's chunk of every trainable tensor: the parameter shard, the fp32 masters and the
        optimizer state all cover the same ranges (``ShardedOptimizer`` over the one layout), and a
        ``write_full`` keeps only this rank's chunk of the values it is given. Frozen parameters and
        buffers are not restricted (read whole, from the first rank's files)."""
        return self.opt_shard.share(self.names)

    @torch.no_grad()
    def load_state(self, full: FullState, load_optimizer_states: bool) -> None:
        """Values outside this rank's chunks may be zeros (a reader reads only ``load_share``'s ranges):
        each group keeps only its own chunk, and the groups held gathered (persistent ones) are gathered
        again from the chunks afterwards, as after an optimizer step."""
        names = {id(p): saved_name(p, n) for n, p in self.module.named_parameters()}  # experts: global names
        stored = [saved_name(v, k) for k, v in self.module.state_dict(keep_vars=True).items()]
        absent = {k for k in stored if not full.has(k)}  # non-strict loads
        for g in self.groups + self.frozen_groups:
            values = []
            current = self._current_values(g) if any(names[id(p)] in absent for p in g.params) else None
            for i, (p, shape) in enumerate(zip(g.params, g.shapes)):
                name = names[id(p)]
                src = full.params.get(name, full.module_extra.get(name))
                if src is not None and name in full.params:
                    src = local_part(src, p, shape)  # an AutoEP rank's slice of fused experts
                if src is None:  # non-strict: a tensor the checkpoint lacks keeps its value
                    src = current[i] if current is not None else torch.zeros(shape)
                elif tuple(src.shape) != tuple(shape):
                    raise ValueError(f"checkpoint tensor '{name}' has shape {tuple(src.shape)} but the model's is "
                                     f"{tuple(shape)}; the checkpoint was saved from a different model")
                values.append(src)
            g.write_full(values)
        for name, b in self.module.named_buffers():
            if name in full.module_extra:
                b.copy_(full.module_extra[name])
        self.opt_shard.load(full, self.optimizer, load_optimizer_states)
        self._after_update()

    def _current_values(self, group: Any) -> list[torch.Tensor]:
        """The full values of a group's parameters (a collective: every rank calls it for the same group)."""
        return group.read_values()

    # ---------------------------------------------------------------------------------- accounting
    def memory_report(self) -> dict[str, Any]:
        live = sum(g.live_bytes() for g in self.groups + self.frozen_groups)
        placed, shard, frozen = self.states.memory(), self.param_store.memory(), self.frozen_store.memory()
        return {
            "parameters": shard["parameters"] + frozen["parameters"],
            "gradients": self.grads.nbytes(),
            "master_weights": placed["master_weights"],
            "optimizer_state": optimizer_state_bytes(self.optimizer),
            "buffers": tensor_bytes(self.module.buffers()),
            "gathered_parameters": live,
            "comm_buckets": self.reducer.scratch_bytes(),
            **({"secondary_parameters": self.gather.secondary_bytes(self.groups + self.frozen_groups)}
               if self.gather.hpz is not None else {}),
            "offloaded": placed["offloaded"] + shard["offloaded"] + frozen["offloaded"],
            "offload_buffers": placed["offload_buffers"],
        }

    def full_fp32_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        if not param.requires_grad:
            g = next(g for g in self.frozen_groups if any(q is param for q in g.params))
            values = g.read_values()
            return next(v for q, v in zip(g.params, values) if q is param).float()
        return self.opt_shard.full_value(param, _full_shape(param))

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        if not param.requires_grad:
            return None
        if self.steps_in_backward:
            raise RuntimeError("safe_get_full_grad: with zero_optimization.optimizer_step_in_backward each "
                               "gradient is applied and dropped during backward; turn the option off to read "
                               "gradients")
        held = self.reducer.held.get(id(param)) if self.gradients_held else None
        if held is not None:  # inside coalesce_grad_reduction(): the local, unreduced sum
            return held.detach().float().clone()
        return self.opt_shard.full_grad(param, _full_shape(param))

    def full_optimizer_state(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        if self.optimizer is None or not param.requires_grad:
            return None
        return self.opt_shard.full_state(param, key, _full_shape(param))

    def fragment_access(self) -> FragmentAccess:
        return stage3_access(self)

    @torch.no_grad()
    def consolidated_state_dict(self, rank: int, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
        """The full 16-bit state dict, gathered group by group onto rank 0 (a collective; {} elsewhere).
        Experts split over expert-parallel ranks are gathered within their expert-data-parallel group:
        its first rank keeps them (``checkpoint.experts.whole_state_dict`` collects them on rank 0)."""
        by_param: dict[int, torch.Tensor] = {}
        for g in self.groups + self.frozen_groups:
            if exclude_frozen and not g.requires_grad:
                continue
            values = g.read_values()
            if g.comm.rank == 0 and (rank == 0 or g.comm is not self.ctx.comm):
                for p, value in zip(g.params, values):
                    by_param[id(p)] = value.cpu()
        out = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            if id(value) in by_param:
                out[name] = by_param[id(value)]
            elif not isinstance(value, torch.nn.Parameter) and rank == 0:
                out[name] = value.detach().cpu().clone()
        return out

    @torch.no_grad()
    def after_external_update(self, group: ShardedGroup) -> None:
        """A group's shard was rewritten from outside (GatheredParameters): refresh its fp32 masters."""
        if not self.states.has_masters or group not in self.groups:
            return
        bucket = self.layout.buckets[group.index]
        self.states.write_masters(self.layout.shard_offset(bucket), group.source.read_copy().float())
        self.states.flush()

    def group_of(self, param: torch.nn.Parameter) -> ShardedGroup | None:
        for g in self.groups + self.frozen_groups:
            if any(q is param for q in g.params):
                return g
        return None

    def remove_hooks(self) -> None:
        """Detach from the module (``engine.destroy``): hooks go, offload files are removed."""
        self.reducer.remove_hooks()
        self.hooks.detach()
        self.hook_surface = None
        surface.detach(self.module)
        self.close()

    def close(self) -> None:
        """Release offloaded state (swap files, staging buffers). Safe to call twice."""
        self.states.close()
        self.param_store.close()
        self.frozen_store.close()


DEFAULT_PREFETCH_CAP = 50_000_000  # DeepSpeed's stage3_prefetch_bucket_size default

# modules whose forward reads their children's parameters without calling the children
DEFAULT_LEAF_CLASSES: tuple[type, ...] = (torch.nn.MultiheadAttention,)


def is_z3_leaf(module: torch.nn.Module) -> bool:
    """A leaf is gathered as one unit with its whole subtree (``set_z3_leaf_modules``)."""
    return bool(getattr(module, "_z3_leaf", False)) or isinstance(module, DEFAULT_LEAF_CLASSES)


def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))


