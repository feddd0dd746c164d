"""Training monitors in DeepSpeed's layout: TensorBoard, CSV files, Weights & Biases."""
from deepshard.monitor.base import (
    DEFAULT_JOB_NAME,
    ELAPSED_BACKWARD,
    ELAPSED_BACKWARD_ALLREDUCE,
    ELAPSED_BACKWARD_INNER,
    ELAPSED_FORWARD,
    ELAPSED_STEP,
    LOSS_SCALE,
    LR,
    TRAIN_LOSS,
    Monitor,
    log_dir,
)
from deepshard.monitor.csv_monitor import CSVMonitor
from deepshard.monitor.monitor import MonitorMaster
from deepshard.monitor.tensorboard import TensorBoardMonitor
from deepshard.monitor.wandb import WandbMonitor

__all__ = [
    "Monitor", "CSVMonitor", "TensorBoardMonitor", "WandbMonitor", "MonitorMaster", "log_dir",
    "DEFAULT_JOB_NAME", "TRAIN_LOSS", "LR", "LOSS_SCALE", "ELAPSED_FORWARD", "ELAPSED_BACKWARD",
    "ELAPSED_BACKWARD_INNER", "ELAPSED_BACKWARD_ALLREDUCE", "ELAPSED_STEP",
]
