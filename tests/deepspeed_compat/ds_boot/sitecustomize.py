"""Imported first by every python of DeepSpeed's venv that the tests start: DeepSpeed's C++ ops are never built.

``tests/deepspeed_compat/ds_support.py`` puts this folder first on ``PYTHONPATH`` of every DeepSpeed process
(and so of the ranks those processes spawn); Python's ``site`` imports ``sitecustomize`` from there at start.

On its CPU accelerator DeepSpeed 0.19.8 JIT-compiles C++ ops through ``torch.utils.cpp_extension.load``: a
shared-memory all-reduce when its comm backend starts (``deepspeed_shm_comm``), a fused Adam when a config
names Adam/AdamW (``fused_adam``), a CPU Adam when the optimizer is offloaded (``cpu_adam``). Each takes
minutes of a C++ build on a fresh venv (CI makes one per run), and a build killed halfway leaves a ``lock``
file that every later run waits on, silently and forever. No test reads what those kernels compute: the
collectives run on gloo, and the engines whose optimizer a test steps are given torch's. So ``load`` is
replaced here: the shared-memory op is absent (DeepSpeed then calls torch.distributed, as where it does not
compile), the optimizer ops are a stand-in whose set-up calls succeed and whose kernels raise, saying so, and
any other op raises at once, naming it. ``DEEPSHARD_TEST_DS_BUILD_OPS=1`` leaves ``load`` alone: the real
builds, into ``TORCH_EXTENSIONS_DIR`` (``ds_support`` sets it inside DeepSpeed's venv).
"""
from __future__ import annotations

import os
from typing import Any, Callable

BUILD_ENV = "DEEPSHARD_TEST_DS_BUILD_OPS"
ABSENT_OPS = ("deepspeed_shm_comm",)  # DeepSpeed checks for None and falls back to torch.distributed
OPTIMIZER_OPS = ("fused_adam", "cpu_adam", "cpu_adagrad", "cpu_lion")


class KernelNotBuilt:
    """An optimizer op whose set-up calls (``create_*``, ``destroy_*``) do nothing and whose kernels raise."""

    def __init__(self, op: str) -> None:
        self.op = op

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        if name.startswith(("create_", "destroy_")):
            return lambda *args, **kwargs: 0

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"DeepSpeed's {self.op}.{name} kernel is not built in the tests "
                               f"(tests/deepspeed_compat/ds_boot/sitecustomize.py): give the engine a torch "
                               f"optimizer, or run with {BUILD_ENV}=1 to build the op")
        return refuse


def load_without_building(name: str, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.cpp_extension.load`` for the tests: no op is compiled (see the module docstring)."""
    if name in ABSENT_OPS:
        return None
    if name in OPTIMIZER_OPS:
        return KernelNotBuilt(name)
    raise RuntimeError(f"DeepSpeed tried to JIT-build its C++ op {name!r}, which the tests do not build (minutes "
                       f"of C++ on every fresh venv): add a stand-in to tests/deepspeed_compat/ds_boot/"
                       f"sitecustomize.py, or run with {BUILD_ENV}=1 to build it")


if os.environ.get(BUILD_ENV) != "1":
    import torch.utils.cpp_extension

    torch.utils.cpp_extension.load = load_without_building
