"""``deepshard.initialize`` (defined here, exported by the package): config -> process group -> engine with
its strategy, optimizer and scheduler."""
from __future__ import annotations

import argparse
from typing import Any, Callable, Iterable

import torch

from deepshard.accelerator import DeviceAccelerator as Accelerator, cpu_has_native_bf16, get_accelerator
from deepshard.comm.group import CommGroup  # noqa: F401  (broadcast_module's type)
from deepshard.compile import adopt_compiled
from deepshard.compression.onebit_adam import check_compressed_setup
from deepshard.config import ConfigError, DeepShardConfig, dtype_from_name, load_config, resolve_config_source
from deepshard.config.inert import warn_unused_pipeline
from deepshard.config.loader import read_config_source
from deepshard.distributed import init_distributed
from deepshard.engine import DeepShardEngine
from deepshard.grid import build_topology
from deepshard.precision import PrecisionPolicy
from deepshard.sp.engine_hooks import attach_sequence_parallel, build_sequence_parallel
from deepshard.topology import Topology
from deepshard.utils.logging import logger
from deepshard.utils.teardown import settle_backend_threads_at_exit
from deepshard.zero.master import check_optimizer_params, trainable_params
from deepshard.zero.optimizer_guard import guard
from deepshard.zero.placement import set_copies
from deepshard.zero.strategy import StrategyContext, ZeroStrategy

OptimizerArg = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None


