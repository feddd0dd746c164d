"""Run a whole pipeline schedule in simulated time, with no process group: every rank's action list at
once, point-to-point messages through one FIFO channel per ordered pair of ranks (NCCL and gloo match
messages between two ranks in posting order).

The simulator checks what would break a real run, raising ``ScheduleError``:

- a receive whose channel's next message is a different one (wrong order, wrong kind, wrong chunk);
- a deadlock: no rank can advance while some still have actions;
- a data dependency broken: a forward before its activation arrived, a backward before its forward or
  before its output gradient arrived, a weight pass before its input-gradient pass, any pass twice or
  missing;
- a message never received.

and measures: the makespan, each rank's busy time and bubble, and the peak number of micro-batches whose
activations a rank holds (a forward done and its backward, or weight pass, not yet).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from deepshard.pipe.schedule import SENDS, Action, Costs, Kind, Schedule, ScheduleError


PassKey = tuple[int, Kind, int, int]
"""A pass in one batch: (rank, kind, micro-batch, chunk)."""


@dataclass(frozen=True)
class PassTime:
    """One compute pass as simulated: where it ran, what it was, when it started and ended."""

    rank: int
    kind: Kind
    micro_batch: int
    chunk: int
    start: float
    end: float


@dataclass
class SimResult:
    """What a simulated batch measured."""

    makespan: float
    busy: list[float]
    peak_in_flight: list[int]
    finish: list[float] = field(default_factory=list)
    passes: list[PassTime] = field(default_factory=list)
    """Every compute pass in the order it ran (the timeline :mod:`deepshard.pipe.draw` draws)."""

    def stage_bubble(self, rank: int) -> float:
        """Idle share of rank ``rank``'s time over the step: ``1 - busy / makespan``."""
        return 1.0 - self.busy[rank] / self.makespan if self.makespan > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the step: ``1 - sum(busy) / (p * makespan)``."""
        p = len(self.busy)
        return 1.0 - sum(self.busy) / (p * self.makespan) if self.makespan > 0 else 0.0


class _Rank:
    def __init__(self, rank: int, actions: list[Action], micro_batches: int) -> None:
        self.rank, self.actions, self.cursor, self.clock, self.busy = rank, actions, 0, 0.0, 0.0
        self.done: set[tuple[Kind, int, int]] = set()
        self.arrived: set[tuple[Kind, int, int]] = set()
        self.holding: set[tuple[int, int]] = set()
        self.peak = 0
        self.passes: list[PassTime] = []

    def finished(self) -> bool:
        return self.cursor >= len(self.actions)


def simulate(schedule: Schedule, micro_batches: int, chunks: int = 1, costs: Costs | Sequence[Costs] | None = None,
             split_backward: bool | None = None, durations: Mapping[PassKey, float] | None = None) -> SimResult:
    """Run ``schedule`` (``schedule[rank]``) and return its measurements; see the module docstring.

    ``costs`` are per-chunk pass durations, the same on every rank or one ``Costs`` per rank (stages of
    unequal work); ``durations`` overrides them pass by pass, keyed ``(rank, kind, micro_batch, chunk)``
    (a measured run replayed); messages take no time. ``split_backward`` (default: whether the schedule
    holds weight passes) says which backward actions a complete batch needs."""
    p = len(schedule)
    per_rank = list(costs) if isinstance(costs, Sequence) else [costs or Costs()] * p
    if len(per_rank) != p:
        raise ScheduleError(f"costs for {len(per_rank)} ranks given to a schedule of {p} ranks")
    exact = durations or {}
    if split_backward is None:
        split_backward = any(a.kind is Kind.BACKWARD_WEIGHT for acts in schedule for a in acts)
    ranks = [_Rank(r, acts, micro_batches) for r, acts in enumerate(schedule)]
    channels: dict[tuple[int, int], deque[tuple[Action, float]]] = {}
    while not all(r.finished() for r in ranks):
        progressed = False
        for r in ranks:
            while not r.finished() and _advance(r, channels, p, chunks, per_rank[r.rank], exact):
                progressed = True
        if not progressed:
            blocked = "; ".join(f"rank {r.rank} waits at {r.actions[r.cursor]}" for r in ranks if not r.finished())
            raise ScheduleError(f"deadlock: no rank can advance ({blocked})")
    left = {k: [str(a) for a, _ in q] for k, q in channels.items() if q}
    if left:
        raise ScheduleError(f"messages sent but never received: {left}")
    for r in ranks:
        _check_complete(r, micro_batches, chunks, p, split_backward)
    return SimResult(makespan=max(r.clock for r in ranks), busy=[r.busy for r in ranks],
                     peak_in_flight=[r.peak for r in ranks], finish=[r.clock for r in ranks],
                     passes=[t for r in ranks for t in r.passes])


def _advance(r: _Rank, channels: dict, p: int, chunks: int, costs: Costs, durations: Mapping[PassKey, float]) -> bool:
    """Run rank ``r``'s next action if it can run now; False if it waits on a message."""
    a = r.actions[r.cursor]
    if a.kind in SENDS:
        _check_sent_done(r, a)
        channels.setdefault((r.rank, a.peer), deque()).append((a, r.clock))
    elif a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
        queue = channels.get((a.peer, r.rank))
        if not queue:
            return False
        sent, at = queue[0]
        step = 1 if sent.kind is Kind.SEND_ACT else -1
        target_chunk = (sent.chunk * p + a.peer + step) // p  # the chunk of the receiving virtual stage
        if SENDS[sent.kind] is not a.kind or (sent.micro_batch, target_chunk) != (a.micro_batch, a.chunk):
            raise ScheduleError(f"rank {r.rank} posts {a} but the next message from rank {a.peer} is {sent}: "
                                "sends and receives are out of order")
        queue.popleft()
        r.clock = max(r.clock, at)
        r.arrived.add((a.kind, a.micro_batch, a.chunk))
    else:
        _run_compute(r, a, p, chunks, durations.get((r.rank, a.kind, a.micro_batch, a.chunk), costs.of(a.kind)))
    r.cursor += 1
    return True


