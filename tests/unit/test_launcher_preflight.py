"""The launcher refuses bad values before any rank starts, with one line naming the flag or file and the
fix (no traceback), and never takes a script's flags for abbreviations of its own."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from deepshard.launcher import cli


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('ran')\n")
    return str(path)


def _error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("deepshard: error: "), err
    return err


def test_script_flags_that_prefix_launcher_flags_belong_to_the_script(script: str) -> None:
    args = cli.parse_args(["--num_gpus", "2", script, "--h", "--n", "3", "--master", "x"])
    assert args.user_args == ["--h", "--n", "3", "--master", "x"]
    assert args.num_gpus == 2 and args.master_port == cli.DEFAULT_MASTER_PORT


def test_a_port_outside_the_valid_range_is_a_usage_error(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--master_port", "70000", script])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--master_port" in err and "70000 is outside 1..65535" in err and "Traceback" not in err, err


def test_a_port_in_use_is_refused_naming_the_flag_and_a_free_port(script: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        err = _error_of(["--num_gpus", "1", "--master_port", str(port), script], capsys)
    assert f"--master_port {port} is already in use on 127.0.0.1" in err and "e.g. --master_port " in err, err


def test_deepshard_launch_names_its_own_port_flag(tmp_path: Path, script: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`deepshard launch` takes --main_process_port and rejects --master_port: its port error says so."""
    from deepshard.accelerate.cli import launch_main

    config = tmp_path / "accelerate.json"
    config.write_text('{"distributed_type": "DEEPSPEED", "num_processes": 1, "use_cpu": true}')
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert launch_main(["--config_file", str(config), "--main_process_port", str(port), script]) == 2
    err = capsys.readouterr().err
    assert f"--main_process_port {port} is already in use" in err and "e.g. --main_process_port " in err, err
    assert "--master_port" not in err, err


def test_an_unwritable_rank_log_directory_is_refused(script: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    err = _error_of(["--num_gpus", "1", "--master_port", "0", "--enable_each_rank_log", str(blocker / "logs"), script],
                    capsys)
    assert f"--enable_each_rank_log {blocker / 'logs'}" in err and "writable directory" in err, err


def test_a_binary_hostfile_is_refused_naming_the_file(script: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    hostfile = tmp_path / "hosts.bin"
    hostfile.write_bytes(bytes(range(256)))
    err = _error_of(["-H", str(hostfile), script], capsys)
    assert f"hostfile {hostfile} is not text" in err, err