def initialize(args: argparse.Namespace | None = None, model: torch.nn.Module | None = None,
               optimizer: OptimizerArg = None, model_parameters: Iterable[Any] | None = None,
               training_data: torch.utils.data.Dataset | None = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[..., Any] | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[DeepShardEngine, Any, Any, Any]:
    """Wrap ``model`` for distributed training; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``optimizer`` (an instance, or a callable taking the parameters) wins over the config's
    ``optimizer`` section; ``lr_scheduler`` (an instance, or a callable taking the optimizer) wins over
    ``scheduler``. ``config`` is a dict, a JSON path or base64 JSON; or pass ``args.deepspeed_config``.
    The dataloader is None unless ``training_data`` is given.
    """
    if model is None:
        raise ValueError("deepshard.initialize needs model=<torch.nn.Module>")
    model = adopt_compiled(model)  # torch.compile(model): train the original, compiled in place
    if config is not None and config_params is not None:
        raise ValueError("pass the config once: config=... or config_params=... (an alias), not both")
    source = resolve_config_source(args, config if config is not None else config_params)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required, verbose=False)
    settle_backend_threads_at_exit()  # a group deepshard did not create: its threads still finish before exit
    raw, _ = read_config_source(source)
    topology = build_topology(raw, model=model, mpu=mpu, mesh_param=mesh_param)
    cfg = load_config(source, dp_world_size=topology.dp.size)
    warn_unused_pipeline(cfg, model)
    sequence_parallel = build_sequence_parallel(topology, cfg, mpu)  # collective: hybrid sub-groups
    engine = _build_engine(model, cfg, get_accelerator(), topology, optimizer, model_parameters, lr_scheduler)
    attach_sequence_parallel(engine, sequence_parallel)
    if training_data is not None:
        engine.training_dataloader = engine.deepspeed_io(training_data, collate_fn=collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _build_engine(model: torch.nn.Module, cfg: DeepShardConfig, accelerator: Accelerator, topology: Topology,
                  optimizer: OptimizerArg, model_parameters: Iterable[Any] | None,
                  lr_scheduler: Any) -> DeepShardEngine:
    """Every part first, then the engine, complete: precision, optimizer, strategy (over the data-parallel
    group), scheduler, monitor."""
    import os

    from deepshard.tp.autotp import apply_tensor_parallel

    apply_tensor_parallel(model, cfg.tensor_parallel, topology)  # automatic TP: split before anything else
    model.to(accelerator.device)
    broadcast_module(model, topology.seq_dp)  # replicas of one model slice (dp x sp) start equal; tp/pp slices differ
    extra = _prepare_pipeline(model, topology, cfg)
    set_copies(model.parameters(), topology.tp.size)
    precision = precision_policy(cfg)
    client_optimizer = build_client_optimizer(model, cfg, optimizer, model_parameters)
    strategy = build_strategy(model, client_optimizer, cfg, topology, precision, accelerator)
    if client_optimizer is not None:
        client_optimizer.overflow = False  # type: ignore[attr-defined]  # set at every step (step.py)
    if client_optimizer is not None and strategy.stage >= 1:
        guard(client_optimizer, strategy)  # a direct optimizer.step() would update nothing: say so
    scheduler = build_lr_scheduler(cfg, client_optimizer, lr_scheduler)
    monitor = build_monitor(cfg, topology.rank)
    logger_ = topology.world.logger
    logger_.enabled = bool(cfg.comms_logger.enabled)
    logger_.verbose = bool(cfg.comms_logger.verbose)
    logger_.reset()  # count training traffic only, not the initial broadcast
    engine_cls = extra.pop("engine_cls", DeepShardEngine)
    engine = engine_cls(model, cfg, accelerator, topology, strategy, optimizer=client_optimizer,
                        precision=precision, lr_scheduler=scheduler, monitor=monitor,
                        local_rank=int(os.environ.get("LOCAL_RANK", "0")), **extra)
    if topology.rank == 0:
        grid = "" if topology.is_data_parallel_only else f", {topology.dims}"
        logger.info("deepshard engine: ZeRO stage %d, %d data-parallel process(es)%s, %s on %s, micro batch %d x "
                    "accumulation %d = global batch %d", cfg.zero_optimization.stage, topology.dp.size, grid,
                    precision.param_dtype, accelerator.device, cfg.train_micro_batch_size_per_gpu,
                    cfg.gradient_accumulation_steps, cfg.train_batch_size)
        emulated_bf16 = accelerator.device.type == "cpu" and cpu_has_native_bf16() is False
        if precision.param_dtype == torch.bfloat16 and emulated_bf16:
            logger.warning("bf16 on this CPU is emulated (no avx512_bf16 / amx_bf16): its matmuls run many times "
                           "slower than fp32 (17x measured on an AVX2-only AMD EPYC). Set \"bf16\": "
                           "{\"enabled\": false} to train in fp32 on this machine")
    return engine


def _prepare_pipeline(model: torch.nn.Module, topology: Topology, cfg: DeepShardConfig) -> dict[str, Any]:
    """For a ``PipelineModule``: the pipeline engine class and its tied weights (``deepshard.pipe``)."""
    from deepshard.pipe.module import PipelineModule

    if not isinstance(model, PipelineModule):
        from deepshard.config.inert import refuse_fp32_accumulation_outside_pipelines

        refuse_fp32_accumulation_outside_pipelines(cfg)
        return {}
    from deepshard.pipe.engine import PipelineEngine, prepare_pipeline

    return {"engine_cls": PipelineEngine, "tied": prepare_pipeline(model, topology, cfg)}


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, comm: CommGroup) -> None:
    """Make every rank start from rank 0's parameters and buffers (one flat broadcast per dtype)."""
    if comm.size == 1:
        return
    tensors = list(module.parameters()) + list(module.buffers())
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


def precision_policy(cfg: DeepShardConfig) -> PrecisionPolicy:
    param_dtype = cfg.model_dtype
    comm_dtype = dtype_from_name(cfg.communication_data_type) if cfg.communication_data_type else None
    buffer_dtype = dtype_from_name(cfg.data_types.buffer_dtype) if cfg.data_types.buffer_dtype else None
    return PrecisionPolicy(param_dtype=param_dtype, master_dtype=torch.float32, comm_dtype=comm_dtype,
                           buffer_dtype=buffer_dtype)


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
        from deepshard.optim import build_optimizer

        opt = build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), params)
    else:
        return None
    check_optimizer_params(model, opt)
    return opt


