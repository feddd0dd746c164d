"""Config mistakes found after the config loads (building the optimizer or the scheduler, the demo fitting its
batch to the process count) end a launched job with one line, printed once for all ranks, no traceback: the
same path as a misspelt config key (``ConfigError`` -> ``deepshard.compat.run`` -> the launcher's report)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "config_mistake.py"
LAUNCH_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
HINT = "(the traceback: deepshard --verbose ..., or DEEPSHARD_VERBOSE=1)"

# (config, the error line as a regular expression): the torch.optim / lr_scheduler class lists in two of the
# messages depend on the torch release, so they are matched as a list of names
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3}}
NAMES = r"[A-Za-z]+(, [A-Za-z]+)*"
MISTAKES = {
    "unknown optimizer type": (
        {"train_batch_size": 2, "optimizer": {"type": "Adamm", "params": {"lr": 1e-3}}},
        re.escape("deepshard: error (ranks 0, 1): unknown optimizer type 'Adamm' (did you mean 'Adam' or 'RAdam' "
                  "or 'NAdam'?). Valid types: Adam, AdamW, Lamb, Lion, ") + NAMES
        + re.escape(" (case-insensitive), or pass your own optimizer as initialize(optimizer=...)")),
    "misspelt optimizer parameter": (
        {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decayy": 0.1}}},
        re.escape("deepshard: error (ranks 0, 1): optimizer 'AdamW' (deepshard.optim.fused_adam.FusedAdamW) does "
                  "not accept optimizer.params 'weight_decayy' (did you mean 'weight_decay'?); accepted: lr, "
                  "bias_correction, betas, eps, adam_w_mode, weight_decay, ") + r"[a-z0-9_]+(, [a-z0-9_]+)*"),
    "unknown scheduler type": (
        {"train_batch_size": 2, "optimizer": OPTIMIZER, "scheduler": {"type": "WarmupLRR", "params": {}}},
        re.escape("deepshard: error (ranks 0, 1): unknown scheduler type 'WarmupLRR' (did you mean 'WarmupLR' or "
                  "'WarmupDecayLR' or 'WarmupCosineLR'?). DeepSpeed schedules (VALID_LR_SCHEDULES): LRRangeTest, "
                  "OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR; or a torch.optim.lr_scheduler class: ")
        + NAMES + re.escape(" (names are case-sensitive)")),
}
DEMO_LINE = ("deepshard: error (ranks 0, 1, 2): train_batch_size 32 is not a multiple of "
             "train_micro_batch_size_per_gpu 8 x 3 processes = 24; run on a process count that divides 4 or "
             "edit the config")


def _launch(args: list[str]) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("deepshard")
    launcher = [str(exe)] if exe.exists() else [shutil.which("deepshard") or "deepshard"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_KEYS and k != "DEEPSHARD_VERBOSE"}
    env["DEEPSHARD_ACCELERATOR"] = "cpu"
    return subprocess.run([*launcher, "--master_port", "0", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    """The job's single ``deepshard: error`` line, after checking it is alone and untangled in tracebacks."""
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "Traceback" not in out and "last output of" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("deepshard: error")]
    assert len(errors) == 1, out
    lines = out.splitlines()
    assert lines[lines.index(errors[0]) + 1] == HINT, out
    return errors[0]


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_optimizer_and_scheduler_mistakes_are_one_line(mistake: str) -> None:
    config, expected = MISTAKES[mistake]
    line = _one_error_line(_launch(["--num_gpus", "2", str(SCRIPT), json.dumps(config)]))
    assert re.fullmatch(expected, line), line


def test_the_demo_on_three_processes_refuses_in_one_line() -> None:
    result = _launch(["--num_gpus", "3", "examples/train_gpt.py", "--deepspeed_config", "examples/ds_config.json"])
    assert _one_error_line(result) == DEMO_LINE
