"""Pictures of pipeline schedules: one timeline row per stage, each compute pass a box (forward,
backward, or the split backward's input and weight passes), the gaps between them the bubble.

    from deepshard.pipe.draw import draw_schedule
    draw_schedule("1f1b", stages=4, micro_batches=8, path="1f1b.svg")     # SVG: no dependency
    draw_schedule("zb-h1", stages=4, micro_batches=8, path="zb-h1.png")   # PNG: needs matplotlib

    python -m deepshard.pipe.draw 1f1b --stages 4 --micro-batches 8 -o 1f1b.svg

The timeline is :func:`deepshard.pipe.simulate.simulate`'s: the schedule the engine runs, every pass
taking its cost (``Costs``: forward 1, backward input 1, backward weight 1 by default, so a whole
backward takes 2), messages taking no time. The title gives the simulated bubble of the busiest stage.
"""
from __future__ import annotations

import argparse
import sys
from html import escape
from pathlib import Path

from deepshard.pipe.schedule import Costs, Kind, build_schedule, schedule_name
from deepshard.pipe.simulate import PassTime, SimResult, simulate

COLORS = {Kind.FORWARD: "#4c78a8", Kind.BACKWARD: "#54a24b", Kind.BACKWARD_INPUT: "#88d27a",
          Kind.BACKWARD_WEIGHT: "#f58518"}
LABELS = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.BACKWARD_INPUT: "backward (input)",
          Kind.BACKWARD_WEIGHT: "backward (weight)"}
ROW, GAP, LEFT, TOP, WIDTH = 30, 6, 70, 40, 900


def timeline(name: str, stages: int, micro_batches: int, chunks: int = 1,
             costs: Costs | None = None) -> tuple[str, SimResult]:
    """The schedule's canonical name and its simulated batch (with every pass's start and end).
    ``costs`` are a whole stage's; with ``chunks`` each chunk's pass takes 1/chunks of them, so every
    schedule draws the same work (interleaved defaults to 2 chunks)."""
    key = schedule_name(name)
    if key == "interleaved" and chunks == 1:
        chunks = 2
    c = costs or Costs()
    per_chunk = Costs(c.forward / chunks, c.backward_input / chunks, c.backward_weight / chunks)
    schedule = build_schedule(key, stages, micro_batches, chunks)
    return key, simulate(schedule, micro_batches, chunks, per_chunk)


def title(key: str, stages: int, micro_batches: int, chunks: int, result: SimResult) -> str:
    busiest = max(result.stage_bubble(r) for r in range(stages))
    chunk_note = f", {chunks} chunks per stage" if chunks > 1 else ""
    return (f"{key}: {stages} stages, {micro_batches} micro-batches{chunk_note}; "
            f"bubble {busiest:.1%} of the step")


def _box(t: PassTime, scale: float, chunks: int) -> str:
    x, y = LEFT + t.start * scale, TOP + t.rank * (ROW + GAP)
    w = (t.end - t.start) * scale
    label = str(t.micro_batch) if chunks == 1 else f"{t.micro_batch}.{t.chunk}"
    opacity = 1.0 if t.chunk == 0 else 0.6
    text = (f'<text x="{x + w / 2:.1f}" y="{y + ROW / 2 + 4:.1f}" font-size="11" text-anchor="middle" '
            f'fill="white">{label}</text>') if w >= 14 else ""
    return (f'<rect x="{x:.1f}" y="{y}" width="{max(w - 1, 0.5):.1f}" height="{ROW}" '
            f'fill="{COLORS[t.kind]}" fill-opacity="{opacity}"><title>stage {t.rank} {LABELS[t.kind]} '
            f'micro-batch {t.micro_batch} chunk {t.chunk}</title></rect>{text}')


def _legend(kinds: list[Kind], y: float) -> list[str]:
    out, x = [], LEFT
    for kind in kinds:
        out.append(f'<rect x="{x}" y="{y}" width="14" height="14" fill="{COLORS[kind]}"/>'
                   f'<text x="{x + 20}" y="{y + 11}" font-size="12">{LABELS[kind]}</text>')
        x += 40 + 8 * len(LABELS[kind])
    out.append(f'<rect x="{x}" y="{y}" width="14" height="14" fill="#e8e8e8" stroke="#999"/>'
               f'<text x="{x + 20}" y="{y + 11}" font-size="12">idle (bubble)</text>')
    return out


