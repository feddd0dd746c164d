"""The flops_profiler section and the step timers in a real 2-process run (ZeRO-0 and ZeRO-3)."""
from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

import pytest

from deepshard.profiling.flops_profiler import FlopsProfiler
from tests.multiproc.harness import run_world
from tests.multiproc.models import make_token_batches, make_transformer
from tests.multiproc.scenarios_tools import profiled_training

WORLD, MICRO, GAS = 2, 2, 2


def reference_step_flops() -> tuple[int, int]:
    """One process, plain PyTorch: fwd+bwd FLOPs of one micro-batch x GAS, and the unique parameters."""
    model = make_transformer()
    x, y = make_token_batches(1, MICRO)[0]
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x, y).backward()
    prof.stop_profile()
    return GAS * (int(prof.get_total_flops()) + int(prof.get_total_backward_flops())), int(prof.get_total_params())


@pytest.fixture(scope="module")
def world(tmp_path_factory: Any) -> tuple[Path, list[dict[int, dict[str, Any]]]]:
    tmp = tmp_path_factory.mktemp("tools")
    return tmp, run_world(profiled_training, WORLD, str(tmp))


@pytest.fixture(params=[0, 3])
def run(request: Any, world: tuple[Path, list[dict[int, dict[str, Any]]]]) -> tuple[int, Path, list[dict[str, Any]]]:
    tmp, results = world
    return request.param, tmp / f"stage{request.param}", [r[request.param] for r in results]


def test_profile_step_counts_match_plain_pytorch(run: tuple[int, Path, list[dict[str, Any]]]) -> None:
    stage, out_dir, results = run
    flops, params = reference_step_flops()
    assert results[0]["flops_per_step"] == flops  # forward and backward of both micro-steps, measured
    assert results[1]["flops_per_step"] is None  # rank 0 profiles, as DeepSpeed does
    assert results[0]["profiler_started"] is False and results[0]["hooks_left"] == 0  # profiler detached
    text = (out_dir / "flops.txt").read_text()
    assert "profile step 1" in text and "block (TransformerEncoderLayer)" in text
    # tied embedding/head once; under ZeRO-3 the shards count at full size
    assert "params of model:" in text and text.count("(root) (TinyTransformer): ") == 1
    root_line = next(line for line in text.splitlines() if line.startswith("(root)"))
    from deepshard.profiling.profile_report import params_to_string

    assert root_line.split(": ")[1].startswith(params_to_string(params) + " (100.00%)"), (stage, root_line)
    assert results[0]["rates"]["tflops"] > 0 and results[0]["tokens_per_step"] == GAS * MICRO * 8


def test_timers_in_log_and_csv(run: tuple[int, Path, list[dict[str, Any]]]) -> None:
    _, out_dir, results = run
    lines = results[0]["lines"]
    micro = [x for x in lines if x.startswith("time (ms) | fwd_microstep:")]
    assert len(micro) == 3 * GAS
    assert "bwd_inner_microstep" in micro[0] and "bwd_allreduce_microstep" in micro[0]
    window = [x for x in lines if x.startswith("time (ms) | fwd:")]
    assert len(window) == 3 and "| step:" in window[0]
    throughput = [x for x in lines if x.startswith("RunningAvgSamplesPerSec=")]
    assert len(throughput) == 3 and "TFLOPsPerProcess=" in throughput[-1] and "TokensPerSec=" in throughput[0]
    assert "ProcessRSS=" in throughput[0] and "MemAllocated" not in throughput[0]  # a CPU run: labelled as RSS
    job = out_dir / "tools"
    for name in ("forward", "backward", "backward_inner", "backward_allreduce", "step"):
        with open(job / f"Train_Samples_elapsed_time_ms_{name}.csv", newline="") as fh:
            rows = list(csv.reader(fh))
        assert len(rows) == 1 + 3 and all(float(r[1]) >= 0 for r in rows[1:])
    with open(job / "Train_Samples_samples_per_sec.csv", newline="") as fh:
        rows = list(csv.reader(fh))
    assert len(rows) == 4 and float(rows[-1][1]) > 0
    assert results[1]["lines"] == [] or not any(x.startswith("RunningAvg") for x in results[1]["lines"])


def test_logged_loss_is_deepspeeds_window_mean_over_ranks(run: tuple[int, Path, list[dict[str, Any]]]) -> None:
    """The step line and ``Train/Samples/train_loss`` give the loss as DeepSpeed's pipeline engine does:
    the mean of the accumulation window's micro-batch losses, averaged over the data-parallel ranks (the
    script's own all-reduced mean here), not rank 0's last micro-batch."""
    _, out_dir, results = run
    expected = results[0]["losses"]
    with open(out_dir / "tools" / "Train_Samples_train_loss.csv", newline="") as fh:
        logged = [float(row[1]) for row in list(csv.reader(fh))[1:]]
    assert logged == pytest.approx(expected, rel=1e-6, abs=1e-6)
    printed = [float(x.split(" loss: ")[1].split()[0]) for x in results[0]["lines"] if x.startswith("steps: ")]
    assert printed == pytest.approx(expected, abs=6e-5)
    # DeepSpeed's line formats, read as a DeepSpeed log parser reads them
    steps_line = re.compile(r"^steps: (\d+) loss: (\d+\.\d{4}) iter time \(s\): (\d+\.\d{3}) samples/sec: (\d+\.\d{3})$")
    rank_line = re.compile(r"^\[Rank 0\] step=(\d+), skipped=(\d+), lr=\[[-0-9.e, ]+\], mom=\[\(0\.9, 0\.999\)(, \(0\.9, 0\.999\))*\]$")
    steps = [steps_line.match(x) for x in results[0]["lines"] if x.startswith("steps: ")]
    ranks = [rank_line.match(x) for x in results[0]["lines"] if x.startswith("[Rank 0] step=")]
    assert steps and all(steps) and all(ranks) and len(ranks) == len(steps), results[0]["lines"]
    assert [int(m.group(1)) for m in steps] == [int(m.group(1)) for m in ranks] == list(range(1, len(steps) + 1))
    assert all(float(m.group(3)) > 0 and float(m.group(4)) > 0 for m in steps)
