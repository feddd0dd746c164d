"""Destroy the process group deepshard created before the interpreter shuts down.

Why: a default process group left alive at exit is destroyed during the interpreter's (and then the
C++ runtime's) teardown, in no fixed order relative to the threads gloo and the rendezvous store run.
When a joinable ``std::thread`` is destroyed first, the C++ runtime calls ``std::terminate``: the
process prints "terminate called without an active exception" and exits with SIGABRT (134) although
the script finished. Plain ``torch.distributed`` does the same without ``destroy_process_group()``
(about 1 exit in 12 on a 2-core machine, 3 in 8 through the launcher). ``atexit`` handlers run while
the interpreter is still whole, so destroying the group there joins those threads in order.
"""
from __future__ import annotations

import atexit

from deepshard.utils.logging import logger


def destroy_process_group_at_exit() -> None:
    """Register :func:`destroy_if_initialized` to run at interpreter exit (call once per group created).

    Registering twice is harmless: the second call finds no group left."""
    atexit.register(destroy_if_initialized)


def destroy_if_initialized() -> None:
    """Destroy the default process group (and every group made from it) if one is still alive."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - at exit a failed teardown must not turn success into failure
        logger.debug("destroying the process group at exit failed: %s", exc)
