"""The ``deepshard`` command's subcommands: what ``deepshard --help`` lists and how an argv picks one (with no
subcommand, ``deepshard`` is the launcher, :mod:`deepshard.launcher.cli`, whose ``main`` dispatches through here)."""
from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One subcommand: a one-line summary for ``--help``, its entry point, and older names for it."""

    summary: str
    entry: str  # ``package.module:function``, called as ``function(argv, prog="deepshard NAME")``.
    aliases: tuple[str, ...] = ()  # Console scripts that run the same function (kept for users of the older names).

    def load(self) -> Callable[..., int]:
        module_name, _, attr = self.entry.partition(":")
        return getattr(importlib.import_module(module_name), attr)


# Subcommands by name, in the order ``deepshard --help`` lists them.
COMMANDS: dict[str, Command] = {
    "launch": Command("run a script written for Accelerate (reads its config file; `accelerate launch`)",
                      "deepshard.accelerate.cli:launch_main"),
    "config": Command("write an Accelerate config file for deepshard (`accelerate config`)",
                      "deepshard.accelerate.cli:config_main"),
    "report": Command("print what this machine offers deepshard (`ds_report`)",
                      "deepshard.utils.env_report:main", ("ds_report_deepshard",)),
    "zero_to_fp32": Command("consolidate a ZeRO checkpoint into fp32 weights (`zero_to_fp32.py`)",
                            "deepshard.utils.zero_to_fp32:main", ("deepshard_zero_to_fp32",)),
    "convert": Command("convert a checkpoint to DeepSpeed's format or from it (`deepshard convert SRC DST --to ...`)",
                       "deepshard.checkpoint.convert_cli:main"),
    "verify": Command("check every file of a checkpoint against its manifest (sizes and sha256)",
                      "deepshard.checkpoint.verify:main"),
    "dryrun": Command("run a script as one rank of an N-rank job in one process (figures per rank, no data moved)",
                      "deepshard.dryrun.cli:main"),
    "plan": Command("the DeepSpeed config that fits a memory per rank best, found by dry runs",
                    "deepshard.dryrun.plan_cli:main"),
    "estimate_memory": Command("estimate the peak memory of one process for a config and a model",
                               "deepshard.profiling.estimate_cli:main", ("deepshard_estimate_memory",)),
}

USAGE = ("deepshard [launcher options] user_script [script args...]\n"
         "       deepshard COMMAND [options]      (deepshard COMMAND --help for each)")


def find_command(argv: Sequence[str]) -> tuple[str, Command] | None:
    """The subcommand ``argv`` names in its first word, if any (else it is a DeepSpeed-style launch)."""
    if argv and argv[0] in COMMANDS:
        return argv[0], COMMANDS[argv[0]]
    return None


def run_command(name: str, argv: Sequence[str]) -> int:
    return int(COMMANDS[name].load()(list(argv), prog=f"deepshard {name}") or 0)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every ``deepshard`` command's ``--help`` shows each option's default when it has a meaningful one (not None, "", False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default in (None, "", False, argparse.SUPPRESS) or "%(default)" in text
        if quiet or not action.option_strings or "(default" in text:
            return text
        return f"{text} (default: %(default)s)"


class _CommandsFirst(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The launcher's help with the command list kept as written (it is the description)."""


def add_command_list(parser: argparse.ArgumentParser) -> None:
    """List the subcommands first in ``parser``'s help (used for ``deepshard --help`` only: the launcher's own
    parser takes the script as its first positional, so it never parses a subcommand)."""
    width = max(map(len, COMMANDS)) + 2
    lines = ["commands:", "  with no COMMAND, deepshard is DeepSpeed's launcher: the arguments and options below"]
    lines += [f"    {name:<{width}}{command.summary}" for name, command in COMMANDS.items()]
    parser.usage, parser.formatter_class = USAGE, _CommandsFirst
    parser.description = "\n\n".join([parser.description or "", *["\n".join(lines)]])
