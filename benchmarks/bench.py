"""deepshard against torch DDP, torch FSDP2 and DeepSpeed on the same workload, one engine at a time.

    python benchmarks/bench.py                 # the full run (make bench): ~100M MLP and a small GPT,
                                               # fp32 and bf16, 2 processes, then stage-3 scaling
    python benchmarks/bench.py --quick         # small models, a minute or two
    python benchmarks/bench.py --workload gpt --dtype bf16 --engines ddp deepshard-z0 --nprocs 4
    python benchmarks/bench.py --only moe      # one part alone: engines (the tables and scaling), moe, sp, zeropp

Every engine runs in fresh processes (gloo, spawned here), on the same seed, data, global batch,
optimizer (AdamW, fixed lr, no clipping) and number of steps. Prints a table, writes
``<out>/bench.json``, ``<out>/bench.png`` and ``<out>/bench.md``; ``--update-docs`` also rewrites the
figures in docs/benchmarks.md. Exit status 1 when an engine crashed or a deepshard engine's final loss
departs from DDP's (a bug report, not a result); a baseline that departs is flagged in the table.
See docs/benchmarks.md for what each column means.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import analysis, capabilities, report  # noqa: E402
from benchmarks.background import background_load  # noqa: E402
from benchmarks.engines import ENGINES  # noqa: E402
from benchmarks.spawn import REPO_ROOT, run_case  # noqa: E402
from benchmarks.workloads import WORKLOADS, describe, make_workload  # noqa: E402

SCALING_ENGINES = ("deepshard-z3", "fsdp2")
DEFAULT_STEPS = {"mlp": (2, 3), "mlp12": (2, 3), "gpt": (3, 10)}  # (warm-up, measured)
PARTS = ("engines", *capabilities.SECTIONS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small models (~4M MLP, ~1M GPT): a minute or two")
    p.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--engines", nargs="+", choices=list(ENGINES), default=[n for n, s in ENGINES.items() if s.default],
                   help="default: all but deepshard-z0-after-backward")
    p.add_argument("--dtype", nargs="+", choices=["fp32", "bf16"], default=None,
                   help="default: fp32 bf16 (--quick: fp32)")
    p.add_argument("--nprocs", type=int, nargs="+", default=[2], help="process counts to run (default 2)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of every engine, interleaved (engine A, B, C, then A, B, C again ...); the "
                        "table shows the median of their medians and the spread (default 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: mlp 2, gpt 3; --quick 2)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default: mlp 3, gpt 10; --quick 4)")
    p.add_argument("--scaling", type=int, nargs="*", default=None,
                   help="process counts of the stage-3 memory scaling runs (default 1 2 4 8, --quick 1 2 4; "
                        "give none to skip)")
    p.add_argument("--scaling-workload", choices=list(WORKLOADS), default="gpt")
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS),
                   help="the parts to run (default all): engines = the engine tables and the stage-3 scaling; "
                        "moe = expert parallelism against DeepSpeed-MoE; sp = Ulysses and ring against one process "
                        "and DeepSpeed's Ulysses; zeropp = ZeRO++ and hybrid sharding against ZeRO-3 on 2 x 2 "
                        "processes (benchmarks/capabilities.py)")
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="N busy processes (pure-Python spin, same nice level) beside the engines for the whole "
                        "measurement: reproducible CPU contention (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per engine run before it is killed")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument("--merge", type=Path, nargs="*", default=[],
                   help="bench.json files of earlier runs: their rows for workload x dtype x process-count groups "
                        "this run does not measure (and their scaling rows, when this run has none) join the report")
    p.add_argument("--update-docs", action="store_true",
                   help="rewrite the figures in docs/benchmarks.md (chart: benchmarks/figures/bench.png)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or (["fp32"] if args.quick else ["fp32", "bf16"])
    args.scaling = args.scaling if args.scaling is not None else ([1, 2, 4] if args.quick else [1, 2, 4, 8])
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0):
        p.error(f"--steps ({args.steps}) must be >= 1 and --warmup ({args.warmup}) >= 0")
    if args.repeats < 1:
        p.error(f"--repeats ({args.repeats}) must be >= 1")
    if args.background_load < 0:
        p.error(f"--background-load ({args.background_load}) must be >= 0 busy processes")
    return args


def steps_for(workload: str, args: argparse.Namespace) -> tuple[int, int]:
    """(warm-up, measured) steps: the flags, else the workload's default (the 100M MLP takes seconds a
    step on 2 cores, so it gets fewer)."""
    warmup, steps = (2, 4) if args.quick else DEFAULT_STEPS[workload]
    return (args.warmup if args.warmup is not None else warmup, args.steps if args.steps is not None else steps)


def _one(engine: str, workload: str, dtype: str, nprocs: int, warmup: int, steps: int,
         args: argparse.Namespace, known: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one case (or record ``known``, a status found earlier, without running it)."""
    spec, w = ENGINES[engine], make_workload(workload, quick=args.quick)
    case = {"engine": engine, "workload": workload, "dtype": dtype, "nprocs": nprocs, "warmup": warmup,
            "steps": steps, "seed": args.seed, "lr": args.lr, "quick": args.quick}
    if known is not None:
        ranks = [known]
    elif spec.family == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        ranks = [{"status": "not installed", "reason": "pip install -e \".[bench]\" (or pip install deepspeed)"}]
    else:
        ranks = run_case(case, timeout=args.timeout)
    return analysis.summarize_case(case, ranks, w.parameter_count(), w.samples_per_step(), spec.family, spec.stage,
                                   keeps_grads=not spec.step_in_backward)


