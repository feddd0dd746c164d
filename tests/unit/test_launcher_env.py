"""The environment a multi-node job exports: env files (.deepshard_env / .deepspeed_env / DS_ENV_FILE)
and the well-known variable prefixes."""
from __future__ import annotations

from pathlib import Path

import pytest

from deepshard.launcher.envfile import (
    env_file_paths,
    job_exports,
    parse_env_file,
    prefixed_variables,
    read_env_files,
)


def test_parse_env_file_lines() -> None:
    text = ("# comment\n\nNCCL_DEBUG=INFO\nexport OMP_NUM_THREADS = 4\nURL=http://h/?a=b\n"
            "QUOTED=\"two words\"\nSINGLE='x'\nEMPTY=\nNCCL_DEBUG=WARN\n")
    assert parse_env_file(text) == {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "4", "URL": "http://h/?a=b",
                                    "QUOTED": "two words", "SINGLE": "x", "EMPTY": ""}


@pytest.mark.parametrize("line", ["JUST_A_NAME", "1BAD=x", "A B=c", "=value"])
def test_parse_env_file_bad_line_names_file_and_line(line: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_env_file(f"OK=1\n# c\n{line}\n", source="/home/u/.deepshard_env")
    message = str(err.value)
    assert message.startswith("/home/u/.deepshard_env:3:") and repr(line) in message and "NAME=VALUE" in message


def test_env_file_paths_default_custom_and_absolute() -> None:
    assert env_file_paths({}, "/home/u", "/work") == [
        "/home/u/.deepspeed_env", "/home/u/.deepshard_env", "/work/.deepspeed_env", "/work/.deepshard_env"]
    assert env_file_paths({"DS_ENV_FILE": "my.env"}, "/home/u", "/work") == ["/home/u/my.env", "/work/my.env"]
    assert env_file_paths({"DEEPSHARD_ENV_FILE": "/etc/job.env", "DS_ENV_FILE": "x"}, "/h", "/w") == ["/etc/job.env"]


def test_read_env_files_later_files_win(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home-ds\nB=home-ds\nC=home-ds\n")
    (home / ".deepshard_env").write_text("B=home-shard\n")
    (cwd / ".deepshard_env").write_text("C=cwd-shard\n")
    merged = read_env_files(env_file_paths({}, str(home), str(cwd)))
    assert merged == {"A": "home-ds", "B": "home-shard", "C": "cwd-shard"}
    (cwd / ".deepspeed_env").write_text("oops\n")
    with pytest.raises(ValueError, match=r"cwd/\.deepspeed_env:1"):
        read_env_files(env_file_paths({}, str(home), str(cwd)))


def test_prefixed_variables_travel_per_machine_ones_do_not() -> None:
    environ = {"PYTHONPATH": "/src", "NCCL_IB_DISABLE": "1", "OMP_NUM_THREADS": "2", "GLOO_SOCKET_IFNAME": "ib0",
               "TORCH_CPP_LOG_LEVEL": "INFO", "DEEPSHARD_ACCELERATOR": "cpu", "UCX_TLS": "tcp", "MV2_X": "1",
               "MLFLOW_URI": "u", "CUDA_LAUNCH_BLOCKING": "1", "CUDA_VISIBLE_DEVICES": "0,1",
               "DEEPSHARD_RESTART_COUNT": "3", "HOME": "/root", "PATH": "/bin", "RANK": "0", "MYPYTHON": "x"}
    assert list(prefixed_variables(environ)) == [
        "CUDA_LAUNCH_BLOCKING", "DEEPSHARD_ACCELERATOR", "GLOO_SOCKET_IFNAME", "MLFLOW_URI", "MV2_X",
        "NCCL_IB_DISABLE", "OMP_NUM_THREADS", "PYTHONPATH", "TORCH_CPP_LOG_LEVEL", "UCX_TLS"]


def test_job_exports_env_file_wins(tmp_path: Path) -> None:
    (tmp_path / ".deepshard_env").write_text("NCCL_DEBUG=INFO\nWANDB_PROJECT=p\n")
    exports = job_exports({"NCCL_DEBUG": "WARN", "PYTHONPATH": "/s", "HOME": "/x"}, home=str(tmp_path / "none"),
                          cwd=str(tmp_path))
    assert exports == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/s", "WANDB_PROJECT": "p"}
