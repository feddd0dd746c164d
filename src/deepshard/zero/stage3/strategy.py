"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned (Rajbhandari et al. 2020).

Each module's direct parameters form a group (trainable and frozen ones apart) whose flat, padded values
are split in equal chunks across ranks (``partition.FlatLayout`` with one bucket per group). A rank
holds its chunks of every group (``flat_shard``), the fp32 masters of its trainable chunks in 16-bit
training, its chunk of the gradients and of the optimizer state: 16Ψ/N bytes with fp32 Adam. Hooks
(``hooks.py``) gather a group just before the module that needs it runs forward or backward and
release it after; gradients are reduce-scattered group by group (``reduce.py``). Groups smaller than
``stage3_param_persistence_threshold`` elements stay gathered.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepshard.checkpoint.fragments import (FragmentRecord, export_param_groups, load_full_state,
                                            restore_param_groups, save_rank_fragments, slice_state)
from deepshard.checkpoint.module_state import frozen_param_names, module_shapes, param_aliases
from deepshard.zero.partition import FlatLayout
from deepshard.zero.stage0 import optimizer_state_bytes, tensor_bytes
from deepshard.zero.stage12 import Stage12Strategy
from deepshard.zero.stage3.group import GroupState, ShardedGroup
from deepshard.zero.stage3.hooks import Stage3Hooks
from deepshard.zero.stage3.init import full_value
from deepshard.zero.stage3.reduce import Stage3Reducer
from deepshard.zero.stage3.watchdog import Watchdog
from deepshard.zero.strategy import StrategyContext, ZeroStrategy


def discover_groups(module: torch.nn.Module) -> list[tuple[str, list[torch.nn.Parameter], list[str]]]:
    """(module name, params, param names) per module and requires_grad, each parameter once."""
    seen: set[int] = set()
    names = {id(p): n for n, p in module.named_parameters()}
    out = []
    for mod_name, m in module.named_modules():
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        for trainable in (True, False):
            ps = [p for p in own if p.requires_grad == trainable]
            if ps:
                out.append((mod_name or "<root>", ps, [names[id(p)] for p in ps]))
    return out


