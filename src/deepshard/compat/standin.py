"""``python -m deepshard.compat.standin on|off|status``: deepshard as the environment's DeepSpeed.

``on`` writes ``deepshard-standin.pth`` into this Python's site-packages (or ``--site-dir``). From then on
every Python process of the environment, including the ones ``accelerate launch`` and ``torchrun`` start,
resolves ``import deepspeed`` to deepshard whenever no real DeepSpeed is installed
(:mod:`deepshard.compat.standin_hook`: it asks only after every other finder, so it never shadows a real
one, and imports nothing of deepshard until ``deepspeed`` is asked for). ``off`` removes the file;
``status`` says what ``import deepspeed`` means here. ``DEEPSHARD_STANDIN=0`` turns the hook off for one
process.

This is the one step that makes the unchanged ``accelerate launch --config_file zero3.yaml train.py`` of
TRL's and Accelerate's documentation use deepshard. ``deepshard launch`` (same flags, same YAML) needs
no step at all and runs DeepSpeed on a CPU too; ``deepshard.compat.install()`` is the per-process form.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "deepshard-standin.pth"


def hook_path() -> Path:
    return Path(__file__).resolve().with_name("standin_hook.py")


def pth_line() -> str:
    """The ``.pth`` line: run the hook file by path if it still exists (an uninstalled deepshard leaves
    no error at every start-up, only a stale file)."""
    path = str(hook_path())
    return (f"import os; p = {path!r}; os.path.exists(p) and exec(compile(open(p).read(), p, 'exec'), "
            "{'__name__': 'deepshard_standin'})\n")


def site_dir(given: str | None) -> Path:
    return Path(given) if given else Path(sysconfig.get_paths()["purelib"])


def real_deepspeed() -> str | None:
    """Where a real DeepSpeed is importable from (looked up without any deepshard finder), or None."""
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("deepspeed")
    return None if spec is None else str(spec.origin or list(spec.submodule_search_locations or []))


def turn_on(directory: Path) -> str:
    target = directory / PTH_NAME
    target.write_text(pth_line())
    real = real_deepspeed()
    note = (f"; a real DeepSpeed is installed ({real}) and stays what 'import deepspeed' means until it is "
            "uninstalled (pip uninstall deepspeed)") if real else ""
    return f"wrote {target}: 'import deepspeed' is deepshard in every process of this environment{note}"


def turn_off(directory: Path) -> str:
    target = directory / PTH_NAME
    if not target.exists():
        return f"nothing to remove: {target} does not exist"
    target.unlink()
    return f"removed {target}: 'import deepspeed' no longer finds deepshard in new processes"


def status(directory: Path) -> str:
    target = directory / PTH_NAME
    real = real_deepspeed()
    if real:
        state = "on" if target.exists() else "off"
        return f"'import deepspeed' is the real DeepSpeed ({real}); the stand-in is {state}"
    if target.exists():
        return f"'import deepspeed' is deepshard ({target})"
    found = importlib.util.find_spec("deepspeed") is not None
    return ("'import deepspeed' is answered in this process only (deepshard.compat.install() ran)" if found
            else "'import deepspeed' fails here: no DeepSpeed installed, and the stand-in is off "
                 "(python -m deepshard.compat.standin on)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deepshard.compat.standin", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["on", "off", "status"])
    parser.add_argument("--site-dir", help="the site-packages directory to write to (default: this Python's)")
    args = parser.parse_args(argv)
    directory = site_dir(args.site_dir)
    print({"on": turn_on, "off": turn_off, "status": status}[args.action](directory))


if __name__ == "__main__":
    sys.exit(main())