def _progress(i: int, total: int, row: dict[str, Any], seconds: float) -> None:
    what = f"{row['engine']} {row['workload']} {row['dtype']} N={row['nprocs']}"
    result = f"{row['step_time'] * 1e3:,.0f} ms/step, loss {row['final_loss']:.5f}" if row["status"] == "ok" \
        else f"{row['status']}" + (f": {row['reason'].strip().splitlines()[-1]}" if row["status"] == "error" else "")
    print(f"[{i}/{total}] {what:<40} {result}  ({seconds:.0f} s)", flush=True)


def collective_costs(nprocs: int, timeout: float) -> dict[str, Any]:
    """Milliseconds per all-reduce / reduce-scatter / all-gather / broadcast of 100 MB of fp32 on this
    machine's gloo: what the engines' communication costs at best."""
    numel = 25 * 2**20
    ranks = run_case({"engine": "collectives", "nprocs": nprocs, "numel": numel}, timeout=timeout)
    if ranks[0].get("status") != "ok":
        return {"status": ranks[0].get("status"), "reason": ranks[0].get("reason", "")}
    slowest = {op: max(r["collective_seconds"][op] for r in ranks) * 1e3 for op in ranks[0]["collective_seconds"]}
    return {"status": "ok", "nprocs": nprocs, "mib": numel * 4 / 2**20, "ms": slowest}


def _merge_sections(run: dict[str, Any], earlier: dict[str, Any]) -> None:
    """Add ``earlier``'s capability sections that ``run`` did not measure, each saying where it came from."""
    have = {s["name"] for s in run.setdefault("sections", [])}
    for section in earlier.get("sections", []):
        if section["name"] not in have:
            source = f"from an earlier run: {earlier.get('machine', {}).get('date', '?')}, `{earlier.get('command', '?')}`"
            merged = any(n.startswith("from an earlier run") for n in section["notes"])
            run["sections"].append({**section, "notes": section["notes"] + ([] if merged else [source])})


