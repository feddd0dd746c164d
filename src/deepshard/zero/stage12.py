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

from typing import Iterable

import torch

from deepshard.precision.cast import cast_module
from deepshard.shard_state import FullState, ShardState
from deepshard.utils.logging import logger
from deepshard.zero.canonical import contiguous_split
from deepshard.zero.fragment_access import FragmentAccess, stage12_access
from deepshard.zero.grad_reducers import Stage1Reducer, Stage2Reducer
from deepshard.zero.master import param_names, trainable_params
from deepshard.zero.module_values import load_module_values, module_extra_state
from deepshard.zero.optimizer_guard import guard
from deepshard.zero.offload.factory import make_shard_states
from deepshard.zero.offload.policy import NoOffload
from deepshard.zero.offload.states import ShardStates, StatesSpec
from deepshard.zero.partition import FlatLayout, Fragment
from deepshard.zero.stage0 import optimizer_state_bytes, tensor_bytes
from deepshard.zero.grad_norm import Pieces
from deepshard.zero.sharded_optimizer import ShardedOptimizer
from deepshard.zero.strategy import Capabilities, StrategyContext, ZeroStrategy
from deepshard.zero.unused_params import UnusedParamCheck


class Stage12Strategy(ZeroStrategy):
    """Partitioned optimizer state (stage 1) and gradients (stage 2): the code both share; the stages are
    :class:`Stage1Strategy` and :class:`Stage2Strategy`."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 ctx: StrategyContext) -> None:
        """``ctx.optimizer_offload`` places the master weights and optimizer state (default: on the device)."""
        stage = self.stage
        if stage not in (1, 2):
            raise TypeError(f"{type(self).__name__} is not a ZeRO stage: build Stage1Strategy or Stage2Strategy")
        super().__init__(module, optimizer, ctx)
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
        # experts split over expert-parallel ranks are sharded over their expert-data-parallel group
        domain_of, self.domain_comms = ctx.domains(self.params)
        self.layout = FlatLayout(self.params, self.names, int(ctx.zero_config.reduce_bucket_size),
                                 comm.size, comm.rank, domains=domain_of,
                                 domain_shapes=[(g.size, g.rank) for g in self.domain_comms])
        self._owned = self.layout.owned_ranges()
        flat32 = self._build_flat_params(module)
        reducer_cls = Stage1Reducer if stage == 1 else Stage2Reducer
        predivide = ctx.gradient_predivide_factor
        grad_reduce = ctx.grad_reduce()
        if ctx.prescale_gradients and predivide == 1.0:
            predivide = float(grad_reduce.world)
        # the deterministic mode (zero/canonical.py): stage 1 sums a rank's micro-steps first where it can
        self.atoms_contiguous = contiguous_split(stage, ctx.deterministic_steps, policy.param_dtype, policy.comm_dtype)
        tree_factor = ctx.final_factor() if ctx.deterministic_steps > 1 else None
        extra = {"local_factor": tree_factor} if self.atoms_contiguous else {"tree_factor": tree_factor}
        self.reducer = reducer_cls(self.layout, self.params, comm, policy.param_dtype, ctx.device,
                                   policy.comm_dtype, predivide, ctx.average_gradients, domains=self.domain_comms,
                                   grad_reduce=grad_reduce, **extra)
        self.states: ShardStates = make_shard_states(ctx.optimizer_offload or NoOffload(), StatesSpec(
            self.layout.fragments, self.layout.shard_numel, ctx.device, policy.keeps_master_weights,
            lambda f: self.flat_param[f.flat_start:f.flat_start + f.numel], comm.rank))
        for lo, hi, off in self._owned:  # masters from the fp32 values, before the module was cast
            self.states.write_masters(off, flat32[lo:hi])
        self.states.flush()
        del flat32
        self.opt_shard = ShardedOptimizer(self.states, self.layout, self.params, comm, ctx.device,
                                          group_of=ctx.reduction_group)
        self.opt_shard.set_grad_sources([self._grad_view(f) for f in self.opt_shard.fragments])
        if optimizer is not None:
            self.opt_shard.bind(optimizer, stage)
            guard(optimizer, self)  # a direct optimizer.step() would update nothing: say so
        self.unused_check = None if ctx.zero_config.ignore_unused_parameters else \
            UnusedParamCheck(self.params, self.names, comm, ctx.device, stage)

    # -------------------------------------------------------------------------------- construction
    @torch.no_grad()
    def _build_flat_params(self, module: torch.nn.Module) -> torch.Tensor:
        """Re-home the parameters into ``flat_param``; returns the fp32 flat values (taken before the
        module is cast to 16 bits, so the master weights lose nothing)."""
        layout, policy = self.layout, self.ctx.precision
        flat32 = torch.zeros(layout.total, dtype=torch.float32, device=self.ctx.device)
        for slot in layout.slots:
            flat32[slot.flat_start:slot.flat_start + slot.numel] = self.params[slot.param_index].reshape(-1)
        cast_module(module, policy.param_dtype, policy.buffer_dtype)
        self.flat_param = flat32 if policy.param_dtype == torch.float32 else flat32.to(policy.param_dtype)
        self._log_flattening()
        for slot in layout.slots:
            p = self.params[slot.param_index]
            p.data = self.flat_param[slot.flat_start:slot.flat_start + slot.numel].view(slot.shape)
        return flat32

    def _log_flattening(self) -> None:
        """Say, on every rank, that the parameters are being re-homed into the flat buffer (DeepSpeed's ZeRO-1/2
        logs "Flattening param group i on <device> (sufficient memory)" when it flattens a group on the device,
        and code written for it looks for that line). deepshard builds the buffer on the device always; the
        line comes once that allocation has succeeded, so the memory was sufficient. All param groups share
        the one buffer, so one line names them all."""
        groups = len(self.optimizer.param_groups) if self.optimizer is not None else 1
        which = "param group 0" if groups == 1 else f"param groups 0-{groups - 1}"
        flat = self.flat_param
        logger.info(f"Flattening {which} on {flat.device.type} into one {str(flat.dtype).replace('torch.', '')} "
                    f"buffer of {flat.numel()} elements in {len(self.layout.buckets)} bucket(s) (sufficient memory)")

    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat buffer every trainable parameter is a view of (``engine.optimizer.bit16_groups_flat``):
        one tensor for all param groups, in launch order, each bucket zero-padded to a multiple of the
        data-parallel size. Writing into it changes the parameters."""
        return [self.flat_param]

    def _grad_view(self, f: Fragment) -> torch.Tensor:
        """Where piece ``f``'s reduced gradient is: the full flat gradient (stage 1) or the shard (2)."""
        if self.stage == 1:
            return self.reducer.flat_grad[f.flat_start:f.flat_start + f.numel]
        return self.reducer.shard[f.shard_start:f.shard_start + f.numel]

    @torch.no_grad()
    def _publish(self, start: int, values: torch.Tensor) -> None:
        """Copy updated fp32 values of shard range ``[start, start + numel)`` into ``flat_param``."""
        end = start + values.numel()
        for lo, hi, off in self._owned:
            a, b = max(start, off), min(end, off + hi - lo)
            if a < b:
                self.flat_param[lo + a - off:lo + b - off].copy_(values[a - start:b - start])

    # ------------------------------------------------------------------------------------ backward
    def begin_backward(self, reduce: bool) -> None:
        self.reducer.begin_backward(reduce)

    def end_backward(self) -> None:
        self.reducer.end_backward()

    def hold_gradients(self, hold: bool) -> None:
        super().hold_gradients(hold)
        if isinstance(self.reducer, Stage2Reducer):
            self.reducer.holding = hold

    # ---------------------------------------------------------------------------------------- step
    def norm_sources(self, by_copies: bool) -> dict[int, list[Pieces]]:
        if not by_copies:
            return {1: [self._grad_shards]}
        return self.opt_shard.norm_sources(self.module)

    @torch.no_grad()
    def step(self, grad_multiplier: float) -> None:
        self.require_optimizer()
        if self.unused_check is not None:
            self.unused_check.check()
        self.opt_shard.step(grad_multiplier, self._publish)
        self._after_update()

    def _grad_shards(self) -> Iterable[torch.Tensor]:
        """This rank's reduced gradient ranges (what the global norm is taken over)."""
        return self.reducer.shard_grads()

    def _after_update(self) -> None:
        """Make the updated partitions visible to the module: all-gather every bucket."""
        self._all_gather_params()

    def _all_gather_params(self) -> None:
        works = [self.domain_comms[b.domain].all_gather_inplace(self.flat_param[b.start:b.start + b.padded],
                                                                async_op=True)
                 for b in self.layout.buckets]
        for w in works:
            w.wait()

    def zero_grad(self) -> None:
        self.reducer.zero_()

    # --------------------------------------------------------------------------------- checkpoints
    def shard_state(self, exclude_frozen: bool = False) -> ShardState | None:
        if self.ctx.replica_rank != 0:  # hybrid sharding: replica 0 of each shard writes it
            return None
        return ShardState(self.opt_shard.records(), self.opt_shard.param_groups_for_save(self.optimizer),
                          module_extra_state(self.module, exclude_frozen) if self.ctx.comm.rank == 0 else None,
                          {"zero_stage": self.stage, "dp_world_size": self.ctx.comm.size})

    def load_share(self) -> dict[str, list[tuple[int, int]]]:
        """The owned ranges: ``load_state`` rebuilds the rest of every bucket from the peers' chunks."""
        return self.opt_shard.share(self.names)

    @torch.no_grad()
    def load_state(self, full: FullState, load_optimizer_states: bool) -> None:
        """Values outside this rank's chunks may be zeros (a reader reads only ``load_share``'s ranges):
        the module's parameters are made whole again with one all-gather per bucket."""
        load_module_values(self.module, full)
        self.opt_shard.load(full, self.optimizer, load_optimizer_states)
        self._all_gather_params()

    # ---------------------------------------------------------------------------------- accounting
    def memory_report(self) -> dict[str, int]:
        """Resident bytes per category; ``offloaded``: bytes in host memory or on disk under an offload
        policy (not resident on the device); ``offload_buffers``: the staging pool."""
        staging = self.reducer.scratch_bytes()
        placed = self.states.memory()
        return {
            "parameters": tensor_bytes(self.module.parameters()),
            "gradients": self.reducer.nbytes(),
            "master_weights": placed["master_weights"],
            "optimizer_state": optimizer_state_bytes(self.optimizer),
            "buffers": tensor_bytes(self.module.buffers()),
            "comm_buckets": staging,
            "offloaded": placed["offloaded"],
            "offload_buffers": placed["offload_buffers"],
        }

    def full_fp32_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        if not self.states.has_masters or not param.requires_grad:
            return param.detach().float().clone()
        return self.opt_shard.full_value(param)

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        if not param.requires_grad:
            return None
        if self.gradients_held and param.grad is not None:
            return param.grad.detach().float().clone()  # inside coalesce_grad_reduction(): the local, unreduced one
        return self.opt_shard.full_grad(param)

    def full_optimizer_state(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        if self.optimizer is None or not param.requires_grad:
            return None
        return self.opt_shard.full_state(param, key)

    def fragment_access(self) -> FragmentAccess:
        return stage12_access(self.opt_shard, self.stage)

    def remove_hooks(self) -> None:
        """Detach from the module (``engine.destroy``): hooks go, offload files are removed."""
        self.reducer.remove_hooks()
        if self.unused_check is not None:
            self.unused_check.remove()
        self.close()

    def close(self) -> None:
        """Release offloaded state (swap files, staging buffers). Safe to call twice."""
        self.states.close()


class Stage1Strategy(Stage12Strategy):
    """ZeRO stage 1: the optimizer state (and fp32 masters) partitioned; whole gradients reduced."""

    stage = 1


class Stage2Strategy(Stage12Strategy):
    """ZeRO stage 2: gradients partitioned too, reduce-scattered as backward produces them."""

    stage = 2
    capabilities = Capabilities(no_sync=False)
