"""``deepspeed.runtime.pipe.schedule``: DeepSpeed's pipeline instruction classes and its clocked schedules,
as a view of deepshard's schedules-as-data (:mod:`deepshard.pipe.schedule`).

A DeepSpeed schedule yields, clock tick by clock tick, the instructions one stage executes
(``LoadMicroBatch``, ``ForwardPass``, ``SendActivation`` ...); a tick is a point where every stage could
synchronise. Here the *actions* come from deepshard's schedule for the stage (``1f1b`` for
:class:`TrainSchedule`, the forwards of ``gpipe`` for :class:`InferenceSchedule`, with their sends and
receives) and are laid on DeepSpeed's clock:

* training: forward and backward take turns, a stage computing forwards on ticks of its own parity:
  ``F(i)`` at tick ``2i + s`` and ``B(i)`` at tick ``2i + 2S - 1 - s`` (stage ``s`` of ``S``); inference:
  ``F(i)`` at tick ``i + s``;
* a receive sits on the tick of the compute that needs it, a send on the tick after the compute that
  produced it; the first and last stages load their micro-batch on its forward tick (first thing in an
  inference tick, right before the forward in a training one); the last tick of a training batch also
  reduces tied and data-parallel gradients and steps the optimizer;
* a micro-batch's buffer is ``i % num_pipe_buffers()``.
"""
from __future__ import annotations

from typing import Any, Iterator

from deepshard.pipe.schedule import Action, Kind, rank_schedule

__all__ = ["BackwardPass", "BufferOpInstruction", "DataParallelSchedule", "ForwardPass", "InferenceSchedule",
           "LoadMicroBatch", "OptimizerStep", "PipeInstruction", "PipeSchedule", "RecvActivation", "RecvGrad",
           "ReduceGrads", "ReduceTiedGrads", "SendActivation", "SendGrad", "TrainSchedule"]


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """``base(arg, key=value)`` with every value's repr."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


class PipeInstruction:
    """One instruction for a pipeline engine; its keyword arguments are attributes."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return call_to_str(self.name, **self.kwargs)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.kwargs == self.kwargs  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after the gradient reductions)."""


class ReduceGrads(PipeInstruction):
    """Reduce gradients over the stage's data-parallel group."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of modules tied across stages."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on one pipeline buffer."""

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Load the next micro-batch into a buffer (first stage: inputs; last stage: labels)."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's forward on a buffer."""


class BackwardPass(BufferOpInstruction):
    """Run the stage's backward for a buffer."""


class SendActivation(BufferOpInstruction):
    """Send a buffer's output activation to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's activation into a buffer."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of a buffer's input to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of a buffer's output from the next stage."""


_INSTRUCTION = {Kind.FORWARD: ForwardPass, Kind.BACKWARD: BackwardPass, Kind.SEND_ACT: SendActivation,
                Kind.RECV_ACT: RecvActivation, Kind.SEND_GRAD: SendGrad, Kind.RECV_GRAD: RecvGrad}


class PipeSchedule:
    """A stage's schedule for one batch: iterating it yields each clock tick's instruction list."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        if not 0 <= stage_id < stages:
            raise ValueError(f"stage_id {stage_id} is outside 0..{stages - 1} of a {stages}-stage pipeline")
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id
        self.prev_stage, self.next_stage = stage_id - 1, stage_id + 1
        self.it: Iterator[list[PipeInstruction]] | None = None

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Each tick's instructions."""
        raise NotImplementedError(f"{type(self).__name__} must implement steps()")

    def num_pipe_buffers(self) -> int:
        """Buffers the engine allocates for this stage."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        if not self._valid_micro_batch(micro_batch_id):
            raise ValueError(f"micro-batch {micro_batch_id} is outside 0..{self.micro_batches - 1}")
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def __iter__(self) -> "PipeSchedule":
        self.it = None
        return self

    def __next__(self) -> list[PipeInstruction]:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)

    def _ticks(self, actions: list[Action], total: int, tick_of: Any, order: dict[Kind, int],
               load_order: int) -> list[list[Any]]:
        """``actions`` on the clock: ``tick_of(action)`` places each; within a tick instructions sort by
        ``order`` (the micro-batch load by ``load_order``), DeepSpeed's order within its ticks."""
        ticks: list[list[tuple[int, PipeInstruction]]] = [[] for _ in range(total)]
        loads = self.is_first_stage or self.is_last_stage
        for action in actions:
            tick = tick_of(action)
            buffer = self._buffer_idx(action.micro_batch)
            ticks[tick].append((order[action.kind], _INSTRUCTION[action.kind](buffer)))
            if action.kind is Kind.FORWARD and loads:
                ticks[tick].append((load_order, LoadMicroBatch(buffer)))
        return [[instr for _, instr in sorted(tick, key=lambda pair: pair[0])] for tick in ticks]


class TrainSchedule(PipeSchedule):
    """1F1B training (deepshard's ``1f1b`` actions) on DeepSpeed's alternating forward/backward clock."""

    def num_pipe_buffers(self) -> int:
        """Forwards in flight on this stage: its distance to the last stage (at least 2)."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def steps(self) -> Iterator[list[PipeInstruction]]:
        s, last = self.stage_id, 2 * self.stages - 1 - self.stage_id
        compute_tick = {Kind.FORWARD: lambda i: 2 * i + s, Kind.BACKWARD: lambda i: 2 * i + last}
        after = {Kind.SEND_ACT: Kind.FORWARD, Kind.SEND_GRAD: Kind.BACKWARD}
        needs = {Kind.RECV_ACT: Kind.FORWARD, Kind.RECV_GRAD: Kind.BACKWARD}

        def tick_of(action: Action) -> int:
            if action.kind in after:
                return compute_tick[after[action.kind]](action.micro_batch) + 1
            return compute_tick[needs.get(action.kind, action.kind)](action.micro_batch)

        order = {Kind.SEND_GRAD: 0, Kind.RECV_GRAD: 0, Kind.SEND_ACT: 1, Kind.RECV_ACT: 1, Kind.FORWARD: 3,
                 Kind.BACKWARD: 3}
        total = 2 * (self.micro_batches + self.stages - 1)
        actions = rank_schedule("1f1b", s, self.stages, self.micro_batches)
        ticks = self._ticks(actions, total, tick_of, order, load_order=2)
        ticks[-1] += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        yield from ticks


class InferenceSchedule(PipeSchedule):
    """Forward-only pipelining (deepshard's forwards with their sends and receives), one forward a tick;
    two buffers that micro-batches use in turn."""

    def num_pipe_buffers(self) -> int:
        return 2

    def steps(self) -> Iterator[list[PipeInstruction]]:
        s = self.stage_id
        forwards = [a for a in rank_schedule("gpipe", s, self.stages, self.micro_batches)
                    if a.kind in (Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT)]

        def tick_of(action: Action) -> int:
            return action.micro_batch + s + (1 if action.kind is Kind.SEND_ACT else 0)

        # an even stage sends before it receives, an odd one receives first (they pair up without waiting)
        send_first = s % 2 == 0
        order = {Kind.SEND_ACT: 0 if send_first else 1, Kind.RECV_ACT: 1 if send_first else 0, Kind.FORWARD: 3}
        yield from self._ticks(forwards, self.micro_batches + self.stages - 1, tick_of, order, load_order=-1)


class DataParallelSchedule(PipeSchedule):
    """One stage, gradient accumulation: load, forward and backward each micro-batch, then reduce and step."""

    def num_pipe_buffers(self) -> int:
        return 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0),
                                           BackwardPass(buffer_id=0)]
            if step_id == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds
