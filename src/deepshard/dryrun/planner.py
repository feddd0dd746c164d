"""``deepshard plan``: the configuration that fits a memory budget with the most throughput, found by dry runs.

Every choice of ``plan_space`` that can be built is dry-run as one rank of the job (the first and the last
rank: with a pipeline they hold different stages), two optimizer steps each. A dry run gives the
choice's peak of live tensor bytes per rank (the figure ``test_dryrun.py`` shows equal to a real run's),
the CPU time of a step and the collective bytes of a step. A choice fits when its peak is at most the
memory given; among those the pick has the best *headroom-adjusted throughput*:

    step time  = measured compute per step + collective volume per step / bandwidth
    throughput = global batch / step time
    score      = throughput x min(1, headroom / 10%)        headroom = 1 - peak / memory

so a choice that leaves less than 10% of the memory free is discounted (allocator fragmentation and
what the dry run cannot see eat into the last few percent). For each layout (tp, pp, stage, offload,
activation checkpointing) the micro batches are tried from small to large and stop at the first that does
not fit: a larger one needs more memory.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from deepshard.dryrun.plan_model import ModelFile, training
from deepshard.dryrun.plan_space import Choice, Space, choices, config_for, refusal

FULL_SCORE_HEADROOM = 0.10


@dataclass
class Trial:
    """One choice's outcome: refused (``reason``), or dry-run figures and whether it fits."""

    choice: Choice
    reason: Optional[str] = None
    peak_bytes: int = 0
    step_s: float = 0.0
    comm_bytes: int = 0
    throughput: float = 0.0
    score: float = 0.0
    fits: bool = False


@dataclass
class Plan:
    """The search's result: every trial, the pick (None when nothing fits) and its config."""

    space: Space
    memory_bytes: int
    bandwidth: float
    trials: list[Trial] = field(default_factory=list)
    pick: Optional[Trial] = None
    config: Optional[dict[str, Any]] = None


def _layout(choice: Choice) -> tuple[Any, ...]:
    return choice.tp, choice.pp, choice.stage, choice.offload, choice.checkpointing


def _measure(model: ModelFile, choice: Choice, base: dict[str, Any], space: Space, steps: int) -> Trial:
    """Dry-run ``choice`` as the first and the last rank; the larger peak and the slower step count. A
    step of the dry run takes ``space.dry_micro_steps`` micro-batches; its time and collective bytes are
    scaled to the real count (linear in the micro-batches: the per-step parts are counted a little high)."""
    from deepshard.dryrun.runner import run_callable

    trial = Trial(choice)
    dry = space.dry_micro_steps(choice)
    config, scale, world_size = config_for(base, choice, space, dry), space.micro_steps(choice) / dry, space.world_size
    for rank in sorted({0, world_size - 1}):
        try:
            report = run_callable(training(model, choice, config, steps), world_size, rank, max_steps=0,
                                  name=choice.label())
        except Exception as err:  # noqa: BLE001 - deepshard's own refusal (plan check, config) is the reason
            trial.reason = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            return trial
        last = report.steps[-1] if report.steps else None
        trial.peak_bytes = max(trial.peak_bytes, report.peak_bytes)
        trial.step_s = max(trial.step_s, scale * last.cpu_s if last else 0.0)
        trial.comm_bytes = max(trial.comm_bytes, int(scale * sum(c.volume_bytes for c in last.collectives)) if last else 0)
    return trial


def score(trial: Trial, global_batch: int, memory_bytes: int, bandwidth: float) -> None:
    """Fill ``trial``'s throughput, fit and score (see the module docstring)."""
    step = trial.step_s + trial.comm_bytes / bandwidth
    trial.throughput = global_batch / step if step > 0 else math.inf
    trial.fits = trial.peak_bytes <= memory_bytes
    headroom = 1.0 - trial.peak_bytes / memory_bytes
    trial.score = trial.throughput * min(1.0, max(0.0, headroom) / FULL_SCORE_HEADROOM) if trial.fits else 0.0
    if not trial.fits:
        trial.reason = (f"predicted peak {trial.peak_bytes / 2**20:,.1f} MiB exceeds the memory per rank "
                        f"{memory_bytes / 2**20:,.1f} MiB")


