"""Run a training script, unchanged, as rank ``r`` of an ``N``-rank job in this one process.

The script's ``deepshard.initialize`` runs for real over a fake process group (``fake_world.py``): the
config, the plan check, the grid and its groups, the pipeline cut, tensor-parallel splits, ZeRO
partitions and offload decisions are those of the real job, at any N. Forward, backward and the
optimizer step run on this rank's own shard; collectives complete without moving data. What it costs
is watched (``observe.py``) and reported (``report.py``). Checkpoints the script saves are written into
a scratch directory (only this rank's files exist), never into the script's own directory.
"""
from __future__ import annotations

import contextlib
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from deepshard.dryrun.fake_world import fake_world
from deepshard.dryrun.observe import Observer, StopDryRun
from deepshard.dryrun.report import DryRunReport, EngineFigures


@contextlib.contextmanager
def _environment(world_size: int, rank: int) -> Iterator[None]:
    """The launcher's variables for rank ``rank`` (one device per process: local rank 0)."""
    values = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "DEEPSHARD_DRYRUN": "1"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _script_argv(script: Path, argv: Sequence[str]) -> Iterator[None]:
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def run_script(script: str | Path, argv: Sequence[str], world_size: int, rank: int = 0,
               max_steps: int = 3) -> DryRunReport:
    """Dry-run ``script argv...`` as ``rank`` of ``world_size`` (see the module docstring); stop it after
    ``max_steps`` optimizer steps of its first engine (0: run it to its end)."""
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"dry run: no script at {path}")

    def body() -> None:
        with _script_argv(path, argv):
            runpy.run_path(str(path), run_name="__main__")

    return run_callable(body, world_size, rank, max_steps, str(path))


def run_callable(body: Callable[[], Any], world_size: int, rank: int = 0, max_steps: int = 3,
                 name: str = "<function>", memory: bool = True) -> DryRunReport:
    """Dry-run ``body()`` (a function doing what a training script does) as ``rank`` of ``world_size``."""
    with _environment(world_size, rank), fake_world(world_size, rank, _device_type()) as mailbox:
        return measure(body, max_steps, name, dry=True, memory=memory, mailbox=mailbox)


def measure(body: Callable[[], Any], max_steps: int = 3, name: str = "<function>", dry: bool = False,
            memory: bool = True, mailbox: Any = None) -> DryRunReport:
    """Run ``body()`` in the process group that exists (a fake one in a dry run, a real one otherwise),
    watched as a dry run watches it: the same figures from a real run, for comparison. ``dry``: the
    world is fake (checkpoints go to a scratch directory). ``memory``: track live tensor bytes (a
    dispatch mode over every op: slower; without it the peak reads 0)."""
    import torch.distributed as dist

    from deepshard.profiling.memory_tracker import TensorMemoryTracker

    observer = Observer(max_steps, redirect_saves=dry, mailbox=mailbox)
    tracker = TensorMemoryTracker(_device_type()) if memory else contextlib.nullcontext()
    outcome = "ran to its end"
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    start = time.perf_counter()
    with observer.watching(), tracker:
        try:
            body()
        except StopDryRun:
            outcome = f"stopped after {max_steps} step(s)"
        except SystemExit as exit_:
            if exit_.code not in (None, 0):
                raise RuntimeError(f"dry run: {name} exited with status {exit_.code}") from exit_
        peak = tracker.peak_bytes - tracker.start_bytes if memory else 0  # what the script allocated at its peak
        return _report(observer, peak, world_size, rank, name, outcome, time.perf_counter() - start)


def _device_type() -> str:
    from deepshard.accelerator import get_accelerator

    return get_accelerator().device.type


def _report(observer: Observer, peak: int, world_size: int, rank: int, name: str, outcome: str,
            wall_s: float) -> DryRunReport:
    engines = [_engine_figures(seen.engine, seen.init_s, seen.states) for seen in observer.engines]
    ledger = observer.ledger
    notes = [f"{d}: saved during this dry run (this rank's files only), so not loaded" for d in observer.skipped_loads]
    if not engines:
        notes.append("the script created no engine (deepshard.initialize was not called)")
    checkpoint = {**ledger.summary(), "written": {Path(p).name: n for p, n in ledger.written.items()},
                  "read": {Path(p).name: n for p, n in ledger.read.items()}}
    return DryRunReport(world_size, rank, name, outcome, wall_s, observer.groups_created, observer.groups_joined,
                        observer.group_s, peak, engines, list(observer.steps), checkpoint, notes)


def _engine_figures(engine: Any, init_s: float, states: dict[str, int]) -> EngineFigures:
    dims, coord = engine.topology.dims, engine.topology.coord
    try:
        states = dict(engine.memory_report())  # as the script left it
    except Exception:  # noqa: BLE001 - destroyed by the script: its last step's figures
        pass
    return EngineFigures({"pp": dims.pp, "dp": dims.dp, "tp": dims.tp, "sp": dims.sp},
                         {"pp": coord.pp, "dp": coord.dp, "tp": coord.tp, "sp": coord.sp},
                         int(engine.zero_optimization_stage()), init_s, states)
