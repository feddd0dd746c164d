"""The plan check: what a run asks for, and every combination deepshard cannot build, found before anything
is built and reported all at once.

``describe`` reads the config, the model and the grid into a ``Plan`` (plain data, no process group
needed); ``check`` returns one ``Conflict`` per pair of things that cannot meet, each with the reason and
the fix; ``enforce`` raises ``PlanError`` listing them all. ZeRO strategies declare what they compose with
(``ZeroStrategy.capabilities``); no compatibility check lives anywhere else. Checks of one key on its
own (a negative size, an unknown name) stay with the config's validation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from deepshard.config.base import ConfigError
from deepshard.topology import ParallelDims
from deepshard.zero.strategy import Capabilities

COMPRESSED_OPTIMIZERS = ("onebitadam",)
"""Optimizer types (lower case) whose compressed momentum exchange replaces the gradient all-reduce."""


@dataclass(frozen=True)
class Conflict:
    """Two things that cannot meet: ``what`` names both (with the keys), ``why`` the reason, ``fix`` how."""

    what: str
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}: {self.why}; {self.fix}"


class PlanError(ConfigError):
    """A run deepshard cannot build; ``conflicts`` lists every reason (the message says them all)."""

    def __init__(self, conflicts: list[Conflict]) -> None:
        self.conflicts = list(conflicts)
        if len(conflicts) == 1:
            message = str(conflicts[0])
        else:
            lines = "\n".join(f"  {i}. {c}" for i, c in enumerate(conflicts, 1))
            message = f"this run combines {len(conflicts)} things deepshard cannot build together:\n{lines}"
        super().__init__(message)

    def __reduce__(self) -> tuple[type, tuple[list[Conflict]]]:
        """Pickled with its conflicts: an error raised in a worker process (multiprocessing re-raises it in
        the parent) keeps its message, instead of being rebuilt from the message text."""
        return type(self), (self.conflicts,)


@dataclass(frozen=True)
class Plan:
    """What a run asks for: the grid, the model kind and the features switched on."""

    dims: ParallelDims
    stage: int
    pipeline: bool = False
    num_chunks: int = 1
    schedule: str = "1f1b"
    autotp: bool = False
    fp16: bool = False
    model_dtype: torch.dtype = torch.float32
    accumulation: int = 1
    managed_accumulation: bool = True
    clipping: float = 0.0
    optimizer_offload: bool = False
    param_offload: bool = False
    step_in_backward: bool = False
    compressed_optimizer: Optional[str] = None
    fp32_accumulation: bool = False
    deterministic: bool = False
    grads_on_disk: bool = False
    """ZeRO-3's reduced gradients wait in the optimizer's swap files (offload_optimizer to nvme)."""
    heads: Optional[int] = None
    """The attention's query heads (the model's config, or its attention modules under automatic TP);
    None: not known (the user's own tensor-parallel layers decide)."""
    kv_heads: Optional[int] = None
    """The attention's key/value heads (``heads`` without grouped-query attention)."""
    expert_parallel: tuple[int, ...] = ()
    """The ``ep_size`` of each of the model's MoE layers (``deepshard.moe``), distinct, in module order."""
    zeropp: Any = None
    """MiCS / hybrid sharding and ZeRO++ (``deepshard.zero.hierarchy.ZeroPlusPlus``), or None: plain ZeRO."""

    @property
    def caps(self) -> Capabilities:
        """What the stage's strategy composes with (declared on its class; ``parts.STRATEGIES``)."""
        from deepshard.parts import strategy_class

        return strategy_class(self.stage).capabilities

    @property
    def model_parallel(self) -> int:
        return self.dims.pp * self.dims.tp


def describe(cfg: Any, model: Any, dims: ParallelDims, optimizer: Any = None,
             accelerator_kind: str = "cpu") -> Plan:
    """The plan of a run from its validated config, its model, its grid and the optimizer argument."""
    from deepshard.config.base import dtype_from_name
    from deepshard.pipe.module import PipelineModule
    from deepshard.tp.autotp import attention_head_counts
    from deepshard.tp.autotp_config import resolve_tp_config
    from deepshard.zero.offload.policy import make_offload_policies

    zero = cfg.zero_optimization
    opt_policy, param_policy = make_offload_policies(zero, cfg.aio, accelerator_kind, quiet=True)
    pipeline = isinstance(model, PipelineModule)
    accum = cfg.data_types.grad_accum_dtype
    autotp = resolve_tp_config(model, cfg.tensor_parallel).enabled
    heads, kv_heads = attention_head_counts(model, module_attributes=autotp)
    return Plan(expert_parallel=_expert_parallel_sizes(model, cfg.expert_parallel),dims=dims, stage=int(zero.stage),
                pipeline=pipeline, num_chunks=int(getattr(model, "num_chunks", 1)) if pipeline else 1,
                schedule=str(cfg.pipeline.schedule), autotp=autotp, heads=heads, kv_heads=kv_heads,
                fp16=bool(cfg.fp16.enabled), model_dtype=cfg.model_dtype,
                accumulation=int(cfg.gradient_accumulation_steps),
                managed_accumulation=bool(cfg.managed_gradient_accumulation),
                clipping=float(cfg.gradient_clipping or 0.0), optimizer_offload=opt_policy.moves_states,
                param_offload=param_policy.moves_states, step_in_backward=bool(zero.optimizer_step_in_backward),
                compressed_optimizer=_compressed_name(cfg, optimizer),
                fp32_accumulation=accum is not None and dtype_from_name(accum) == torch.float32,
                zeropp=_zeropp(zero), deterministic=bool(cfg.deterministic),
                grads_on_disk=int(zero.stage) == 3 and getattr(opt_policy, "device", None) == "nvme")


def _zeropp(zero: Any) -> Any:
    from deepshard.zero.hierarchy import ZeroPlusPlus

    settings = ZeroPlusPlus.from_config(zero)
    return settings if settings.any else None


def _expert_parallel_sizes(model: Any, autoep_section: Any) -> tuple[int, ...]:
    """The ep sizes of the model's MoE layers, then AutoEP's (the ``expert_parallel`` section)."""
    from deepshard.moe.autoep import AutoEPConfig
    from deepshard.moe.parallel import moe_layers

    sizes: list[int] = []
    for _, layer in moe_layers(model) if hasattr(model, "named_modules") else []:
        if layer.ep_size not in sizes:
            sizes.append(layer.ep_size)
    autoep = AutoEPConfig(autoep_section)
    if autoep.enabled and autoep.size not in sizes:
        sizes.append(autoep.size)
    return tuple(sizes)


def _compressed_name(cfg: Any, optimizer: Any) -> Optional[str]:
    from deepshard.compression.onebit_adam import CompressedCommOptimizer

    if isinstance(optimizer, CompressedCommOptimizer):
        return type(optimizer).__name__
    if optimizer is None and cfg.optimizer is not None and cfg.optimizer.type.lower() in COMPRESSED_OPTIMIZERS:
        return str(cfg.optimizer.type)
    return None


def check(plan: Plan) -> list[Conflict]:
    """Every conflict of ``plan`` (empty when deepshard can build it)."""
    conflicts: list[Conflict] = []
    for rule in RULES:
        conflicts.extend(rule(plan))
    return conflicts


def enforce(plan: Plan) -> None:
    """Raise ``PlanError`` with every conflict of ``plan``."""
    conflicts = check(plan)
    if conflicts:
        raise PlanError(conflicts)


# ------------------------------------------------------------------------------------------- rules
def _pipeline_rules(plan: Plan) -> list[Conflict]:
    out = []
    if not plan.pipeline:
        return out
    if not plan.caps.pipeline:
        out.append(Conflict(f"zero_optimization.stage={plan.stage} cannot be combined with pipeline parallelism",
                            "each stage already holds only its layers; ZeRO-3 would gather them again for every "
                            "micro-batch", "use stage 0, 1 or 2"))
    if plan.schedule == "interleaved" and plan.num_chunks < 2:
        out.append(Conflict("pipeline.schedule='interleaved' with a PipelineModule of one chunk per stage",
                            "the interleaved schedule runs several model chunks per stage",
                            "build the model with PipelineModule(..., num_chunks=2) (or more), or use '1f1b', "
                            "'gpipe' or 'zb-h1'"))
    if plan.schedule != "interleaved" and plan.num_chunks > 1:
        out.append(Conflict(f"the PipelineModule has num_chunks={plan.num_chunks} (chunks interleaved over the "
                            f"stages) and pipeline.schedule={plan.schedule!r}", "that schedule runs one chunk "
                            "per stage", "set pipeline.schedule to 'interleaved', or build the module with "
                            "num_chunks=1"))
    if plan.autotp and plan.dims.pp > 1:
        out.append(Conflict(f"automatic TP (tensor_parallel.autotp_size={plan.dims.tp}) with pipeline parallelism "
                            f"({plan.dims.pp} stages)", "automatic TP shards a whole model, not a pipeline stage "
                            "(DeepSpeed cannot either)", "build the pipeline stages with deepshard.tp's "
                            "ColumnParallelLinear/RowParallelLinear instead, or drop one of the two"))
    return out


def _precision_rules(plan: Plan) -> list[Conflict]:
    sixteen = plan.model_dtype in (torch.float16, torch.bfloat16)
    if plan.fp32_accumulation and sixteen and plan.accumulation > 1 and not plan.pipeline:
        return [Conflict(f"data_types.grad_accum_dtype is 'fp32' without pipeline parallelism "
                         f"(gradient_accumulation_steps {plan.accumulation})",
                         f"deepshard accumulates the {plan.accumulation} micro-batches in the training dtype "
                         f"({plan.model_dtype}) outside pipelines (fp32 sums are a pipeline feature)",
                         "remove the key or set it to the training dtype")]
    return []


def _offload_rules(plan: Plan) -> list[Conflict]:
    if plan.optimizer_offload and not plan.caps.optimizer_offload:
        return [Conflict(f"zero_optimization.offload_optimizer with zero_optimization.stage={plan.stage}",
                         "offload moves each process's optimizer partition, and ZeRO stage 0 has none (it needs "
                         "ZeRO stage 1, 2 or 3)", "set zero_optimization.stage to 1 or more")]
    return []


def _compression_rules(plan: Plan) -> list[Conflict]:
    name, out = plan.compressed_optimizer, []
    if name is None:
        return out
    if not plan.caps.compressed_comm:
        out.append(Conflict(f"optimizer {name} needs zero_optimization.stage 0, got {plan.stage}",
                            "its compressed momentum exchange replaces the all-reduce of whole gradients, which "
                            "stages 1-3 shard (DeepSpeed has the same rule)",
                            "set zero_optimization.stage to 0, or use optimizer type 'Adam'"))
    if plan.model_parallel > 1:
        out.append(Conflict(f"optimizer {name} works with data parallelism only; this run has "
                            f"{plan.model_parallel} model-parallel ranks (pipeline x tensor)",
                            "the gradient norm would mix local and reduced gradients",
                            "use optimizer type 'Adam', or no pipeline.stages / tensor_parallel"))
    return out


def _step_in_backward_rules(plan: Plan) -> list[Conflict]:
    if not plan.step_in_backward:
        return []
    problems = []
    if not plan.caps.step_in_backward:
        problems.append(f"zero_optimization.stage is {plan.stage} (it is a stage-3 option)")
    if plan.accumulation != 1 or not plan.managed_accumulation:
        problems.append(f"gradient_accumulation_steps is {plan.accumulation} and managed_gradient_accumulation "
                        f"{plan.managed_accumulation} (every backward is a step: set them to 1 and true)")
    if plan.clipping > 0:
        problems.append(f"gradient_clipping is {plan.clipping} (clipping needs the global norm first: set it to 0)")
    if plan.fp16:
        problems.append("fp16 is enabled (loss scaling must see every gradient for overflow first: use bf16)")
    if plan.optimizer_offload or plan.param_offload:
        problems.append("offload_optimizer / offload_param move states (remove them)")
    if plan.model_parallel > 1:
        problems.append(f"the grid is {plan.dims} (each update would need the norm over the model-parallel "
                        "ranks first: use a data-parallel grid)")
    if not problems:
        return []
    return [Conflict("zero_optimization.optimizer_step_in_backward=true cannot be used", "; ".join(problems),
                     "or set optimizer_step_in_backward to false")]


def _sequence_rules(plan: Plan) -> list[Conflict]:
    dims = plan.dims
    if dims.sp == 1:
        return []
    if dims.pp > 1:
        return [Conflict(f"sequence_parallel_size={dims.sp} with pipeline stages (pp={dims.pp})",
                         "is not supported: sequence parallelism composes with data parallelism, ZeRO and "
                         "tensor parallelism", "set the pipeline size to 1 or sequence_parallel_size to 1")]
    if dims.tp == 1 or plan.heads is None:
        return []
    kv_heads = plan.kv_heads if plan.kv_heads is not None else plan.heads
    if plan.heads % dims.tp == 0 and kv_heads % dims.tp == 0:
        return []
    fits = [t for t in range(1, plan.heads + 1) if plan.heads % t == 0 and kv_heads % t == 0]
    return [Conflict(f"sequence_parallel_size={dims.sp} with tensor parallelism (tp={dims.tp}) on attention "
                     f"with {plan.heads} query heads and {kv_heads} key/value heads",
                     f"each tensor-parallel rank must hold whole heads (heads/tp and kv_heads/tp) before the "
                     f"sequence-parallel attention exchanges them, and tp={dims.tp} does not divide both counts",
                     f"use a tensor-parallel size in {fits}, or tensor_parallel size 1 with "
                     f"sequence_parallel_size={dims.sp}")]


def _expert_rules(plan: Plan) -> list[Conflict]:
    """Mixture-of-experts layers split over expert-parallel ranks (``ep_size`` > 1)."""
    split = [p for p in plan.expert_parallel if p > 1]
    if not plan.expert_parallel:
        return []
    dims, out = plan.dims, []
    replicas = dims.dp * dims.sp
    for size in plan.expert_parallel:
        if replicas % size != 0:
            out.append(Conflict(f"a MoE layer with ep_size={size} on {replicas} data-parallel replicas ({dims})",
                                "each expert-parallel group is ep_size replicas, so ep_size must divide their number",
                                f"use an ep_size that divides {replicas}, or launch a multiple of {size} processes"))
    if not split:
        return out
    if dims.tp > 1:
        out.append(Conflict(f"MoE layers with ep_size={split[0]} and tensor parallelism (tp={dims.tp})",
                            "every tensor-parallel rank holds the same tokens, which the all-to-all would send "
                            "tp times (DeepSpeed drops and re-gathers the duplicates around it; deepshard does not)",
                            "use ep_size=1 for the MoE layers (experts replicated), or no tensor parallelism"))
    if plan.pipeline:
        out.append(Conflict(f"MoE layers with ep_size={split[0]} inside a PipelineModule",
                            "the pipeline engine passes one activation tensor between stages, and a MoE layer "
                            "returns (output, l_aux, exp_counts) with l_aux to add to the loss",
                            "train the MoE model without pipeline stages (ZeRO 0-2 with expert parallelism)"))
    if dims.sp > 1:
        out.append(Conflict(f"MoE layers with ep_size={split[0]} and sequence parallelism (sp={dims.sp})",
                            "expert gradients are averaged over data-parallel replicas, while sequence-parallel "
                            "ranks backpropagate one shared loss", "use sequence_parallel_size 1 with MoE"))
    if not plan.caps.expert_parallel:
        out.append(Conflict(f"MoE layers with ep_size={split[0]} and zero_optimization.stage={plan.stage}",
                            "this ZeRO stage does not shard expert parameters over their expert-data-parallel group",
                            "use another ZeRO stage, or ep_size=1"))
    if plan.compressed_optimizer is not None:
        out.append(Conflict(f"optimizer {plan.compressed_optimizer} with MoE layers of ep_size={split[0]}",
                            "its compressed momentum exchange averages every parameter over all data-parallel "
                            "ranks, and experts differ between expert-parallel ranks", "use optimizer type 'Adam'"))
    return out


def _hierarchy_rules(plan: Plan) -> list[Conflict]:
    """MiCS / hybrid sharding and ZeRO++ (``deepshard.zero.hierarchy``): the stage each needs, and the shapes."""
    z = plan.zeropp
    if z is None:
        return []
    out: list[Conflict] = []
    replicas = plan.dims.dp * plan.dims.sp
    if z.hybrid and not plan.caps.partitioned_states:
        out.append(Conflict(f"zero_optimization.mics_shard_size={z.mics_shard_size} with zero_optimization.stage=0",
                            "hybrid sharding partitions the optimizer states (stages 1-2) or everything (stage 3) "
                            "over groups of mics_shard_size ranks; stage 0 partitions nothing",
                            "set zero_optimization.stage to 1, 2 or 3, or remove mics_shard_size"))
    if z.hybrid and replicas % z.mics_shard_size:
        out.append(Conflict(f"zero_optimization.mics_shard_size={z.mics_shard_size} on {replicas} data-parallel ranks "
                            f"({plan.dims})", "the shard groups are blocks of mics_shard_size ranks",
                            f"use a divisor of {replicas}, e.g. the number of ranks per machine"))
    stage3_only = [key for key, on in (("zero_hpz_partition_size", z.hpz_partition_size > 1),
                                       ("zero_quantized_weights", z.quantized_weights),
                                       ("zero_quantized_nontrainable_weights", z.quantized_nontrainable_weights)) if on]
    if stage3_only and not plan.caps.partitioned_parameters:
        out.append(Conflict(f"zero_optimization.{' and '.join(stage3_only)} with zero_optimization.stage={plan.stage}",
                            "they act on ZeRO-3's parameter gathers, and below stage 3 every rank holds the whole "
                            "parameters (DeepSpeed ignores them there without a word)",
                            "set zero_optimization.stage to 3, or remove them"))
    if z.quantized_gradients and not plan.caps.partitioned_states:
        out.append(Conflict("zero_optimization.zero_quantized_gradients with zero_optimization.stage=0",
                            "it quantizes the reduce-scatter of partitioned gradients; stage 0 all-reduces whole ones",
                            "set zero_optimization.stage to 1, 2 or 3"))
    shard = z.mics_shard_size if z.hybrid else replicas
    if z.hpz_partition_size > 1 and z.hybrid:
        out.append(Conflict(f"zero_optimization.zero_hpz_partition_size={z.hpz_partition_size} with "
                            f"mics_shard_size={z.mics_shard_size}", "hybrid sharding already keeps every gather "
                            "inside its shard group: hpZ's secondary shard would copy what the shard holds",
                            "use one of the two (mics_shard_size = ranks per machine gathers inside the machine)"))
    elif z.hpz_partition_size > 1 and shard % z.hpz_partition_size:
        out.append(Conflict(f"zero_optimization.zero_hpz_partition_size={z.hpz_partition_size} on {shard} ranks",
                            "the secondary shards are cut over blocks of zero_hpz_partition_size ranks",
                            f"use a divisor of {shard}, e.g. the number of ranks per machine"))
    if (z.hybrid or z.quantized_gradients) and any(p > 1 for p in plan.expert_parallel):
        out.append(Conflict("MoE layers with ep_size > 1 and mics_shard_size / zero_quantized_gradients",
                            "experts are sharded and reduced over their expert-data-parallel group, which hybrid "
                            "sharding and qgZ's node hierarchy do not split", "use ep_size=1, or plain ZeRO"))
    return out


def _determinism_rules(plan: Plan) -> list[Conflict]:
    if not plan.deterministic:
        return []
    problems = []
    if plan.pipeline:
        problems.append("a pipeline model (each stage adds its micro-batches' gradients in schedule order before "
                        "its one reduction; remove \"deterministic\": the default mode already gives every ZeRO "
                        "stage the same bits at one layout)")
    if plan.compressed_optimizer is not None:
        problems.append(f"optimizer {plan.compressed_optimizer} (its compressed exchange replaces the reduction "
                        "the mode orders; use Adam or AdamW)")
    if plan.grads_on_disk and plan.accumulation > 1:
        problems.append(f"ZeRO-3 gradients in nvme swap files with gradient_accumulation_steps "
                        f"{plan.accumulation} (the sum over micro-batches keeps partial sums in memory; offload "
                        "to cpu, or accumulate 1 step)")
    if any(p > 1 for p in plan.expert_parallel):
        problems.append("MoE layers split over expert-parallel ranks (experts are reduced over their own groups, "
                        "outside the canonical tree; use ep_size=1)")
    if plan.zeropp is not None and (plan.zeropp.hybrid or plan.zeropp.quantized_gradients):
        problems.append("hybrid sharding or zero_quantized_gradients (they replace the reduction the mode orders)")
    if not problems:
        return []
    return [Conflict("\"deterministic\": true cannot be used", "; ".join(problems),
                     "or set \"deterministic\" to false")]


RULES: tuple[Callable[[Plan], list[Conflict]], ...] = (
    _pipeline_rules, _precision_rules, _offload_rules, _compression_rules, _step_in_backward_rules,
    _sequence_rules, _expert_rules, _hierarchy_rules, _determinism_rules)
"""Every rule, in the order conflicts are reported."""