def search(model: ModelFile, base: dict[str, Any], space: Space, memory_bytes: int, bandwidth: float = 10e9,
           steps: int = 2, progress: Callable[[Trial], None] | None = None,
           measure: Callable[[Choice], Trial] | None = None) -> Plan:
    """Try the choices of ``space`` (see the module docstring) and pick one. Offload and activation
    checkpointing only save memory at a cost in time, so they are tried for a (tp, pp, stage) only when it
    does not fit its largest micro batch without them. ``measure``: how a choice is dry-run (default: as
    ``steps`` steps of ``model`` on ``base``; a caller searching several budgets passes one that remembers)."""
    if measure is None:
        measure = lambda choice: _measure(model, choice, base, space, steps)  # noqa: E731
    plan = Plan(space, memory_bytes, bandwidth)
    too_big: set[tuple[Any, ...]] = set()
    plain_fits: set[tuple[int, int, int]] = set()
    for choice in choices(space):
        why = _skip(choice, space, model, too_big, plain_fits)
        if why is not None:
            plan.trials.append(Trial(choice, reason=why))
            continue
        trial = dataclasses.replace(measure(choice))  # a copy: scoring writes into it
        if trial.reason is None:
            score(trial, space.global_batch, memory_bytes, bandwidth)
            if not trial.fits:
                too_big.add(_layout(choice))
            elif choice.offload == "none" and not choice.checkpointing and choice.micro == _largest_micro(choice, space):
                plain_fits.add((choice.tp, choice.pp, choice.stage))
        plan.trials.append(trial)
        if progress is not None:
            progress(trial)
    fitting = [t for t in plan.trials if t.fits]
    if fitting:
        plan.pick = max(fitting, key=lambda t: (t.score, t.throughput, -t.peak_bytes))
        plan.config = config_for(base, plan.pick.choice, space)
    return plan


def _largest_micro(choice: Choice, space: Space) -> int:
    dp = space.world_size // (choice.tp * choice.pp)
    return max((m for m in space.micros if space.global_batch % (m * dp) == 0), default=0)


def _skip(choice: Choice, space: Space, model: ModelFile, too_big: set[tuple[Any, ...]],
          plain_fits: set[tuple[int, int, int]]) -> str | None:
    why = refusal(choice, space, model.pipeline, model.checkpointable, model.tensor_parallel)
    if why is None and _layout(choice) in too_big:
        why = "a smaller micro batch of this layout already exceeds the memory"
    if why is None and (choice.offload != "none" or choice.checkpointing) \
            and (choice.tp, choice.pp, choice.stage) in plain_fits:
        why = "not needed: this tp, pp and stage fit their largest micro batch without offload or recomputation"
    return why


def to_json(plan: Plan) -> dict[str, Any]:
    """The plan as data: the pick, the config and every trial."""
    def trial(t: Trial) -> dict[str, Any]:
        return {**dataclasses.asdict(t.choice), "label": t.choice.label(),
                **{k: v for k, v in dataclasses.asdict(t).items() if k != "choice"}}

    return {"world_size": plan.space.world_size, "global_batch": plan.space.global_batch,
            "memory_per_rank": plan.memory_bytes, "bandwidth": plan.bandwidth,
            "pick": trial(plan.pick) if plan.pick else None, "config": plan.config,
            "trials": [trial(t) for t in plan.trials]}


def format_plan(plan: Plan, shown: int = 40) -> str:
    """The report ``deepshard plan`` prints: the pick, then the choices tried, best first."""
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    lines = [f"deepshard plan: {plan.space.world_size} ranks, global batch {plan.space.global_batch}, "
             f"{mib(plan.memory_bytes)} per rank, collectives at {plan.bandwidth / 1e9:g} GB/s"]
    if plan.pick is None:
        lines.append("no choice fits: every one exceeds the memory or is refused (reasons below)")
    else:
        p = plan.pick
        lines.append(f"pick: {p.choice.label()}: predicted peak {mib(p.peak_bytes)} "
                     f"({100 * (1 - p.peak_bytes / plan.memory_bytes):.0f}% headroom), {p.throughput:,.1f} samples/s")
    ran = sorted((t for t in plan.trials if t.peak_bytes), key=lambda t: -t.score)
    for t in ran[:shown]:
        mark = "*" if t is plan.pick else ("fits" if t.fits else "no")
        lines.append(f"  {mark:>4} {t.choice.label():<48} peak {mib(t.peak_bytes):>12} {t.throughput:>10,.1f} samples/s"
                     + (f"  ({t.reason})" if t.reason else ""))
    refused: dict[str, int] = {}
    for t in plan.trials:
        if not t.peak_bytes and t.reason:
            refused[t.reason] = refused.get(t.reason, 0) + 1
    lines += [f"  refused x{n}: {reason}" for reason, n in sorted(refused.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)
