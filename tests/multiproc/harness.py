"""The one multi-process test harness: spawn N ranks on gloo, collect results, surface tracebacks.

On a GPU machine ``pytest --device cuda`` runs the same worlds on CUDA (``tests/multiproc/device.py``).

``run_world(fn, world_size, *args)`` starts ``world_size`` fresh interpreters (spawn), each with the
launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port), calls
``fn(rank, world_size, *args)`` and returns the list of per-rank return values. Any rank's exception is
re-raised here with that rank's traceback; a world that does not finish within ``timeout`` seconds is
killed and reported as a hang naming the ranks that did not finish.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple[Any, ...],
            results: Any) -> None:
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


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import time

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