def to_svg(key: str, stages: int, micro_batches: int, chunks: int, result: SimResult) -> str:
    """The timeline as a standalone SVG document (written by hand: no plotting library needed)."""
    scale = (WIDTH - LEFT - 10) / result.makespan
    rows_h = stages * (ROW + GAP)
    height = TOP + rows_h + 50
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             f'font-family="sans-serif">', '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="{LEFT}" y="22" font-size="14">{escape(title(key, stages, micro_batches, chunks, result))}'
             '</text>']
    for rank in range(stages):
        y = TOP + rank * (ROW + GAP)
        parts.append(f'<rect x="{LEFT}" y="{y}" width="{result.makespan * scale:.1f}" height="{ROW}" '
                     'fill="#e8e8e8"/>')
        parts.append(f'<text x="{LEFT - 8}" y="{y + ROW / 2 + 4}" font-size="12" text-anchor="end">'
                     f'stage {rank}</text>')
    parts += [_box(t, scale, chunks) for t in result.passes]
    parts.append(f'<text x="{WIDTH - 10}" y="{TOP + rows_h + 8}" font-size="11" text-anchor="end" '
                 f'fill="#555">time (forward pass = 1): step {result.makespan:g}</text>')
    kinds = [k for k in COLORS if any(t.kind is k for t in result.passes)]
    parts += _legend(kinds, TOP + rows_h + 22)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_png(path: Path, key: str, stages: int, micro_batches: int, chunks: int, result: SimResult) -> None:
    """The same picture through matplotlib (``pip install matplotlib``, or ``.[plot]`` from a checkout)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise RuntimeError(f"writing {path} needs matplotlib: pip install matplotlib (from a deepshard checkout: "
                           "pip install '.[plot]'), or give a .svg path, which needs nothing") from None
    fig, ax = plt.subplots(figsize=(11, 0.5 * stages + 1.4))
    for t in result.passes:
        ax.barh(t.rank, t.end - t.start, left=t.start, height=0.8, color=COLORS[t.kind],
                alpha=1.0 if t.chunk == 0 else 0.6, edgecolor="white")
        if t.end - t.start >= result.makespan / 60:
            label = str(t.micro_batch) if chunks == 1 else f"{t.micro_batch}.{t.chunk}"
            ax.text((t.start + t.end) / 2, t.rank, label, ha="center", va="center", color="white", fontsize=7)
    ax.set_yticks(range(stages), [f"stage {r}" for r in range(stages)])
    ax.invert_yaxis()
    ax.set_facecolor("#e8e8e8")
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time (forward pass = 1)")
    ax.set_title(title(key, stages, micro_batches, chunks, result), fontsize=10)
    kinds = [k for k in COLORS if any(t.kind is k for t in result.passes)]
    ax.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in kinds], loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if stages < 4 else -0.2), ncol=len(kinds), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_schedule(name: str, stages: int, micro_batches: int, path: str | Path, chunks: int = 1,
                  costs: Costs | None = None) -> SimResult:
    """Simulate schedule ``name`` and write its timeline to ``path`` (``.svg`` or ``.png``); returns the
    simulated batch (makespan, bubble, peak in flight)."""
    path = Path(path)
    key, result = timeline(name, stages, micro_batches, chunks, costs)
    chunks = max(t.chunk for t in result.passes) + 1
    if path.suffix.lower() == ".svg":
        path.write_text(to_svg(key, stages, micro_batches, chunks, result), encoding="utf-8")
    elif path.suffix.lower() == ".png":
        write_png(path, key, stages, micro_batches, chunks, result)
    else:
        raise ValueError(f"{path}: give a .svg or .png file name")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepshard.pipe.draw", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("schedule", help="gpipe, 1f1b, interleaved or zb-h1")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages (default: %(default)s)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (default: %(default)s)")
    parser.add_argument("--chunks", type=int, default=1, help="chunks per stage (interleaved; default 2 there)")
    parser.add_argument("--backward", type=float, default=2.0,
                        help="a whole backward's cost against a forward of 1, split evenly into input and "
                             "weight passes (default: %(default)s)")
    parser.add_argument("-o", "--output", required=True, help="the picture to write: NAME.svg or NAME.png")
    args = parser.parse_args(argv)
    costs = Costs(1.0, args.backward / 2, args.backward / 2)
    try:
        result = draw_schedule(args.schedule, args.stages, args.micro_batches, args.output, args.chunks, costs)
    except (ValueError, RuntimeError) as exc:
        print(f"python -m deepshard.pipe.draw: error: {exc}", file=sys.stderr)
        return 2
    bubble = max(result.stage_bubble(r) for r in range(args.stages))
    print(f"wrote {args.output}: step {result.makespan:g} (forward = 1), bubble {bubble:.3f}, "
          f"peak in flight per stage {result.peak_in_flight}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
