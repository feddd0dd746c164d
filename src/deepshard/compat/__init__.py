"""``import deepspeed`` answered by deepshard, for code that imports DeepSpeed itself (Accelerate, the
``transformers`` Trainer, scripts written for DeepSpeed).

    import deepshard.compat
    deepshard.compat.install()      # from now on, in this process, `import deepspeed` is deepshard
    from accelerate import Accelerator, DeepSpeedPlugin

It is opt-in, per process: :func:`install` here, ``deepshard launch`` (which runs every rank through
``python -m deepshard.compat.run``), or ``from deepshard.accelerate import ...``. Nothing is written to
site-packages, so a real DeepSpeed installed in the same environment (``make bench`` installs one as a
baseline) is neither broken nor shadowed by default: while a real ``deepspeed`` is importable,
:func:`install` refuses unless told ``replace_installed=True`` (or ``DEEPSHARD_REPLACE_DEEPSPEED=1``).

What resolves: ``deepspeed`` -> ``deepshard``; ``deepspeed.X`` -> ``deepshard.X`` except where the paths
differ (:mod:`deepshard.compat.aliases`); modules of DeepSpeed features deepshard lacks raise an
ImportError naming the feature. ``importlib.metadata`` reports a ``deepspeed`` distribution of version
``0.19.8+deepshard.<version>`` (:func:`deepshard.compat.finder.shim_version`). :func:`install` also
arms the CPU adjustments of Accelerate and transformers (:mod:`deepshard.compat.hf_patches`).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys

from deepshard.compat.finder import DEEPSPEED_CONTRACT, AliasModule, DeepSpeedFinder, shim_version
from deepshard.compat.hf_patches import install_hooks

REPLACE_ENV = "DEEPSHARD_REPLACE_DEEPSPEED"

__all__ = ["DEEPSPEED_CONTRACT", "REPLACE_ENV", "install", "installed_deepspeed", "is_installed", "shim_version",
           "uninstall"]


def _finder() -> DeepSpeedFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, DeepSpeedFinder)), None)


def is_installed() -> bool:
    """Whether ``import deepspeed`` resolves to deepshard in this process."""
    return _finder() is not None


def installed_deepspeed() -> str | None:
    """Where a real DeepSpeed is importable from (its package path), or None. Checked without the shim."""
    if is_installed():
        raise RuntimeError("installed_deepspeed() looks past the shim; call it before deepshard.compat.install()")
    module = sys.modules.get("deepspeed")
    if module is not None:
        return str(getattr(module, "__file__", None) or module)
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        return None
    return str(spec.origin or list(spec.submodule_search_locations or []))


def install(replace_installed: bool | None = None) -> None:
    """Make ``import deepspeed`` resolve to deepshard in this process (idempotent).

    A real DeepSpeed that is importable is not shadowed unless ``replace_installed`` is True (None reads
    ``DEEPSHARD_REPLACE_DEEPSPEED=1``); a ``deepspeed`` module already imported can never be replaced."""
    if is_installed():
        return
    imported = sys.modules.get("deepspeed")
    if imported is not None and not isinstance(imported, AliasModule):
        where = getattr(imported, "__file__", "?")
        raise RuntimeError(f"deepspeed is already imported in this process (from {where}); "
                           "call deepshard.compat.install() before anything imports deepspeed")
    if replace_installed is None:
        replace_installed = os.environ.get(REPLACE_ENV, "") == "1"
    real = installed_deepspeed()
    if real is not None and not replace_installed:
        raise RuntimeError(
            f"a real DeepSpeed is installed ({real}) and deepshard.compat.install() will not shadow it unasked: "
            f"pass install(replace_installed=True), set {REPLACE_ENV}=1 (deepshard launch --replace_deepspeed), "
            "or pip uninstall deepspeed")
    if real is not None:
        from deepshard.utils.logging import logger

        logger.info("deepshard.compat: 'import deepspeed' now means deepshard in this process; the DeepSpeed "
                    "installed at %s is shadowed (asked for with replace_installed)", real)
    sys.meta_path.insert(0, DeepSpeedFinder())
    install_hooks()
    importlib.invalidate_caches()


def uninstall() -> None:
    """Undo :func:`install`: remove the finder and forget the ``deepspeed`` alias modules imported so far."""
    for finder in [f for f in sys.meta_path if isinstance(f, DeepSpeedFinder)]:
        sys.meta_path.remove(finder)
    for name in [n for n, m in sys.modules.items() if isinstance(m, AliasModule)]:
        del sys.modules[name]
    importlib.invalidate_caches()
