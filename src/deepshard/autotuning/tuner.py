"""``deepshard --autotuning tune|run [launcher options] script.py --deepspeed_config ds.json ...``.

1. a model-info trial (one step) records the model's parameter counts;
2. the experiments (ZeRO stage x micro batch, accumulation derived so the global batch is kept) whose
   model states alone exceed the memory a process has are pruned (the memory estimator's formulas);
3. every other experiment is a short real run of the script through the launcher, in fresh processes,
   measured by the engine between ``start_profile_step`` and ``end_profile_step``; a failure or a hang
   (``trial_timeout``) is recorded and the search goes on;
4. the ``leaders`` best experiments are run again until each has ``repeats`` runs; an experiment's
   metric is the median of its runs (one noisy window cannot win) and the summary gives their spread;
5. a second phase tries the best experiment with the other ``bucket_sizes`` and (stage >= 1) with
   optimizer/parameter offload to each of ``offload_devices`` (default: cpu with a GPU, none on a
   CPU-only machine); its leaders are repeated too, and the best median of both phases wins;
6. progress: trial k of N, the time elapsed and left (a bar on a terminal, else a log line per trial);
7. ``results_dir`` gets ``summary.txt``, ``ds_config_optimal.json`` and ``cmd_optimal.txt`` (DeepSpeed's
   names); ``run`` then launches the script with the best config.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepshard.autotuning.progress import TrialProgress
from deepshard.autotuning.settings import AutotuningSettings
from deepshard.autotuning.space import Experiment, experiments, prune, refinements
from deepshard.autotuning.trial import run_trial
from deepshard.profiling.memory_estimator import ModelFacts
from deepshard.utils.logging import logger

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config", "--deepscale_config")


def split_argv(argv: list[str], args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(launcher options without ``--autotuning``, [script, *script args])."""
    tail = 1 + len(args.user_args)
    launcher, script = list(argv[:len(argv) - tail]), list(argv[len(argv) - tail:])
    out, skip = [], False
    for token in launcher:
        if skip:
            skip = False
        elif token == "--autotuning":
            skip = True
        elif not token.startswith("--autotuning="):
            out.append(token)
    return out, script


def config_position(script: list[str]) -> int:
    """Index in ``script`` of the config path after ``--deepspeed_config`` (or ``-1`` for ``=`` form)."""
    for i, token in enumerate(script):
        if token in CONFIG_FLAGS and i + 1 < len(script):
            return i + 1
        if any(token.startswith(flag + "=") for flag in CONFIG_FLAGS):
            return i
    raise ValueError("--autotuning needs the script's config argument (--deepspeed_config ds.json): the "
                     "tuner writes one config per experiment and passes it there")


def with_config(script: list[str], path: Path) -> list[str]:
    out = list(script)
    i = config_position(out)
    out[i] = f"{out[i].split('=')[0]}={path}" if "=" in out[i] and out[i].startswith("--") else str(path)
    return out


