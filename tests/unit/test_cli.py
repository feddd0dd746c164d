"""The ``deepshard`` command line: subcommands listed by ``--help`` (old script names kept as aliases), a
help text for every flag, the script's flags never prefix-matched against the launcher's, port 0, which
``deepspeed`` the ranks import, the PyYAML hint, and the ranks' one-line error reports."""
from __future__ import annotations

import argparse
import builtins
import logging
import sys
import tomllib
from pathlib import Path

import pytest

from deepshard.accelerate import launch_config as ac
from deepshard import commands
from deepshard.launcher import cli
from deepshard.launcher import report as rank_errors
from deepshard.accelerate.cli import build_launch_parser, config_main
from deepshard.launcher.options import LaunchError
from deepshard.compat.run import COMPAT_RUN, KEEP_DEEPSPEED, REPLACE_ENV, route_ranks

ROOT = Path(__file__).resolve().parents[2]


def _option_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_help_lists_every_command_and_every_flag_explains_itself(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert text.index("commands:") < text.index("--num_gpus")
    for name, command in commands.COMMANDS.items():
        assert f"    {name} " in text and command.summary.split()[0] in text
    for parser in (cli.build_parser(), build_launch_parser()):
        missing = [a.option_strings[0] for a in _option_actions(parser) if not a.help]
        assert missing == [], f"{parser.prog}: no help for {missing}"


def test_old_script_names_are_aliases_of_the_subcommands() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["deepshard"] == "deepshard.launcher.cli:main"
    for name, command in commands.COMMANDS.items():
        for alias in command.aliases:
            assert scripts[alias] == command.entry, (alias, name)
        assert callable(command.load())
    assert commands.find_command(["report", "--hide_devices"]) == ("report", commands.COMMANDS["report"])
    assert commands.find_command(["train.py", "report"]) is None


def test_the_scripts_flags_belong_to_the_script() -> None:
    hf = build_launch_parser().parse_args(["--num_processes", "2", "train.py", "--deepspeed", "ds.json", "-h",
                                           "--num_processes", "3"])
    assert (hf.training_script, hf.num_processes) == ("train.py", 2)
    assert hf.training_script_args == ["--deepspeed", "ds.json", "-h", "--num_processes", "3"]
    ds = cli.parse_args(["--num_gpus", "2", "train.py", "--deepspeed", "--h", "3", "--num_gpus", "5"])
    assert (ds.user_script, ds.num_gpus, ds.user_args) == ("train.py", 2, ["--deepspeed", "--h", "3", "--num_gpus", "5"])
    # before the script a unique prefix of a launcher flag is that flag, as DeepSpeed's parser accepts
    short = cli.parse_args(["--num_gp", "2", "--launcher_arg", "-mca btl_tcp_if_include eth1", "--no_ssh",
                            "--master_p=4000", "train.py", "--num_gp", "3"])
    assert (short.num_gpus, short.launcher_args, short.no_ssh, short.master_port) == (
        2, "-mca btl_tcp_if_include eth1", True, 4000)
    assert (short.user_script, short.user_args) == ("train.py", ["--num_gp", "3"])
    with pytest.raises(SystemExit):  # a prefix of several flags is refused
        cli.parse_args(["--num", "2", "train.py"])


def test_deepspeeds_runner_main_raises_on_an_impossible_selection(capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSpeed's ``runner.main`` raises ValueError on --num_nodes/--num_gpus with --include/--exclude (before
    looking at the script); the ``deepshard`` command prints the same message in one line."""
    from deepshard.compat.launcher_runner import main as ds_main  # deepspeed.launcher.runner.main

    for line in ("--num_nodes 1 -i localhost foo.py", "--num_gpus 1 -e localhost foo.py"):
        with pytest.raises(ValueError, match="Cannot specify num_nodes/gpus with include/exclude"):
            ds_main(line.split())
        assert cli.main(line.split()) == 2
        assert "error: Cannot specify num_nodes/gpus" in capsys.readouterr().err


def test_port_zero_is_a_free_port_on_one_machine(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="deepshard")
    args = cli.parse_args(["--master_port", "0", "train.py"])
    chosen = cli._with_port(args, "local").master_port
    assert 1024 <= chosen <= 65535 and f"rendezvous on free port {chosen}" in caplog.text
    with pytest.raises(LaunchError, match="one machine only"):
        cli._with_port(args, "ssh")
    assert cli._with_port(cli.parse_args(["train.py"]), "ssh").master_port == 29500


def test_ranks_import_deepshard_as_deepspeed_unless_a_real_one_is_installed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="deepshard")
    env: dict[str, str] = {}
    plain = route_ranks(cli.parse_args(["train.py", "--lr", "1"]), None, env)
    assert (plain.module, plain.user_script, plain.user_args) == (True, COMPAT_RUN, ["train.py", "--lr", "1"])
    kept = route_ranks(cli.parse_args(["--module", "pkg.train"]), "/site/deepspeed/__init__.py", env)
    assert kept.user_args == [KEEP_DEEPSPEED, "-m", "pkg.train"] and env == {}
    assert "DeepSpeed is installed (/site/deepspeed/__init__.py)" in caplog.text and "--replace_deepspeed" in caplog.text
    replaced = route_ranks(cli.parse_args(["--replace_deepspeed", "train.py"]), "/site/deepspeed", env)
    assert replaced.user_args == ["train.py"] and env == {REPLACE_ENV: "1"}
    for untouched in (["--no_python", "run.sh"], ["--module", COMPAT_RUN, "train.py"]):
        args = cli.parse_args(untouched)
        assert route_ranks(args, None, env) is args


def test_yaml_hint_is_the_same_for_config_and_launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    real_import = builtins.__import__

    def no_yaml(name: str, *args: object, **kwargs: object) -> object:
        if name == "yaml":
            raise ImportError("No module named 'yaml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "yaml", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_yaml)
    assert config_main(["--config_file", str(tmp_path / "c.yaml"), "-y", "--num_processes", "2"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("deepshard config: error: writing") and ac.YAML_HINT in said, said
    (tmp_path / "c.yaml").write_text("num_processes: 2\n")
    with pytest.raises(LaunchError, match="needs PyYAML") as read_error:
        ac.read_config_file(tmp_path / "c.yaml")
    assert ac.YAML_HINT in str(read_error.value)
    assert config_main(["--config_file", str(tmp_path / "c.json"), "-y", "--num_processes", "2"]) == 0
    assert ac.read_config_file(tmp_path / "c.json")["num_processes"] == 2  # JSON needs no PyYAML


def test_rank_errors_are_grouped_by_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {"RANK": "1"}
    with rank_errors.error_dir(env) as where:
        rank_errors.report("bad key 'x'", env)
        rank_errors.report("bad key 'x'", {**env, "RANK": "0"})
        rank_errors.report("other", {**env, "RANK": "3"})
        found = rank_errors.collect(where)
    assert found == {"bad key 'x'": [0, 1], "other": [3]}
    assert rank_errors.ERROR_DIR_ENV not in env and not Path(where).exists()
    text = rank_errors.format_errors(found)
    assert "deepshard: error (ranks 0, 1): bad key 'x'" in text and "deepshard: error (rank 3): other" in text
    rank_errors.report("alone", {})  # no launcher: the terminal
    assert "deepshard: error: alone" in capsys.readouterr().err
