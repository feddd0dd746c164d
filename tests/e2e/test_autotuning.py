"""``deepshard --autotuning run``: a 3-experiment search (ZeRO stages 0, 1, 2 at one micro batch, global
batch 8 over 2 processes) on a 100k-parameter MLP, end to end through the launcher, then the second
phase (stage 2 with another bucket size); the leader is run twice and picked by its median. The memory limit (1.4 MiB per process) prunes stage 0 (16
bytes per parameter: 1.5 MiB); stage 1 fails as an out-of-memory would; stage 2 is the stage that runs,
so the optimum is one of its two bucket sizes, the faster as measured. A trial that hangs is stopped at
its timeout with every process it started."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from deepshard.autotuning.settings import AutotuningSettings
from deepshard.autotuning.space import experiments, refinements

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


def test_second_phase_tries_other_buckets_and_offload_on_the_best() -> None:
    base = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {}}, "zero_optimization": {"stage": 1},
            "autotuning": {"zero_stages": [1, 3], "max_train_micro_batch_size_per_gpu": 4,
                           "bucket_sizes": [5e6, 5e8], "offload_devices": ["cpu"]}}
    settings = AutotuningSettings.from_config(base)
    first = {t.stage: t for t in reversed(experiments(base, settings, dp=2))}  # micro batch 4 of each stage
    z1, z3 = first[1], first[3]
    found = {t.name: t.config["zero_optimization"] for t in refinements(z1, settings, ("cpu",))}
    assert found == {"z1_mbs4_gas1_bkt5e6": {"stage": 1, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000},
                     "z1_mbs4_gas1_offcpu": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}  # 5e8: the default
    z3_offload = refinements(z3, settings, ("cpu",))[-1].config["zero_optimization"]
    assert z3_offload["offload_param"] == {"device": "cpu"} and z3_offload["offload_optimizer"] == {"device": "cpu"}
    assert "stage3_prefetch_bucket_size" in refinements(z3, settings, ())[0].config["zero_optimization"]
    z0 = experiments(base, AutotuningSettings(zero_stages=(0,)), dp=2)[0]
    assert all("off" not in t.name for t in refinements(z0, settings, ("cpu",)))  # stage 0 has no offload


def test_autotuning_run_end_to_end(tmp_path: Path) -> None:
    config = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "autotuning": {"enabled": True, "zero_stages": [0, 1, 2], "min_train_micro_batch_size_per_gpu": 4,
                             "start_profile_step": 2, "end_profile_step": 4, "memory_per_process_mb": 1.4,
                             "results_dir": str(tmp_path / "autotuning_results"),
                             "exps_dir": str(tmp_path / "autotuning_exps"), "trial_timeout": 120,
                             "bucket_sizes": [5e7], "offload_devices": [], "repeats": 2, "leaders": 1}}
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
    assert set(rows) == {"z0_mbs4_gas1", "z1_mbs4_gas1", "z2_mbs4_gas1", "z2_mbs4_gas1_bkt5e7"}
    assert rows["z0_mbs4_gas1"]["status"] == "pruned" and rows["z0_mbs4_gas1"]["estimate_bytes"] == 16 * PARAMS
    assert rows["z1_mbs4_gas1"]["status"] == "failed" and "out of memory" in rows["z1_mbs4_gas1"]["detail"]
    ran = [rows["z2_mbs4_gas1"], rows["z2_mbs4_gas1_bkt5e7"]]
    assert all(r["status"] == "ok" and r["metrics"]["throughput"] > 0 and r["metrics"]["steps"] == 2 for r in ran)
    best = max(ran, key=lambda r: r["metrics"]["throughput"])  # the brute-force answer over what ran
    assert len(best["samples"]) == 2 and best["metrics"]["throughput"] == sum(best["samples"]) / 2  # the median
    assert "autotuning: trial 1 of " in done.stdout + done.stderr  # progress: k of N, elapsed, time left
    assert f"best by throughput (median of its runs): {best['name']}\n" in summary + "\n" and "pruned" in summary
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] == best["stage"] and "autotuning" not in optimal
    assert (optimal["zero_optimization"].get("reduce_bucket_size") == 50_000_000) == best["name"].endswith("bkt5e7")
    assert "ds_config_optimal.json" in (results / "cmd_optimal.txt").read_text()
    # `run` trained to the end with the optimal config (the trial runs stopped at end_profile_step)
    trained = json.loads((results / "trained.json").read_text())
    assert trained == {"stage": best["stage"], "micro": 4, "gas": 1, "steps": 30}
    assert not (tmp_path / "autotuning_exps" / best["name"] / "trained.json").exists()  # the trial stopped early


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
