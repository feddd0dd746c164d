"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models"): each data-parallel rank keeps the optimizer state (and, in 16-bit training, the fp32
master weights) of its 1/N partition only; stage 2 also keeps only its 1/N of the gradients.

The trainable parameters are re-homed into one flat, bucketed buffer (``partition.FlatLayout``); rank r
owns chunk r of every bucket. The optimizer is handed *fragments*: 1-D views of the owned part of each
parameter (of the fp32 masters in 16-bit training, of the parameters themselves in fp32), so any
elementwise optimizer, torch's or the user's, updates a partition exactly as it would the whole model.
After the update each bucket is rebuilt on every rank with one all-gather of the chunks.
"""
from __future__ import annotations

from pathlib import Path

import torch

from deepshard.checkpoint.fragments import (FragmentRecord, export_param_groups, load_full_state,
                                            restore_param_groups, save_rank_fragments, slice_state)
from deepshard.checkpoint.module_state import (frozen_param_names, load_module_from_full, module_extra_state,
                                               module_shapes, param_aliases)
from deepshard.zero.grad_reducers import Stage1Reducer, Stage2Reducer
from deepshard.zero.master import param_names, trainable_params
from deepshard.zero.partition import FlatLayout
from deepshard.zero.stage0 import optimizer_state_bytes, tensor_bytes
from deepshard.zero.strategy import StrategyContext, ZeroStrategy


class Stage12Strategy(ZeroStrategy):
    """Partitioned optimizer state (stage 1) and gradients (stage 2)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 ctx: StrategyContext, stage: int) -> None:
        super().__init__(module, optimizer, ctx)
        if stage not in (1, 2):
            raise ValueError(f"Stage12Strategy handles ZeRO stages 1 and 2, not {stage}")
        self.stage = stage
        comm, policy = ctx.comm, ctx.precision
        names = param_names(module)
        self.params = list(reversed(trainable_params(module)))  # launch order: roughly backward's
        if not self.params:
            raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO stage {stage} needs one dtype for all trainable parameters, found {dtypes}; "
                             "cast the model (e.g. model.float()) before deepshard.initialize")
        self.names = [names[id(p)] for p in self.params]
        self.layout = FlatLayout(self.params, self.names, int(ctx.zero_config.reduce_bucket_size),
                                 comm.size, comm.rank)
        self._build_flat_params(module)
        reducer_cls = Stage1Reducer if stage == 1 else Stage2Reducer
        predivide = ctx.gradient_predivide_factor
        if ctx.prescale_gradients and predivide == 1.0:
            predivide = float(comm.size)
        self.reducer = reducer_cls(self.layout, self.params, comm, policy.param_dtype, ctx.device,
                                   policy.comm_dtype, predivide, ctx.average_gradients)
        self._build_fragments()
        if optimizer is not None:
            self._swap_into(optimizer)

    # -------------------------------------------------------------------------------- construction
    @torch.no_grad()
    def _build_flat_params(self, module: torch.nn.Module) -> None:
        layout, policy = self.layout, self.ctx.precision
        flat32 = torch.zeros(layout.total, dtype=torch.float32, device=self.ctx.device)
        for slot in layout.slots:
            flat32[slot.flat_start:slot.flat_start + slot.numel] = self.params[slot.param_index].reshape(-1)
        self.master_shard: torch.Tensor | None = None
        if policy.keeps_master_weights:  # masters from the fp32 values, before the module is cast
            self.master_shard = torch.cat([flat32[lo:hi] for lo, hi, _ in layout.owned_ranges()]).clone()
        module.to(policy.param_dtype)
        self.flat_param = flat32 if policy.param_dtype == torch.float32 else flat32.to(policy.param_dtype)
        for slot in layout.slots:
            p = self.params[slot.param_index]
            p.data = self.flat_param[slot.flat_start:slot.flat_start + slot.numel].view(slot.shape)

    def _build_fragments(self) -> None:
        """1-D views of the owned part of each parameter: what the optimizer updates."""
        self.fragments = self.layout.fragments
        self.frag_params: list[torch.nn.Parameter] = []
        self.frag_grad_src: list[torch.Tensor] = []
        grads = self.reducer.flat_grad if self.stage == 1 else self.reducer.shard
        for f in self.fragments:
            if self.master_shard is not None:
                value = self.master_shard[f.shard_start:f.shard_start + f.numel]
            else:
                value = self.flat_param[f.flat_start:f.flat_start + f.numel]
            self.frag_params.append(torch.nn.Parameter(value, requires_grad=True))
            if self.stage == 1:
                self.frag_grad_src.append(grads[f.flat_start:f.flat_start + f.numel])
            else:
                self.frag_grad_src.append(grads[f.shard_start:f.shard_start + f.numel])
        self._frag_of_param: dict[int, int] = {id(self.params[self.layout.slots[f.slot].param_index]): i
                                               for i, f in enumerate(self.fragments)}

    def _swap_into(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer.state:
            raise ValueError("the optimizer already holds state; ZeRO stages 1-2 partition a fresh optimizer: "
                             "create it before training, or load its state with engine.load_checkpoint")
        for group in optimizer.param_groups:
            group["params"] = [self.frag_params[self._frag_of_param[id(p)]] for p in group["params"]
                               if id(p) in self._frag_of_param]

    # ------------------------------------------------------------------------------------ backward
    def begin_backward(self, reduce: bool) -> None:
        self.reducer.begin_backward(reduce)

    def end_backward(self) -> None:
        self.reducer.end_backward()

    # ---------------------------------------------------------------------------------------- step
    def global_grad_norm(self, loss_scale: float) -> float:
        local = torch.zeros(1, dtype=torch.float32, device=self.ctx.device)
        for g in self.reducer.shard_grads():
            local += g.float().pow(2).sum()
        total = self.ctx.comm.all_reduce_sum_scalar(local)
        return float(total.sqrt().item()) / loss_scale

    @torch.no_grad()
    def step(self, grad_multiplier: float) -> None:
        if self.optimizer is None:
            raise RuntimeError("engine.step() needs an optimizer: pass optimizer=... to deepshard.initialize "
                               "or add an \"optimizer\" section to the config")
        mixed = self.master_shard is not None
        for fp, src in zip(self.frag_params, self.frag_grad_src):
            if mixed:
                g = src.to(torch.float32, copy=True)
                fp.grad = g.mul_(grad_multiplier) if grad_multiplier != 1.0 else g
            else:
                fp.grad = src
        if not mixed and grad_multiplier != 1.0 and self.frag_grad_src:
            torch._foreach_mul_(self.frag_grad_src, grad_multiplier)
        self.optimizer.step()
        if mixed:
            for fp in self.frag_params:
                fp.grad = None
            for lo, hi, off in self.layout.owned_ranges():
                self.flat_param[lo:hi].copy_(self.master_shard[off:off + hi - lo])  # type: ignore[index]
        self._all_gather_params()

    def _all_gather_params(self) -> None:
        works = []
        for bucket in self.layout.buckets:
            lo, hi = bucket.owned(self.ctx.comm.rank)
            mine = self.flat_param[lo:hi].clone()
            out = self.flat_param[bucket.start:bucket.start + bucket.padded]
            works.append(self.ctx.comm.all_gather_into_tensor(out, mine, async_op=True))
        for w in works:
            w.wait()

    def zero_grad(self) -> None:
        self.reducer.zero_()

    # --------------------------------------------------------------------------------- checkpoints
    def _fragment_value(self, i: int) -> torch.Tensor:
        return self.frag_params[i].detach()

    def save(self, directory: Path, rank: int, exclude_frozen: bool = False) -> list[str]:
        records = []
        for i, f in enumerate(self.fragments):
            fp = self.frag_params[i]
            state = dict(self.optimizer.state.get(fp, {})) if self.optimizer is not None else {}
            records.append(FragmentRecord(f.name, f.start, f.numel, fp.detach().float(), state))
        groups = None
        if rank == 0 and self.optimizer is not None:
            name_of = {id(self.frag_params[i]): f.name for i, f in enumerate(self.fragments)}
            groups = export_param_groups(self.optimizer, name_of)
        return save_rank_fragments(directory, rank, records, module_shapes(self.module), groups,
                                   param_aliases(self.module), module_extra_state(self.module, exclude_frozen) if rank == 0 else None,
                                   {"zero_stage": self.stage, "dp_world_size": self.ctx.comm.size,
                                    "frozen_params": frozen_param_names(self.module)})

    @torch.no_grad()
    def load(self, directory: Path, load_optimizer_states: bool, strict: bool) -> None:
        full = load_full_state(directory, with_optimizer=load_optimizer_states)
        load_module_from_full(self.module, full, strict)
        for i, f in enumerate(self.fragments):
            if f.name in full.params:
                self.frag_params[i].copy_(full.params[f.name].reshape(-1)[f.start:f.start + f.numel])
        if load_optimizer_states and self.optimizer is not None:
            restore_param_groups(self.optimizer, full.param_groups)
            self.optimizer.state.clear()
            for i, f in enumerate(self.fragments):
                if f.name in full.optim:
                    fp = self.frag_params[i]
                    self.optimizer.state[fp] = slice_state(full, f.name, f.start, f.numel, fp)

    # ---------------------------------------------------------------------------------- accounting
    def memory_report(self) -> dict[str, int]:
        staging = self.reducer.staging_bytes() if isinstance(self.reducer, Stage2Reducer) else 0
        return {
            "parameters": tensor_bytes(self.module.parameters()),
            "gradients": self.reducer.nbytes(),
            "master_weights": 0 if self.master_shard is None else self.master_shard.numel() * 4,
            "optimizer_state": optimizer_state_bytes(self.optimizer),
            "buffers": tensor_bytes(self.module.buffers()),
            "comm_buckets": staging,
        }

    def _assemble(self, param: torch.nn.Parameter, pieces: list[torch.Tensor | None]) -> torch.Tensor:
        """Sum per-rank fragments of ``param`` into a full fp32 tensor on every rank (a collective)."""
        full = torch.zeros(param.numel(), dtype=torch.float32, device=self.ctx.device)
        i = self._frag_of_param.get(id(param))
        if i is not None and pieces[i] is not None:
            f = self.fragments[i]
            full[f.start:f.start + f.numel] = pieces[i].float()  # type: ignore[union-attr]
        self.ctx.comm.all_reduce(full)
        return full.view(param.shape)

    def full_fp32_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        if self.master_shard is None or not param.requires_grad:
            return param.detach().float().clone()
        return self._assemble(param, [fp.detach() for fp in self.frag_params])

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        if not param.requires_grad:
            return None
        return self._assemble(param, list(self.frag_grad_src))

    def full_optimizer_state(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        if self.optimizer is None or not param.requires_grad:
            return None
        pieces = [self.optimizer.state.get(fp, {}).get(key) for fp in self.frag_params]
        return self._assemble(param, pieces)

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