class Stage3Strategy(Stage12Strategy):
    """Everything partitioned; see the module docstring."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 ctx: StrategyContext) -> None:
        ZeroStrategy.__init__(self, module, optimizer, ctx)
        self.stage = 3
        comm, policy, zcfg = ctx.comm, ctx.precision, ctx.zero_config
        self.watchdog = Watchdog(comm)
        discovered = discover_groups(module)
        trainable = [d for d in discovered if d[1][0].requires_grad]
        frozen = [d for d in discovered if not d[1][0].requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
        self.params = [p for _, ps, _ in trainable for p in ps]
        self.names = [n for _, _, ns in trainable for n in ns]
        self.layout = self._layout(trainable)
        self.frozen_layout = self._layout(frozen) if frozen else None
        self.flat_shard = torch.zeros(self.layout.shard_numel, dtype=policy.param_dtype, device=ctx.device)
        self.frozen_shard = torch.zeros(self.frozen_layout.shard_numel if frozen else 0, dtype=policy.param_dtype,
                                        device=ctx.device)
        self.master_shard = (torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=ctx.device)
                             if policy.keeps_master_weights else None)
        _cast_buffers(module, policy.param_dtype)
        self.groups = self._build_groups(trainable, self.layout, self.flat_shard, self.master_shard)
        self.frozen_groups = (self._build_groups(frozen, self.frozen_layout, self.frozen_shard, None)
                              if frozen else [])
        threshold = int(zcfg.stage3_param_persistence_threshold)
        for g in self.groups + self.frozen_groups:
            if g.numel <= threshold:
                g.persistent = True
                g.unshard(async_op=False)
        self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=policy.param_dtype, device=ctx.device)
        predivide = ctx.gradient_predivide_factor
        if ctx.prescale_gradients and predivide == 1.0:
            predivide = float(comm.size)
        offsets = [self.layout.shard_offset(b) for b in self.layout.buckets]
        self.reducer = Stage3Reducer(self.groups, offsets, comm, self.grad_shard, policy.comm_dtype, predivide,
                                     ctx.average_gradients, self.watchdog.wait)
        self.hooks = Stage3Hooks(module, self._groups_by_module(module), int(zcfg.stage3_prefetch_bucket_size))
        self._build_fragments()
        if optimizer is not None:
            self._swap_into(optimizer)

    # -------------------------------------------------------------------------------- construction
    def _layout(self, groups: list[tuple[str, list[torch.nn.Parameter], list[str]]]) -> FlatLayout:
        params = [p for _, ps, _ in groups for p in ps]
        names = [n for _, _, ns in groups for n in ns]
        index, members = 0, []
        for _, ps, _ in groups:
            members.append(list(range(index, index + len(ps))))
            index += len(ps)
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in params]
        return FlatLayout(params, names, 1 << 62, self.ctx.comm.size, self.ctx.comm.rank, groups=members,
                          shapes=shapes)

    @torch.no_grad()
    def _build_groups(self, discovered: list[tuple[str, list[torch.nn.Parameter], list[str]]], layout: FlatLayout,
                      shard: torch.Tensor, masters: torch.Tensor | None) -> list[ShardedGroup]:
        """One group at a time: take each parameter's full fp32 value (gathering it if zero.Init
        partitioned it), keep this rank's chunk, drop the full value. Peak memory: one group."""
        comm, groups = self.ctx.comm, []
        for (mod_name, params, _), bucket in zip(discovered, layout.buckets):
            values = [full_value(p, comm) for p in params]
            flat = torch.zeros(bucket.padded, dtype=torch.float32, device=self.ctx.device)
            offset = 0
            for v in values:
                flat[offset:offset + v.numel()] = v.reshape(-1).float()
                offset += v.numel()
            off, r = layout.shard_offset(bucket), comm.rank
            mine = flat[r * bucket.chunk:(r + 1) * bucket.chunk]
            shard[off:off + bucket.chunk] = mine
            if masters is not None:
                masters[off:off + bucket.chunk] = mine
            shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in params]
            for p in params:
                if hasattr(p, "ds_tensor"):
                    del p.ds_tensor
            groups.append(ShardedGroup(len(groups), mod_name, params, shapes, shard[off:off + bucket.chunk],
                                       comm, self.watchdog.wait))
        return groups

    def _groups_by_module(self, module: torch.nn.Module) -> dict[int, list[ShardedGroup]]:
        """The groups each module's forward needs: its own parameters and registered external ones; a
        *leaf* module (see ``is_z3_leaf``) needs its whole subtree and its descendants get no hooks."""
        group_of = {id(p): g for g in self.groups + self.frozen_groups for p in g.params}
        out: dict[int, list[ShardedGroup]] = {}
        inside_leaf: set[int] = set()
        for m in module.modules():
            if id(m) in inside_leaf:
                continue
            leaf = is_z3_leaf(m)
            params = list(m.parameters(recurse=leaf)) + list(m.__dict__.get("_deepshard_external_params", []))
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

    def _build_fragments(self) -> None:
        self.fragments = self.layout.fragments
        self.frag_params = []
        self.frag_grad_src = []
        values = self.master_shard if self.master_shard is not None else self.flat_shard
        for f in self.fragments:
            self.frag_params.append(torch.nn.Parameter(values[f.shard_start:f.shard_start + f.numel]))
            self.frag_grad_src.append(self.grad_shard[f.shard_start:f.shard_start + f.numel])
        self._frag_of_param = {id(self.params[self.layout.slots[f.slot].param_index]): i
                               for i, f in enumerate(self.fragments)}

    # ------------------------------------------------------------------------------------ backward
    def begin_backward(self, reduce: bool) -> None:
        self.hooks.stop_recording()
        self.reducer.begin_backward()

    def end_backward(self) -> None:
        self.reducer.end_backward()
        for g in self.groups + self.frozen_groups:
            if g.users == 0:
                g.reshard()

    def global_grad_norm(self, loss_scale: float) -> float:
        local = self.grad_shard.float().pow(2).sum().reshape(1)
        return float(self.ctx.comm.all_reduce_sum_scalar(local).sqrt().item()) / loss_scale

    @torch.no_grad()
    def step(self, grad_multiplier: float) -> None:
        if self.optimizer is None:
            raise RuntimeError("engine.step() needs an optimizer: pass optimizer=... to deepshard.initialize "
                               "or add an \"optimizer\" section to the config")
        mixed = self.master_shard is not None
        for fp, src in zip(self.frag_params, self.frag_grad_src):
            fp.grad = src.to(torch.float32, copy=True).mul_(grad_multiplier) if mixed else src
        if not mixed and grad_multiplier != 1.0:
            self.grad_shard.mul_(grad_multiplier)
        self.optimizer.step()
        if mixed:
            for fp in self.frag_params:
                fp.grad = None
            self.flat_shard.copy_(self.master_shard)  # type: ignore[arg-type]
        for g in self.groups:
            if g.state is not GroupState.SHARDED:
                g.refresh()

    def zero_grad(self) -> None:
        self.grad_shard.zero_()
        for p in self.params:
            p.grad = None

    # --------------------------------------------------------------------------------- checkpoints
    def gathered_module_extra(self, rank: int, exclude_frozen: bool) -> dict[str, torch.Tensor] | None:
        """Buffers and (gathered) frozen parameters; a collective: every rank calls it."""
        extra: dict[str, torch.Tensor] = {}
        frozen_names = {id(p): n for n, p in self.module.named_parameters() if not p.requires_grad}
        for g in self.frozen_groups:
            was = g.state
            g.unshard(async_op=False)
            if not exclude_frozen:
                for p in g.params:
                    extra[frozen_names[id(p)]] = p.detach().clone()
            if was is GroupState.SHARDED:
                g.reshard()
        for name, b in self.module.named_buffers():
            extra[name] = b.detach()
        return extra if rank == 0 else None

    def save(self, directory: Path, rank: int, exclude_frozen: bool = False) -> list[str]:
        extra = self.gathered_module_extra(rank, exclude_frozen)
        records = []
        for i, f in enumerate(self.fragments):
            fp = self.frag_params[i]
            state = dict(self.optimizer.state.get(fp, {})) if self.optimizer is not None else {}
            records.append(FragmentRecord(f.name, f.start, f.numel, fp.detach().float(), state))
        groups = None
        if rank == 0 and self.optimizer is not None:
            groups = export_param_groups(self.optimizer, {id(fp): f.name for fp, f in zip(self.frag_params,
                                                                                          self.fragments)})
        return save_rank_fragments(directory, rank, records, module_shapes(self.module), groups,
                                   param_aliases(self.module), extra,
                                   {"zero_stage": 3, "dp_world_size": self.ctx.comm.size,
                                    "frozen_params": frozen_param_names(self.module)})

    @torch.no_grad()
    def load(self, directory: Path, load_optimizer_states: bool, strict: bool) -> None:
        full = load_full_state(directory, with_optimizer=load_optimizer_states)
        names = {id(p): n for n, p in self.module.named_parameters()}
        missing = []
        for g in self.groups + self.frozen_groups:
            values = []
            for p, shape in zip(g.params, g.shapes):
                name = names[id(p)]
                src = full.params.get(name, full.module_extra.get(name))
                if src is None:
                    missing.append(name)
                    src = torch.zeros(shape)
                elif tuple(src.shape) != tuple(shape):
                    raise ValueError(f"checkpoint tensor '{name}' has shape {tuple(src.shape)} but the model's is "
                                     f"{tuple(shape)}; the checkpoint was saved from a different model")
                values.append(src)
            g.write_full(values)
        if missing and strict:
            raise KeyError(f"checkpoint does not match the model: missing {missing[:10]}; load with "
                           "load_module_strict=False to load the matching part")
        for name, b in self.module.named_buffers():
            if name in full.module_extra:
                b.copy_(full.module_extra[name])
        if self.master_shard is not None:
            for i, f in enumerate(self.fragments):
                if f.name in full.params:
                    self.frag_params[i].copy_(full.params[f.name].reshape(-1)[f.start:f.start + f.numel])
        if load_optimizer_states and self.optimizer is not None:
            restore_param_groups(self.optimizer, full.param_groups)
            self.optimizer.state.clear()
            for i, f in enumerate(self.fragments):
                if f.name in full.optim:
                    self.optimizer.state[self.frag_params[i]] = slice_state(full, f.name, f.start, f.numel,
                                                                            self.frag_params[i])

    # ---------------------------------------------------------------------------------- accounting
    def memory_report(self) -> dict[str, Any]:
        live = sum(g.live_bytes() for g in self.groups + self.frozen_groups)
        return {
            "parameters": self.flat_shard.numel() * self.flat_shard.element_size()
            + self.frozen_shard.numel() * self.frozen_shard.element_size(),
            "gradients": self.grad_shard.numel() * self.grad_shard.element_size(),
            "master_weights": 0 if self.master_shard is None else self.master_shard.numel() * 4,
            "optimizer_state": optimizer_state_bytes(self.optimizer),
            "buffers": tensor_bytes(self.module.buffers()),
            "gathered_parameters": live,
            "comm_buckets": self.reducer.staging_bytes(),
        }

    def full_fp32_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        if not param.requires_grad:
            g = next(g for g in self.frozen_groups if any(q is param for q in g.params))
            was = g.state
            g.unshard(async_op=False)
            value = param.detach().float().clone()
            if was is GroupState.SHARDED:
                g.reshard()
            return value
        pieces = [fp.detach() for fp in self.frag_params]
        return self._assemble_shaped(param, pieces)

    def _assemble_shaped(self, param: torch.nn.Parameter, pieces: list[torch.Tensor | None]) -> torch.Tensor:
        shape = tuple(getattr(param, "ds_shape", param.shape))
        full = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float32, device=self.ctx.device)
        i = self._frag_of_param.get(id(param))
        if i is not None and pieces[i] is not None:
            f = self.fragments[i]
            full[f.start:f.start + f.numel] = pieces[i].float()  # type: ignore[union-attr]
        self.ctx.comm.all_reduce(full)
        return full.view(shape)

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        if not param.requires_grad:
            return None
        return self._assemble_shaped(param, list(self.frag_grad_src))

    def full_optimizer_state(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        if self.optimizer is None or not param.requires_grad:
            return None
        return self._assemble_shaped(param, [self.optimizer.state.get(fp, {}).get(key) for fp in self.frag_params])

    @torch.no_grad()
    def consolidated_state_dict(self, rank: int, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
        """The full 16-bit state dict, gathered group by group onto rank 0 (a collective; {} elsewhere)."""
        by_param: dict[int, torch.Tensor] = {}
        for g in self.groups + self.frozen_groups:
            if exclude_frozen and not g.requires_grad:
                continue
            was = g.state
            g.unshard(async_op=False)
            if rank == 0:
                for p in g.params:
                    by_param[id(p)] = p.detach().cpu().clone()
            if was is GroupState.SHARDED:
                g.reshard()
        if rank != 0:
            return {}
        out = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            if id(value) in by_param:
                out[name] = by_param[id(value)]
            elif not isinstance(value, torch.nn.Parameter):
                out[name] = value.detach().cpu().clone()
        return out

    @torch.no_grad()
    def after_external_update(self, group: ShardedGroup) -> None:
        """A group's shard was rewritten from outside (GatheredParameters): refresh its fp32 masters."""
        if self.master_shard is None or group not in self.groups:
            return
        bucket = self.layout.buckets[group.index]
        off = self.layout.shard_offset(bucket)
        self.master_shard[off:off + bucket.chunk] = group.shard.float()

    def group_of(self, param: torch.nn.Parameter) -> ShardedGroup | None:
        for g in self.groups + self.frozen_groups:
            if any(q is param for q in g.params):
                return g
        return None

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
        self.hooks.remove()


# modules whose forward reads their children's parameters without calling the children
DEFAULT_LEAF_CLASSES: tuple[type, ...] = (torch.nn.MultiheadAttention,)


def is_z3_leaf(module: torch.nn.Module) -> bool:
    """A leaf is gathered as one unit with its whole subtree (``set_z3_leaf_modules``)."""
    return bool(getattr(module, "_z3_leaf", False)) or isinstance(module, DEFAULT_LEAF_CLASSES)


def _cast_buffers(module: torch.nn.Module, dtype: torch.dtype) -> None:
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point():
                m._buffers[name] = b.to(dtype)
