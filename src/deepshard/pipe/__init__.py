"""Pipeline parallelism (DeepSpeed's ``deepspeed.pipe``): ``PipelineModule`` and its layer specs, schedules
as data (``schedule``), their simulator (``simulate``) and the ``PipelineEngine`` that
``deepshard.initialize`` returns for a ``PipelineModule``."""
from __future__ import annotations

from deepshard.pipe.grid import (PipeDataParallelTopology, PipelineParallelGrid, PipeModelDataParallelTopology,
                                 ProcessTopology)
from deepshard.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from deepshard.pipe.partition import PartitionError
from deepshard.pipe.schedule import Action, Kind, ScheduleError, build_schedule

__all__ = ["Action", "Kind", "LayerSpec", "PartitionError", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
           "PipelineModule", "PipelineParallelGrid", "ProcessTopology", "ScheduleError", "TiedLayerSpec",
           "build_schedule"]