def memory_limit(settings: AutotuningSettings, dp: int) -> int:
    if settings.memory_per_process_mb is not None:
        return int(settings.memory_per_process_mb * 2**20)
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    import psutil

    return int(psutil.virtual_memory().available // max(dp, 1))


def offload_devices(settings: AutotuningSettings) -> tuple[str, ...]:
    """The offload devices the second phase tries: the setting, else cpu with a GPU and none without one."""
    if settings.offload_devices is not None:
        return settings.offload_devices
    import torch

    if torch.cuda.is_available():
        return ("cpu",)
    logger.info("autotuning: offload not searched on a CPU-only machine (offloading to cpu moves nothing); "
                "set autotuning.offload_devices to try it")
    return ()


def process_count(args: argparse.Namespace) -> int:
    if args.num_gpus and args.num_gpus > 0:
        return int(args.num_gpus)
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    raise ValueError("--autotuning on a CPU machine needs --num_gpus N (the processes each trial runs)")


def _probe_spec(settings: AutotuningSettings, exp_dir: Path, model_info: bool = False) -> dict[str, Any]:
    return {"metric_path": str(exp_dir / "metrics.json"), "start_step": settings.start_profile_step,
            "end_step": settings.end_profile_step, "model_info": model_info}


def _result(trial: Experiment, metric: str) -> str:
    if trial.status != "ok":
        return f"{trial.status}: {trial.detail}"
    return f"ok, {metric} {trial.samples[-1]:.4g}"


def _run(trial: Experiment, settings: AutotuningSettings, launcher: list[str], script: list[str],
         progress: TrialProgress) -> None:
    """Run ``trial`` once more (its first run, or a repeat in ``<name>/repeat<k>``); a failed repeat
    fails the experiment (a configuration that fails now and then is not a safe pick)."""
    repeat = len(trial.samples)
    exp_dir = Path(settings.exps_dir) / trial.name / (f"repeat{repeat + 1}" if repeat else "")
    exp_dir.mkdir(parents=True, exist_ok=True)
    config_path = exp_dir / "ds_config.json"
    config_path.write_text(json.dumps(trial.config, indent=2))
    status, metrics, detail = run_trial(launcher, with_config(script, config_path), exp_dir,
                                        _probe_spec(settings, exp_dir), settings.trial_timeout)
    trial.status, trial.detail = status, (f"run {repeat + 1}: {detail}" if repeat and detail else detail)
    if status == "ok":
        trial.samples.append(float(metrics[settings.metric]))
        trial.runs.append(metrics)
        trial.metrics = median_metrics(trial.runs)
    progress.finished(trial.name + (f" (run {repeat + 1})" if repeat else ""), _result(trial, settings.metric))


def median_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The last run's metrics with every number replaced by its median over ``runs``."""
    out = dict(runs[-1])
    for key, value in out.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(float(run[key]) for run in runs if key in run)
    return out


def ranked(trials: list[Experiment], metric: str) -> list[Experiment]:
    """The successful trials, best first by ``metric`` (the median of their runs)."""
    done = [t for t in trials if t.status == "ok"]
    return sorted(done, key=lambda t: t.metrics[metric], reverse=metric == "throughput")


def confirm_leaders(trials: list[Experiment], settings: AutotuningSettings, launcher: list[str],
                    script: list[str], progress: TrialProgress) -> None:
    """Repeat the ``leaders`` best trials until each has ``repeats`` runs. A repeat can reorder them, so
    this goes on until the leaders by median are all measured ``repeats`` times (each trial is repeated
    at most that often, so it ends)."""
    while True:
        short = [t for t in ranked(trials, settings.metric)[:settings.leaders] if len(t.samples) < settings.repeats]
        if not short:
            return
        progress.add(sum(settings.repeats - len(t.samples) for t in short))
        for trial in short:
            while trial.status == "ok" and len(trial.samples) < settings.repeats:
                _run(trial, settings, launcher, script, progress)


def model_facts(trials: list[Experiment], settings: AutotuningSettings, launcher: list[str],
                script: list[str]) -> ModelFacts:
    """One step of the script with the smallest experiment's config: the parameter counts."""
    first = min(trials, key=lambda t: (t.micro, -t.stage))
    exp_dir = Path(settings.exps_dir) / "model_info"
    exp_dir.mkdir(parents=True, exist_ok=True)
    config_path = exp_dir / "ds_config.json"
    config_path.write_text(json.dumps(first.config, indent=2))
    status, metrics, detail = run_trial(launcher, with_config(script, config_path), exp_dir,
                                        _probe_spec(settings, exp_dir, model_info=True), settings.trial_timeout)
    if status != "ok":
        raise ValueError(f"autotuning: the model-info run ({first.name}) did not finish: {status}, {detail}")
    info = metrics["model_info"]
    return ModelFacts(**{k: tuple(v) if isinstance(v, list) else v for k, v in info.items()})


def best_of(trials: list[Experiment], metric: str) -> Experiment | None:
    """The best successful trial by the median of its runs, or None."""
    leading = ranked(trials, metric)
    return leading[0] if leading else None


def spread(trial: Experiment) -> str:
    """``min-max (n runs)`` of the tuning metric, ``-`` before a run succeeded."""
    if not trial.samples or trial.status != "ok":
        return "-"
    return f"{min(trial.samples):.4g}-{max(trial.samples):.4g} (n={len(trial.samples)})"


def summary_table(trials: list[Experiment], metric: str, best: Experiment | None) -> str:
    lines = [f"{'experiment':<22}{'stage':>6}{'micro':>6}{'gas':>5}{'states MiB':>12}{'status':>9}"
             f"{'throughput':>12}{'latency s':>11}  {metric + ' spread':<26}detail"]
    for t in trials:
        tput = f"{t.metrics['throughput']:.2f}" if t.status == "ok" else "-"
        lat = f"{t.metrics['latency']:.4f}" if t.status == "ok" else "-"
        est = f"{t.estimate_bytes / 2**20:.2f}" if t.estimate_bytes is not None else "-"
        mark = " *" if t is best else ""
        lines.append(f"{t.name:<22}{t.stage:>6}{t.micro:>6}{t.gas:>5}{est:>12}{t.status:>9}{tput:>12}{lat:>11}  "
                     f"{spread(t):<26}{t.detail}{mark}")
    lines.append(f"best by {metric} (median of its runs): "
                 f"{best.name if best else 'none (every experiment failed or was pruned)'}")
    return "\n".join(lines)


def write_results(trials: list[Experiment], settings: AutotuningSettings, best: Experiment | None,
                  launcher: list[str], script: list[str]) -> Path | None:
    results = Path(settings.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / "summary.txt").write_text(summary_table(trials, settings.metric, best) + "\n")
    (results / "experiments.json").write_text(json.dumps(
        [{"name": t.name, "stage": t.stage, "micro": t.micro, "gas": t.gas, "status": t.status,
          "metrics": t.metrics, "samples": t.samples, "estimate_bytes": t.estimate_bytes, "detail": t.detail}
         for t in trials], indent=2))
    if best is None:
        return None
    optimal = results / "ds_config_optimal.json"
    optimal.write_text(json.dumps(best.config, indent=2))
    command = ["deepshard", *launcher, *with_config(script, optimal.resolve())]
    (results / "cmd_optimal.txt").write_text(shlex.join(command) + "\n")
    return optimal


def _search(trials: list[Experiment], settings: AutotuningSettings, launcher: list[str], script: list[str],
            progress: TrialProgress) -> None:
    """Phase 1 (every pending trial), its leaders repeated; phase 2 (refinements of the best), appended
    to ``trials``, the leaders of both repeated."""
    for trial in [t for t in trials if t.status == "pending"]:
        _run(trial, settings, launcher, script, progress)
    confirm_leaders(trials, settings, launcher, script, progress)
    best = best_of(trials, settings.metric)
    if best is None:
        return
    second = refinements(best, settings, offload_devices(settings))
    progress.add(len(second))
    for trial in second:
        _run(trial, settings, launcher, script, progress)
    trials += second
    confirm_leaders(trials, settings, launcher, script, progress)


def tune(args: argparse.Namespace, argv: list[str]) -> tuple[Path | None, list[str], list[str]]:
    """The whole search; returns (the optimal config's path or None, launcher options, script args)."""
    launcher, script = split_argv(argv, args)
    config_file = Path(script[config_position(script)].split("=")[-1])
    base = json.loads(config_file.read_text())
    settings = AutotuningSettings.from_config(base)
    dp = process_count(args)
    trials = experiments(base, settings, dp)
    prune(trials, model_facts(trials, settings, launcher, script), dp, memory_limit(settings, dp))
    progress = TrialProgress(sum(t.status == "pending" for t in trials))
    try:
        _search(trials, settings, launcher, script, progress)
    finally:
        progress.close()
    best = best_of(trials, settings.metric)
    optimal = write_results(trials, settings, best, launcher, script)
    print(summary_table(trials, settings.metric, best), flush=True)
    return optimal, launcher, script


def main(args: argparse.Namespace, argv: list[str], launch: Callable[[list[str]], int]) -> int:
    """``--autotuning tune``: search and write the results; ``run``: then train with the best config through
    ``launch`` (the ``deepshard`` command's entry point, given by the launcher that called this)."""
    optimal, launcher, script = tune(args, argv)
    if optimal is None:
        print("deepshard: autotuning: no experiment succeeded; see the summary above and the logs under "
              "the exps_dir", flush=True)
        return 1
    print(f"deepshard: autotuning: best config written to {optimal}", flush=True)
    if args.autotuning != "run":
        return 0
    return launch([*launcher, *with_config(script, optimal)])
