"""The root model: :class:`DeepShardConfig`, one field per top-level key of DeepSpeed's JSON config.

Validate it through :func:`deepshard.config.load_config` (which reads files and base64, and turns
pydantic's errors into :class:`ConfigError`). Validating it directly works too:
``DeepShardConfig.model_validate(d, context={"dp_world_size": 2})`` (dp defaults to 1, as in
DeepSpeed before ``torch.distributed`` is initialised).

After validation the batch keys are resolved (always ints), ``zero_optimization.overlap_comm`` is
resolved, ``raw`` holds a deep copy of the input, and unimplemented-but-enabled features have been
warned about.
"""
from __future__ import annotations

import copy
import math
from typing import Any, ClassVar, Literal, Optional

import torch
from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from deepshard.config.base import AUTO, ConfigError, DtypeName, ScalarFlag, Section, exact_error
from deepshard.config.batch import BATCH_KEYS, resolve_batch_sizes
from deepshard.config.inert import check_inert
from deepshard.config.loose_sections import check_loose_sections
from deepshard.config.misc import (ActivationCheckpointingConfig, AIOConfig, CheckpointConfig,
                                   FlopsProfilerConfig, PipelineConfig)
from deepshard.config.monitor import (CometConfig, CommsLoggerConfig, CSVConfig, TensorBoardConfig,
                                      WandbConfig)
from deepshard.config.optimizer import OptimizerConfig, SchedulerConfig
from deepshard.config.precision import (AMPConfig, BF16Config, DataTypesConfig, FP16Config,
                                        TorchAutocastConfig)
from deepshard.config.sequence import SequenceParallelConfig, check_sequence_parallel
from deepshard.config.tolerated import drop_tolerated_keys
from deepshard.config.unimplemented import UNIMPLEMENTED_KEYS, warn_unimplemented
from deepshard.config.zero import ZeroConfig
from deepshard.utils.logging import logger


