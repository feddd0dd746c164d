"""The autotuner's pure parts: settings, the search space, pruning, and the command lines it builds."""
from __future__ import annotations

from pathlib import Path

import pytest

from deepshard.autotuning.settings import AutotuningSettings
from deepshard.autotuning.space import experiments, micro_batch_sizes, prune
from deepshard.autotuning.tuner import best_of, split_argv, with_config
from deepshard.launcher.cli import parse_args
from deepshard.profiling.memory_estimator import ModelFacts


def test_settings_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="autotuning.metric = 'flops'"):
        AutotuningSettings.from_config({"autotuning": {"metric": "flops"}})
    with pytest.raises(ValueError, match="unknown key.*zero_stage"):
        AutotuningSettings.from_config({"autotuning": {"zero_stage": [1]}})
    with pytest.raises(ValueError, match="zero_stages"):
        AutotuningSettings.from_config({"autotuning": {"zero_stages": [4]}})
    with pytest.raises(ValueError, match="start_profile_step"):
        AutotuningSettings.from_config({"autotuning": {"start_profile_step": 5, "end_profile_step": 5}})
    assert AutotuningSettings.from_config({"autotuning": {"enabled": True, "fast": True}}).metric == "throughput"


def test_micro_batches_divide_the_global_batch_largest_first() -> None:
    settings = AutotuningSettings(min_train_micro_batch_size_per_gpu=1, max_train_micro_batch_size_per_gpu=8,
                                  num_tuning_micro_batch_sizes=3)
    assert micro_batch_sizes(settings, batch=24, dp=2) == [6, 4, 3]  # 12 per process
    with pytest.raises(ValueError, match="divides the global batch 6 over 4"):
        experiments({"train_batch_size": 6}, settings, dp=4)


def test_pruning_uses_the_model_state_formulas() -> None:
    facts = ModelFacts(trainable=1000, frozen=0, largest_tensor=1000, group_sizes=(1000,), frozen_group_sizes=(),
                       buffer_bytes=0)
    base = {"train_batch_size": 4, "optimizer": {"type": "Adam"},
            "zero_optimization": {"stage3_param_persistence_threshold": 0}}
    trials = experiments(base, AutotuningSettings(zero_stages=(0, 1, 2, 3), max_train_micro_batch_size_per_gpu=2,
                                                  num_tuning_micro_batch_sizes=1), dp=2)
    prune(trials, facts, dp=2, limit_bytes=11_000)
    # fp32 Adam per process: stage 0 16P, stage 1 8P + 8P/2, stage 2 4P + 12P/2, stage 3
    # 16P/2 (PRODUCT.md's fp32 rows)
    assert [t.estimate_bytes for t in trials] == [16_000, 12_000, 10_000, 8_000]  # stage 3: 16P/2
    assert [t.status for t in trials] == ["pruned", "pruned", "pending", "pending"]
    trials[2].status, trials[2].metrics = "ok", {"throughput": 5.0, "latency": 0.2}
    trials[3].status, trials[3].metrics = "ok", {"throughput": 7.0, "latency": 0.1}
    assert best_of(trials, "throughput") is trials[3] and best_of(trials, "latency") is trials[3]


def test_trial_command_lines() -> None:
    argv = ["--num_gpus", "2", "--autotuning", "run", "--master_port", "1234", "train.py", "--deepspeed",
            "--deepspeed_config=ds.json", "--lr", "3"]
    args = parse_args(argv)
    launcher, script = split_argv(argv, args)
    assert launcher == ["--num_gpus", "2", "--master_port", "1234"]
    assert with_config(script, Path("/x/e.json")) == ["train.py", "--deepspeed", "--deepspeed_config=/x/e.json",
                                                      "--lr", "3"]
    with pytest.raises(ValueError, match="--deepspeed_config"):
        with_config(["train.py"], Path("e.json"))


def test_leaders_are_repeated_and_the_median_picks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The case that made one window untrustworthy: a config measured 59.4 samples/s once and 43.1 and
    28.9 when run again. The leaders are re-run, the median picks, the spread is reported, and progress
    counts trial k of N with the time left."""
    import logging

    from deepshard.autotuning import tuner
    from deepshard.autotuning.progress import TrialProgress

    runs = {"z1_mbs4_gas1": [59.4, 43.1, 28.9], "z2_mbs4_gas1": [45.0, 44.0, 46.0], "z3_mbs4_gas1": [40.0]}

    def fake_trial(launcher: list[str], script: list[str], exp_dir: Path, spec: dict, timeout: float):
        name = exp_dir.name if not exp_dir.name.startswith("repeat") else exp_dir.parent.name
        value = runs[name].pop(0)
        return "ok", {"throughput": value, "latency": 1 / value}, ""

    monkeypatch.setattr(tuner, "run_trial", fake_trial)
    monkeypatch.setenv("DEEPSHARD_PROGRESS", "0")
    caplog.set_level(logging.INFO, logger="deepshard")
    base = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {}},
            "autotuning": {"zero_stages": [1, 2, 3], "min_train_micro_batch_size_per_gpu": 4, "repeats": 3,
                           "leaders": 2, "bucket_sizes": [], "offload_devices": [], "exps_dir": str(tmp_path)}}
    settings = AutotuningSettings.from_config(base)
    trials = experiments(base, settings, dp=2)
    progress = TrialProgress(len(trials))
    tuner._search(trials, settings, [], ["train.py", "--deepspeed_config", "ds.json"], progress)
    by_name = {t.name: t for t in trials}
    assert by_name["z1_mbs4_gas1"].samples == [59.4, 43.1, 28.9] and by_name["z3_mbs4_gas1"].samples == [40.0]
    best = best_of(trials, "throughput")
    assert best is by_name["z2_mbs4_gas1"] and best.metrics["throughput"] == 45.0  # not the lucky 59.4
    assert best.metrics["latency"] == pytest.approx(1 / 45.0) and len(best.runs) == 3  # every figure: its median
    table = tuner.summary_table(trials, "throughput", best)
    assert "28.9-59.4 (n=3)" in table and "44-46 (n=3)" in table and "z2_mbs4_gas1" in table.splitlines()[-1]
    assert (progress.done, progress.total) == (7, 7)
    assert "autotuning: trial 7 of 7: z2_mbs4_gas1 (run 3) -> ok, throughput 46 (elapsed" in caplog.text
    assert "left)" in caplog.text
    with pytest.raises(ValueError, match="autotuning.repeats"):
        AutotuningSettings(repeats=0).check()
