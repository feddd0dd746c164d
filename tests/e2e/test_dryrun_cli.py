"""`deepshard dryrun`: a script, unchanged, as one rank of a large job in one process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_launcher import _clean_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "dryrun_tiny.py"


def _dryrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepshard.launcher", "dryrun", *args], cwd=tmp_path,
                          env=_clean_env(), capture_output=True, text=True, timeout=600)


def test_a_script_as_rank_5_of_1024(tmp_path: Path) -> None:
    out = _dryrun(tmp_path, "--world_size", "1024", "--rank", "5", "--steps", "0", "--json", "figures.json",
                  str(SCRIPT), "--stage", "3", "--steps", "2", "--save_dir", "ckpt")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "script done on rank 5 of 1024, RANK=5" in out.stdout  # its loss mean over ranks stayed plausible
    assert "rank 5 of 1024 ranks" in out.stdout and "ZeRO stage 3" in out.stdout
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["world_size"] == 1024 and figures["rank"] == 5 and len(figures["steps"]) == 2
    step = figures["steps"][-1]["collectives"]
    assert {c["op"] for c in step} >= {"all_gather", "reduce_scatter"}
    assert all(c["group_size"] == 1024 for c in step)
    params = 16 * 64 + 64 + 64 * 4 + 4
    states = figures["engines"][0]["model_states"]  # ZeRO-3: this rank's 1/1024 of each parameter, fp32
    assert states["parameters"] < params * 4 / 100
    assert "zero_rank5.safetensors" in figures["checkpoint"]["written"]
    assert not (tmp_path / "ckpt").exists()  # saves go to a scratch directory, never the script's own


def test_a_pipeline_stage_after_the_first(tmp_path: Path) -> None:
    pipeline = ROOT / "examples" / "train_pipeline.py"
    out = _dryrun(tmp_path, "--world_size", "64", "--rank", "63", "--steps", "2", str(pipeline), "--steps", "5")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pp=2 dp=32" in out.stdout and "this rank at pp=1 dp=31" in out.stdout
    assert "pp:send" in out.stdout and "stopped after 2 step(s)" in out.stdout


def test_bad_rank_is_refused(tmp_path: Path) -> None:
    out = _dryrun(tmp_path, "--world_size", "4", "--rank", "4", str(SCRIPT))
    assert out.returncode == 2 and "--rank 4 must be in 0..3" in out.stderr
