"""``deepshard --autotuning run``: a 3-experiment search (ZeRO stages 0, 1, 2 at one micro batch, global
batch 8 over 2 processes) on a 100k-parameter MLP, end to end through the launcher. The memory limit
(1.4 MiB per process) prunes stage 0 (16 bytes per parameter: 1.5 MiB); stage 1 fails as an
out-of-memory would; stage 2 is the one that runs, so it must be the optimum. A trial that hangs is
stopped at its timeout with every process it started."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from deepshard.autotuning.settings import AutotuningSettings
from deepshard.autotuning.space import experiments

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "autotune_train.py"
PARAMS = 64 * 768 + 768 + 768 * 64 + 64


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_search_space_keeps_the_global_batch() -> None:
    base = {"train_batch_size": 16, "optimizer": {"type": "Adam", "params": {}},
            "autotuning": {"enabled": True, "zero_stages": [0, 3], "max_train_micro_batch_size_per_gpu": 4}}
    trials = experiments(base, AutotuningSettings.from_config(base), dp=2)
    assert [(t.stage, t.micro, t.gas) for t in trials] == [(0, 4, 2), (0, 2, 4), (0, 1, 8),
                                                           (3, 4, 2), (3, 2, 4), (3, 1, 8)]
    assert all("autotuning" not in t.config and t.config["train_batch_size"] == 16 for t in trials)


def test_autotuning_run_end_to_end(tmp_path: Path) -> None:
    config = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "autotuning": {"enabled": True, "zero_stages": [0, 1, 2], "min_train_micro_batch_size_per_gpu": 4,
                             "start_profile_step": 2, "end_profile_step": 4, "memory_per_process_mb": 1.4,
                             "results_dir": str(tmp_path / "autotuning_results"),
                             "exps_dir": str(tmp_path / "autotuning_exps"), "trial_timeout": 120}}
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DEEPSHARD_ACCELERATOR="cpu", AUTOTUNE_OOM_STAGE="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    cmd = [sys.executable, "-m", "deepshard.launcher", "--autotuning", "run", "--num_gpus", "2", "--master_port",
           str(_port()), str(SCRIPT), "--deepspeed", "--deepspeed_config", str(cfg)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    summary = (results / "summary.txt").read_text()
    rows = {r["name"]: r for r in json.loads((results / "experiments.json").read_text())}
    assert set(rows) == {"z0_mbs4_gas1", "z1_mbs4_gas1", "z2_mbs4_gas1"}
    assert rows["z0_mbs4_gas1"]["status"] == "pruned" and rows["z0_mbs4_gas1"]["estimate_bytes"] == 16 * PARAMS
    assert rows["z1_mbs4_gas1"]["status"] == "failed" and "out of memory" in rows["z1_mbs4_gas1"]["detail"]
    best = rows["z2_mbs4_gas1"]
    assert best["status"] == "ok" and best["metrics"]["throughput"] > 0 and best["metrics"]["steps"] == 2
    assert "best by throughput: z2_mbs4_gas1" in summary and "pruned" in summary
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] == best["stage"] and "autotuning" not in optimal
    assert "ds_config_optimal.json" in (results / "cmd_optimal.txt").read_text()
    # `run` trained to the end with the optimal config (the trial runs stopped at end_profile_step)
    trained = json.loads((results / "trained.json").read_text())
    assert trained == {"stage": best["stage"], "micro": 4, "gas": 1, "steps": 30}
    assert not (tmp_path / "autotuning_exps" / "z2_mbs4_gas1" / "trained.json").exists()  # the trial stopped early


def test_a_hanging_trial_is_stopped_with_its_processes(tmp_path: Path) -> None:
    import psutil

    from deepshard.autotuning.trial import run_trial

    spec = {"metric_path": str(tmp_path / "metrics.json"), "start_step": 1, "end_step": 2, "model_info": False}
    before = {p.pid for p in psutil.process_iter()}
    status, metrics, detail = run_trial(["--num_gpus", "1", "--master_port", str(_port())],
                                        [str(SCRIPT.parent / "sleep_forever.py")], tmp_path, spec, timeout=6)
    assert status == "timeout" and metrics == {} and "stopped after 6 s" in detail
    left = [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before
            and "sleep_forever.py" in " ".join(p.info["cmdline"] or [])]
    assert not left, left
