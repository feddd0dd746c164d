"""The search space, with no process and no model: the experiments (ZeRO stage x micro batch, the
accumulation derived so the global batch stays the base config's), the memory pruning, and the second
phase's refinements of the best experiment (bucket sizes, offload)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

from deepshard.autotuning.settings import AutotuningSettings
from deepshard.profiling.memory_estimator import STATE_BYTES, ModelFacts, model_state_bytes


@dataclass
class Experiment:
    """One trial: its name, its config and, once run or pruned, what happened."""

    name: str
    stage: int
    micro: int
    gas: int
    config: dict[str, Any]
    estimate_bytes: Optional[int] = None
    status: str = "pending"
    """pending | pruned | ok | failed | timeout"""
    metrics: dict[str, float] = field(default_factory=dict)
    """The median over :attr:`runs` of each figure (the tuning metric's median ranks the experiment)."""
    samples: list[float] = field(default_factory=list)
    """The tuning metric of each successful run (several for the leaders)."""
    runs: list[dict[str, Any]] = field(default_factory=list)
    """Every successful run's metrics, as measured."""
    detail: str = ""


def global_batch(config: dict[str, Any], dp: int) -> int:
    """The base config's global batch (train_batch_size, else micro x accumulation x dp)."""
    if config.get("train_batch_size"):
        return int(config["train_batch_size"])
    micro = int(config.get("train_micro_batch_size_per_gpu") or 1)
    return micro * int(config.get("gradient_accumulation_steps") or 1) * dp


def micro_batch_sizes(settings: AutotuningSettings, batch: int, dp: int) -> list[int]:
    """Up to ``num_tuning_micro_batch_sizes`` micro batches in [min, max] that divide the global batch
    per process, the largest first (they are the fastest when they fit)."""
    per_process = batch // dp
    fits = [m for m in range(settings.min_train_micro_batch_size_per_gpu,
                             min(settings.max_train_micro_batch_size_per_gpu, per_process) + 1)
            if per_process % m == 0 and batch % dp == 0]
    return sorted(fits, reverse=True)[:settings.num_tuning_micro_batch_sizes]


def experiments(base: dict[str, Any], settings: AutotuningSettings, dp: int) -> list[Experiment]:
    """Every (stage, micro batch) trial, stage-major as DeepSpeed searches (0 -> 3)."""
    batch = global_batch(base, dp)
    micros = micro_batch_sizes(settings, batch, dp)
    if not micros:
        raise ValueError(f"autotuning: no micro batch in [{settings.min_train_micro_batch_size_per_gpu}, "
                         f"{settings.max_train_micro_batch_size_per_gpu}] divides the global batch {batch} over "
                         f"{dp} process(es); change train_batch_size or the autotuning micro-batch bounds")
    out = []
    for stage in settings.zero_stages:
        for micro in micros:
            config = copy.deepcopy(base)
            config.pop("autotuning", None)
            gas = batch // (micro * dp)
            config.update({"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro,
                           "gradient_accumulation_steps": gas})
            config.setdefault("zero_optimization", {})["stage"] = stage
            out.append(Experiment(f"z{stage}_mbs{micro}_gas{gas}", stage, micro, gas, config))
    return out


def model_states_estimate(facts: ModelFacts, config: dict[str, Any], dp: int) -> int:
    """Bytes of model states per process for ``config`` (the memory estimator's formulas)."""
    half = (config.get("bf16") or {}).get("enabled") or (config.get("fp16") or {}).get("enabled")
    optimizer = str((config.get("optimizer") or {}).get("type", "adam")).lower()
    zero = config.get("zero_optimization") or {}
    states = model_state_bytes(facts, int(zero.get("stage", 0)), dp, 2 if half else 4, STATE_BYTES.get(optimizer, 8),
                               int(zero.get("stage3_param_persistence_threshold", 100000)))
    return sum(states.values())


def prune(trials: list[Experiment], facts: ModelFacts, dp: int, limit_bytes: int) -> None:
    """Mark the trials whose model states alone exceed ``limit_bytes`` as pruned (they cannot fit)."""
    for trial in trials:
        trial.estimate_bytes = model_states_estimate(facts, trial.config, dp)
        if trial.estimate_bytes > limit_bytes:
            trial.status = "pruned"
            trial.detail = (f"model states {trial.estimate_bytes / 2**20:.1f} MiB > "
                            f"{limit_bytes / 2**20:.1f} MiB per process")


def refinements(best: Experiment, settings: AutotuningSettings, offload_devices: tuple[str, ...]) -> list[Experiment]:
    """The second phase: ``best`` with each other bucket size, and (stage >= 1) with each offload device.

    Buckets: ``reduce_bucket_size`` with ``allgather_bucket_size`` (stages 0-2) or the stage-3 prefetch
    bucket. Offload: the optimizer states, and at stage 3 the parameters too."""
    zero = best.config.get("zero_optimization") or {}
    current = int(float(zero.get("reduce_bucket_size", 500_000_000)))
    out = []
    for size in settings.bucket_sizes:
        if size == current:
            continue
        config = copy.deepcopy(best.config)
        knobs = {"reduce_bucket_size": size}
        knobs["stage3_prefetch_bucket_size" if best.stage == 3 else "allgather_bucket_size"] = size
        config["zero_optimization"].update(knobs)
        out.append(Experiment(f"{best.name}_bkt{size:.0e}".replace("+0", ""), best.stage, best.micro, best.gas, config))
    for device in offload_devices if best.stage >= 1 else ():
        config = copy.deepcopy(best.config)
        zero = config["zero_optimization"]
        zero["offload_optimizer"] = {**(zero.get("offload_optimizer") or {}), "device": device}
        if best.stage == 3:
            zero["offload_param"] = {**(zero.get("offload_param") or {}), "device": device}
        out.append(Experiment(f"{best.name}_off{device}", best.stage, best.micro, best.gas, config))
    return out
