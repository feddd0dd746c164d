"""What the forkserver of the test worlds imports once, so that each rank forked from it starts warm.

``tests/multiproc/harness.py`` starts ranks with multiprocessing's forkserver: one server process per
pytest session imports this module (torch, torch.distributed, deepshard's modules and the scenario
modules the ranks run), then forks a fresh process for every rank of every world. A rank so started
costs a few hundredths of a CPU second instead of the ~1.8 s of a spawned interpreter importing torch
and deepshard (and the ~1.2 s more of torch._dynamo, which torch imports at the first optimizer a process
builds), and it still begins from the same state: nothing but imports happened in the server.

Two rules keep the fork safe. The server never runs a torch operation (an OpenMP or intra-op thread pool
created before ``fork`` is unusable in the child), so OpenMP is pinned to one thread before torch loads
and nothing here computes. The generator torch seeds at start is put back after the imports, so an unseeded draw in a rank is what
it would be in a spawned interpreter (Python's ``random`` reseeds itself in each child). And the imported
objects are moved out of the garbage collector's sight
(``gc.freeze``): a child's first full collection would otherwise touch, and so copy, every page the
server filled.
"""
from __future__ import annotations

import gc
import importlib
import os
import pkgutil

os.environ["OMP_NUM_THREADS"] = "1"  # read once by OpenMP when torch loads: no thread pool in the server

import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401

_FIRST_RNG = torch.random.get_rng_state()  # a new interpreter's generator, before any import could draw

import tests.multiproc  # noqa: E402

# deepshard imports lazily; these are the modules nearly every rank reaches. torch._dynamo first: torch wraps
# Optimizer.__init__ in torch._disable_dynamo, which imports torch._dynamo (and sympy) when a process builds
# its first optimizer, about 1.2 CPU seconds in every rank that builds an engine if the server has not
# (0.04 s with it here); importing it starts no thread and runs no torch operation
EAGER = ("torch._dynamo", "deepshard", "deepshard.bootstrap", "deepshard.engine", "deepshard.config", "deepshard.zero",
         "deepshard.comm", "deepshard.pipe", "deepshard.checkpoint", "deepshard.runtime.lr_schedules",
         "tests.multiproc.device", "tests.multiproc.harness")


def _preload() -> list[str]:
    """Import the modules ranks need; a module that fails to import is left to fail in the rank that
    needs it, with its own traceback (returns the names that failed)."""
    names = list(EAGER) + sorted(f"tests.multiproc.{m.name}" for m in pkgutil.iter_modules(tests.multiproc.__path__)
                                 if not m.name.startswith(("test_", "rank_preload")))
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the rank importing it reports the error
            failed.append(name)
    return failed


FAILED = _preload()
torch.random.set_rng_state(_FIRST_RNG)  # ranks start from the generator a spawned interpreter has
gc.collect()
gc.freeze()
