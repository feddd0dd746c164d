"""Leave the process in an order that cannot abort: the backend's threads finish before the interpreter does.

What aborts (seen in a core dump of a 2-rank gloo job that printed "terminate called without an active
exception" and exited with SIGABRT, 134, after its script had finished): a gloo worker thread finishes a
collective, wakes the waiting main thread, and only then drops its own reference to the work. When that
is the last reference to a tensor the Python side has already let go of, the worker must take the GIL to
release the tensor's Python object. The main thread, holding the GIL, runs to the end of the script and
into interpreter finalization without releasing it; the worker then finds the interpreter finalizing,
``PyThread_exit_thread`` unwinds it through gloo's ``noexcept`` destructor, and the C++ runtime calls
``std::terminate``. Plain ``torch.distributed`` does the same (about 1 exit in 10 with two busy jobs on
2 cores, measured), with or without ``destroy_process_group()``.

The cure is to let those threads run before finalization: an ``atexit`` handler (the interpreter is still
whole there) gives the GIL up for a moment (:data:`SETTLE_S`), so a worker waiting for it takes it,
releases its tensors and goes back to sleep, and then destroys the process group deepshard created.
An engine over a group someone else created (Accelerate, a script that called ``init_process_group``)
registers the settling step alone: the group is left for its owner to destroy.
"""
from __future__ import annotations

import atexit
import sys
import time

from deepshard.utils.logging import logger

SETTLE_S = 0.2  # GIL released this long at exit: a worker blocked on it gets it within a scheduler slice
_REGISTERED: set[str] = set()  # which exit handler this process has: "destroy" (settles too) or "settle"


def destroy_process_group_at_exit() -> None:
    """Settle, then destroy the default process group, at interpreter exit (when deepshard created the group).

    Registering again moves the handler; it never runs twice, and replaces a settle-only handler."""
    atexit.unregister(settle_backend_threads)
    atexit.unregister(destroy_if_initialized)
    atexit.register(destroy_if_initialized)
    _REGISTERED.discard("settle")
    _REGISTERED.add("destroy")


def settle_backend_threads_at_exit() -> None:
    """Give the backend's worker threads the GIL at interpreter exit (a group someone else created, which
    its owner destroys). Does nothing after :func:`destroy_process_group_at_exit`, which settles too."""
    if _REGISTERED:
        return
    atexit.register(settle_backend_threads)
    _REGISTERED.add("settle")


def destroy_if_initialized() -> None:
    """Settle, then destroy the default process group (and every group made from it) if one is alive.

    Settles also when the script destroyed the group itself: objects that still hold it keep its threads."""
    settle_backend_threads()
    dist = sys.modules.get("torch.distributed")  # never imported here: imports fail once shutdown began
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - at exit a failed teardown must not turn success into failure
        logger.debug("destroying the process group at exit failed: %s", exc)


def settle_backend_threads(seconds: float = SETTLE_S) -> None:
    """Release the GIL for ``seconds`` so backend threads waiting for it finish their work's cleanup
    (before the group's destructor would join them, and before finalization would stop them)."""
    time.sleep(seconds)
