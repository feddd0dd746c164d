"""A DeepSpeed-style script (``import deepshard as deepspeed``) through the launcher, end to end."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.e2e.test_launcher import SCRIPTS, _launch


def run_deepspeed_script(tmp_path: Path, config: dict[str, Any], steps: int
                         ) -> tuple[subprocess.CompletedProcess, list[dict[str, Any]]]:
    """Launch tests/e2e/scripts/deepspeed_style_train.py on 2 processes with ``config``; return the process
    and the JSON line each rank printed (asserting the run succeeded)."""
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(config))
    proc = _launch(["--num_gpus", "2", str(SCRIPTS / "deepspeed_style_train.py"), "--deepspeed",
                    "--deepspeed_config", str(cfg), "--save_dir", str(tmp_path / "ckpt"), "--steps", str(steps)],
                   timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    return proc, rows


def test_deepspeed_script_runs_unchanged(tmp_path: Path) -> None:
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
              "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 4,
              "zero_optimization": {"stage": 0, "reduce_bucket_size": 200}}
    proc, rows = run_deepspeed_script(tmp_path, config, steps=30)
    for r in rows:
        assert r["local_rank"] == r["rank"] and r["env_rank"] == str(r["rank"])
        assert r["world"] == 2 and r["steps"] == 30  # 16 = 4 micro x 2 accumulation x 2 ranks
        assert r["last"] < 0.5 * r["first"]
        # client_state is saved once, from rank 0 (as DeepSpeed does), and every rank gets it back
        rank0 = next(row for row in rows if row["rank"] == 0)
        assert r["client_first"] == rank0["first"] and r["client_len"] == 60
        assert abs(r["lr"] - 0.01) < 1e-9  # WarmupLR finished its 4 warmup steps
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step30"
    assert "step=4" in proc.stdout + proc.stderr  # steps_per_print