def build_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, cfg: DeepShardConfig,
                   topology: Topology, precision: PrecisionPolicy, accelerator: Accelerator) -> ZeroStrategy:
    """The ZeRO strategy of ``cfg``'s stage, sharding and reducing over the replicas of the model slice only
    (``topology.seq_dp``: data x sequence parallel; a sequence-parallel rank holds the whole weights, and
    the gradient mean over dp x sp is the single-process gradient when every sp rank backpropagates the
    same global loss, as ``deepshard.sp.loss`` computes it)."""
    stage = cfg.zero_optimization.stage
    optimizer_offload, param_offload = check_offload(cfg, accelerator)
    step_in_backward = check_step_in_backward(cfg, optimizer_offload, param_offload)
    if step_in_backward and topology.model_parallel.size > 1:
        raise ConfigError(f"zero_optimization.optimizer_step_in_backward=true cannot be used on {topology.dims}: "
                          "each update would need the norm over the model-parallel ranks first; set it to false")
    check_compressed_setup(optimizer, stage, topology.model_parallel.size)
    ctx = StrategyContext(comm=topology.seq_dp, model_parallel=topology.model_parallel, precision=precision,
                          zero_config=cfg.zero_optimization, device=accelerator.device,
                          gradient_predivide_factor=float(cfg.gradient_predivide_factor),
                          prescale_gradients=bool(cfg.prescale_gradients),
                          average_gradients=cfg.gradient_allreduce_op != "sum")
    if stage == 0:
        from deepshard.zero.stage0 import Stage0Strategy

        return Stage0Strategy(model, optimizer, ctx)
    if stage in (1, 2):
        from deepshard.zero.stage12 import Stage12Strategy

        return Stage12Strategy(model, optimizer, ctx, stage, optimizer_offload=optimizer_offload)
    from deepshard.zero.stage3.strategy import Stage3Strategy

    return Stage3Strategy(model, optimizer, ctx, optimizer_offload=optimizer_offload, param_offload=param_offload,
                          step_in_backward=step_in_backward)


def check_step_in_backward(cfg: DeepShardConfig, optimizer_offload: Any, param_offload: Any) -> bool:
    """``zero_optimization.optimizer_step_in_backward``, refused where an update needs every gradient
    first (the key, the value in the way and the fix in the message)."""
    zero = cfg.zero_optimization
    if not zero.optimizer_step_in_backward:
        return False
    key = "zero_optimization.optimizer_step_in_backward=true"
    problems = []
    if zero.stage != 3:
        problems.append(f"zero_optimization.stage is {zero.stage} (it is a stage-3 option)")
    if cfg.gradient_accumulation_steps != 1 or not cfg.managed_gradient_accumulation:
        problems.append(f"gradient_accumulation_steps is {cfg.gradient_accumulation_steps} and "
                        f"managed_gradient_accumulation {cfg.managed_gradient_accumulation} (every backward "
                        "is a step: set them to 1 and true)")
    if float(cfg.gradient_clipping or 0.0) > 0:
        problems.append(f"gradient_clipping is {cfg.gradient_clipping} (clipping needs the global norm first: "
                        "set it to 0)")
    if cfg.fp16.enabled:
        problems.append("fp16 is enabled (loss scaling must see every gradient for overflow first: use bf16)")
    if optimizer_offload.moves_states or param_offload.moves_states:
        problems.append("offload_optimizer / offload_param move states (remove them)")
    if problems:
        raise ConfigError(f"{key} cannot be used: " + "; ".join(problems))
    return True


def check_offload(cfg: DeepShardConfig, accelerator: Accelerator) -> tuple[Any, Any]:
    """The offload policies ``(optimizer, param)`` for the strategy (``deepshard.zero.offload``).

    ``device: cpu`` on a CPU-only run is a no-op (the states already are in host memory; said once);
    ``nvme`` keeps states in files under ``nvme_path``. Combinations that cannot work raise here, before
    anything is built: offload at stage 0, partial offload (``ratio`` < 1)."""
    from deepshard.zero.offload.policy import make_offload_policies

    policies = make_offload_policies(cfg.zero_optimization, cfg.aio, accelerator.kind)
    for what, policy in zip(("master weights and optimizer states", "parameter shards"), policies):
        if policy.moves_states:
            logger.debug("zero_optimization offload: %s %s", what, policy.describe())
    if cfg.zero_optimization.stage == 3 and policies[1].moves_states and not policies[0].moves_states:
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