def merge_earlier(run: dict[str, Any], earlier: dict[str, Any]) -> None:
    """Add ``earlier``'s rows for the groups ``run`` did not measure (and its scaling when ``run`` has
    none), then recompute the comparisons, targets and notes; ``run["merged"]`` says where they came from."""
    _merge_sections(run, earlier)
    have = {(r["workload"], r["dtype"], r["nprocs"]) for r in run["rows"]}
    taken = [r for r in earlier["rows"] if (r["workload"], r["dtype"], r["nprocs"]) not in have]
    scaling = not run.get("scaling_runs") and bool(earlier.get("scaling_runs"))
    if not taken and not scaling:
        return
    run["rows"] = taken + run["rows"]
    if scaling:
        run["scaling_runs"], run["scaling"] = earlier["scaling_runs"], earlier.get("scaling", [])
    run["workloads"] = {**earlier.get("workloads", {}), **run.get("workloads", {})}
    analysis.add_comparisons(run["rows"])
    targets = analysis.evaluate_targets(run["rows"], quick=bool(run.get("settings", {}).get("quick")))
    run["targets"] = [t.describe() for t in targets]
    run["targets_detail"] = [{**vars(t), "verdict": t.verdict} for t in targets]
    run["notes"] = _notes(run["rows"])
    groups = sorted({f"{r['workload']} {r['dtype']} N={r['nprocs']}" for r in taken}) + (["scaling"] if scaling else [])
    # what ``earlier`` itself took from older runs keeps its own source
    sources = []
    for older in earlier.get("merged", []):
        moved = [g for g in older["groups"] if g in groups]
        if moved:
            sources.append({**older, "groups": moved})
            groups = [g for g in groups if g not in moved]
    if groups:
        sources.insert(0, {"groups": groups, "command": earlier.get("command", "?"),
                           "machine": earlier.get("machine", {}), "wall_seconds": earlier.get("wall_seconds", 0)})
    run.setdefault("merged", []).extend(sources)


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every case: per workload x dtype x process count, ``--repeats`` rounds of every engine in turn
    (so a disturbance on the shared machine hits every engine alike); then the scaling runs, the
    comparisons and the targets."""
    groups = [(w, d, n) for w in args.workload for d in args.dtype for n in args.nprocs] if "engines" in args.only else []
    cases = [(e, w, d, n, *steps_for(w, args)) for (w, d, n) in groups for _ in range(args.repeats)
             for e in args.engines]
    scaling = [(e, args.scaling_workload, "fp32", n, 0, 1) for e in SCALING_ENGINES for n in args.scaling
               if "engines" in args.only]
    runs: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    scale_rows = []
    total = len(cases) + len(scaling)
    load_before = report.machine_info()["load_average"]
    collectives = collective_costs(max(args.nprocs), args.timeout) if groups else {"status": "not run"}
    unavailable: dict[tuple[str, str, int], dict[str, Any]] = {}
    for i, c in enumerate(cases + scaling, 1):
        start = time.perf_counter()
        # a stage that is not implemented (or an engine that crashed) is so every time: run it once
        row = _one(*c, args, known=unavailable.get((c[0], c[1], c[2], c[3])) or unavailable.get((c[0], c[2], c[3])))
        if row["status"] in ("not implemented", "not installed"):
            unavailable[(c[0], c[2], c[3])] = {"status": row["status"], "reason": row["reason"]}
        elif row["status"] != "ok":
            unavailable[(c[0], c[1], c[2], c[3])] = {"status": row["status"], "reason": row["reason"]}
        _progress(i, total, row, time.perf_counter() - start)
        if i <= len(cases):
            runs.setdefault((c[0], c[1], c[2], c[3]), []).append(row)
        else:
            scale_rows.append(row)
    sections = capabilities.run_sections([p for p in PARTS if p in args.only], args)
    rows = [analysis.merge_repeats(r) for r in runs.values()]
    analysis.add_comparisons(rows)
    targets = analysis.evaluate_targets(rows, quick=args.quick)
    workloads = {w: describe(make_workload(w, quick=args.quick)) for w in set(args.workload) | {args.scaling_workload}}
    machine = report.machine_info()
    machine["load_average_before"] = load_before
    return {"machine": machine, "command": "python benchmarks/bench.py " + shlex.join(sys.argv[1:]),
            "settings": {k: v for k, v in vars(args).items() if k not in ("out",)}, "workloads": workloads,
            "collectives": collectives, "rows": rows, "scaling_runs": scale_rows, "sections": sections,
            "scaling": analysis.scaling_rows(scale_rows),
            "targets": [t.describe() for t in targets],
            "targets_detail": [{**vars(t), "verdict": t.verdict} for t in targets], "notes": _notes(rows)}


def _notes(rows: list[dict[str, Any]]) -> list[str]:
    notes = []
    bad = [r for r in rows if r["status"] == "ok" and not r.get("loss_ok", True)]
    if bad:
        notes.append("LOSS MISMATCH (a bug report, not a result): " + ", ".join(
            f"{r['engine']} {r['workload']} {r['dtype']}: {r['final_loss']:.6f} vs {r['loss_reference']} "
            f"(rel. diff {r['loss_rel_diff']:.2e})" for r in bad))
    noisy = [r for r in rows if r["status"] == "ok" and (analysis.step_spread(r) or 1.0) > analysis.NOISY_SPREAD]
    if noisy:
        notes.append("noisy (slowest measured step > 1.5x the fastest: other work ran on the machine; every "
                     "step's time is in bench.json): " + ", ".join(
                         f"{r['engine']} {r['workload']} {r['dtype']} ({analysis.step_spread(r):.1f}x)" for r in noisy))
    slower = [r for r in rows if r["status"] == "ok" and r.get("slower_than")]
    if slower:
        notes.append("SLOWER than a peer outside the spread (deepshard's fastest repeat slower than the peer's "
                     "slowest; in brackets deepshard's CPU per step against the peer's: at or below 1, the extra "
                     "time is waiting for cores or peers, not work): " + ", ".join(
                         f"{r['engine']} {r['workload']} {r['dtype']} N={r['nprocs']} vs "
                         f"{', '.join(_with_cpu(peer, r) for peer in r['slower_than'])}" for r in slower))
    crashed = [r for r in rows if r["status"] == "error"]
    if crashed:
        notes.append("crashed: " + ", ".join(f"{r['engine']} {r['workload']} {r['dtype']}" for r in crashed))
    return notes


def _with_cpu(peer: str, row: dict[str, Any]) -> str:
    """``peer (CPU/step 0.95x)``, or the peer alone when either run has no CPU times."""
    cpu = (row.get("cpu_vs_slower") or {}).get(peer)
    return peer if cpu is None else f"{peer} (CPU/step {cpu:.2f}x)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    with background_load(args.background_load):
        run = run_all(args)
    run["wall_seconds"] = round(time.perf_counter() - started, 1)
    for earlier in args.merge:
        merge_earlier(run, json.loads(earlier.read_text()))
    print(report.format_table(run))
    args.out.mkdir(parents=True, exist_ok=True)
    chart = report.write_chart(args.out / "bench.png", run)
    report.write_json(args.out / "bench.json", run)
    (args.out / "bench.md").write_text(report.render_markdown(run, chart))
    print(f"\nwrote {args.out / 'bench.json'}, {args.out / 'bench.md'}"
          + (f", {chart}" if chart else " (no chart: pip install matplotlib)") + f" in {run['wall_seconds']:.0f} s")
    if args.update_docs:
        figure = REPO_ROOT / "benchmarks" / "figures" / "bench.png"
        has_chart = report.write_chart(figure, run) is not None
        report.update_docs(REPO_ROOT / "docs" / "benchmarks.md",
                           report.render_markdown(run, "../benchmarks/figures/bench.png" if has_chart else None))
        print("updated docs/benchmarks.md")
    # a crash, or deepshard off the others' loss, fails the run; a baseline that departs from DDP is
    # reported (MISMATCH, NOTE) but is not deepshard's bug
    failed = any(r["status"] == "error" or (r["family"] == "deepshard" and not r.get("loss_ok", True))
                 for r in run["rows"]) or capabilities.failed(run["sections"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
