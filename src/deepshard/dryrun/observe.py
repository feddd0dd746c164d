"""What a dry run watches while the user's script runs: the engines ``initialize`` returns, how long it
took, the process groups created, each optimizer step's collectives and CPU time, the live tensor peak,
and the checkpoint files touched.

Everything is attached for the run only (:meth:`Observer.watching`) and removed after it: the engine's
own counters do the counting (its comms logger, ``checkpoint.ledger``); this module only takes
snapshots at step boundaries and wraps a few entry points of this one process.
"""
from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist

from deepshard.checkpoint.ledger import IOLedger, track_io
from deepshard.comm.logger import OpStats
from deepshard.dryrun.patching import swapped


class StopDryRun(Exception):
    """Raised inside the script after the requested number of optimizer steps (caught by the runner)."""


@dataclass
class Collective:
    """One kind of collective in one step: op (``tp:all_reduce``), group size, calls, bytes handed in."""

    op: str
    group_size: int
    calls: int
    bytes: int
    volume_bytes: int


@dataclass
class StepWindow:
    """One optimizer step of one engine: its collectives and the time it took: ``cpu_s`` is the CPU time of
    the thread that trains (compute and the Python issuing collectives; not a backend's own threads, not
    time spent waiting for peers), ``wall_s`` the elapsed time."""

    engine: int
    step: int
    cpu_s: float
    wall_s: float
    collectives: list[Collective]

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.collectives)


@dataclass
class EngineSeen:
    """An engine the script created, with what it cost to build."""

    engine: Any
    init_s: float
    states: dict[str, int] = field(default_factory=dict)
    """``engine.memory_report()`` after its latest step (the engine may be destroyed by the script's end)."""
    last: dict[tuple[str, int], OpStats] = field(default_factory=dict)
    cpu_mark: float = 0.0
    wall_mark: float = 0.0


def _snapshot(stats: dict[tuple[str, int], OpStats]) -> dict[tuple[str, int], OpStats]:
    return {k: OpStats(v.calls, v.elements, v.bytes, v.volume_elements, v.volume_bytes) for k, v in stats.items()}


def _delta(now: dict[tuple[str, int], OpStats], before: dict[tuple[str, int], OpStats]) -> list[Collective]:
    rows = []
    for (op, size), stats in sorted(now.items()):
        old = before.get((op, size), OpStats())
        if stats.calls > old.calls:
            rows.append(Collective(op, size, stats.calls - old.calls, stats.bytes - old.bytes,
                                   stats.volume_bytes - old.volume_bytes))
    return rows


