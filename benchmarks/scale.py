"""Per-rank costs against the rank count: the same tiny GPT at N real processes (gloo, one machine) and, beyond
what one machine holds, one rank's view of N ranks (``deepshard dryrun``'s fake process group).

    python benchmarks/scale.py real --sizes 2,4,8            # real processes (resumable: done sizes are kept)
    python benchmarks/scale.py dry --sizes 2,4,...,4096      # dry runs of the first and last rank
    python benchmarks/scale.py plot                          # docs/images/scale.svg + the table for docs
    python benchmarks/scale.py plot --table docs/scale.md    # the figure from the rows the docs show

For each rank: CPU time per step of the training thread (compute and the Python that issues collectives;
not gloo's threads, not waiting for peers), ``initialize`` time, process groups created, bytes and files
read by ``load_checkpoint``, save time, collective bytes per step. Results are appended to a JSON-lines
file, one line per (mode, layout, N); a size already there is skipped unless ``--force``, so a long run
can be stopped and resumed, and the quick sizes can be measured now and the large ones on a quiet machine.
Timings taken on a busy machine are skewed: re-measure there before comparing.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "scale.jsonl"
FIGURE = ROOT / "docs" / "images" / "scale.svg"
LAYOUTS = ("dp", "pp2")


def summarize(report: dict[str, Any], figures: dict[str, Any]) -> dict[str, Any]:
    """One rank's figures: its last (steady) step, its initialize, groups, checkpoint costs."""
    steps = report["steps"]
    last = steps[-1] if steps else {"cpu_s": 0.0, "collectives": []}
    return {"rank": report["rank"], "cpu_step_s": last["cpu_s"], "init_s": sum(e["init_s"] for e in report["engines"]),
            "groups_created": report["groups_created"], "groups_joined": report["groups_joined"],
            "collective_bytes": sum(c["bytes"] for c in last["collectives"]),
            "save_s": figures.get("save_s"), "load_s": figures.get("load_s"), "load_bytes": figures.get("load_bytes"),
            "load_files": figures.get("load_files"), "written_bytes": report["checkpoint"]["bytes_written"]}


def _rank_main(rank: int, world: int, port: int, layout: str, save_dir: str, out: Any) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "DEEPSHARD_ACCELERATOR": "cpu"})
    import dataclasses

    import torch
    import torch.distributed as dist

    from benchmarks.scale_workload import body
    from deepshard.dryrun.runner import measure

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        figures: dict[str, Any] = {}
        report = measure(body(layout, save_dir, figures), max_steps=0, name=layout, memory=False)
        out.put((rank, summarize(dataclasses.asdict(report), figures)))
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported by the parent
        out.put((rank, {"error": f"{type(err).__name__}: {err}"}))


def run_real(layout: str, world: int, timeout: float) -> list[dict[str, Any]]:
    """Every rank's figures from a real world of ``world`` gloo processes."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as save_dir:
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, layout, save_dir, out)) for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, value = out.get(timeout=1.0)
                results[rank] = value
            except Exception:  # noqa: BLE001 - queue.Empty: keep waiting
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results.get(r, {"rank": r, "error": "no result (died or timed out)"}) for r in range(world)]


def run_dry(layout: str, world: int) -> list[dict[str, Any]]:
    """The first and the last rank's figures, each from a dry run in this process."""
    import dataclasses

    from benchmarks.scale_workload import body
    from deepshard.dryrun.runner import run_callable

    rows = []
    for rank in sorted({0, world - 1}):
        figures: dict[str, Any] = {}
        with tempfile.TemporaryDirectory() as save_dir:
            report = run_callable(body(layout, save_dir, figures), world, rank, max_steps=0, name=layout, memory=False)
        rows.append(summarize(dataclasses.asdict(report), figures))
    return rows


def _done(path: Path) -> set[tuple[str, str, int]]:
    if not path.is_file():
        return set()
    return {(r["mode"], r["layout"], r["n"]) for r in map(json.loads, path.read_text().splitlines()) if r.get("ranks")}


def measure_sizes(mode: str, sizes: list[int], layouts: list[str], path: Path, force: bool, timeout: float) -> None:
    done = set() if force else _done(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode == "dry":
        import torch

        torch.set_num_threads(1)  # as each real rank runs
        run_dry(layouts[0], 2)  # warm-up: the first initialize in a process imports what it needs (seconds)
    for layout in layouts:
        for n in sizes:
            if (mode, layout, n) in done or (layout == "pp2" and n % 2):
                continue
            start = time.perf_counter()
            ranks = run_real(layout, n, timeout) if mode == "real" else run_dry(layout, n)
            errors = [r["error"] for r in ranks if "error" in r]
            row = {"mode": mode, "layout": layout, "n": n, "ranks": [] if errors else ranks, "errors": errors,
                   "wall_s": time.perf_counter() - start, "host": platform.node(), "cpus": os.cpu_count(),
                   "when": time.strftime("%Y-%m-%d %H:%M")}
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{mode} {layout} N={n}: {'; '.join(errors) if errors else _line(ranks)} ({row['wall_s']:.0f} s)",
                  flush=True)


def _line(ranks: list[dict[str, Any]]) -> str:
    worst = {k: max((r[k] or 0) for r in ranks) for k in ("cpu_step_s", "init_s", "groups_created", "load_bytes")}
    return (f"CPU/step {worst['cpu_step_s'] * 1e3:.1f} ms, init {worst['init_s']:.2f} s, groups {worst['groups_created']}, "
            f"load {worst['load_bytes'] / 2**20:.2f} MiB (max over ranks)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("real", "dry", "plot"))
    parser.add_argument("--sizes", default="2,4,8", help="comma-separated rank counts")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--figure", type=Path, default=FIGURE)
    parser.add_argument("--force", action="store_true", help="measure sizes already in the results again")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per real world")
    parser.add_argument("--table", type=Path, help="plot: read the rows from this page's table (docs/scale.md) "
                                                   "instead of --results")
    args = parser.parse_args(argv)
    if args.mode == "plot":
        from benchmarks.scale_plot import rows_from_table, write_figure

        rows = (rows_from_table(args.table.read_text()) if args.table is not None
                else [json.loads(line) for line in args.results.read_text().splitlines()])
        print(write_figure(rows, args.figure))
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s]
    measure_sizes(args.mode, sizes, args.layouts.split(","), args.results, args.force, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
