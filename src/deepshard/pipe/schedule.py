"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it performs in one
training batch. No process group is needed to build or read them (``simulate.py`` runs them all).

Vocabulary. ``p`` ranks, ``m`` micro-batches, ``v`` model chunks per rank (interleaved schedules); the
model is cut into ``p * v`` *virtual stages*; virtual stage ``vs`` lives on rank ``vs % p`` as chunk
``vs // p`` (Megatron's layout), so with ``v = 1`` virtual stage and rank coincide.

Each rank's list holds compute actions (``FORWARD``, ``BACKWARD``, or the split ``BACKWARD_INPUT`` /
``BACKWARD_WEIGHT`` of the zero-bubble schedules) and the point-to-point actions around them: a
``RECV_ACT`` right before a forward that needs an upstream activation, a ``SEND_ACT`` right after a
forward whose output goes downstream, ``RECV_GRAD`` / ``SEND_GRAD`` the same way for backward. Sends are
non-blocking (the engine posts ``isend`` and waits for them at the end of the batch); receives block.

Schedules:

- ``gpipe``: fill-drain (Huang et al. 2019): every forward, then every backward.
- ``one_f_one_b``: 1F1B / PipeDream-Flush (Narayanan et al. 2021): ``p - s - 1`` warm-up forwards on rank
  ``s``, then one forward and one backward in turn, then the remaining backwards.
- ``interleaved_one_f_one_b``: 1F1B over ``v`` chunks per rank (Narayanan et al. 2021, section 2.2).
- ``zero_bubble_h1``: ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B's order of forwards
  and input-gradient backwards, with each weight-gradient pass deferred into what would be idle time,
  never holding more micro-batches than 1F1B does.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable


class ScheduleError(ValueError):
    """A schedule that cannot run: bad sizes, a receive with no matching send, a deadlock."""


class Kind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "BI"
    BACKWARD_WEIGHT = "BW"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"


COMPUTE = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
SENDS = {Kind.SEND_ACT: Kind.RECV_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD}


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: ``kind`` on ``micro_batch`` for model ``chunk`` (0 unless
    interleaved). Point-to-point actions also name the ``peer`` rank."""

    kind: Kind
    micro_batch: int
    chunk: int = 0
    peer: int = -1

    def __str__(self) -> str:
        peer = f"@{self.peer}" if self.peer >= 0 else ""
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{self.kind.value}{self.micro_batch}{chunk}{peer}"


Schedule = list[list[Action]]
"""``schedule[rank]`` is that rank's ordered action list."""


@dataclass(frozen=True)
class PipeShape:
    """Sizes of one pipelined batch."""

    stages: int
    micro_batches: int
    chunks: int = 1

    def __post_init__(self) -> None:
        for name in ("stages", "micro_batches", "chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{name} must be a positive integer, got {value!r}")

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def rank_of(self, virtual_stage: int) -> int:
        return virtual_stage % self.stages

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.stages + rank


# ---------------------------------------------------------------------------------- compute orders
def _check_rank(shape: PipeShape, rank: int) -> None:
    if not 0 <= rank < shape.stages:
        raise ScheduleError(f"rank {rank} is outside 0..{shape.stages - 1} of a {shape.stages}-stage pipeline")


def gpipe_order(shape: PipeShape, rank: int) -> list[Action]:
    """Fill-drain: all forwards, then all backwards (same micro-batch order)."""
    _check_rank(shape, rank)
    m = shape.micro_batches
    return [Action(Kind.FORWARD, i) for i in range(m)] + [Action(Kind.BACKWARD, i) for i in range(m)]


