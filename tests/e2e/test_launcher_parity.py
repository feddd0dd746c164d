"""What a script sees under ``deepshard`` and under ``torchrun``: the same variables (both run torch's
elastic agent), plus DeepSpeed's ``--local_rank`` argument and deepshard's own few under ``deepshard``."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_launcher import ROOT, SCRIPTS, _clean_env, _deepshard, _free_port

SHOW = str(SCRIPTS / "show_env.py")
PER_RUN = {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_PORT", "MASTER_ADDR"}
"""Values that name this run (an id, a file, the port and address each launch was given)."""
DEEPSHARD_ONLY = {"CROSS_RANK", "CROSS_SIZE", "DEEPSHARD_RESTART_COUNT"}


def _rows(text: str) -> dict[int, dict]:
    rows = [json.loads(line[4:]) for line in text.splitlines() if line.startswith("ENV ")]
    return {int(row["env"]["RANK"]): row for row in rows}


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def test_the_script_sees_torchruns_environment_and_deepspeeds_local_rank() -> None:
    if shutil.which("true") is None:
        pytest.skip("needs a POSIX system")
    env = _clean_env(OMP_NUM_THREADS="1")
    ours = subprocess.run([*_deepshard(), "--master_port", str(_free_port()), "--num_gpus", "2", SHOW], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    theirs = subprocess.run([*_torchrun(), "--nproc_per_node", "2", "--master_port", str(_free_port()), SHOW],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert theirs.returncode == 0, theirs.stdout + theirs.stderr
    mine, torch_rows = _rows(ours.stdout), _rows(theirs.stdout)
    assert sorted(mine) == sorted(torch_rows) == [0, 1]
    for rank in (0, 1):
        ds_env, tr_env = mine[rank]["env"], torch_rows[rank]["env"]
        assert set(ds_env) - DEEPSHARD_ONLY == set(tr_env), (ds_env, tr_env)
        same = {k: v for k, v in tr_env.items() if k not in PER_RUN}
        assert {k: ds_env[k] for k in same} == same
        assert {k: ds_env[k] for k in DEEPSHARD_ONLY} == {"CROSS_RANK": "0", "CROSS_SIZE": "1",
                                                          "DEEPSHARD_RESTART_COUNT": "0"}
        assert ds_env["MASTER_ADDR"] in ("127.0.0.1", "localhost") and tr_env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert mine[rank]["argv"] == [f"--local_rank={rank}"] and torch_rows[rank]["argv"] == []