class DeepShardConfig(Section):
    """A validated DeepSpeed-schema config. Every section forbids unknown keys."""

    section_path: ClassVar[str] = ""

    # batch (resolved to ints after validation; None only while validating)
    train_batch_size: Optional[int] = None
    train_micro_batch_size_per_gpu: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None
    managed_gradient_accumulation: bool = True
    """False: the caller owns the accumulation boundary and every ``step()`` applies an update."""
    deterministic: bool = False
    """deepshard's own key: the same bits for any data-parallel size x accumulation split of one global
    batch, and across resumes on another process count (``docs/determinism.md``)."""

    # optimisation
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    gradient_clipping: float = Field(1.0, ge=0, allow_inf_nan=False)
    """Max global gradient norm; 0 disables clipping (default 1.0 as in DeepSpeed >= 0.19.3)."""
    zero_allow_untested_optimizer: ScalarFlag = False
    """Accepted for DeepSpeed compatibility; deepshard accepts any optimizer with any stage."""
    zero_force_ds_cpu_optimizer: ScalarFlag = True

    # precision
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config, alias="bfloat16")
    amp: AMPConfig = Field(default_factory=AMPConfig)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)

    # ZeRO and communication
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    communication_data_type: Optional[DtypeName] = None
    gradient_predivide_factor: float = Field(1.0, gt=0, allow_inf_nan=False)
    prescale_gradients: bool = False
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    sparse_gradients: bool = False

    # logging, data
    steps_per_print: Optional[int] = Field(None, ge=1)
    """Log every N steps; None (or Infinity, as Accelerate writes) never."""
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    dump_state: bool = False
    dataloader_drop_last: bool = False

    # monitors
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)

    # other modelled sections
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    aio: AIOConfig = Field(default_factory=AIOConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tensor_parallel: Any = None
    """Automatic TP, read by ``deepshard.tp.autotp_config.parse_tp_config`` (None = not given)."""
    sequence_parallel_size: Any = 1
    """Ranks that split one sample's sequence (``deepshard.sp``); the data-parallel size is what is left."""
    sequence_parallel: SequenceParallelConfig = Field(default_factory=SequenceParallelConfig)
    """deepshard: how the sequence-parallel ranks attend (ulysses, ring, hybrid)."""
    use_data_before_expert_parallelism: bool = False
    """MoE layers: expert-data-parallel groups of consecutive ranks and expert-parallel groups strided
    (DeepSpeed's key; default: the reverse, ``topology.ParallelDims.expert_group_ranks``)."""

    # accepted as given, not implemented (see unimplemented.py); None = not given
    autotuning: Any = None
    elasticity: Any = None
    compile: Any = None
    expert_parallel: Any = None
    hybrid_engine: Any = None
    compression_training: Any = None
    data_efficiency: Any = None
    curriculum_learning: Any = None
    eigenvalue: Any = None
    progressive_layer_drop: Any = None
    sparse_attention: Any = None
    nebula: Any = None
    datastates: Any = None
    weight_quantization: Any = None
    quantize_training: Any = None
    timers: Any = None
    zenflow: Any = None
    trackio: Any = None
    log_level: Any = None
    disable_allgather: Any = None
    graph_harvesting: Any = None
    seq_parallel_comm_data_type: Any = None
    vocabulary_size: Any = None

    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    # ------------------------------------------------------------------ input preparation
    @classmethod
    def prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        data = drop_tolerated_keys(data, known)
        zero = data.get("zero_optimization")
        if isinstance(zero, bool):
            logger.warning("\"zero_optimization\": %s is a deprecated form; use "
                           "\"zero_optimization\": {\"stage\": %d}", str(zero).lower(), int(zero))
            data["zero_optimization"] = {"stage": int(zero)}
        spp = data.get("steps_per_print")
        if isinstance(spp, float) and math.isinf(spp) and spp > 0:
            data["steps_per_print"] = None  # Accelerate writes float("inf"): never print
        return data

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _lower_op(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.lower()
            if value not in ("mean", "sum"):
                raise ValueError(f"Invalid gradient_allreduce_op {value!r}: use 'mean' (average the gradients "
                                 "over data-parallel ranks) or 'sum'")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _load(cls, data: Any, handler: Any, info: ValidationInfo) -> "DeepShardConfig":
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise exact_error(f"the config must be a JSON object (a dict of sections), got "
                              f"{type(data).__name__}")
        raw = copy.deepcopy(data)
        model = handler(copy.deepcopy(data))
        model._raw = raw
        dp = int((info.context or {}).get("dp_world_size", 1))
        auto_keys = [key for key in BATCH_KEYS if isinstance(raw.get(key), str) and raw[key] == AUTO]
        try:
            model._resolve_batch(dp, auto_keys)
            model._check_sections()
            check_inert(model)
        except ConfigError as exc:
            raise exact_error(str(exc)) from None
        warn_unimplemented({key: getattr(model, key) for key in UNIMPLEMENTED_KEYS})
        return model

    def _resolve_batch(self, dp: int, auto_keys: list[str]) -> None:
        tbs, micro, gas = resolve_batch_sizes(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                              self.gradient_accumulation_steps, dp, auto_keys)
        if auto_keys:
            logger.debug("batch keys %s were 'auto'; derived train_batch_size=%d, "
                         "train_micro_batch_size_per_gpu=%d, gradient_accumulation_steps=%d (dp=%d)",
                         auto_keys, tbs, micro, gas, dp)
        self.train_batch_size = tbs
        self.train_micro_batch_size_per_gpu = micro
        self.gradient_accumulation_steps = gas
        for key in BATCH_KEYS:
            if key in self._raw and self._raw[key] is None:
                logger.warning("%s is null, which is read as not given: it was derived as %d (train_batch_size "
                               "= train_micro_batch_size_per_gpu * gradient_accumulation_steps * data-parallel "
                               "size %d); give a number or leave the key out", key, getattr(self, key), dp)

    def _check_sections(self) -> None:
        self.sequence_parallel_size = check_sequence_parallel(self.sequence_parallel_size, self.sequence_parallel)
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("fp16.enabled and bf16.enabled are both true; enable one of them "
                              "(bf16 needs no loss scaling and is the recommended choice where supported)")
        if self.bf16.bf16_optimizer_states and not self.bf16.bf16_master_weights_and_grads:
            raise ConfigError("bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads: true")
        check_loose_sections(self)

    # ------------------------------------------------------------------ convenience
    @property
    def raw(self) -> dict[str, Any]:
        """A deep copy of the config as the user gave it (``"auto"`` values included)."""
        return self._raw

    @property
    def param_dtype(self) -> Optional[str]:
        """``data_types.param_dtype`` (DeepSpeed's flat name)."""
        return self.data_types.param_dtype

    @property
    def buffer_dtype(self) -> Optional[str]:
        """``data_types.buffer_dtype`` (DeepSpeed's flat name)."""
        return self.data_types.buffer_dtype

    @property
    def fp16_enabled(self) -> bool:
        return self.fp16.enabled

    @property
    def bf16_enabled(self) -> bool:
        return self.bf16.enabled

    @property
    def zero_stage(self) -> int:
        return int(self.zero_optimization.stage)

    @property
    def zero_enabled(self) -> bool:
        return self.zero_stage > 0

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the model's parameters are trained in: fp16, bf16 or fp32."""
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32
