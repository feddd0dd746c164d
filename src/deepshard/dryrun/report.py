"""A dry run's figures for one rank, as data (:class:`DryRunReport`, JSON-ready) and as the text
``deepshard dryrun`` prints."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from deepshard.dryrun.observe import StepWindow


@dataclass
class EngineFigures:
    """One engine the script built: its grid, this rank's place in it, and its model states by category."""

    grid: dict[str, int]
    coord: dict[str, int]
    zero_stage: int
    init_s: float
    model_states: dict[str, int]


@dataclass
class DryRunReport:
    """Everything a dry run measured for one rank of a ``world_size``-rank job."""

    world_size: int
    rank: int
    script: str
    outcome: str
    wall_s: float
    groups_created: int
    groups_joined: int
    group_s: float
    peak_bytes: int
    engines: list[EngineFigures] = field(default_factory=list)
    steps: list[StepWindow] = field(default_factory=list)
    checkpoint: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def init_s(self) -> float:
        return sum(e.init_s for e in self.engines)

    def steady_step(self, engine: int = 0) -> StepWindow | None:
        """The engine's last step recorded (its first may include one-time work)."""
        mine = [s for s in self.steps if s.engine == engine]
        return mine[-1] if mine else None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["init_s"] = self.init_s
        return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _grid(e: EngineFigures) -> str:
    g, c = e.grid, e.coord
    return (f"pp={g.get('pp', 1)} dp={g.get('dp', 1)} tp={g.get('tp', 1)} sp={g.get('sp', 1)}; this rank at "
            f"pp={c.get('pp', 0)} dp={c.get('dp', 0)} tp={c.get('tp', 0)}, ZeRO stage {e.zero_stage}")


def format_report(report: DryRunReport) -> str:
    """The text ``deepshard dryrun`` prints."""
    lines = [f"deepshard dryrun: rank {report.rank} of {report.world_size} ranks, {report.script} ({report.outcome}, "
             f"{report.wall_s:.1f} s)",
             f"process groups   {report.groups_created} created, {report.groups_joined} joined by this rank "
             f"({report.group_s:.3f} s)",
             f"peak memory      {_mib(report.peak_bytes)} of live tensors (measured on this rank's own work)"]
    for i, e in enumerate(report.engines):
        lines.append(f"engine {i}         {_grid(e)}; initialize {e.init_s:.3f} s")
        states = ", ".join(f"{k} {_mib(v)}" for k, v in e.model_states.items() if v and k != "total")
        lines.append(f"  model states   {_mib(e.model_states.get('total', 0))}: {states or 'none'}")
        lines += _step_lines(report, i)
    ck = report.checkpoint
    if ck:
        lines.append(f"checkpoints      wrote {ck['files_written']} files ({_mib(ck['bytes_written'])}), "
                     f"read {ck['files_read']} files ({_mib(ck['bytes_read'])})")
    lines += [f"note             {n}" for n in report.notes]
    return "\n".join(lines)


def _step_lines(report: DryRunReport, engine: int) -> list[str]:
    mine = [s for s in report.steps if s.engine == engine]
    if not mine:
        return ["  steps          none taken"]
    step = mine[-1]
    cpu = ", ".join(f"{s.cpu_s:.3f}" for s in mine)
    lines = [f"  steps          {len(mine)}; CPU s per step {cpu}; step {step.step}'s collectives "
             f"({_mib(step.bytes)} handed in):"]
    width = max([24] + [len(c.op) + 2 for c in step.collectives])
    lines.append(f"    {'collective':<{width}}{'group':>7}{'calls':>7}{'bytes':>14}")
    for c in step.collectives:
        lines.append(f"    {c.op:<{width}}{c.group_size:>7}{c.calls:>7}{c.bytes:>14,}")
    return lines
