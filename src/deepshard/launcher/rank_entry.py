"""Which program each Python rank runs: the user's script through :mod:`deepshard.compat.run`, so that a
script written for DeepSpeed, Accelerate or the Hugging Face Trainer finds deepshard when it does
``import deepspeed`` (as ``deepspeed --num_gpus 2 train.py --deepspeed ds.json`` would find DeepSpeed)."""
from __future__ import annotations

import argparse
from collections.abc import MutableMapping

from deepshard.utils.logging import logger

COMPAT_RUN = "deepshard.compat.run"
KEEP_DEEPSPEED = "--keep_deepspeed"
REPLACE_ENV = "DEEPSHARD_REPLACE_DEEPSPEED"


def real_deepspeed() -> str | None:
    """Where a real DeepSpeed is importable from in this environment, or None (nothing is imported)."""
    from deepshard import compat

    if compat.is_installed():  # this process answers `import deepspeed` itself: look past it
        return None
    return compat.installed_deepspeed()


def route_ranks(args: argparse.Namespace, real: str | None, environ: MutableMapping[str, str]) -> argparse.Namespace:
    """``args`` with the user's script run through :mod:`deepshard.compat.run` (``--no_python`` and a
    launch already routed there are left as they are). ``real`` is :func:`real_deepspeed`'s answer;
    with ``--replace_deepspeed`` the ranks are told (``environ``) to shadow it."""
    if args.no_python or (args.module and args.user_script == COMPAT_RUN):
        return args
    head: list[str] = []
    if real is not None and not args.replace_deepspeed:
        logger.info("DeepSpeed is installed (%s): the script's `import deepspeed` runs DeepSpeed itself; "
                    "pass --replace_deepspeed to run deepshard in its place", real)
        head.append(KEEP_DEEPSPEED)
    elif real is not None:
        logger.info("`import deepspeed` in the script runs deepshard in place of the DeepSpeed installed at "
                    "%s (--replace_deepspeed)", real)
        environ[REPLACE_ENV] = "1"
    if args.module:
        head.append("-m")
    return argparse.Namespace(**{**vars(args), "module": True, "user_script": COMPAT_RUN,
                                 "user_args": [*head, args.user_script, *args.user_args]})
