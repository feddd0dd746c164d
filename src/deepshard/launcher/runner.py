"""DeepSpeed's launcher module path: ``deepshard.launcher.runner`` (``deepspeed.launcher.runner``)."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from deepshard.launcher import cli

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
"""The env file every node's ranks get (DeepSpeed's name; deepshard also reads ``.deepshard_env``,
:mod:`deepshard.launcher.envfile`)."""


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a launcher command line (``sys.argv[1:]`` when ``args`` is None), as DeepSpeed's
    ``runner.parse_args`` does."""
    return cli.parse_args(args)


def main(args: Sequence[str] | None = None) -> int:
    """Run the launcher on ``args`` (``sys.argv[1:]`` when None); returns the exit status."""
    return cli.main(None if args is None else list(args))


if __name__ == "__main__":
    sys.exit(main())
