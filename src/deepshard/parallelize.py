"""The one composer: a model, its config and its grid in, a training engine out, each technique applied
in a fixed order. ``deepshard.initialize`` (``bootstrap.py``) reads the config and builds the grid, then
calls :func:`parallelize`; nothing else composes.

    plan check           every combination deepshard cannot build, refused at once   deepshard/plan.py
    grid                 pp x dp x tp process groups (given; a PipelineModule's own)  deepshard/grid.py, topology.py
    pipeline cut         this rank's stage (built by the PipelineModule), config keys deepshard/pipe/module.py, engine.py
                         applied, tied-weight groups across stages                   deepshard/pipe/tied.py
    tensor parallelism   AutoTP split; Megatron attributes adopted into placements   deepshard/tp/autotp.py, placement.py
    sequence parallelism Ulysses / ring / hybrid over the sp group (weights replicated) deepshard/sp/
    activation ckpt      the pipeline's recompute function from the config           deepshard/checkpointing.py
    compile              a torch.compile'd model trains its original module, compiled deepshard/compile.py
                         in place (unwrapped first, at initialize)
    experts              MoE layers' expert-parallel groups, experts' placements     deepshard/moe/parallel.py
                         (AutoEP: Hugging Face MoE blocks' experts split over ranks)  deepshard/moe/autoep.py
    ZeRO wrapping        device, replicas made equal, precision, the strategy         deepshard/parts.py, zero/
                         (sharding and reducing over the replicas: dp x sp)
    optimizer            the user's or the config's, taken over by the strategy       deepshard/optim/
    engine               from the table below, by model kind                          deepshard/engine.py, pipe/engine.py
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterable

import torch

from deepshard.accelerator import DeviceAccelerator as Accelerator, cpu_has_native_bf16
from deepshard.config import DeepShardConfig
from deepshard.parts import (EngineParts, OptimizerArg, broadcast_module, build_client_optimizer, build_lr_scheduler,
                             build_monitor, build_strategy, precision_policy)
from deepshard.plan import Plan, describe, enforce
from deepshard.placement import adopt_megatron_attributes, set_copies
from deepshard.topology import Topology
from deepshard.utils.logging import logger

if TYPE_CHECKING:
    from deepshard.engine import EngineCore


def engine_class(plan: Plan) -> "type[EngineCore]":
    """The engine of a plan: the table of engines, by model kind."""
    if plan.pipeline:
        from deepshard.pipe.engine import PipelineEngine

        return PipelineEngine
    from deepshard.engine import DeepShardEngine

    return DeepShardEngine


def parallelize(model: torch.nn.Module, cfg: DeepShardConfig, accelerator: Accelerator, topology: Topology,
                optimizer: OptimizerArg = None, model_parameters: Iterable[Any] | None = None,
                lr_scheduler: Any = None, mpu: Any = None) -> "EngineCore":
    """Compose the run (collective: every rank calls it): see the module docstring for the order. ``mpu``:
    what the user passed to ``initialize`` (it may carry a sequence-parallel setup)."""
    from deepshard.moe.autoep import AutoEPConfig, apply_autoep
    from deepshard.moe.parallel import attach_experts, broadcast_experts, expert_param_ids
    from deepshard.pipe.module import PipelineModule
    from deepshard.sp.engine_hooks import build_sequence_parallel
    from deepshard.utils.groups import remember_grid

    plan = describe(cfg, model, topology.dims, optimizer, accelerator.kind)
    enforce(plan)  # nothing is built before this line
    topology = attach_experts(model, topology, bool(cfg.use_data_before_expert_parallelism))
    autoep = AutoEPConfig(cfg.expert_parallel)
    if autoep.enabled:  # Hugging Face MoE blocks' experts split over expert-parallel ranks
        topology = apply_autoep(model, topology, autoep.size, autoep.preset_model)
    stage = model if isinstance(model, PipelineModule) else None  # plan.pipeline
    tied = None
    if stage is not None:  # the stage's layers were built by the PipelineModule for this grid position
        from deepshard.pipe.engine import configure_pipeline
        from deepshard.pipe.tied import build_tied_weights

        configure_pipeline(stage, cfg)
        tied = build_tied_weights(stage, topology)
    if plan.autotp:
        from deepshard.tp.autotp import apply_tensor_parallel

        apply_tensor_parallel(model, cfg.tensor_parallel, topology)
    adopt_megatron_attributes(model.parameters(), topology.coord.tp, topology.tp.size)
    set_copies(model.parameters(), topology.tp.size)
    sequence_parallel = build_sequence_parallel(topology, cfg, mpu)  # collective: hybrid sub-groups
    if stage is not None:
        from deepshard.pipe.engine import configure_recompute

        configure_recompute(stage, cfg)
    model.to(accelerator.device)
    # replicas of one model slice (dp x sp) start equal; tp/pp slices differ; experts split over ep ranks differ,
    # and their replicas (the expert-data-parallel group) start equal
    broadcast_module(model, topology.seq_dp, skip=expert_param_ids(model.parameters()))
    broadcast_experts(model, topology)
    if tied is not None:
        tied.broadcast()  # then the tied copies across stages
    precision = precision_policy(cfg)
    client_optimizer = build_client_optimizer(model, cfg, optimizer, model_parameters)
    strategy = build_strategy(model, client_optimizer, cfg, topology, precision, accelerator)
    if client_optimizer is not None:
        setattr(client_optimizer, "overflow", False)  # set at every step (step.py)
    comms = topology.world.logger
    comms.enabled, comms.verbose = bool(cfg.comms_logger.enabled), bool(cfg.comms_logger.verbose)
    comms.reset()  # count training traffic only, not the initial broadcast
    parts = EngineParts(module=model, config=cfg, accelerator=accelerator, topology=topology, strategy=strategy,
                        precision=precision, optimizer=client_optimizer,
                        lr_scheduler=build_lr_scheduler(cfg, client_optimizer, lr_scheduler),
                        monitor=build_monitor(cfg, topology.rank), local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                        sequence_parallel=sequence_parallel, tied=tied)
    engine = engine_class(plan)(parts)
    remember_grid(topology, sequence_parallel)  # deepspeed.utils.groups' accessors answer for this grid
    _announce(cfg, topology, precision.param_dtype, accelerator)
    return engine


def _announce(cfg: DeepShardConfig, topology: Topology, dtype: torch.dtype, accelerator: Accelerator) -> None:
    if topology.rank != 0:
        return
    grid = "" if topology.is_data_parallel_only else f", {topology.dims}"
    logger.info("deepshard engine: ZeRO stage %d, %d data-parallel process(es)%s, %s on %s, micro batch %d x "
                "accumulation %d = global batch %d", cfg.zero_optimization.stage, topology.dp.size, grid, dtype,
                accelerator.device, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
                cfg.train_batch_size)
    if dtype == torch.bfloat16 and accelerator.device.type == "cpu" and cpu_has_native_bf16() is False:
        logger.warning("bf16 on this CPU is emulated (no avx512_bf16 / amx_bf16): its matmuls run many times "
                       "slower than fp32 (17x measured on an AVX2-only AMD EPYC). Set \"bf16\": "
                       "{\"enabled\": false} to train in fp32 on this machine")
