"""The interface every ZeRO stage implements.

The engine owns the training-loop contract (micro-step counting, the accumulation boundary, loss
scaling, clipping policy, scheduler stepping, logging, checkpoint orchestration). A strategy owns where
model states live and how gradients are reduced: one object per ZeRO stage, chosen from the config.

Life of an optimizer step, as the engine drives it::

    strategy.begin_backward(reduce=boundary)   # before every loss.backward()
    loss.backward()                             # hooks installed by the strategy reduce gradients
    strategy.end_backward()                     # wait for in-flight reductions (idempotent)
    ...at the boundary:
    norm = strategy.global_grad_norm(loss_scale)  # inf/nan means overflow (same on every rank)
    strategy.step(grad_multiplier)                 # unscale + clip, optimizer update, publish params
    strategy.zero_grad()
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from deepshard.comm.group import CommGroup
from deepshard.placement import claim, expert_of, norm_weight, owner_of as placement_owner, release
from deepshard.precision.policy import PrecisionPolicy
from deepshard.shard_state import FullState, ShardState
from deepshard.zero.grad_comm import GradReduce
from deepshard.zero.grad_norm import NormScratch, Pieces, exact_norm
from deepshard.zero.offload.policy import OffloadPolicy


@dataclass(frozen=True)
class Capabilities:
    """What a ZeRO stage composes with, declared on its class and read by the plan check (``deepshard.plan``)
    before anything is built."""

    pipeline: bool = True
    """Runs under a pipeline engine (gradients reduced once per batch, parameters resident per stage)."""
    optimizer_offload: bool = True
    """Can move its optimizer partition to CPU memory or files (stage 0 has no partition)."""
    param_offload: bool = False
    """Can move its parameter shards off the device (stage 3)."""
    compressed_comm: bool = False
    """Leaves whole gradients local for a compressed-communication optimizer (OneBitAdam) to average."""
    step_in_backward: bool = False
    """Can apply each update during backward (``optimizer_step_in_backward``)."""
    no_sync: bool = True
    """Can skip the gradient reduction of a backward (``engine.no_sync()``): stages 2 and 3 cannot, they
    partition gradients as backward produces them."""
    expert_parallel: bool = True
    """Shards and reduces the experts of MoE layers with ``ep_size`` > 1 over their expert-data-parallel
    group (every stage does; DeepSpeed refuses native MoE under ZeRO-3 altogether)."""
    partitioned_states: bool = True
    """Each rank keeps a partition of the optimizer states and reduce-scatters gradients into it (stages
    1-3): what hybrid sharding (``mics_shard_size``) and quantized gradients (qgZ) act on; stage 0 keeps
    whole states and all-reduces whole gradients."""
    partitioned_parameters: bool = False
    """Each rank holds only a shard of every parameter between uses (stage 3): a 16-bit save must
    gather them (``stage3_gather_16bit_weights_on_model_save``), a forward that reads a parameter outside
    its module's call sees an empty placeholder, and ``engine.compile()`` cannot compile around the hooks."""


