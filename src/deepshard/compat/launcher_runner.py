"""DeepSpeed's ``deepspeed.launcher.runner`` module API over deepshard's launcher (the module path
:mod:`deepshard.launcher.runner` re-exports it and runs it): ``main``, the command line, DeepSpeed's hostfile and
``--include``/``--exclude`` helpers over deepshard's own (:mod:`deepshard.launcher.hostfile`), and
``encode_world_info``."""
from __future__ import annotations

import argparse
import base64
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from deepshard.launcher import cli
from deepshard.launcher.hostfile import parse_hostfile, parse_node_spec

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "encode_world_info", "main", "parse_args", "parse_resource_filter"]

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
"""The env file every node's ranks get (DeepSpeed's name; deepshard also reads ``.deepshard_env``,
:mod:`deepshard.launcher.envfile`)."""


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a launcher command line (``sys.argv[1:]`` when ``args`` is None), as DeepSpeed's
    ``runner.parse_args`` does."""
    return cli.parse_args(args)


def parse_resource_filter(host_info: Mapping[str, Sequence[int]], include_str: str = "",
                          exclude_str: str = "") -> dict[str, list[int]]:
    """``{host: [slots]}`` narrowed by an ``--include`` or ``--exclude`` spec (``worker-0@worker-1:0,2``);
    hosts left with no slot are dropped. A host or slot the pool lacks, or both specs at once, is a
    ValueError."""
    if include_str and exclude_str:
        raise ValueError("--include and --exclude are mutually exclusive; give one of them")
    spec_text = include_str or exclude_str
    if not spec_text:
        return dict(host_info)
    spec = parse_node_spec(spec_text)
    for host, slots in spec.items():
        if host not in host_info:
            raise ValueError(f"host {host!r} of {spec_text!r} is not in the hostfile ({', '.join(host_info)})")
        missing = [slot for slot in slots or [] if slot not in host_info[host]]
        if missing:
            raise ValueError(f"host {host!r} has no slot {missing[0]} (its slots: {list(host_info[host])})")
    chosen: dict[str, list[int]] = {}
    for host, slots in host_info.items():
        if include_str:
            keep = list(slots) if spec.get(host, []) is None else list(spec.get(host) or [])
        else:
            dropped = spec.get(host, [])
            keep = [] if dropped is None else [slot for slot in slots if slot not in dropped]
        if keep:
            chosen[host] = list(dict.fromkeys(keep))
    return chosen


def _parse_hostfile(hostfile_lines: Sequence[str]) -> dict[str, int]:
    """DeepSpeed's private name for parsing hostfile lines: :func:`deepshard.launcher.hostfile.parse_hostfile`."""
    return parse_hostfile("\n".join(hostfile_lines))


def encode_world_info(world_info: Mapping[str, Any]) -> str:
    """``world_info`` (``{host: slots}``) as the base64 JSON token DeepSpeed's runners pass to every node."""
    return base64.urlsafe_b64encode(json.dumps(dict(world_info)).encode("utf-8")).decode("ascii")


def main(args: Sequence[str] | None = None) -> int:
    """Run the launcher on ``args`` (``sys.argv[1:]`` when None); returns the exit status. A command line
    that cannot be launched (``--num_gpus`` with ``--include``, a host the hostfile lacks, ...) raises
    ``ValueError``, as DeepSpeed's ``runner.main`` does (the ``deepshard`` command prints it instead)."""
    return cli.main(None if args is None else list(args), raise_errors=True)
