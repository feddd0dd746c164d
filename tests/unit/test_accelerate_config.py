"""``deepshard launch`` / ``deepshard config``: Accelerate's YAML keys and flags planned onto deepshard's
launcher (pure: no process is started)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deepshard.accelerate import launch_config as ac
from deepshard.accelerate.cli import build_launch_parser, config_main, _flags
from deepshard.launcher.options import LaunchError

YAML = {"compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
                             "offload_optimizer_device": "cpu",
                             "offload_param_device": "none", "zero3_init_flag": False, "zero3_save_16bit_model": True,
                             "zero_stage": 3},
        "downcast_bf16": "no", "enable_cpu_affinity": False, "machine_rank": 0, "main_training_function": "main",
        "mixed_precision": "bf16", "num_machines": 1, "num_processes": 2, "rdzv_backend": "static",
        "same_network": True, "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False, "use_cpu": True,
        "main_process_port": 29555}


def flags(argv: list[str]) -> dict:
    return _flags(build_launch_parser().parse_args([*argv, "train.py"]))


def test_deepspeed_yaml_becomes_accelerates_environment() -> None:
    plan = ac.plan(YAML, flags([]), "train.py", ["--lr", "1"])
    assert plan.num_processes == 2 and plan.distributed_type == "DEEPSPEED"
    assert plan.launcher_argv == ["--num_gpus", "2", "--master_port", "29555", "--no_local_rank", "--max_restarts",
                                  "0", "--module", "deepshard.compat.run", "train.py", "--lr", "1"]
    env = plan.env
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3" and env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "2"
    assert env["ACCELERATE_GRADIENT_CLIPPING"] == "1.0"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] == "cpu"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "none"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "false"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"] == "true"
    assert set(env["ACCELERATE_CONFIG_DS_FIELDS"].split(",")) == set(YAML["deepspeed_config"])
    # use_cpu keeps DeepSpeed on (Accelerate would switch it off): deepshard and Accelerate on the CPU device
    assert env["DEEPSHARD_ACCELERATOR"] == "cpu" and env["ACCELERATE_TORCH_DEVICE"] == "cpu"
    assert "ACCELERATE_USE_CPU" not in env


def test_flags_beat_the_file_and_no_file_means_deepspeed() -> None:
    plan = ac.plan(YAML, flags(["--zero_stage", "1", "--num_processes", "4", "--mixed_precision", "no"]), "t.py", [])
    assert plan.env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "1" and plan.num_processes == 4
    assert plan.env["ACCELERATE_MIXED_PRECISION"] == "no"
    bare = ac.plan({}, flags(["--num_processes", "2", "--use_cpu", "--offload_param_device", "cpu"]), "t.py", [])
    assert bare.distributed_type == "DEEPSPEED" and bare.env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "cpu"
    assert bare.env["ACCELERATE_CONFIG_DS_FIELDS"] == ""  # nothing came from a file
    assert bare.launcher_argv[bare.launcher_argv.index("--master_port") + 1] == "29500"  # Accelerate's default
    free = ac.plan({"main_process_port": 0}, flags([]), "t.py", [])  # 0: the launcher picks (and logs) a port
    assert free.launcher_argv[free.launcher_argv.index("--master_port") + 1] == "0"
    with pytest.raises(LaunchError, match="main_process_port 0 .* one machine only"):
        ac.plan({"main_process_port": 0, "num_machines": 2, "num_processes": 2, "main_process_ip": "h0"},
                flags([]), "t.py", [])
    module = ac.plan({}, flags(["-m"]), "pkg.train", [], as_module=True, replace_deepspeed=True)
    assert module.launcher_argv[-4:] == ["--module", "deepshard.compat.run", "-m", "pkg.train"]
    assert module.env["DEEPSHARD_REPLACE_DEEPSPEED"] == "1"


def test_other_distributed_types() -> None:
    plain = ac.plan({"distributed_type": "MULTI_CPU", "num_processes": 3}, flags([]), "t.py", [])
    assert plain.launcher_argv[-1] == "t.py" and "deepshard.compat.run" not in plain.launcher_argv
    assert plain.env["ACCELERATE_USE_CPU"] == "true" and "ACCELERATE_USE_DEEPSPEED" not in plain.env
    assert ac.plan({"distributed_type": "NO", "num_processes": 4}, flags([]), "t.py", []).num_processes == 1
    with pytest.raises(LaunchError, match="use `accelerate launch` for the others"):
        ac.plan({}, flags(["--use_fsdp"]), "t.py", [])


@pytest.mark.parametrize("config,match", [
    ({"distributed_type": "DEEPSPEED", "num_procs": 2},
     r"unknown key\(s\) \['num_procs'\] in the Accelerate config \(did you mean 'num_processes'"),
    ({"deepspeed_config": {"zero_stag": 2}},
     r"unknown deepspeed_config key\(s\) \['zero_stag'\] \(did you mean 'zero_stage'"),
    ({"deepspeed_config": {"zero_stage": 5}}, "choose 0, 1, 2 or 3"),
    ({"deepspeed_config": {"offload_param_device": "gpu"}}, "choose one of"),
    ({"mixed_precision": "fp32"}, "choose one of"),
    ({"distributed_type": "MULTI_GPU", "deepspeed_config": {"zero_stage": 2}}, "set distributed_type: DEEPSPEED"),
    ({"num_processes": 3, "num_machines": 2}, "cannot be split evenly"),
    ({"num_processes": 4, "num_machines": 2}, "needs main_process_ip"),
])
def test_bad_configs_name_the_key(config: dict, match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        ac.plan(config, flags([]), "t.py", [])


def test_config_file_conflicts_with_the_keys_it_sets(tmp_path: Path) -> None:
    ds_json = tmp_path / "ds.json"
    ds_json.write_text("{}")
    config = {"mixed_precision": "bf16", "deepspeed_config": {"deepspeed_config_file": str(ds_json), "zero_stage": 2}}
    with pytest.raises(LaunchError, match=r"\['zero_stage', 'mixed_precision'\] would be ignored"):
        ac.plan(config, flags([]), "t.py", [])
    ok = ac.plan({"deepspeed_config": {"deepspeed_config_file": str(ds_json), "zero3_init_flag": True}},
                 flags([]), "t.py", [])
    assert ok.env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(ds_json)
    assert ok.env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"


def test_multinode_runners_and_filters() -> None:
    base = {"num_processes": 8, "num_machines": 2, "main_process_ip": "10.0.0.1", "machine_rank": 1}
    pdsh = ac.plan({**base, "deepspeed_config": {"deepspeed_hostfile": "/h"}}, flags([]), "t.py", [])
    argv = pdsh.launcher_argv
    assert argv[:2] == ["--num_gpus", "4"] and argv[argv.index("--hostfile") + 1] == "/h"
    assert argv[argv.index("--launcher") + 1] == "pdsh" and argv[argv.index("--master_addr") + 1] == "10.0.0.1"
    nossh = ac.plan({**base, "deepspeed_config": {"deepspeed_multinode_launcher": "standard"}}, flags([]), "t.py", [])
    argv = nossh.launcher_argv
    assert "--no_ssh" in argv and argv[argv.index("--node_rank") + 1] == "1"
    included = ac.plan({**base, "deepspeed_config": {"deepspeed_inclusion_filter": "a@b"}}, flags([]), "t.py", [])
    assert "--num_gpus" not in included.launcher_argv and "a@b" in included.launcher_argv


def test_default_location_and_yaml_reading(tmp_path: Path) -> None:
    assert ac.default_config_file({"HF_HOME": str(tmp_path)}) == tmp_path / "accelerate" / "default_config.yaml"
    assert ac.default_config_file({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/accelerate/default_config.yaml")
    pytest.importorskip("yaml", reason="reading YAML needs PyYAML (the accelerate extra)")
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\nuse_cpu: true\n")
    assert ac.read_config_file(path) == {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2},
                                         "use_cpu": True}


def test_deepshard_config_writes_a_launchable_yaml(tmp_path: Path) -> None:
    pytest.importorskip("yaml", reason="writing YAML needs PyYAML (the accelerate extra)")
    path = tmp_path / "out.yaml"
    assert config_main(["--config_file", str(path), "-y", "--zero_stage", "3", "--num_processes", "2", "--use_cpu",
                        "--gradient_clipping", "0.5"]) == 0
    written = ac.read_config_file(path)
    assert written["distributed_type"] == "DEEPSPEED" and written["use_cpu"] is True and written["num_processes"] == 2
    assert written["deepspeed_config"] == {"zero_stage": 3, "gradient_clipping": 0.5, "zero3_init_flag": True}
    plan = ac.plan(written, flags([]), "t.py", [])
    assert plan.env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3" and plan.env["DEEPSHARD_ACCELERATOR"] == "cpu"
    assert config_main(["--config_file", str(path), "-y", "--zero_stage", "7"]) == 2


@pytest.mark.parametrize("content,expect", [
    (b"distributed_type: DEEPSPEED\nnum_processes: [2\n", ["c.yaml:3:1: not valid YAML"]),
    (b"distributed_type: DEEPSPEED\ndeepspeed_config:\n\tzero_stage: 2\n",
     ["c.yaml:3:1: not valid YAML", "indented with spaces, not tabs"]),
    (b"distributed_type: DEEPSPEED\n\x89PNG\xff\xfe\n", ["c.yaml:2: not a text file", "not UTF-8"]),
    (b"distributed_type: DEEPSPEED\ndeepspeed_config: zero2\n", ["c.yaml:2: deepspeed_config must be a mapping",
                                                                  "'zero2'"]),
    (b"", ["c.yaml is empty"]),
    (b"# only a comment\n\n", ["c.yaml holds no settings"]),
])
def test_a_bad_accelerate_file_is_one_line_naming_the_file_and_line(tmp_path: Path, content: bytes,
                                                                    expect: list[str], capsys: Any) -> None:
    """Raw yaml.ParserError / ScannerError / UnicodeDecodeError / 'dictionary update sequence' tracebacks
    before, and an empty file started one process; now `deepshard launch` exits 2 with one line."""
    pytest.importorskip("yaml", reason="reading YAML needs PyYAML (the accelerate extra)")
    from deepshard.accelerate.cli import launch_main

    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    assert launch_main(["--config_file", str(path), "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("deepshard launch: error: "), err
    for part in expect:
        assert part in err, err