class Observer:
    """Collects a dry run's figures (see the module docstring); ``max_steps``: stop the script after that many
    optimizer steps of its first engine (0: let it run to its end). ``redirect_saves``: write checkpoints
    into a scratch directory (a dry run, where only this rank's files would exist), not the script's."""

    def __init__(self, max_steps: int = 0, redirect_saves: bool = True, mailbox: Any = None) -> None:
        self.max_steps = max_steps
        self.redirect_saves = redirect_saves
        self.mailbox = mailbox
        """The fake world's (a dry run's): a pipeline stage after the first learns there what it receives."""
        self.engines: list[EngineSeen] = []
        self.steps: list[StepWindow] = []
        self.groups_created = 0
        self.groups_joined = 0
        self.group_s = 0.0
        self.ledger = IOLedger()
        self.scratch: Optional[Path] = None
        self.redirected: dict[str, Path] = {}
        self.skipped_loads: list[str] = []

    # -------------------------------------------------------------------------------- installation
    @contextlib.contextmanager
    def watching(self) -> Iterator["Observer"]:
        """Inside the block: engines, groups, steps and checkpoint files are recorded."""
        import deepshard

        original = deepshard.initialize
        replacements = {original: self._initialize_wrapper(original)}
        replacements.update({fn: self._group_wrapper(fn) for fn in _group_makers()})
        with swapped(replacements), tempfile.TemporaryDirectory(prefix="deepshard-dryrun-") as scratch, \
                track_io() as ledger:
            self.scratch, self.ledger = Path(scratch), ledger
            yield self

    def _initialize_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def initialize(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self._adopt(out[0], time.perf_counter() - start)
            return out

        initialize.__wrapped__ = original  # type: ignore[attr-defined]
        initialize.__doc__ = original.__doc__
        return initialize

    def _group_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def make_group(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            group = original(*args, **kwargs)
            self.group_s += time.perf_counter() - start
            created, joined = _groups_made(group)
            self.groups_created += created
            self.groups_joined += joined
            return group

        make_group.__wrapped__ = original  # type: ignore[attr-defined]
        return make_group

    # ------------------------------------------------------------------------------------- engines
    def _adopt(self, engine: Any, init_s: float) -> None:
        seen = EngineSeen(engine, init_s, dict(engine.memory_report()))
        seen.last = _snapshot(engine.comms_logger.by_group)
        seen.cpu_mark, seen.wall_mark = time.thread_time(), time.perf_counter()
        self.engines.append(seen)
        index = len(self.engines) - 1
        for name in ("step", "train_batch"):  # a step ends in one or the other, by engine kind
            if callable(getattr(type(engine), name, None)):
                setattr(engine, name, self._step_wrapper(index, getattr(engine, name)))
        if self.mailbox is not None and getattr(engine, "stage_id", 0) > 0:
            engine.train_batch = self._first_batch_wrapper(engine, engine.train_batch)
        if self.redirect_saves:
            for name, wrap in (("save_checkpoint", self._save_wrapper), ("load_checkpoint", self._load_wrapper)):
                setattr(engine, name, wrap(getattr(engine, name)))

    def _step_wrapper(self, index: int, method: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            seen = self.engines[index]
            before = seen.engine.global_steps
            out = method(*args, **kwargs)
            if seen.engine.global_steps != before:
                self._close_window(index, seen)
            return out

        return step

    def _first_batch_wrapper(self, engine: Any, method: Callable[..., Any]) -> Callable[..., Any]:
        """Before a later pipeline stage's first batch: what the stage before it would send (a dry run)."""
        def train_batch(data_iter: Any = None, *args: Any, **kwargs: Any) -> Any:
            if not self._expecting.get(id(engine)):
                data_iter = self._expect_stage_input(engine, data_iter)
                self._expecting[id(engine)] = True
            return method(data_iter, *args, **kwargs)

        self._expecting: dict[int, bool] = getattr(self, "_expecting", {})
        return train_batch

    def _expect_stage_input(self, engine: Any, data_iter: Any) -> Any:
        from deepshard.dryrun.pipe_shapes import peek_inputs, stage_input_header

        source = data_iter
        if source is None and engine.training_dataloader is not None:
            source = iter(engine.training_dataloader)
        inputs, replay = peek_inputs(source)
        if inputs is None:
            raise RuntimeError(f"dry run of pipeline stage {engine.stage_id}: it needs a sample batch to know what "
                               "the stage before it sends; pass the data iterator to train_batch() on every stage "
                               "(or give training_data= to initialize)")
        header = stage_input_header(engine.module, inputs, engine.stage_id)
        prev = engine.topology.dims.stage_rank(engine.global_rank, engine.stage_id - 1)

        def respond(buffer: Any) -> bool:
            if buffer.dtype == header.dtype and buffer.numel() == header.numel():
                buffer.copy_(header)
            else:
                buffer.zero_()  # the activations themselves: zeros of the right shape
            return True

        self.mailbox.expect(prev, respond)
        return replay if data_iter is not None else None

    def _close_window(self, index: int, seen: EngineSeen) -> None:
        now = _snapshot(seen.engine.comms_logger.by_group)
        cpu, wall = time.thread_time(), time.perf_counter()
        self.steps.append(StepWindow(index, int(seen.engine.global_steps), cpu - seen.cpu_mark, wall - seen.wall_mark,
                                     _delta(now, seen.last)))
        seen.states = dict(seen.engine.memory_report())
        seen.last, seen.cpu_mark, seen.wall_mark = now, time.thread_time(), time.perf_counter()
        if self.max_steps and index == 0 and sum(1 for s in self.steps if s.engine == 0) >= self.max_steps:
            raise StopDryRun()

    def mark(self) -> None:
        """Start every engine's next step window now (after the script's own set-up between steps)."""
        for seen in self.engines:
            seen.last = _snapshot(seen.engine.comms_logger.by_group)
            seen.cpu_mark, seen.wall_mark = time.thread_time(), time.perf_counter()

    # --------------------------------------------------------------------------------- checkpoints
    def _scratch_for(self, save_dir: Any) -> Path:
        key = str(Path(save_dir).resolve())
        if self.scratch is None:
            raise RuntimeError("save_checkpoint in a dry run outside Observer.watching()")
        if key not in self.redirected:
            self.redirected[key] = self.scratch / f"save{len(self.redirected)}"
        return self.redirected[key]

    def _save_wrapper(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def save_checkpoint(save_dir: Any, *args: Any, **kwargs: Any) -> Any:
            return method(str(self._scratch_for(save_dir)), *args, **kwargs)  # never into the user's directory

        return save_checkpoint

    def _load_wrapper(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def load_checkpoint(load_dir: Any, *args: Any, **kwargs: Any) -> Any:
            if str(Path(load_dir).resolve()) in self.redirected:
                self.skipped_loads.append(str(load_dir))  # holds this rank's files only: nothing to resume
                return None, None
            return method(load_dir, *args, **kwargs)

        return load_checkpoint


def _group_makers() -> list[Callable[..., Any]]:
    names = ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group")
    return [getattr(dist, n) for n in names if callable(getattr(dist, n, None))]


def _groups_made(result: Any) -> tuple[int, int]:
    """``(created, joined)`` by one call: ``new_group`` / ``split_group`` give this rank's group (or none),
    ``new_subgroups*`` give ``(this rank's, all of them)``."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], list):
        return len(result[1]), 1 if result[0] is not None else 0
    joined = result is not None and result != dist.GroupMember.NON_GROUP_MEMBER
    return 1, int(joined)
