"""``deepspeed.runtime.constants``: the config's top-level key names and their defaults under DeepSpeed's
constant names. The defaults are read from deepshard's config models (:mod:`deepshard.config`), so they are
the values deepshard actually uses (they match DeepSpeed 0.19.8's: ``gradient_clipping`` 1.0, ...)."""
from __future__ import annotations

from typing import Any

from deepshard.config.root import DeepShardConfig


def _default(field: str) -> Any:
    return DeepShardConfig.model_fields[field].get_default(call_default_factory=True)


TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_BATCH_SIZE_DEFAULT = _default(TRAIN_BATCH_SIZE)
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT = _default(TRAIN_MICRO_BATCH_SIZE_PER_GPU)
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
GRADIENT_ACCUMULATION_STEPS_DEFAULT = _default(GRADIENT_ACCUMULATION_STEPS)
MANAGED_GRADIENT_ACCUMULATION = "managed_gradient_accumulation"
MANAGED_GRADIENT_ACCUMULATION_DEFAULT = _default(MANAGED_GRADIENT_ACCUMULATION)

OPTIMIZER = "optimizer"
OPTIMIZER_TYPE_DEFAULT = None
OPTIMIZER_PARAMS = "params"
TYPE = "type"
LEGACY_FUSION = "legacy_fusion"
LEGACY_FUSION_DEFAULT = False
SCHEDULER = "scheduler"
SCHEDULER_TYPE_DEFAULT = None
SCHEDULER_PARAMS = "params"
MAX_GRAD_NORM = "max_grad_norm"

GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = _default(GRADIENT_CLIPPING)
ZERO_ALLOW_UNTESTED_OPTIMIZER = "zero_allow_untested_optimizer"
ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT = _default(ZERO_ALLOW_UNTESTED_OPTIMIZER)
ZERO_FORCE_DS_CPU_OPTIMIZER = "zero_force_ds_cpu_optimizer"
ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT = _default(ZERO_FORCE_DS_CPU_OPTIMIZER)

COMMUNICATION_DATA_TYPE = "communication_data_type"
COMMUNICATION_DATA_TYPE_DEFAULT = _default(COMMUNICATION_DATA_TYPE)
PRESCALE_GRADIENTS = "prescale_gradients"
PRESCALE_GRADIENTS_DEFAULT = _default(PRESCALE_GRADIENTS)
GRADIENT_PREDIVIDE_FACTOR = "gradient_predivide_factor"
GRADIENT_PREDIVIDE_FACTOR_DEFAULT = _default(GRADIENT_PREDIVIDE_FACTOR)
GRADIENT_ALLREDUCE_OP = "gradient_allreduce_op"
GRADIENT_ALLREDUCE_OP_DEFAULT = _default(GRADIENT_ALLREDUCE_OP)
SPARSE_GRADIENTS = "sparse_gradients"
SPARSE_GRADIENTS_DEFAULT = _default(SPARSE_GRADIENTS)

STEPS_PER_PRINT = "steps_per_print"
STEPS_PER_PRINT_DEFAULT = _default(STEPS_PER_PRINT)
WALL_CLOCK_BREAKDOWN = "wall_clock_breakdown"
WALL_CLOCK_BREAKDOWN_DEFAULT = _default(WALL_CLOCK_BREAKDOWN)
MEMORY_BREAKDOWN = "memory_breakdown"
MEMORY_BREAKDOWN_DEFAULT = _default(MEMORY_BREAKDOWN)
DUMP_STATE = "dump_state"
DUMP_STATE_DEFAULT = _default(DUMP_STATE)
LOG_LEVEL = "log_level"
LOG_LEVEL_DEFAULT = _default(LOG_LEVEL)
"""None: the engine keeps the logger's level unless the config names one."""
DATALOADER_DROP_LAST = "dataloader_drop_last"
DATALOADER_DROP_LAST_DEFAULT = _default(DATALOADER_DROP_LAST)

FP16 = "fp16"
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"
AMP = "amp"
TORCH_AUTOCAST = "torch_autocast"
ZERO_OPTIMIZATION = "zero_optimization"
ACTIVATION_CHECKPOINTING = "activation_checkpointing"
PIPELINE = "pipeline"
CHECKPOINT = "checkpoint"
SEQUENCE_PARALLEL_SIZE = "sequence_parallel_size"
SEQUENCE_PARALLEL_SIZE_DEFAULT = _default(SEQUENCE_PARALLEL_SIZE)
TENSOR_PARALLEL = "tensor_parallel"

# checkpoint section values
CHECKPOINT_TAG_VALIDATION = "tag_validation"
CHECKPOINT_TAG_VALIDATION_DEFAULT = "Warn"
CHECKPOINT_TAG_VALIDATION_MODES = ["Warn", "Ignore", "Fail"]
LOAD_UNIVERSAL_CHECKPOINT = "load_universal"
LOAD_UNIVERSAL_CHECKPOINT_DEFAULT = False
USE_NODE_LOCAL_STORAGE_CHECKPOINT = "use_node_local_storage"
USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT = False

# pipeline engine
PIPE_REPLICATED = "ds_pipe_replicated"
DATA_PARALLEL_GROUP = "data_parallel_group"
GLOBAL_RANK = "global_rank"
