"""The one place where deepshard adjusts Accelerate and transformers: DeepSpeed on a CPU, and no ZeRO-3 hang
in ``main_process_first``.

Neither library runs DeepSpeed without a GPU; deepshard does (gloo). Two adjustments, applied only when
deepshard's device is the CPU (``deepshard.accelerator.get_accelerator().kind == "cpu"``: no GPU, or
``DEEPSHARD_ACCELERATOR=cpu`` as ``deepshard launch`` sets for ``use_cpu: true``):

1. ``accelerate.state.PartialState._prepare_backend``: with DeepSpeed requested
   (``ACCELERATE_USE_DEEPSPEED=true``) in a launched process (``LOCAL_RANK`` set) it finds no GPU backend
   and reports a world of one process on every rank, though deepshard runs gloo with N. Adjusted: the
   backend is ``gloo`` (Accelerate's multi-CPU type), so Accelerate sees the real world (process count
   and index, main process, sharded dataloaders) and then switches to its DeepSpeed type as usual.
2. ``transformers.training_args.is_torch_bf16_gpu_available``: ``TrainingArguments(bf16=True)`` is refused
   without a GPU unless ``use_cpu=True``, which turns DeepSpeed off. Adjusted: True on a CPU device
   (torch's CPU kernels compute bf16; deepshard keeps fp32 master weights).

And one guard, on any device:

3. ``accelerate.state.PartialState._goes_first`` (``main_process_first``), on any device: the block runs
   as a rank-ordered section (:mod:`deepshard.utils.rank_order`), where ``zero.Init`` refuses to start: a
   ZeRO-3 model built inside ``main_process_first`` fails at once with the reason instead of hanging
   every rank (accelerate #3709). Not version-bound: it only adds that check.

Each is applied when its module is imported (an import hook, so neither library is imported early);
adjustments 1 and 2 only for the versions tested (:data:`TESTED`): another version fails with a message
saying so, except a transformers newer than the tested series, which is adjusted with one warning
(:data:`NEWER_WARNS`). On a GPU only the guard applies.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import re
import sys
import types
from typing import Any, Callable

TESTED: dict[str, tuple[str, ...]] = {"accelerate": ("1.15",), "transformers": ("5.23",)}
"""Distribution -> the major.minor series the adjustments were written and tested against."""

NEWER_WARNS: tuple[str, ...] = ("transformers",)
"""Distributions whose releases after the tested series are adjusted with a warning instead of refused:
transformers' adjustment replaces one function that answers a yes/no question, which a newer release
cannot break; Accelerate's wraps a private method whose signature a newer release may change."""

UNTESTED_ENV = "DEEPSHARD_ALLOW_UNTESTED_HF"


def on_cpu() -> bool:
    """Whether deepshard trains on the CPU in this process (the only case that needs adjusting)."""
    from deepshard.accelerator import get_accelerator

    return get_accelerator().kind == "cpu"


def _series(version: str) -> tuple[int, int] | None:
    """``"5.24.0.dev0"`` -> ``(5, 24)``; None when the version does not start with two numbers."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def check_version(dist: str) -> None:
    """Raise unless the installed ``dist`` is a tested series (or ``DEEPSHARD_ALLOW_UNTESTED_HF=1``); a
    release of a :data:`NEWER_WARNS` distribution after the tested series logs one warning instead."""
    version = importlib.metadata.version(dist)
    if any(version == t or version.startswith(t + ".") for t in TESTED[dist]):
        return
    if os.environ.get(UNTESTED_ENV) == "1":
        return
    tested = ", ".join(f"{t}.x" for t in TESTED[dist])
    newest = _series(TESTED[dist][-1])
    installed = _series(version)
    if dist in NEWER_WARNS and installed is not None and newest is not None and installed > newest:
        from deepshard.utils.logging import logger

        logger.warning("deepshard adjusts %s to run DeepSpeed on a CPU and was tested with %s %s; %s is newer and "
                       "is adjusted the same way (see deepshard/compat/hf_patches.py; pip install '%s%s' for the "
                       "tested series)", dist, dist, tested, version, dist, tested_range(dist))
        return
    raise RuntimeError(
        f"deepshard must adjust {dist} to run DeepSpeed on a CPU and was tested with {dist} {tested}, but "
        f"{version} is installed: pip install '{dist}{tested_range(dist)}' (the tested series; from a deepshard "
        f"checkout, pip install '.[hf]'), or set {UNTESTED_ENV}=1 to try this version anyway (see "
        "deepshard/compat/hf_patches.py for what is adjusted)")


def tested_range(dist: str) -> str:
    """The pip version range of the tested series of ``dist``, e.g. ``>=1.15,<1.16`` (pyproject's extras
    say the same)."""
    series = TESTED[dist]
    first, last = series[0], series[-1]
    major, minor = last.split(".")
    return f">={first},<{major}.{int(minor) + 1}"


def _deepspeed_launched() -> bool:
    return (os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
            and int(os.environ.get("LOCAL_RANK", "-1")) != -1)


def patch_accelerate_state(module: types.ModuleType) -> None:
    """Adjustment 1 (see the module docstring) on ``accelerate.state``."""
    cls = module.PartialState
    original = cls._prepare_backend
    if getattr(original, "_deepshard_adjusted", False) or not on_cpu():
        return
    check_version("accelerate")
    multi_cpu = module.DistributedType.MULTI_CPU

    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False,
                         backend: str | None = None) -> tuple[str | None, Any]:
        found = original(self, cpu, sagemaker_dp, backend)
        if not cpu and not sagemaker_dp and backend in (None, "gloo") and _deepspeed_launched():
            return "gloo", multi_cpu
        return found

    setattr(_prepare_backend, "_deepshard_adjusted", True)
    cls._prepare_backend = _prepare_backend


def patch_training_args(module: types.ModuleType) -> None:
    """Adjustment 2 (see the module docstring) on ``transformers.training_args``."""
    original = module.is_torch_bf16_gpu_available
    if getattr(original, "_deepshard_adjusted", False) or not on_cpu():
        return
    check_version("transformers")

    def is_torch_bf16_gpu_available(*args: Any, **kwargs: Any) -> bool:
        return True

    setattr(is_torch_bf16_gpu_available, "_deepshard_adjusted", True)
    module.is_torch_bf16_gpu_available = is_torch_bf16_gpu_available


def guard_main_process_first(module: types.ModuleType) -> None:
    """Adjustment 3, on any device and version that has it: ``PartialState._goes_first`` (the body of
    ``main_process_first`` / ``local_main_process_first``) runs as a rank-ordered section, so a ZeRO-3
    ``zero.Init`` started inside it fails at once with the reason instead of hanging every rank."""
    from deepshard.utils.rank_order import rank_ordered_section

    original = getattr(module.PartialState, "_goes_first", None)
    if original is None or getattr(original, "_deepshard_adjusted", False):
        return

    def _goes_first(self: Any, is_main: bool) -> Any:
        with rank_ordered_section("accelerate's main_process_first()"):
            yield from original(self, is_main)

    setattr(_goes_first, "_deepshard_adjusted", True)
    module.PartialState._goes_first = _goes_first


def patch_state_module(module: types.ModuleType) -> None:
    """Everything adjusted in ``accelerate.state``."""
    guard_main_process_first(module)
    patch_accelerate_state(module)


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "accelerate.state": patch_state_module,
    "transformers.training_args": patch_training_args,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[types.ModuleType], None]) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies :data:`PATCHES` to their modules right after those are first executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def install_hooks() -> None:
    """Apply the adjustments to modules already imported, and to the others when they are (idempotent)."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, PatchOnImport())
