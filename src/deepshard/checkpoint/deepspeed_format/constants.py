"""The keys and file-name prefixes of DeepSpeed's checkpoint files that deepshard reads and writes
(``deepspeed.checkpoint.constants``): facts of the file format, shared by the reader of Megatron-DeepSpeed
3D folders (:class:`~deepshard.checkpoint.deepspeed_format.megatron_checkpoint.DeepSpeedCheckpoint`) and
the conversion helpers."""
from __future__ import annotations

from deepshard.checkpoint.deepspeed_format.names import (LAYER_FILE_PREFIX, MODEL_FILE_PREFIX, MODEL_FILE_SUFFIX,
                                                         OPTIM_FILE_SUFFIX, ZERO_FILE_PREFIX)

# the optimizer-states file (``*_optim_states.pt``)
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"
PARAM_GROUPS = "param_groups"
GROUP_PADDINGS = "group_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
LOSS_SCALER = "loss_scaler"
DS_VERSION = "ds_version"

# the model-states file (``mp_rank_XX_model_states.pt``)
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
CHECKPOINT_PP_DEGREE = "pp_degree"
CHECKPOINT_TP_DEGREE = "tp_degree"
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
AUTOEP_LAYERS_KEY = "ds_autoep_layers"
AUTOEP_LAYERS_KEY_LEGACY = "autoep_layers"
AUTOEP_EXPERT_KEY_PREFIX = "expert_key_prefix"
AUTOEP_NUM_EXPERTS = "num_experts"
AUTOEP_NUM_LOCAL_EXPERTS = "num_local_experts"
AUTOEP_EP_SIZE = "ep_size"
AUTOEP_ZERO12_REQUIRED_FIELDS = (AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_NUM_EXPERTS, AUTOEP_NUM_LOCAL_EXPERTS,
                                 AUTOEP_EP_SIZE)

# file names: the ZeRO files of a bf16 / fp16 run carry a prefix
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX
FP16_ZERO_FILE_PREFIX = "fp16_" + ZERO_FILE_PREFIX

__all__ = [name for name in dir() if name.isupper()]
__all__ += ["LAYER_FILE_PREFIX", "MODEL_FILE_PREFIX", "MODEL_FILE_SUFFIX", "OPTIM_FILE_SUFFIX", "ZERO_FILE_PREFIX"]
