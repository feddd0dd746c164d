"""``python -m deepshard.compat.run [-m] TARGET [ARGS...]``: run a script (or, with ``-m``, a module) as
``__main__`` with ``import deepspeed`` resolving to deepshard. ``deepshard launch`` starts every rank this
way, so the user's script (Accelerate, the Trainer) needs no change.

A real DeepSpeed installed next to deepshard is shadowed only with ``DEEPSHARD_REPLACE_DEEPSPEED=1``
(``deepshard launch --replace_deepspeed``); otherwise this refuses with the reason (see
:func:`deepshard.compat.install`).
"""
from __future__ import annotations

import os
import runpy
import sys

from deepshard.compat import install


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    as_module = bool(args) and args[0] == "-m"
    if as_module:
        args = args[1:]
    if not args:
        raise SystemExit("usage: python -m deepshard.compat.run [-m] SCRIPT_OR_MODULE [ARGS...]")
    install()
    sys.argv = args
    if as_module:
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
