"""The rows of ``make bench`` for the capabilities beyond the dense engines: mixture of experts against
DeepSpeed-MoE (``moe``), each case run ``--repeats`` times, the cases interleaved as bench.py interleaves
its engines, so a change in the machine's load touches every case alike.

Each section is a plain dict that bench.json keeps and report.py prints without knowing what it measured:
``name``, ``title``, ``conditions``, ``command`` (the standalone script that measures the same), ``header``,
``body`` (the table's cells), ``notes``, ``rows`` (the figures), ``status`` (``ok`` or what went wrong).
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks import moe_bench
from benchmarks.deepspeed_launch import DEFAULT_DS_PYTHON

MOE_SIZES = {  # (dim, layers, experts, tokens per rank, warm-up, measured steps)
    "full": ["--dim", "256", "--layers", "4", "--experts", "4", "--tokens", "512", "--warmup", "2", "--steps", "5"],
    "quick": ["--dim", "128", "--layers", "2", "--experts", "4", "--tokens", "256", "--warmup", "1", "--steps", "3"],
}
LOSS_TOLERANCE = 1e-3
"""Relative difference allowed between the final losses of two cases: the same model, tokens and optimizer,
so only round-off (the order of a sum, which tokens fit an expert's capacity after it) separates them."""


def deepspeed_python() -> Optional[str]:
    """An interpreter with real DeepSpeed: this one (the bench venv installs it), else
    ``DEEPSHARD_DEEPSPEED_PYTHON`` / ``.venv-deepspeed``; None when neither has it."""
    if importlib.util.find_spec("deepspeed") is not None:
        return sys.executable
    return DEFAULT_DS_PYTHON if Path(DEFAULT_DS_PYTHON).exists() else None


def spread_text(values: list[float], fmt: str = "{:.2f}") -> str:
    """``median (fastest-slowest)`` of ``values``."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def paired_ratios(ours: list[float], theirs: list[float]) -> list[float]:
    """Round by round ``ours / theirs``: the two ran one after the other, under the same load."""
    return [a / b for a, b in zip(ours, theirs) if b > 0]


def _moe_cells(row: dict[str, Any], peer: Optional[dict[str, Any]]) -> list[str]:
    rounds = row["step_s_rounds"]
    vs_time = spread_text(paired_ratios(rounds, peer["step_s_rounds"])) if peer else "-"
    vs_rss = f"{row['peak_rss_mb'] / peer['peak_rss_mb']:.2f}" if peer else "-"
    measured = row.get("measured_all_to_all_bytes")
    analytic = row["analytic_all_to_all_bytes"]
    if measured is None:
        a2a = f"- ({analytic / 2**20:.1f})" if analytic else "0"
    else:
        a2a = f"{measured / 2**20:.1f} ({analytic / 2**20:.1f})" if analytic else f"{measured:.0f}"
    return [row["case"], spread_text(rounds), f"{row['tokens_per_s']:,.0f}", vs_time,
            f"{row['expert_params_per_rank']:,}", f"{row['peak_rss_mb']:,.0f}", vs_rss, f"{row['tensor_mb']:.1f}",
            a2a, f"{row['final_loss']:.6f}"]


MOE_HEADER = ["case", "step s (spread)", "tokens/s", "step / DeepSpeed same ep (spread)", "expert params/rank",
              "peak RSS MiB", "RSS / DeepSpeed", "tensor MiB", "all-to-all MiB/step (analytic)", "final loss"]


def moe_notes(rows: list[dict[str, Any]], ep: int) -> list[str]:
    """What the rows must show: equal losses, experts divided by ep, all-to-all bytes = the analytic volume."""
    notes = []
    base = rows[0]["final_loss"]
    off = [r["case"] for r in rows if abs(r["final_loss"] - base) > LOSS_TOLERANCE * abs(base)]
    if off:
        notes.append(f"LOSS MISMATCH (a bug report, not a result): {', '.join(off)} end away from "
                     f"{rows[0]['case']}'s {base:.6f} by more than {LOSS_TOLERANCE:.0e} relative")
    by_case = {r["case"]: r for r in rows}
    one, split = by_case.get("deepshard ep1"), by_case.get(f"deepshard ep{ep}")
    if one and split and split["expert_params_per_rank"] * ep != one["expert_params_per_rank"]:
        notes.append(f"EXPERTS NOT DIVIDED: ep{ep} holds {split['expert_params_per_rank']:,} expert parameters "
                     f"per rank, ep1 {one['expert_params_per_rank']:,}")
    for r in rows:
        measured = r.get("measured_all_to_all_bytes")
        if measured is not None and r["analytic_all_to_all_bytes"] and measured != r["analytic_all_to_all_bytes"]:
            notes.append(f"ALL-TO-ALL VOLUME: {r['case']} hands {measured:,.0f} B a step to the all-to-alls, "
                         f"the analytic volume is {r['analytic_all_to_all_bytes']:,.0f} B")
    return notes


def moe_section(quick: bool, repeats: int, timeout: float, nprocs: int = 2,
                progress: Callable[[str], None] = print) -> dict[str, Any]:
    """deepshard at ep 1 and ``nprocs`` against DeepSpeed-MoE (when installed) on moe_bench's model."""
    size = MOE_SIZES["quick" if quick else "full"]
    argv = size + ["--nprocs", str(nprocs), "--rounds", str(repeats), "--timeout", str(timeout)]
    args = moe_bench.parse_args(argv)
    ds_python = deepspeed_python()
    libraries = [("deepshard", sys.executable)] + ([("deepspeed", ds_python)] if ds_python else [])
    cases = [(library, ep, python) for ep in (1, nprocs) for library, python in libraries]
    section: dict[str, Any] = {
        "name": "moe", "title": "Mixture of experts: deepshard against DeepSpeed-MoE",
        "command": "python benchmarks/moe_bench.py " + " ".join(argv) + (" --deepspeed-python ''" if not ds_python else ""),
        "conditions": (f"{args.layers} blocks of LayerNorm + MoE (width {args.dim}, {args.experts} experts of a 4x MLP, "
                       f"top-2, capacity factor 1.25), {args.tokens} tokens per rank, {nprocs} processes on gloo, "
                       f"ZeRO {args.stage}, fp32, torch AdamW in both libraries, {args.threads} thread per process; "
                       f"{args.warmup} warm-up + {args.steps} measured steps, {repeats} interleaved round{'s' if repeats > 1 else ''} "
                       "(step: median round, spread: fastest-slowest round; ratios paired round by round)"),
        "header": MOE_HEADER, "body": [], "notes": [], "rows": [], "status": "ok"}
    if not ds_python:
        section["notes"].append("DeepSpeed not installed (pip install -e \".[bench]\"): deepshard rows only")
    results: dict[tuple[str, int], list[list[dict[str, Any]]]] = {}
    try:
        for round_ in range(repeats):
            for library, ep, python in cases:
                ranks = moe_bench.run_case(args, library, ep, python)
                results.setdefault((library, ep), []).append(ranks)
                progress(f"[moe {round_ + 1}/{repeats}] {library} ep{ep}: "
                         f"{max(r['step_s'] for r in ranks) * 1e3:,.0f} ms/step")
    except RuntimeError as exc:
        section.update(status="error", reason=str(exc)[-3000:])
        section["notes"].append(f"crashed: {str(exc).splitlines()[0]}")
        return section
    rows = [moe_bench.summarize(args, library, ep, results[(library, ep)]) for library, ep, _ in cases]
    by_case = {r["case"]: r for r in rows}
    for r in rows:
        peer = by_case.get(r["case"].replace("deepshard", "deepspeed")) if r["case"].startswith("deepshard") else None
        section["body"].append(_moe_cells(r, peer))
    section["rows"] = rows
    section["notes"] += moe_notes(rows, nprocs)
    return section


SECTIONS: dict[str, Callable[..., dict[str, Any]]] = {"moe": moe_section}


def run_sections(names: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every section named, in order (bench.py's ``--only``), at bench.py's ``--quick``, ``--repeats``,
    ``--timeout`` and largest ``--nprocs``."""
    return [SECTIONS[name](args.quick, args.repeats, args.timeout, nprocs=max(args.nprocs)) for name in names
            if name in SECTIONS]


def failed(sections: list[dict[str, Any]]) -> bool:
    """A crash, or a mismatch that is a bug report rather than a figure."""
    return any(s["status"] != "ok" or any(n.startswith(("LOSS MISMATCH", "EXPERTS NOT", "ALL-TO-ALL"))
                                          for n in s["notes"]) for s in sections)
