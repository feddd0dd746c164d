"""The one multi-process test harness: start N ranks on gloo, collect results, surface tracebacks.

On a GPU machine ``pytest --device cuda`` runs the same worlds on CUDA (``tests/multiproc/device.py``).

``run_world(fn, world_size, *args)`` starts ``world_size`` rank processes, each with the launcher's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port) over the caller's
``os.environ``, in the caller's working directory and ``sys.path``, calls ``fn(rank, world_size, *args)``
and returns the list of per-rank return values. Any rank's exception is re-raised here with that rank's
traceback; a world that does not finish within ``timeout`` seconds is killed and reported as a hang
naming the ranks that did not finish.

Every rank is a fresh process, forked from one server per pytest session that imported torch, deepshard
and the scenario modules once (multiprocessing's forkserver, ``tests/multiproc/rank_preload.py``): a
world of 2 costs a few hundredths of a CPU second to start instead of ~3.6 s for two spawned
interpreters, and no state passes from one world to the next. ``run_world(..., fresh=True)`` spawns
new interpreters instead, for a check that must see a process that imported nothing yet (what an import
pulls in, the memory an interpreter starts with); ``DEEPSHARD_TEST_SPAWN=1`` spawns every world, to rule
the forkserver out when a failure looks like it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

SPAWN_ENV = "DEEPSHARD_TEST_SPAWN"  # "1": every world spawns fresh interpreters (no forkserver)
PRELOAD = "tests.multiproc.rank_preload"


@dataclass
class WorldStats:
    """How many worlds and rank processes this pytest process started (read by ``tests/timing.py``)."""

    worlds: int = 0
    ranks: int = 0


STATS = WorldStats()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple[Any, ...],
            results: Any, environ: dict[str, str]) -> None:
    # the caller's environment as it is now (a forked rank would otherwise have the forkserver's)
    os.environ.clear()
    os.environ.update(environ)
    from tests.multiproc.device import device_kind, to_host, world_backend

    kind = device_kind()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1", "DEEPSHARD_ACCELERATOR": kind})
    import torch

    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        if kind == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(world_backend(world_size), rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        if kind == "cuda":
            value = to_host(value)
            if torch.cuda.max_memory_allocated() == 0:
                raise RuntimeError(f"rank {rank} ran under --device cuda but never allocated CUDA memory: "
                                   f"{getattr(fn, '__name__', fn)} did not train on the GPU")
        # plain pickle bytes: self-contained (torch's ForkingPickler would pass tensors through
        # shared-memory handles that die with this process)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", traceback.format_exc()))


class WorldError(AssertionError):
    """A rank failed or the world hung."""


def _context(fresh: bool) -> Any:
    """Forkserver with the preloaded server, or spawn (``fresh``, ``DEEPSHARD_TEST_SPAWN=1``, CUDA runs)."""
    from tests.multiproc.device import device_kind

    if fresh or os.environ.get(SPAWN_ENV) == "1" or device_kind() == "cuda" or \
            "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    return ctx


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              fresh: bool = False) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each of ``world_size`` ranks; their return values in rank order.

    ``fresh=True`` spawns new interpreters rather than forking warm ones (see the module docstring)."""
    ctx = _context(fresh)
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, environ), daemon=True)
             for r in range(world_size)]
    STATS.worlds += 1
    STATS.ranks += world_size
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}

    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out) - set(errors))
                raise WorldError(f"world of {world_size} timed out after {timeout:.0f}s; ranks {missing} did "
                                 f"not finish" + _format_errors(errors))
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in out and r not in errors]
                if dead:
                    raise WorldError(f"rank(s) {dead} died with exit codes "
                                     f"{[procs[r].exitcode for r in dead]}" + _format_errors(errors))
                continue
            if status == "ok":
                out[rank] = pickle.loads(value)
            else:
                errors[rank] = value
                # one failure usually blocks the others in a collective: give them a moment, then stop
                deadline = min(deadline, time.monotonic() + 5.0)
        if errors:
            raise WorldError(f"{len(errors)} of {world_size} rank(s) failed" + _format_errors(errors))
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def _format_errors(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
