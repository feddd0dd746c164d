"""The examples for sequence parallelism, tensor parallelism and the Hugging Face Trainer run as their
docstrings say: on 2 processes through the ``deepshard`` launcher, their losses equal those of the same
script on one process (plain attention / the whole model / the plain Trainer: the reference), fp32."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LAUNCH_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STEPS = 4
TOL = 1e-5  # measured: at most 1e-6 (the last printed digit) on each example


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_KEYS}
    env.update({"DEEPSHARD_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    return env


def _both(script: str, args: list[str], launched_args: list[str] = (), single_args: list[str] = ()
          ) -> tuple[str, str]:
    """(stdout of ``script`` on 2 processes through the launcher, stdout on one process), run side by side."""
    exe = Path(sys.executable).with_name("deepshard")
    launcher = [str(exe)] if exe.exists() else [shutil.which("deepshard") or "deepshard"]
    commands = [[*launcher, "--num_gpus", "2", "--master_port", "0", str(EXAMPLES / script), *args, *launched_args],
                [sys.executable, str(EXAMPLES / script), *args, *single_args]]
    procs = [subprocess.Popen(c, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    outs = []
    for proc, command in zip(procs, commands):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{command} failed:\n{out[-3000:]}\n{err[-5000:]}"
        outs.append(out)
    return outs[0], outs[1]


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step +\d+  loss ([0-9.]+)", out, re.M)]


def _same_losses(launched: str, single: str) -> None:
    ours, reference = _losses(launched), _losses(single)
    assert len(ours) == len(reference) == STEPS, (launched, single)
    assert max(abs(a - b) for a, b in zip(ours, reference)) <= TOL, (ours, reference)
    assert reference[-1] < reference[0], reference  # it learns


def test_ulysses_example_on_two_processes_gives_the_one_process_losses() -> None:
    launched, single = _both("train_ulysses.py", ["--steps", str(STEPS)])
    assert "(sequence parallel size 2)" in launched and "(sequence parallel size 1)" in single
    _same_losses(launched, single)


def test_autotp_example_splits_the_model_and_gives_the_one_process_losses() -> None:
    pytest.importorskip("transformers", reason="the example's model is transformers' LLaMA: pip install '.[hf]'")
    launched, single = _both("train_autotp.py", ["--steps", str(STEPS)])
    held = {int(r): int(n.replace(",", "")) for r, n in re.findall(r"^rank (\d): holds ([0-9,]+) parameters", launched, re.M)}
    (whole,) = [int(n.replace(",", "")) for n in re.findall(r"^rank 0: holds ([0-9,]+) parameters", single, re.M)]
    assert sorted(held) == [0, 1] and all(whole / 2 <= n < 0.52 * whole for n in held.values()), (held, whole)
    _same_losses(launched, single)


def test_hf_trainer_example_with_a_deepspeed_config_gives_the_plain_trainers_losses(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the example is a transformers Trainer: pip install '.[hf]'")
    common = ["--max_steps", str(STEPS), "--logging_steps", "1", "--output_dir", str(tmp_path)]
    launched, single = _both("hf_trainer.py", common,
                             ["--deepspeed", str(EXAMPLES / "hf_trainer_ds_config.json"),
                              "--per_device_train_batch_size", "2"],
                             ["--per_device_train_batch_size", "4"])  # the same global batch of 4
    assert f"done: {STEPS} steps on 2 process(es), DeepSpeed config" in launched, launched
    assert f"done: {STEPS} steps on 1 process(es), DeepSpeed config none" in single, single
    _same_losses(launched, single)
