"""The ``autotuning`` config section (DeepSpeed's names; deepshard's additions marked), read once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METRICS = ("throughput", "latency")


@dataclass(frozen=True)
class AutotuningSettings:
    """What the search covers and how each trial is measured."""

    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    metric: str = "throughput"
    start_profile_step: int = 3
    end_profile_step: int = 5
    min_train_micro_batch_size_per_gpu: int = 1
    max_train_micro_batch_size_per_gpu: int = 1024
    num_tuning_micro_batch_sizes: int = 3
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """deepshard: the ZeRO stages to try (DeepSpeed tries 0-3)."""
    trial_timeout: float = 600.0
    """deepshard: seconds after which a trial is stopped and recorded as failed (a hang)."""
    memory_per_process_mb: float | None = None
    """deepshard: the memory a process may use, for pruning (default: the device's, or the host's RAM
    shared by the processes)."""
    repeats: int = 3
    """deepshard: runs of each leading experiment; the metric is the median of its runs (one noisy
    window cannot win), their spread is reported. 1: every experiment runs once, as DeepSpeed does."""
    leaders: int = 3
    """deepshard: how many of the best experiments (by the median so far) are repeated, after each phase."""
    bucket_sizes: tuple[int, ...] = (5_000_000, 50_000_000, 500_000_000)
    """deepshard: gradient-reduction / all-gather bucket sizes (elements) tried on the best stage and micro
    batch, in a second phase; [] skips them. 5e8 is the config's default."""
    offload_devices: tuple[str, ...] | None = None
    """deepshard: optimizer (and, at stage 3, parameter) offload devices tried on the best experiment of
    stage >= 1, besides none. Default: ["cpu"] with a GPU, [] on a CPU-only machine (where offloading to
    "cpu" moves nothing); "nvme" needs the config's nvme_path."""

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> "AutotuningSettings":
        section = raw.get("autotuning") or {}
        if not isinstance(section, dict):
            raise ValueError(f"autotuning = {section!r} must be an object, e.g. {{\"enabled\": true}}")
        known = set(cls.__dataclass_fields__) | {"enabled", "fast", "tuner_type", "tuner_num_trials", "overwrite",
                                                 "arg_mappings", "tuner_early_stopping", "metric_path", "mp_size",
                                                 "model_info", "model_info_path", "max_train_batch_size",
                                                 "min_train_batch_size"}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"autotuning: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        kwargs = {k: v for k, v in section.items() if k in cls.__dataclass_fields__}
        if "zero_stages" in kwargs:
            kwargs["zero_stages"] = tuple(int(s) for s in kwargs["zero_stages"])
        if "bucket_sizes" in kwargs:
            kwargs["bucket_sizes"] = tuple(int(float(b)) for b in kwargs["bucket_sizes"])
        if kwargs.get("offload_devices") is not None:
            kwargs["offload_devices"] = tuple(str(d) for d in kwargs["offload_devices"])
        settings = cls(**kwargs)
        settings.check()
        return settings

    def check(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"autotuning.metric = {self.metric!r}: expected one of {', '.join(METRICS)}")
        if not 1 <= self.start_profile_step < self.end_profile_step:
            raise ValueError(f"autotuning.start_profile_step ({self.start_profile_step}) must be >= 1 and below "
                             f"end_profile_step ({self.end_profile_step})")
        if not 1 <= self.min_train_micro_batch_size_per_gpu <= self.max_train_micro_batch_size_per_gpu:
            raise ValueError("autotuning.min_train_micro_batch_size_per_gpu "
                             f"({self.min_train_micro_batch_size_per_gpu}) must be >= 1 and <= "
                             f"max_train_micro_batch_size_per_gpu ({self.max_train_micro_batch_size_per_gpu})")
        if self.repeats < 1 or self.leaders < 1:
            raise ValueError(f"autotuning.repeats ({self.repeats}) and autotuning.leaders ({self.leaders}) must be "
                             ">= 1 (repeats 1: each experiment runs once)")
        if any(b < 1 for b in self.bucket_sizes):
            raise ValueError(f"autotuning.bucket_sizes = {list(self.bucket_sizes)}: give positive element counts, "
                             "e.g. [5e6, 5e7, 5e8], or [] to skip the bucket phase")
        bad_devices = [d for d in self.offload_devices or () if d not in ("cpu", "nvme")]
        if bad_devices:
            raise ValueError(f"autotuning.offload_devices = {list(self.offload_devices or ())}: give devices among "
                             "cpu, nvme (or [] to skip the offload phase)")
        bad = [s for s in self.zero_stages if s not in (0, 1, 2, 3)]
        if bad or not self.zero_stages:
            raise ValueError(f"autotuning.zero_stages = {list(self.zero_stages)}: give stages among 0, 1, 2, 3")
