"""The ``zero_optimization`` section and its ``offload_param`` / ``offload_optimizer`` parts.

Keys, defaults and alias spellings follow DeepSpeed's ``DeepSpeedZeroConfig`` (v0.19.x): the
stage-3 settings are fields named without the ``stage3_`` prefix (``prefetch_bucket_size``) that
also accept the prefixed spelling (``stage3_prefetch_bucket_size``), which is what most configs use;
read-only ``stage3_*`` properties return the same values, so either name works in code too.

Deprecated keys are accepted with a warning: ``cpu_offload: true`` becomes
``offload_optimizer: {device: cpu}``, ``cpu_offload_param: true`` becomes ``offload_param:
{device: cpu}``, and ``stage3_gather_fp16_weights_on_model_save`` sets
``gather_16bit_weights_on_model_save``.
"""
from __future__ import annotations

import sys
from typing import Any, ClassVar, Literal, Optional

from pydantic import Field, PrivateAttr, model_validator

from deepshard.config.base import Count, Section, exact_error
from deepshard.utils.logging import logger

OffloadDevice = Literal["none", "cpu", "nvme"]

# ZenFlow / legacy stage 1, which deepshard does not implement: key -> value meaning "off".
ZERO_UNIMPLEMENTED: dict[str, Any] = {
    "zenflow": None,
    "legacy_stage1": False,
}


def _require_nvme_path(section: str, device: str, nvme_path: Optional[str]) -> None:
    if device == "nvme" and not nvme_path:
        raise exact_error(
            f"zero_optimization.{section}.device is 'nvme' but zero_optimization.{section}.nvme_path "
            "is not set; give the directory to swap to, e.g. \"nvme_path\": \"/local_nvme\"")


class OffloadParamConfig(Section):
    """Where ZeRO-3 keeps parameter shards between uses: GPU (``none``), CPU memory or disk."""

    section_path: ClassVar[str] = "zero_optimization.offload_param"

    device: OffloadDevice = "none"
    nvme_path: Optional[str] = None
    buffer_count: Count = Field(5, ge=0)
    buffer_size: Count = Field(100_000_000, ge=0)
    max_in_cpu: Count = Field(1_000_000_000, ge=0)
    pin_memory: bool = True

    @model_validator(mode="after")
    def _check_nvme(self) -> "OffloadParamConfig":
        _require_nvme_path("offload_param", self.device, self.nvme_path)
        return self


