"""Monitoring sections: ``tensorboard``, ``csv_monitor``, ``wandb``, ``comet`` and ``comms_logger``."""
from __future__ import annotations

from typing import ClassVar, Optional

from pydantic import Field

from deepshard.config.base import Section


class TensorBoardConfig(Section):
    """Scalars to TensorBoard event files under ``output_path/job_name``."""

    section_path: ClassVar[str] = "tensorboard"

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CSVConfig(Section):
    """Scalars to CSV files under ``output_path/job_name``."""

    section_path: ClassVar[str] = "csv_monitor"

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(Section):
    """Scalars to Weights & Biases."""

    section_path: ClassVar[str] = "wandb"

    enabled: bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


class CometConfig(Section):
    """Comet ML: the keys DeepSpeed accepts (unset values fall back to Comet's own configuration)."""

    section_path: ClassVar[str] = "comet"

    enabled: bool = False
    samples_log_interval: int = Field(100, ge=1)
    project: Optional[str] = None
    workspace: Optional[str] = None
    api_key: Optional[str] = None
    experiment_name: Optional[str] = None
    experiment_key: Optional[str] = None
    online: Optional[bool] = None
    mode: Optional[str] = None


class CommsLoggerConfig(Section):
    """Per-collective counts, bytes and latency (``prof_all`` or only the ops in ``prof_ops``)."""

    section_path: ClassVar[str] = "comms_logger"

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = Field(default_factory=list)
    debug: bool = False