def one_f_one_b_order(shape: PipeShape, rank: int) -> list[Action]:
    """1F1B: ``min(p - rank - 1, m)`` warm-up forwards, then forward/backward pairs, then cool-down."""
    _check_rank(shape, rank)
    p, m = shape.stages, shape.micro_batches
    warmup = min(p - rank - 1, m)
    order = [Action(Kind.FORWARD, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(Kind.FORWARD, warmup + i), Action(Kind.BACKWARD, i)]
    order += [Action(Kind.BACKWARD, i) for i in range(m - warmup, m)]
    return order


def interleaved_order(shape: PipeShape, rank: int) -> list[Action]:
    """Interleaved 1F1B (Megatron's order): micro-batches advance in groups of ``p`` through the chunks;
    ``2 (p - rank - 1) + (v - 1) p`` warm-up forwards, then forward/backward pairs, then cool-down.
    Needs ``m`` to be a multiple of ``p`` (as Megatron does)."""
    _check_rank(shape, rank)
    p, m, v = shape.stages, shape.micro_batches, shape.chunks
    if m % p != 0:
        raise ScheduleError(f"interleaved 1F1B needs the micro-batch count ({m}) to be a multiple of the "
                            f"stage count ({p}); use {((m + p - 1) // p) * p} micro-batches or another schedule")
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = (k // p) % v
        return group * p + within % p, (v - 1 - chunk) if backward else chunk

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [Action(Kind.FORWARD, *unit(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(Action(Kind.FORWARD, *unit(warmup + k, False)))
        order.append(Action(Kind.BACKWARD, *unit(k, True)))
    order += [Action(Kind.BACKWARD, *unit(k, True)) for k in range(total - warmup, total)]
    return order


def zero_bubble_h1_order(shape: PipeShape, rank: int, costs: "Costs | None" = None) -> list[Action]:
    """ZB-H1: 1F1B's forwards and input-gradient backwards; weight-gradient passes are deferred while an
    input-gradient or forward of another rank's critical path can go first, and forced before a forward
    that would exceed 1F1B's in-flight bound ``min(p - rank, m)``.

    The placement of the deferred passes depends on the pass costs, so the whole pipeline is
    list-scheduled once (``costs``, default F = B_in = W = 1) and this rank's order returned."""
    _check_rank(shape, rank)
    if shape.chunks != 1:
        raise ScheduleError(f"zero_bubble_h1 runs one chunk per rank, got chunks={shape.chunks}")
    return _zb_h1_all(shape, costs or Costs(forward=1.0, backward_input=1.0, backward_weight=1.0))[rank]


@dataclass(frozen=True)
class Costs:
    """Relative durations of the passes (per chunk); ``backward`` is the full (unsplit) backward."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight

    def of(self, kind: Kind) -> float:
        return {Kind.FORWARD: self.forward, Kind.BACKWARD: self.backward, Kind.BACKWARD_INPUT: self.backward_input,
                Kind.BACKWARD_WEIGHT: self.backward_weight}.get(kind, 0.0)


def _zb_h1_all(shape: PipeShape, costs: Costs) -> list[list[Action]]:
    """List-schedule ZB-H1 over all ranks in simulated time (every rank follows its 1F1B order with the
    backward split; a pending weight pass runs when the next pass is not ready, or when the in-flight
    bound forces it)."""
    p, m = shape.stages, shape.micro_batches
    plans = [[Action(Kind.BACKWARD_INPUT, a.micro_batch) if a.kind is Kind.BACKWARD else a
              for a in one_f_one_b_order(shape, r)] for r in range(p)]
    bound = [min(p, m)] * p  # the paper keeps the peak of 1F1B (stage 0 holds p micro-batches)
    done_f = [[-1.0] * m for _ in range(p)]   # time each forward finished, per rank
    done_b = [[-1.0] * m for _ in range(p)]   # time each input-gradient backward finished
    clock, cursor = [0.0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    in_flight = [0] * p
    out: list[list[Action]] = [[] for _ in range(p)]
    while any(cursor[r] < len(plans[r]) or pending_w[r] for r in range(p)):
        best = None  # (start time, rank, action)
        for r in range(p):
            cand = _zb_next(r, plans[r], cursor[r], pending_w[r], in_flight[r], bound[r], done_f, done_b, clock[r], p)
            if cand is not None and (best is None or cand[0] < best[0]):
                best = (cand[0], r, cand[1])
        if best is None:
            raise ScheduleError("zero_bubble_h1 list scheduling found no runnable pass (internal error)")
        start, r, action = best
        end = start + costs.of(action.kind)
        clock[r] = end
        out[r].append(action)
        if action.kind is Kind.BACKWARD_WEIGHT:
            pending_w[r].remove(action.micro_batch)
            in_flight[r] -= 1
            continue
        cursor[r] += 1
        if action.kind is Kind.FORWARD:
            done_f[r][action.micro_batch] = end
            in_flight[r] += 1
        else:
            done_b[r][action.micro_batch] = end
            pending_w[r].append(action.micro_batch)
    return out


def _zb_next(r: int, plan: list[Action], cursor: int, pending: list[int], in_flight: int, bound: int,
             done_f: list[list[float]], done_b: list[list[float]], clock: float, p: int
             ) -> tuple[float, Action] | None:
    """The (start time, action) rank ``r`` would run next, or None if it must wait on another rank."""
    weight = (clock, Action(Kind.BACKWARD_WEIGHT, pending[0])) if pending else None
    if cursor >= len(plan):
        return weight
    nxt = plan[cursor]
    i = nxt.micro_batch
    if nxt.kind is Kind.FORWARD:
        if in_flight >= bound:
            return weight
        ready = 0.0 if r == 0 else done_f[r - 1][i]
    else:
        if done_f[r][i] < 0:
            return weight
        ready = done_f[r][i] if r == p - 1 else done_b[r + 1][i]
    if ready < 0:  # the upstream/downstream pass has not been scheduled yet
        return weight
    start = max(clock, ready)
    if weight is not None and start > clock:
        return weight  # fill the wait with a weight pass
    return start, nxt


# --------------------------------------------------------------------------------- communication
def with_communication(shape: PipeShape, rank: int, order: list[Action]) -> list[Action]:
    """Insert the point-to-point actions around ``order``'s compute actions (see the module docstring)."""
    last = shape.virtual_stages - 1
    out: list[Action] = []
    for a in order:
        if a.kind not in COMPUTE:
            raise ScheduleError(f"compute orders hold compute actions only, got {a}")
        vs = shape.virtual_stage(rank, a.chunk)
        if a.kind is Kind.FORWARD:
            if vs > 0:
                out.append(Action(Kind.RECV_ACT, a.micro_batch, a.chunk, shape.rank_of(vs - 1)))
            out.append(a)
            if vs < last:
                out.append(Action(Kind.SEND_ACT, a.micro_batch, a.chunk, shape.rank_of(vs + 1)))
        elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
            if vs < last:
                out.append(Action(Kind.RECV_GRAD, a.micro_batch, a.chunk, shape.rank_of(vs + 1)))
            out.append(a)
            if vs > 0:
                out.append(Action(Kind.SEND_GRAD, a.micro_batch, a.chunk, shape.rank_of(vs - 1)))
        else:
            out.append(a)
    return out


OrderFn = Callable[[PipeShape, int], list[Action]]
SCHEDULES: dict[str, OrderFn] = {
    "gpipe": gpipe_order,
    "1f1b": one_f_one_b_order,
    "interleaved": interleaved_order,
    "zb-h1": zero_bubble_h1_order,
}
"""Names accepted by ``build_schedule`` and the config's ``pipeline.schedule``."""

ALIASES = {"fill_drain": "gpipe", "fill-drain": "gpipe", "one_f_one_b": "1f1b", "interleaved_1f1b": "interleaved",
           "zero_bubble": "zb-h1", "zb_h1": "zb-h1", "zbh1": "zb-h1"}


def schedule_name(name: str) -> str:
    """The canonical schedule name for ``name`` (case-insensitive, aliases accepted)."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ScheduleError(f"pipeline.schedule={name!r} is not a schedule; use one of {sorted(SCHEDULES)}")
    return key


def build_schedule(name: str, stages: int, micro_batches: int, chunks: int = 1) -> Schedule:
    """Every rank's full action list (compute and communication) for schedule ``name``."""
    key = schedule_name(name)
    if chunks != 1 and key != "interleaved":
        raise ScheduleError(f"schedule {key!r} runs one chunk per rank, got chunks={chunks}; use 'interleaved'")
    shape = PipeShape(stages, micro_batches, chunks)
    order_fn = SCHEDULES[key]
    return [with_communication(shape, r, order_fn(shape, r)) for r in range(stages)]


def rank_schedule(name: str, rank: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    """One rank's action list (what the pipeline engine executes)."""
    return build_schedule(name, stages, micro_batches, chunks)[rank]