def _check_sent_done(r: _Rank, a: Action) -> None:
    need = Kind.FORWARD if a.kind is Kind.SEND_ACT else None
    key_ok = ((need, a.micro_batch, a.chunk) in r.done if need else
              any((k, a.micro_batch, a.chunk) in r.done for k in (Kind.BACKWARD, Kind.BACKWARD_INPUT)))
    if not key_ok:
        raise ScheduleError(f"rank {r.rank} runs {a} before computing what it sends")


def _run_compute(r: _Rank, a: Action, p: int, chunks: int, duration: float) -> None:
    vs, last = a.chunk * p + r.rank, p * chunks - 1
    key = (a.kind, a.micro_batch, a.chunk)
    if key in r.done:
        raise ScheduleError(f"rank {r.rank} runs {a} twice")
    unit = (a.micro_batch, a.chunk)
    if a.kind is Kind.FORWARD:
        if vs > 0 and (Kind.RECV_ACT, *unit) not in r.arrived:
            raise ScheduleError(f"rank {r.rank} runs {a} before receiving its input activation")
        r.holding.add(unit)
        r.peak = max(r.peak, len(r.holding))
    elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        if (Kind.FORWARD, *unit) not in r.done:
            raise ScheduleError(f"rank {r.rank} runs {a} before its forward")
        if vs < last and (Kind.RECV_GRAD, *unit) not in r.arrived:
            raise ScheduleError(f"rank {r.rank} runs {a} before receiving its output gradient")
        if a.kind is Kind.BACKWARD:
            r.holding.discard(unit)
    else:
        if (Kind.BACKWARD_INPUT, *unit) not in r.done:
            raise ScheduleError(f"rank {r.rank} runs {a} before its input-gradient pass")
        r.holding.discard(unit)
    r.done.add(key)
    r.passes.append(PassTime(r.rank, a.kind, a.micro_batch, a.chunk, r.clock, r.clock + duration))
    r.clock += duration
    r.busy += duration


def _check_complete(r: _Rank, m: int, chunks: int, p: int, split: bool) -> None:
    kinds = (Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT) if split else (Kind.FORWARD, Kind.BACKWARD)
    missing = [f"{k.value}{i}c{c}" for k in kinds for i in range(m) for c in range(chunks) if (k, i, c) not in r.done]
    if missing:
        raise ScheduleError(f"rank {r.rank} never runs {missing[:8]}{'...' if len(missing) > 8 else ''}")
    if r.holding:
        raise ScheduleError(f"rank {r.rank} still holds activations of {sorted(r.holding)} at the end")


# ------------------------------------------------------------------------------------ formulas
def formula_makespan(name: str, p: int, m: int, chunks: int = 1, costs: Costs | None = None) -> float:
    """The analytic step time (REFERENCE_PARALLEL.md section 7) in the same units as ``simulate``."""
    c = costs or Costs()
    full = c.forward + c.backward
    if name in ("gpipe", "1f1b"):
        return (m + p - 1) * full
    if name == "interleaved":
        return chunks * m * full + (p - 1) * full
    if name == "zb-h1":
        return m * full + (p - 1) * (c.forward + c.backward - 2 * c.backward_weight)
    raise ScheduleError(f"no formula for schedule {name!r}")


def formula_peak_in_flight(name: str, rank: int, p: int, m: int, chunks: int = 1) -> int:
    """Micro-batches (times chunks, for interleaved) whose activations rank ``rank`` holds at most."""
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - rank, m)
    if name == "zb-h1":
        return min(p, m)  # every stage may hold as many as 1F1B's first stage (Qi et al.: same peak)
    if name == "interleaved":
        return min(m * chunks, 2 * (p - rank - 1) + (chunks - 1) * p + 1)
    raise ScheduleError(f"no formula for schedule {name!r}")
