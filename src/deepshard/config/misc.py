"""Smaller sections: ``activation_checkpointing``, ``flops_profiler``, ``aio``, ``pipeline`` and
``checkpoint``. Keys and defaults follow DeepSpeed v0.19.x."""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import Field, field_validator

from deepshard.config.base import Count, Section


class ActivationCheckpointingConfig(Section):
    """Options of ``deepshard.checkpointing`` (activation recomputation)."""

    section_path: ClassVar[str] = "activation_checkpointing"

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: Optional[int] = Field(None, ge=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class FlopsProfilerConfig(Section):
    """The FLOPs profiler run at ``profile_step``."""

    section_path: ClassVar[str] = "flops_profiler"

    enabled: bool = False
    recompute_fwd_factor: float = Field(0.0, ge=0)
    profile_step: int = Field(1, ge=1)
    module_depth: int = -1
    top_modules: int = Field(1, ge=1)
    detailed: bool = True
    output_file: Optional[str] = None
    peak_tflops: Optional[float] = Field(None, gt=0)
    """deepshard: the device's peak TFLOP/s for the MFU line (default: known GPUs' dense 16-bit peak)."""


class AIOConfig(Section):
    """Asynchronous disk I/O settings for NVMe offload."""

    section_path: ClassVar[str] = "aio"

    block_size: Count = Field(1_048_576, ge=1)
    queue_depth: Count = Field(8, ge=1)
    intra_op_parallelism: Count = Field(1, ge=1)
    thread_count: Count = Field(1, ge=1)
    """Older name of the I/O thread count; accepted alongside intra_op_parallelism."""
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False


class PipelineConfig(Section):
    """Pipeline-engine options (``stages`` is an int or ``"auto"``)."""

    section_path: ClassVar[str] = "pipeline"

    stages: Union[int, Literal["auto"]] = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = Field(0, ge=0)
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool = True
    schedule: str = "1f1b"
    """deepshard: the pipeline engine's schedule (``deepshard.pipe.schedule``): ``1f1b`` (default),
    ``gpipe``, ``zb-h1`` (zero bubble, split backward) or ``interleaved`` (a module built with
    ``num_chunks`` >= 2)."""

    @field_validator("stages", mode="plain")
    @classmethod
    def _stages(cls, value: Any) -> Union[int, str]:
        if value == "auto" and isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        raise ValueError("expected a number of stages >= 1 or \"auto\"")


class ParallelWriteConfig(Section):
    """``checkpoint.parallel_write``."""

    section_path: ClassVar[str] = "checkpoint.parallel_write"

    pipeline_stage: bool = False


_TAG_MODES = {"warn": "Warn", "ignore": "Ignore", "fail": "Fail"}


class CheckpointConfig(Section):
    """``checkpoint``: tag validation across ranks, universal-checkpoint loading, writers."""

    section_path: ClassVar[str] = "checkpoint"

    tag_validation: Literal["Warn", "Ignore", "Fail"] = "Warn"
    """Case-insensitive on input; stored as ``Warn`` / ``Ignore`` / ``Fail``."""
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    serialization: bool = True
    writer: Optional[dict[str, Any]] = None
    """DeepSpeed's fast-checkpoint writer options; accepted, not used by deepshard."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _tag_case(cls, value: Any) -> Any:
        if isinstance(value, str):
            return _TAG_MODES.get(value.lower(), value)
        return value