class OffloadOptimizerConfig(Section):
    """Where optimizer states live and the optimizer step runs (ZeRO-Offload / ZeRO-Infinity)."""

    section_path: ClassVar[str] = "zero_optimization.offload_optimizer"

    device: OffloadDevice = "none"
    nvme_path: Optional[str] = None
    buffer_count: Count = Field(4, ge=0)
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of optimizer states offloaded; below 1.0 only with ZeRO stage 3."""
    super_offload: bool = False
    convert_grad_on_cpu: bool = True
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _check_nvme(self) -> "OffloadOptimizerConfig":
        _require_nvme_path("offload_optimizer", self.device, self.nvme_path)
        return self

    @property
    def pipeline(self) -> bool:
        """True when NVMe reads or writes are overlapped with the optimizer step."""
        return self.pipeline_read or self.pipeline_write


DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
"""Hugging Face mixture-of-experts blocks that are ZeRO-3 leaves by default (as in DeepSpeed 0.19.8)."""
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


class LeafModuleConfig(Section):
    """Modules ZeRO-3 gathers as a whole instead of hooking their children (MoE blocks): by class (plain or
    fully qualified name), by module name, or by name suffix. A single string counts as a one-item list;
    repeats are dropped."""

    section_path: ClassVar[str] = "zero_optimization.leaf_module"

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    name_suffixes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))

    @classmethod
    def prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        for key in ("classes", "names", "name_suffixes"):
            if isinstance(data.get(key), str):
                data[key] = [data[key]]
        return data

    @model_validator(mode="after")
    def _drop_repeats(self) -> "LeafModuleConfig":
        for key in ("classes", "names", "name_suffixes"):
            object.__setattr__(self, key, list(dict.fromkeys(getattr(self, key))))
        return self


class ZeroConfig(Section):
    """ZeRO (Rajbhandari et al., 2020): stage 1 shards optimizer states, 2 also gradients, 3 also
    parameters; 0 is plain data parallelism."""

    section_path: ClassVar[str] = "zero_optimization"

    stage: int = Field(0, ge=0, le=3)
    contiguous_gradients: bool = True
    overlap_comm: Optional[bool] = None
    """None resolves to True for stage 3 and False otherwise (``overlap_comm_given`` tells the two apart:
    stage 0 picks its schedule by backend when the config leaves it out)."""
    reduce_scatter: bool = True
    reduce_bucket_size: Count = Field(500_000_000, ge=0)
    allgather_partitions: bool = True
    allgather_bucket_size: Count = Field(500_000_000, ge=0)
    use_multi_rank_bucket_allreduce: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: Optional[OffloadParamConfig] = None
    _overlap_comm_given: bool = PrivateAttr(default=True)
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    sub_group_size: Count = Field(1_000_000_000, ge=0)
    round_robin_gradients: bool = False
    ignore_unused_parameters: bool = True

    # stage 3 (DeepSpeed's field names; the stage3_* spellings are the aliases)
    prefetch_bucket_size: Optional[Count] = Field(None, ge=0, alias="stage3_prefetch_bucket_size")
    """Elements gathered ahead of use. None (left out or "auto"): the largest parameter group's size,
    at most DeepSpeed's 5e7, i.e. one module ahead (FSDP2's choice); a smaller window costs stalls, a
    larger one memory."""
    param_persistence_threshold: Count = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: Count = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold")
    max_live_parameters: Count = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: Count = Field(0, ge=0, alias="stage3_max_reuse_distance")
    """Keep a group gathered at the forward/backward turn when its reuse is fewer elements away (and
    closer than the prefetch window). Default 0, keep nothing (DeepSpeed: 1e9), so that stage 3 moves
    exactly 3Ψ per step; any setting saves at most one prefetch window of gathers."""
    optimizer_step_in_backward: bool = False
    """deepshard's own key (stage 3): update each group's shard as soon as its gradient is reduced,
    during backward, and keep no gradient shard: 12Ψ/N instead of 16Ψ/N with fp32 Adam. Needs
    gradient_accumulation_steps 1, gradient_clipping 0, no fp16 loss scaling and no offload (each of
    those needs every gradient before the first update)."""
    min_gather_size: Count = Field(6_553_600, ge=0, alias="stage3_min_gather_size")
    """deepshard's own key (stage 3): a module whose subtree holds at most this many parameter elements is
    gathered and reduced as one group, as FSDP2 does a ``fully_shard`` unit (``zero/stage3/units.py``): fewer,
    larger collectives on models of many small layers. Default 6,553,600 (DDP's 25 MB bucket of fp32
    values), which adds at most that much to the gathered parameters; 0: one group per module. Left out
    with ZeRO++'s quantized weights or gradients: 0 (``gather_unit_size``)."""
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: Count = Field(0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    partition_stream_chunk_size: Count = Field(0, ge=0, alias="stage3_partition_stream_chunk_size")

    # ZeRO++ and MiCS / hybrid sharding (deepshard.zero.hierarchy; what combines is the plan check's)
    zero_hpz_partition_size: Count = Field(1, ge=0)
    """hpZ: ranks per secondary parameter shard (ZeRO-3): backward's gathers stay inside such a block (the
    ranks of one machine). 0 and 1: off."""
    zero_quantized_weights: bool = False
    """qwZ: ZeRO-3 parameter gathers send 8-bit blocks."""
    zero_quantized_nontrainable_weights: bool = False
    """Frozen parameters' gathers send 8-bit blocks too (ZeRO-3)."""
    zero_quantized_gradients: bool = False
    """qgZ: gradients are reduce-scattered as 4-bit blocks by two all-to-alls, inside machines then across."""
    zeropp_loco_param: Optional[dict[str, Any]] = None
    """LoCo-ZeRO++ error feedback: removed from DeepSpeed (0.19.8 rejects the key) and not implemented."""
    mics_shard_size: int = -1
    """MiCS / hybrid sharding: shard over groups of this many ranks, replicate across the groups (-1, 0: off)."""
    mics_hierarchical_params_gather: bool = False
    """MiCS: a shard group spanning machines gathers across them first, then inside each."""

    # other
    memory_efficient_linear: bool = True
    override_module_apply: bool = True
    pipeline_loading_checkpoint: bool = False
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    zenflow: Optional[dict[str, Any]] = None
    legacy_stage1: bool = False

    # deprecated (accepted, mapped onto their replacements in prepare())
    cpu_offload: Optional[bool] = None
    cpu_offload_param: Optional[bool] = None
    cpu_offload_use_pin_memory: Optional[bool] = None
    stage3_gather_fp16_weights_on_model_save: bool = False

    @classmethod
    def prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        _map_deprecated_offload(data, "cpu_offload", "offload_optimizer")
        _map_deprecated_offload(data, "cpu_offload_param", "offload_param")
        if "cpu_offload_use_pin_memory" in data:
            logger.warning("zero_optimization.cpu_offload_use_pin_memory is deprecated and has no "
                           "effect; set pin_memory in offload_param / offload_optimizer instead")
        _map_deprecated_gather(data)
        return data

    @property
    def overlap_comm_given(self) -> bool:
        """True when the config set ``overlap_comm`` (False when it was left to its default)."""
        return self._overlap_comm_given

    @model_validator(mode="after")
    def _resolve(self) -> "ZeroConfig":
        if self.overlap_comm is None:
            self._overlap_comm_given = False
            self.overlap_comm = self.stage == 3
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1.0 and self.stage != 3:
            raise exact_error(
                f"zero_optimization.offload_optimizer.ratio ({self.offload_optimizer.ratio}) below 1.0 "
                f"(partial offload) needs zero_optimization.stage 3, got stage {self.stage}")
        if self.offload_param_device != "none" and self.stage != 3:
            logger.warning("zero_optimization.offload_param is only used by ZeRO stage 3; it is "
                           "ignored at stage %d", self.stage)
        if self.stage == 3 and self.elastic_checkpoint:
            logger.warning("zero_optimization.elastic_checkpoint at stage 3: elastic checkpointing is deprecated "
                           "(DeepSpeed no longer supports it at ZeRO-3) and has no effect: deepshard checkpoints "
                           "load on any data-parallel size; drop the key")
        self._warn_unimplemented()
        if self.zeropp_loco_param is not None:
            raise exact_error(
                "zero_optimization.zeropp_loco_param (LoCo-ZeRO++ error feedback for quantized gradients) is not "
                "implemented: DeepSpeed 0.19.8 removed it too and rejects the key. Remove it; "
                "zero_quantized_gradients works without it")
        return self

    def _warn_unimplemented(self) -> None:
        for key, off_value in ZERO_UNIMPLEMENTED.items():
            if getattr(self, key) != off_value:
                logger.warning("zero_optimization.%s is not implemented by deepshard and is ignored", key)

    # convenience ---------------------------------------------------------------------------
    @property
    def gather_unit_size(self) -> int:
        """``stage3_min_gather_size`` as stage 3 applies it: as given when the config sets it; left out, 0
        (one group per module) under ZeRO++'s quantized weights or gradients, whose blocks would then span
        parameters of different scales (a LayerNorm's weights beside a Linear's) and lose precision; else
        the default."""
        quantized = self.zero_quantized_weights or self.zero_quantized_nontrainable_weights or \
            self.zero_quantized_gradients
        if quantized and "min_gather_size" not in self.model_fields_set:
            return 0
        return int(self.min_gather_size)

    @property
    def offload_optimizer_device(self) -> str:
        """``"none"``, ``"cpu"`` or ``"nvme"`` (``"none"`` when the section is absent)."""
        return self.offload_optimizer.device if self.offload_optimizer is not None else "none"

    @property
    def offload_param_device(self) -> str:
        """``"none"``, ``"cpu"`` or ``"nvme"`` (``"none"`` when the section is absent)."""
        return self.offload_param.device if self.offload_param is not None else "none"

    @property
    def stage3_prefetch_bucket_size(self) -> Optional[int]:
        return self.prefetch_bucket_size

    @property
    def stage3_param_persistence_threshold(self) -> int:
        return self.param_persistence_threshold

    @property
    def stage3_model_persistence_threshold(self) -> int:
        return self.model_persistence_threshold

    @property
    def stage3_max_live_parameters(self) -> int:
        return self.max_live_parameters

    @property
    def stage3_max_reuse_distance(self) -> int:
        return self.max_reuse_distance

    @property
    def stage3_gather_16bit_weights_on_model_save(self) -> bool:
        return self.gather_16bit_weights_on_model_save

    @property
    def stage3_module_granularity_threshold(self) -> int:
        return self.module_granularity_threshold

    @property
    def stage3_use_all_reduce_for_fetch_params(self) -> bool:
        return self.use_all_reduce_for_fetch_params

    @property
    def stage3_allgather_sequential(self) -> bool:
        return self.allgather_sequential

    @property
    def stage3_partition_stream_chunk_size(self) -> int:
        return self.partition_stream_chunk_size


def _map_deprecated_offload(data: dict[str, Any], old: str, new: str) -> None:
    """``cpu_offload: true`` -> ``offload_optimizer: {device: cpu}`` (same for the param variant)."""
    if old not in data:
        return
    logger.warning("zero_optimization.%s is deprecated; use \"%s\": {\"device\": \"cpu\"} instead", old, new)
    if data[old] is True:
        if data.get(new) is not None:
            raise exact_error(f"zero_optimization.{old} (deprecated) and zero_optimization.{new} are both "
                              f"set; remove {old} and keep {new}")
        data[new] = {"device": "cpu"}


def _map_deprecated_gather(data: dict[str, Any]) -> None:
    old, new = "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"
    if old not in data:
        return
    logger.warning("zero_optimization.%s is deprecated; use %s instead", old, new)
    given = [data[k] for k in (new, "gather_16bit_weights_on_model_save") if k in data]
    if given and given[0] != data[old]:
        raise exact_error(f"zero_optimization.{old} (deprecated) = {data[old]!r} contradicts "
                          f"zero_optimization.{new} = {given[0]!r}; remove {old}")
    if not given:
        data[new] = data[old]
