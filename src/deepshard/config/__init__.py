"""deepshard's config: DeepSpeed's JSON schema as strict pydantic models.

``load_config(source, dp_world_size)`` reads a dict, a JSON file or base64 JSON and returns a
:class:`DeepShardConfig` with the batch sizes resolved; every problem raises :class:`ConfigError`
naming the key path, the value and the fix (unknown keys get the closest valid key).
"""
from deepshard.config.args import add_config_arguments, resolve_config_source
from deepshard.config.base import ConfigError, dtype_from_name
from deepshard.config.batch import resolve_batch_sizes
from deepshard.config.loader import load_config
from deepshard.config.misc import (ActivationCheckpointingConfig, AIOConfig, CheckpointConfig,
                                   FlopsProfilerConfig, PipelineConfig)
from deepshard.config.monitor import (CometConfig, CommsLoggerConfig, CSVConfig, TensorBoardConfig,
                                      WandbConfig)
from deepshard.config.optimizer import OptimizerConfig, SchedulerConfig
from deepshard.config.precision import (AMPConfig, BF16Config, DataTypesConfig, FP16Config,
                                        TorchAutocastConfig)
from deepshard.config.root import DeepShardConfig
from deepshard.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "ConfigError", "DeepShardConfig", "load_config", "resolve_config_source", "add_config_arguments",
    "dtype_from_name", "resolve_batch_sizes",
    "OptimizerConfig", "SchedulerConfig", "FP16Config", "BF16Config", "AMPConfig", "TorchAutocastConfig",
    "DataTypesConfig", "ZeroConfig", "OffloadParamConfig", "OffloadOptimizerConfig",
    "TensorBoardConfig", "CSVConfig", "WandbConfig", "CometConfig", "CommsLoggerConfig",
    "ActivationCheckpointingConfig", "FlopsProfilerConfig", "AIOConfig", "PipelineConfig",
    "CheckpointConfig",
]
