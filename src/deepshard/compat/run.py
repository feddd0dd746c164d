"""``python -m deepshard.compat.run [--keep_deepspeed] [-m] TARGET [ARGS...]``: run a script (or, with
``-m``, a module) as ``__main__`` with ``import deepspeed`` resolving to deepshard. The ``deepshard``
launcher and ``deepshard launch`` start every Python rank this way (:func:`route_ranks` is the launcher's side),
so the user's script (Accelerate, the Trainer, a DeepSpeed script) needs no change.

A real DeepSpeed installed next to deepshard is shadowed only with ``DEEPSHARD_REPLACE_DEEPSPEED=1``
(``--replace_deepspeed`` on either launcher); the launcher passes ``--keep_deepspeed`` otherwise, and the
script's ``import deepspeed`` is the real one (see :func:`deepshard.compat.install`).

A deepshard config error (:class:`deepshard.config.base.ConfigError`, the same on every rank) ends the
rank with a one-line message and exit status 1, without the traceback (``DEEPSHARD_VERBOSE=1``, the
launcher's ``--verbose``, shows it). Under the launcher (``DEEPSHARD_ERROR_DIR`` set) the message goes to
``rank<RANK>.txt`` there and the launcher prints each distinct message once. Any other exception is
written to torch's elastic error file (``TORCHELASTIC_ERROR_FILE``) before the rank ends with it.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import MutableMapping

from deepshard.compat import REPLACE_ENV, install, installed_deepspeed, is_installed
from deepshard.launcher.report import VERBOSE_ENV, report
from deepshard.utils.logging import logger

COMPAT_RUN = "deepshard.compat.run"
KEEP_DEEPSPEED = "--keep_deepspeed"


def real_deepspeed() -> str | None:
    """Where a real DeepSpeed is importable from in this environment, or None (nothing is imported)."""
    return None if is_installed() else installed_deepspeed()  # installed: this process answers it: look past


def route_ranks(args: argparse.Namespace, real: str | None, environ: MutableMapping[str, str]) -> argparse.Namespace:
    """The launcher's side: ``args`` (its parsed command line) with the user's script run through this module
    (``--no_python`` and a launch already routed here are left as they are). ``real`` is :func:`real_deepspeed`'s
    answer; with ``--replace_deepspeed`` the ranks are told (``environ``) to shadow it."""
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


def _run(args: list[str], as_module: bool) -> None:
    sys.argv = args
    if as_module:
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    # the launcher passes --local_rank=N right after the program it starts (this module); the script
    # gets it right after its own path, where DeepSpeed's launcher puts it
    local_rank = args[:1] if args and args[0].startswith("--local_rank=") else []
    args = args[len(local_rank):]
    keep = bool(args) and args[0] == KEEP_DEEPSPEED
    args = args[1:] if keep else args
    as_module = bool(args) and args[0] == "-m"
    args = args[1:] if as_module else args
    if not args:
        raise SystemExit(f"usage: python -m deepshard.compat.run [{KEEP_DEEPSPEED}] [-m] SCRIPT_OR_MODULE [ARGS...]")
    args = [args[0], *local_rank, *args[1:]]
    if not keep:
        install()
    from deepshard.config.base import ConfigError

    try:
        _run(args, as_module)
    except ConfigError as exc:
        if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
            raise
        report(str(exc))
        raise SystemExit(1) from None
    except Exception as exc:
        _record(exc)
        raise


def _record(exc: BaseException) -> None:
    """Under torch's elastic agent (``TORCHELASTIC_ERROR_FILE`` set), write the traceback to the rank's error
    file, as torch's ``@record`` does, so the launcher's report shows it first."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    try:
        ErrorHandler().record_exception(exc)
    except Exception:  # noqa: BLE001 -- the report falls back to the rank's output
        pass


if __name__ == "__main__":
    main()
