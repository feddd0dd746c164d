"""DeepSpeed's launcher module path, ``deepshard.launcher.runner`` (``deepspeed.launcher.runner``): :func:`main`
runs the ``deepshard`` launcher (``python -m deepshard.launcher.runner`` too); DeepSpeed's helpers of that module
are :mod:`deepshard.compat.launcher_runner`'s."""
from __future__ import annotations

import sys
from collections.abc import Sequence

from deepshard.compat.launcher_runner import (
    DEEPSPEED_ENVIRONMENT_NAME,
    _parse_hostfile,
    encode_world_info,
    parse_args,
    parse_resource_filter,
)
from deepshard.launcher import cli

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "_parse_hostfile", "encode_world_info", "main", "parse_args",
           "parse_resource_filter"]


def main(args: Sequence[str] | None = None) -> int:
    """Run the launcher on ``args`` (``sys.argv[1:]`` when None); returns the exit status."""
    return cli.main(None if args is None else list(args))


if __name__ == "__main__":
    sys.exit(main())
