"""The parts a run is built from, one builder each, called in order by ``deepshard.parallelize``: replicas
made equal, the precision policy, the optimizer, the ZeRO strategy (from :data:`STRATEGIES`, the one table
of stages), the LR scheduler, the monitors; and :class:`EngineParts`, all of them in one frozen record that
the engine takes whole."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from deepshard.accelerator import DeviceAccelerator as Accelerator
from deepshard.comm.group import CommGroup
from deepshard.comm.scratch import release
from deepshard.config import DeepShardConfig, dtype_from_name
from deepshard.precision import PrecisionPolicy
from deepshard.topology import Topology
from deepshard.utils.logging import logger
from deepshard.zero.master import check_optimizer_params, trainable_params
from deepshard.zero.offload.policy import OffloadPolicy, make_offload_policies
from deepshard.zero.stage0 import Stage0Strategy
from deepshard.zero.stage12 import Stage1Strategy, Stage2Strategy
from deepshard.zero.stage3.strategy import Stage3Strategy
from deepshard.zero.strategy import StrategyContext, ZeroStrategy

if TYPE_CHECKING:
    from deepshard.pipe.tied import TiedWeights
    from deepshard.sp.api import SequenceParallel

OptimizerArg = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None


@dataclass(frozen=True)
class EngineParts:
    """Everything an engine is made of, built once by ``deepshard.parallelize`` and handed to the engine
    whole: an engine is complete when its ``__init__`` returns, nothing is attached to it afterwards."""

    module: torch.nn.Module
    config: DeepShardConfig
    accelerator: Accelerator
    topology: Topology
    strategy: ZeroStrategy
    precision: PrecisionPolicy
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    """The user's scheduler or the config's (anything with ``step`` / ``state_dict``), or None."""
    monitor: Any = None
    """The ``MonitorMaster`` of the config's monitors, or None."""
    local_rank: int = 0
    sequence_parallel: "SequenceParallel | None" = None
    """The run's sequence parallelism (``sequence_parallel_size`` > 1), else None."""
    tied: "TiedWeights | None" = None
    """A pipeline's tied-weight groups across its stages (the pipeline engine's); None for a plain model."""

STRATEGIES: dict[int, type[ZeroStrategy]] = {0: Stage0Strategy, 1: Stage1Strategy, 2: Stage2Strategy,
                                             3: Stage3Strategy}
"""The ZeRO strategy of each ``zero_optimization.stage``: the one table of stages. Every strategy is built
the same way, ``cls(module, optimizer, StrategyContext)``, and declares what it composes with on its class
(``capabilities``), which the plan check reads from here before anything is built."""


def strategy_class(stage: int) -> type[ZeroStrategy]:
    """The strategy class of ZeRO ``stage`` (0-3)."""
    found = STRATEGIES.get(stage)
    if found is None:
        raise ValueError(f"zero_optimization.stage={stage!r}: use 0, 1, 2 or 3")
    return found


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, comm: CommGroup, skip: set[int] | None = None) -> None:
    """Make every rank start from rank 0's parameters and buffers (one flat broadcast per dtype);
    ``skip``: ids of parameters that differ between ranks on purpose (experts split over ranks)."""
    if comm.size == 1:
        return
    tensors = [p for p in module.parameters() if not skip or id(p) not in skip] + list(module.buffers())
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        comm.broadcast(flat, src=0)
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        release(flat)  # now, not when gloo's worker thread drops the broadcast (comm/scratch.py)


def precision_policy(cfg: DeepShardConfig) -> PrecisionPolicy:
    param_dtype = cfg.model_dtype
    comm_dtype = dtype_from_name(cfg.communication_data_type) if cfg.communication_data_type else None
    buffer_dtype = dtype_from_name(cfg.data_types.buffer_dtype) if cfg.data_types.buffer_dtype else None
    return PrecisionPolicy(param_dtype=param_dtype, master_dtype=torch.float32, comm_dtype=comm_dtype,
                           buffer_dtype=buffer_dtype, auto_cast=cfg.fp16.enabled and cfg.fp16.auto_cast)


def build_client_optimizer(model: torch.nn.Module, cfg: DeepShardConfig, optimizer: OptimizerArg,
                           model_parameters: Iterable[Any] | None) -> torch.optim.Optimizer | None:
    """The user's optimizer wins over the config's; a callable receives the parameters."""
    params = list(model_parameters) if model_parameters is not None else trainable_params(model)
    if isinstance(optimizer, torch.optim.Optimizer):
        if cfg.optimizer is not None:
            logger.info("the optimizer passed to initialize() is used; the config's optimizer section is ignored")
        opt = optimizer
    elif callable(optimizer):
        opt = optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned {type(opt).__name__}, not a torch.optim.Optimizer")
    elif optimizer is not None:
        raise TypeError(f"optimizer= must be a torch.optim.Optimizer or a callable returning one, "
                        f"got {type(optimizer).__name__}")
    elif cfg.optimizer is not None:
        from deepshard.moe.utils import configure_moe_param_groups, has_moe_layers
        from deepshard.optim import build_optimizer

        if has_moe_layers(model)[0] and params:  # DeepSpeed's engine gives experts groups of their own
            params = configure_moe_param_groups(params)
        opt = build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), params)
    else:
        return None
    check_optimizer_params(model, opt)
    return opt


