"""The rows of ``make bench`` for the capabilities beyond the dense engines: mixture of experts against
DeepSpeed-MoE (``moe``), Ulysses and ring sequence parallelism against one process and DeepSpeed's Ulysses
(``sp``), ZeRO++ and hybrid sharding against plain ZeRO-3 (``zeropp``). Each case runs ``--repeats`` times,
the cases interleaved as bench.py interleaves its engines, so a change in the machine's load touches every
case alike; ratios are paired round by round.

Each section is a plain dict that bench.json keeps and report.py prints without knowing what it measured:
``name``, ``title``, ``conditions``, ``command`` (the standalone script that measures the same), ``header``,
``body`` (the table's cells), ``notes``, ``rows`` (the figures), ``status`` (``ok`` or what went wrong).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
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


def _shown(path: str) -> str:
    """``path`` relative to the repository when inside it (the command reads the same on another checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        return str(Path(path).absolute().relative_to(root))
    except ValueError:
        return path


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


SP_SEQ = {"full": 4096, "quick": 1024}
SP_LOSS_TOLERANCE = 1e-4
"""Relative difference allowed between a sequence-parallel case's loss and one process's: the same model and
tokens, only the attention's order of sums differs."""


def _interleaved(todo: list[dict[str, Any]], repeats: int, run: Callable[[dict[str, Any]], dict[str, Any]],
                 name: Callable[[dict[str, Any]], str], progress: Callable[[str], None]) -> dict[str, list[dict]]:
    """Every case of ``todo`` once per round, ``repeats`` rounds: each case's results by name."""
    runs: dict[str, list[dict[str, Any]]] = {name(c): [] for c in todo}
    for round_ in range(repeats):
        for case in todo:
            runs[name(case)].append(run(case))
            got = runs[name(case)][-1]
            seconds = got.get("seconds", got.get("step_s"))
            progress(f"[{round_ + 1}/{repeats}] {name(case)}: " + (f"{seconds * 1e3:,.0f} ms/step" if seconds is not None
                                                                   else str(got.get("error", "?"))[-200:]))
    return runs


def sp_section(quick: bool, repeats: int, timeout: float, nprocs: int = 2,
               progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Ulysses and ring step time against one process and DeepSpeed's ``DistributedAttention``
    (``benchmarks/sp_step_bench.py``'s model and tokens) at sp = ``nprocs``."""
    from benchmarks import sp_step_bench as sp

    seq, ds_python = SP_SEQ["quick" if quick else "full"], deepspeed_python()
    base = {"seq": seq, "warmup": 1, "steps": 3}
    todo = [dict(base, lib="deepshard", impl="torch", world=1)] + [
        dict(base, lib="deepshard", impl=impl, world=nprocs) for impl in ("ulysses", "ring", "DistributedAttention")]
    if ds_python:
        todo.append(dict(base, lib="deepspeed", impl="DistributedAttention", world=nprocs))
    section: dict[str, Any] = {
        "name": "sp", "title": "Sequence parallelism: Ulysses and ring against one process and DeepSpeed's Ulysses",
        "command": f"python benchmarks/sp_step_bench.py --seq {seq} --repeats {repeats}"
                   + (f" --deepspeed-python {_shown(ds_python)}" if ds_python else ""),
        "conditions": (f"a {sp.LAYERS}-layer causal transformer (width {sp.DIM}, {sp.HEADS} heads, fp32) on one "
                       f"sequence of {seq} tokens, forward + backward, sp = {nprocs} processes on gloo; 1 warm-up + "
                       f"3 measured steps, {repeats} interleaved round{'s' if repeats > 1 else ''} (step: median, "
                       "spread: fastest-slowest; ratios paired round by round)"),
        "header": ["case", "step ms (spread)", "x one process (spread)", "x DeepSpeed's Ulysses (spread)", "loss"],
        "body": [], "notes": [] if ds_python else ["DeepSpeed not installed: no DeepSpeed row"], "rows": [],
        "status": "ok"}
    python = {"deepshard": sys.executable, "deepspeed": ds_python}
    try:
        runs = _interleaved(todo, repeats, lambda c: sp.run_case(python[c["lib"]], c, timeout), sp.label, progress)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        section.update(status="error", reason=str(exc)[-3000:])
        section["notes"].append(f"crashed: {str(exc).splitlines()[0]}")
        return section
    one = [r["seconds"] for r in runs[sp.label(todo[0])]]
    ds_name = sp.label(todo[-1]) if ds_python else None
    for name, results in runs.items():
        secs = [r["seconds"] for r in results]
        vs_ds = spread_text(paired_ratios(secs, [r["seconds"] for r in runs[ds_name]])) \
            if ds_name and name.startswith("deepshard") and name != sp.label(todo[0]) else "-"
        section["body"].append([name, spread_text([1e3 * x for x in secs], "{:.0f}"),
                                spread_text(paired_ratios(secs, one)), vs_ds, f"{results[-1]['loss']:.6f}"])
        section["rows"].append({"case": name, "seconds": secs, "loss": results[-1]["loss"]})
    ref = section["rows"][0]["loss"]
    off = [r["case"] for r in section["rows"] if abs(r["loss"] - ref) > SP_LOSS_TOLERANCE * abs(ref)]
    if off:
        section["notes"].append(f"LOSS MISMATCH (a bug report, not a result): {', '.join(off)} away from one "
                                f"process's {ref:.6f} by more than {SP_LOSS_TOLERANCE:.0e} relative")
    return section


ZEROPP_SIZES = {"full": ["--steps", "20", "--warmup", "3"],
                "quick": ["--steps", "6", "--warmup", "2", "--dim", "128", "--layers", "2"]}


def zeropp_section(quick: bool, repeats: int, timeout: float, nprocs: int = 2,
                   progress: Callable[[str], None] = print) -> dict[str, Any]:
    """ZeRO-3 against ZeRO++ (hpZ + qwZ + qgZ) and hybrid sharding (MiCS) on 2 "nodes" x 2 processes faked on the
    loopback (``zeropp_bench.py --unshaped``): the bytes that would cross the node boundary, step time, loss.
    Always 4 processes (the layouts need 2 per node), whatever ``nprocs``."""
    from benchmarks import zeropp_bench as zb
    from benchmarks.shaped_links import UnshapedNodes

    size = ZEROPP_SIZES["quick" if quick else "full"]
    flags = dict(zip(size[::2], size[1::2]))
    dims = {"vocab": 8192, "dim": int(flags.get("--dim", 384)), "layers": int(flags.get("--layers", 6)), "seq_len": 32}
    dims["heads"] = max(1, dims["dim"] // 64)
    base = {"steps": int(flags["--steps"]), "warmup": int(flags["--warmup"]), "dims": dims, "batch": 8, "lr": 3e-4,
            "threads": max(1, (os.cpu_count() or 1) // zb.WORLD)}
    todo = [dict(base, layout=layout) for layout in ("plain", "zeropp", "hybrid")]
    section: dict[str, Any] = {
        "name": "zeropp", "title": "ZeRO++ and hybrid sharding against plain ZeRO-3 (2 nodes x 2 processes, unshaped)",
        "command": "python benchmarks/zeropp_bench.py --unshaped " + " ".join(size),
        "conditions": (f"a GPT ({dims['layers']} layers, width {dims['dim']}, vocabulary 8192, 32 tokens, global "
                       f"batch 8), AdamW with clipping, {zb.WORLD} processes on this host's loopback as 2 nodes of 2; "
                       f"{base['warmup']} warm-up + {base['steps']} measured steps, {repeats} interleaved "
                       f"round{'s' if repeats > 1 else ''}; the link is not shaped, so the step times show the "
                       "layouts' compute cost, not their saving on a slow link (that needs root: zeropp_bench.py "
                       "without --unshaped shapes a 1 Gbit/s link between the nodes)"),
        "header": ["layout", "inter-node MiB/step", "x plain", "intra-node MiB/step", "step s (spread)",
                   "x plain (spread)", "final loss", "vs plain"],
        "body": [], "notes": [], "rows": [], "status": "ok"}
    with UnshapedNodes() as nodes:
        runs = _interleaved(todo, repeats, lambda c: zb.run_layout(nodes, "127.0.0.1", c, timeout),
                            lambda c: c["layout"], progress)
    failures = [f"{name}: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}"
                for name, rs in runs.items() for r in rs if "error" in r]
    if failures:
        section.update(status="error", reason="; ".join(failures)[-3000:])
        section["notes"].append("crashed: " + failures[0])
        return section
    plain = runs["plain"]
    for name, rs in runs.items():
        last, steps = rs[-1], [r["step_s"] for r in rs]
        rel = (last["final_loss"] - plain[-1]["final_loss"]) / abs(plain[-1]["final_loss"])
        section["body"].append([name, f"{last['inter_bytes_per_step'] / 2**20:.2f}",
                                f"{last['inter_bytes_per_step'] / max(plain[-1]['inter_bytes_per_step'], 1.0):.3f}",
                                f"{last['intra_bytes_per_step'] / 2**20:.2f}", spread_text(steps),
                                spread_text(paired_ratios(steps, [r["step_s"] for r in plain])),
                                f"{last['final_loss']:.4f}", f"{100 * rel:+.2f}%"])
        section["rows"].append({"layout": name, "runs": rs})
    return section


SECTIONS: dict[str, Callable[..., dict[str, Any]]] = {"moe": moe_section, "sp": sp_section, "zeropp": zeropp_section}


def run_sections(names: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every section named, in order (bench.py's ``--only``), at bench.py's ``--quick``, ``--repeats``,
    ``--timeout`` and largest ``--nprocs``."""
    return [SECTIONS[name](args.quick, args.repeats, args.timeout, nprocs=max(args.nprocs)) for name in names
            if name in SECTIONS]


def failed(sections: list[dict[str, Any]]) -> bool:
    """A crash, or a mismatch that is a bug report rather than a figure."""
    return any(s["status"] != "ok" or any(n.startswith(("LOSS MISMATCH", "EXPERTS NOT", "ALL-TO-ALL"))
                                          for n in s["notes"]) for s in sections)