@dataclass
class StrategyContext:
    """Everything a strategy is built from besides the module and the optimizer, passed explicitly (no
    global state): every stage takes ``(module, optimizer, ctx)``."""

    comm: CommGroup
    precision: PrecisionPolicy
    zero_config: Any
    device: torch.device
    gradient_predivide_factor: float = 1.0
    prescale_gradients: bool = False
    average_gradients: bool = True
    model_parallel: CommGroup | None = None
    """The ranks of one data-parallel replica (pipeline x tensor): the gradient norm and the overflow
    flag are combined here after ``comm`` (the data-parallel group). None: no model parallelism."""
    optimizer_offload: OffloadPolicy | None = None
    """Where the master weights and optimizer state live (None: on the device). Stages 1-3."""
    param_offload: OffloadPolicy | None = None
    """Where the parameter shard lives between uses (None: on the device). Stage 3."""
    step_in_backward: bool = False
    """Apply each update during backward (``optimizer_step_in_backward``; ``deepshard.plan`` has checked
    that nothing needs every gradient first). Stage 3."""
    zero_groups: Any = None
    """The hierarchical groups of MiCS / hybrid sharding and ZeRO++ (``deepshard.zero.hierarchy.ZeroGroups``;
    ``comm`` is then their shard group), or None: plain ZeRO over ``comm``."""
    experts: Mapping[str, CommGroup] = field(default_factory=dict)
    """The expert-data-parallel group of each expert-parallel group name (``ep_size_<P>``): a parameter
    whose placement names one (``placement.expert_of``) is reduced and sharded there, not over ``comm``,
    its sum still divided by ``comm.size`` (``reduction_group``)."""

    def grad_reduce(self) -> GradReduce:
        """How the dense parameters' gradients are reduced (``zero/grad_comm.py``): over ``comm``, and across
        the replicas of hybrid sharding, quantized under qgZ."""
        return self.zero_groups.grad_reduce() if self.zero_groups is not None else GradReduce(self.comm)

    @property
    def replica_rank(self) -> int:
        """This rank's replica under hybrid sharding (0 without): only replica 0 writes the shard to a checkpoint."""
        return self.zero_groups.replica.rank if self.zero_groups is not None else 0

    def reduction_group(self, param: torch.Tensor) -> CommGroup:
        """The group ``param``'s gradient is summed over (and its ZeRO state sharded over): its experts'
        expert-data-parallel group, else ``comm``. The sum is always divided by ``comm.size``: an expert on
        one expert-parallel rank has gathered the gradient of every rank of its expert-parallel group's
        tokens already (through the all-to-all's backward), so the sum over its replicas covers all
        ``comm.size`` ranks' losses once (DeepSpeed's scaling)."""
        found = expert_of(param)
        if found is None:
            return self.comm
        group = self.experts.get(found.group)
        if group is None:
            raise KeyError(f"a parameter is recorded as an expert of group {found.group!r}, but this engine has "
                           f"expert groups {sorted(self.experts)}: was the model given to another engine?")
        return group

    def domains(self, params: list[torch.Tensor]) -> tuple[list[int], list[CommGroup]]:
        """``(domain of each parameter, the domains' groups)``: domain 0 is ``comm``, the others the
        expert-data-parallel groups the parameters' experts are reduced over, in order of appearance."""
        groups: list[CommGroup] = [self.comm]
        index: list[int] = []
        for p in params:
            group = self.reduction_group(p)
            found = next((i for i, g in enumerate(groups) if g is group), None)
            if found is None:
                groups.append(group)
                found = len(groups) - 1
            index.append(found)
        return index, groups
    deterministic_steps: int = 0
    """The deterministic mode's accumulation steps (``zero/canonical.py``): every micro-step is reduced, the
    steps' sums are added in the canonical tree and averaged once at the boundary over ``dp x steps``
    micro-batches (whose losses the engine does not divide). 0: the default mode."""

    def final_factor(self) -> float:
        """What the deterministic mode multiplies the canonical sum by at the boundary."""
        steps = max(1, self.deterministic_steps)
        if self.prescale_gradients and self.gradient_predivide_factor == 1.0:
            predivide = float(self.comm.size)
        else:
            predivide = self.gradient_predivide_factor
        return predivide / (self.comm.size * steps) if self.average_gradients else predivide / steps


def copies_of(param: torch.Tensor) -> int:
    """How many model-parallel ranks hold ``param`` (1 unless replicated over tensor-parallel ranks or tied
    across pipeline stages)."""
    return max(1, round(1.0 / norm_weight(param)))


def sources_by_copies(params: list[torch.nn.Parameter], grads: Callable[[list[int]], Iterable[torch.Tensor]],
                      by_copies: bool) -> dict[int, list[Pieces]]:
    """Gradient sources keyed by copies: ``grads(indices)`` yields the gradients of ``params[i]`` for
    ``i`` in ``indices`` (read when the norm asks for them). One key, 1, when ``by_copies`` is False."""
    keys: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        keys.setdefault(copies_of(p) if by_copies else 1, []).append(i)
    return {c: [lambda idx=idx: grads(idx)] for c, idx in keys.items()}