def build_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, cfg: DeepShardConfig,
                   topology: Topology, precision: PrecisionPolicy, accelerator: Accelerator) -> ZeroStrategy:
    """The ZeRO strategy of ``cfg``'s stage (``strategy_class``), sharding and reducing over the replicas of
    the model slice only (``topology.seq_dp``: data x sequence parallel; a sequence-parallel rank holds the
    whole weights, and the gradient mean over dp x sp is the single-process gradient when every sp rank
    backpropagates the same global loss, as ``deepshard.sp.loss`` computes it). The plan check
    (``deepshard.plan``) has refused what it cannot hold."""
    optimizer_offload, param_offload = offload_policies(cfg, accelerator)
    zero_groups = build_zero_groups(topology, cfg)
    ctx = StrategyContext(comm=zero_groups.shard if zero_groups is not None else topology.seq_dp,
                          zero_groups=zero_groups, model_parallel=topology.model_parallel, precision=precision,
                          experts={name: groups.edp for name, groups in topology.experts.items()},
                          zero_config=cfg.zero_optimization, device=accelerator.device,
                          gradient_predivide_factor=float(cfg.gradient_predivide_factor),
                          prescale_gradients=bool(cfg.prescale_gradients),
                          average_gradients=cfg.gradient_allreduce_op != "sum",
                          optimizer_offload=optimizer_offload, param_offload=param_offload,
                          step_in_backward=bool(cfg.zero_optimization.optimizer_step_in_backward),
                          deterministic_steps=int(cfg.gradient_accumulation_steps) if cfg.deterministic else 0)
    if cfg.deterministic:  # every backend's reduce-scatter sums in the canonical order (NCCL's too)
        topology.seq_dp.canonical = True
    return strategy_class(cfg.zero_optimization.stage)(model, optimizer, ctx)


def build_zero_groups(topology: Topology, cfg: DeepShardConfig) -> Any:
    """MiCS / hybrid sharding and ZeRO++'s groups (``deepshard.zero.hierarchy``; a collective), or None when
    the config asks for none of them: the strategy then shards over ``topology.seq_dp``."""
    from deepshard.zero.hierarchy import ZeroPlusPlus, build

    settings = ZeroPlusPlus.from_config(cfg.zero_optimization)
    if not settings.any:
        return None
    groups = build(topology, settings)
    if topology.rank == 0:
        logger.info("ZeRO groups: sharded over %d rank(s) x %d replica(s)%s%s%s; %s", groups.shard.size,
                    groups.replica.size, f", hpZ secondary shards over {groups.hpz.size}" if groups.hpz else "",
                    ", quantized weights (qwZ)" if settings.quantized_weights else "",
                    ", quantized gradients (qgZ)" if settings.quantized_gradients else "", topology.nodes.describe())
    return groups


def offload_policies(cfg: DeepShardConfig, accelerator: Accelerator) -> tuple[OffloadPolicy, OffloadPolicy]:
    """The offload policies ``(optimizer, param)`` for the strategy (``deepshard.zero.offload``).

    ``device: cpu`` on a CPU-only run is a no-op (the states already are in host memory; said once);
    ``nvme`` keeps states in files under ``nvme_path``. Partial offload (``ratio`` < 1) is refused here
    (a key on its own); offload at stage 0 by the plan check."""
    policies = make_offload_policies(cfg.zero_optimization, cfg.aio, accelerator.kind)
    for what, policy in zip(("master weights and optimizer states", "parameter shards"), policies):
        if policy.moves_states:
            logger.debug("zero_optimization offload: %s %s", what, policy.describe())
    if policies[1].moves_states and not policies[0].moves_states:
        logger.warning("zero_optimization.offload_param moves the parameter shard off the device but "
                       "offload_optimizer does not: the fp32 master weights and optimizer state stay resident "
                       "(in fp32 training an fp32 master copy is kept for the optimizer); offload both for the "
                       "smallest footprint")
    return policies


def build_lr_scheduler(cfg: DeepShardConfig, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any) -> Any:
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(optimizer)
        return lr_scheduler
    if cfg.scheduler is None:
        return None
    if optimizer is None:
        raise ValueError(f"the config's scheduler ({cfg.scheduler.type}) needs an optimizer: add an "
                         "\"optimizer\" section or pass optimizer=...")
    from deepshard.optim import build_scheduler

    return build_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), optimizer)


def build_monitor(cfg: DeepShardConfig, rank: int) -> Any:
    if not (cfg.tensorboard.enabled or cfg.csv_monitor.enabled or cfg.wandb.enabled):
        return None
    from deepshard.monitor import MonitorMaster

    return MonitorMaster(cfg.tensorboard, cfg.csv_monitor, cfg.wandb, rank)