def owner_of(param: torch.Tensor) -> "ZeroStrategy | None":
    """The strategy that manages ``param``, if any (kept on the parameter: ``placement.py``)."""
    found = placement_owner(param)
    return found if isinstance(found, ZeroStrategy) else None


class ZeroStrategy(ABC):
    """Base class: see the module docstring for the call order."""

    stage: int = -1
    capabilities: Capabilities = Capabilities()
    steps_in_backward: bool = False
    """True when the optimizer update happens during backward (stage 3's optimizer_step_in_backward):
    ``step()`` then only finishes it, and an overflow cannot be skipped."""
    atoms_contiguous: bool = False
    """The deterministic mode's split of a global batch (``zero/canonical.py``): True when rank ``r``'s
    accumulation step ``m`` trains micro-batch ``r x gas + m`` (stages 0 and 1, fp32, a power-of-two ``gas``:
    one reduction per step), False for ``m x dp + r``."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 ctx: StrategyContext) -> None:
        self.module = module
        self.optimizer = optimizer
        self.ctx = ctx
        # lets deepshard.utils.safe_get_full_* find the strategy from a bare parameter
        claim(module.parameters(), self)

    # ---------------------------------------------------------------------------------- backward
    @abstractmethod
    def begin_backward(self, reduce: bool) -> None:
        """Called before each backward; ``reduce`` is False inside ``no_sync`` / before the boundary."""

    @abstractmethod
    def end_backward(self) -> None:
        """Finish every gradient reduction started by this backward. Safe to call twice."""

    # ------------------------------------------------------------------------- coalesced reduction
    def hold_gradients(self, hold: bool) -> None:
        """``engine.coalesce_grad_reduction()``: while held, backward passes (told not to reduce) add their
        gradients into local, unreduced ones and issue no collective; ``reduce_held`` reduces them once.
        Stages that hold a backward's gradients whenever it is not at the boundary (1) need nothing more;
        stages that otherwise reduce every backward (2, 3) extend this."""
        self.gradients_held = hold

    gradients_held: bool = False
    """Inside ``engine.coalesce_grad_reduction()``: ``full_grad`` reads the local, unreduced gradient."""

    def reduce_held(self) -> None:
        """Reduce the held gradients once, every bucket (group) in order, as a boundary backward would have."""
        self.hold_gradients(False)
        self.begin_backward(True)
        self.end_backward()

    # -------------------------------------------------------------------------------------- step
    grads_sharded: bool = True
    """True when this rank holds 1/dp of the reduced gradient (stages 1-3): its sum of squares is summed
    over the data-parallel group; False when every dp rank holds all of it (stage 0)."""

    def norm_sources(self, by_copies: bool) -> dict[int, list[Pieces]]:
        """This rank's reduced gradient tensors, keyed by how many model-parallel ranks hold a copy of each
        (``placement.py``: a replicated or tied parameter counts once in the norm); all under key 1 when
        ``by_copies`` is False (no model parallelism)."""
        raise NotImplementedError(f"{type(self).__name__} does not compute a gradient norm")

    def global_grad_norm(self, loss_scale: float) -> float:
        """The L2 norm of the full (unscaled, reduced) gradient over the data-parallel group; inf on
        overflow. The same bits at every stage and shard layout (``zero/grad_norm.py``). With model
        parallelism, the engine calls ``model_grad_norm`` instead."""
        groups = [self.ctx.comm] if self.grads_sharded and self.ctx.comm.size > 1 else []
        return exact_norm(self.norm_sources(False), groups, self.ctx.device, self._norm_scratch()) / loss_scale

    def model_grad_norm(self, loss_scale: float) -> float:
        """The norm of the whole model's gradient: summed over dp, then over the model-parallel group
        (``ctx.model_parallel``), each element weighted by ``1 / copies``. Without model parallelism this
        is ``global_grad_norm``."""
        mp = self.ctx.model_parallel
        if mp is None or mp.size == 1:
            return self.global_grad_norm(loss_scale)
        groups = ([self.ctx.comm] if self.grads_sharded and self.ctx.comm.size > 1 else []) + [mp]
        return exact_norm(self.norm_sources(True), groups, self.ctx.device, self._norm_scratch(),
                          copies_max=mp.size) / loss_scale

    def _norm_scratch(self) -> NormScratch:
        scratch = getattr(self, "_norm_buffers", None)
        if scratch is None:
            scratch = self._norm_buffers = NormScratch()
        return scratch

    @abstractmethod
    def step(self, grad_multiplier: float) -> None:
        """Multiply gradients by ``grad_multiplier`` (unscale x clip), run the optimizer, publish the new
        parameters to the module."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Clear accumulated gradients."""

    def release(self) -> None:
        """Detach from the module for good (``engine.destroy``): hooks removed, files closed, the
        parameters no longer name this strategy as their owner."""
        from deepshard.zero.optimizer_guard import unguard

        self.remove_hooks()
        release(self.module.parameters(), self)
        unguard(self.optimizer)

    def remove_hooks(self) -> None:
        """Remove every hook this strategy installed and release its files (overridden per stage)."""

    # ------------------------------------------------------------------------------- checkpoints
    @abstractmethod
    def shard_state(self, exclude_frozen: bool = False) -> ShardState | None:
        """This rank's share of model and optimizer state as plain data (``deepshard.shard_state``) for
        ``checkpoint/`` to write; None when this rank writes none. ``exclude_frozen`` leaves out
        parameters with ``requires_grad=False``. Every rank calls it (stage 3 gathers frozen weights)."""

    @abstractmethod
    def load_state(self, full: FullState, load_optimizer_states: bool) -> None:
        """Take this rank's slices of ``full``: a checkpoint ``checkpoint/`` read from any stage, any process
        count and any format, its names already checked against the module."""

    def load_share(self) -> dict[str, list[tuple[int, int]]] | None:
        """The element ranges ``[start, stop)`` of each trainable tensor (saved name, flattened) whose
        checkpoint values ``load_state`` uses on this rank, when it uses only those (the rest it takes from
        its peers); None: it needs every value (``checkpoint/share.py``)."""
        return None

    def consolidated_state_dict(self, rank: int, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
        """The module's whole state dict in its compute dtype, on CPU. Every rank holds it whole here; a
        stage that partitions parameters gathers them (a collective: every rank calls it; {} off rank 0)."""
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()
                if not (exclude_frozen and k in frozen)}

    def require_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer, or the error that says how to give one."""
        if self.optimizer is None:
            raise RuntimeError("engine.step() needs an optimizer: pass optimizer=... to deepshard.initialize "
                               "or add an \"optimizer\" section to the config")
        return self.optimizer

    # ---------------------------------------------------------------------------------- accounting
    @abstractmethod
    def memory_report(self) -> dict[str, int]:
        """Bytes per category held by this process: parameters, gradients, master_weights,
        optimizer_state, buffers, comm_buckets."""

    def full_fp32_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The full fp32 value of ``param`` (the master copy where one exists; a frozen parameter's value:
        ``safe_get_full_fp32_param`` answers None for it, as DeepSpeed, but checkpoints and tests read it)."""
        return param.detach().float().clone()

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The full reduced gradient of ``param`` (fp32), or None."""
        return None if param.grad is None else param.grad.detach().float().clone()

    def full_optimizer_state(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        """The full optimizer state ``key`` (e.g. ``exp_avg``) of ``param``."""
        return None

    def fragment_access(self) -> Any:
        """The writers and local readers of ``deepshard.utils`` (``safe_set_full_*``, ``safe_*_local_*``) over
        this strategy's state: a ``zero.fragment_access.FragmentAccess`` (or ``WholeAccess`` at stage 0)."""
        raise NotImplementedError(f"{type(self).__name__} does not support writing its training state "
                                  "(deepspeed.utils.safe_set_*): use ZeRO stage 0-3's strategies")
