"""Is ``deepshard plan`` right on this machine? Its predicted peak (a dry run) against the peak measured in a
real gloo world, for many configurations of one model file, and its pick against the memory it was given.

    python benchmarks/plan_check.py                       # 24 configurations of examples/plan_model.py, 4 ranks
    python benchmarks/plan_check.py --budgets 6MiB,9MiB   # + the planner's pick for each budget, run for real

Every configuration runs in the same real world (one start-up for all), each measured on its own (the
peak of live tensor bytes above what was live before it), and each rank alone in a dry run. Prints one
line per configuration (predicted, measured, ratio) and writes the results as JSON.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHOICES = [  # (tp, pp, stage, offload, checkpointing, micro)
    (1, 1, 0, "none", False, 1), (1, 1, 0, "none", False, 4), (1, 1, 0, "none", True, 4),
    (1, 1, 1, "none", False, 2), (1, 1, 1, "none", True, 8), (1, 1, 1, "optimizer", False, 2),
    (1, 1, 2, "none", False, 1), (1, 1, 2, "none", False, 8), (1, 1, 2, "optimizer", True, 4),
    (1, 1, 3, "none", False, 2), (1, 1, 3, "none", True, 8), (1, 1, 3, "optimizer", False, 4),
    (1, 1, 3, "optimizer+params", False, 2), (2, 1, 0, "none", False, 2), (2, 1, 1, "none", False, 4),
    (2, 1, 2, "none", True, 4), (2, 1, 3, "none", False, 2), (1, 2, 0, "none", False, 2),
    (1, 2, 1, "none", False, 4), (1, 2, 1, "none", True, 4), (1, 2, 2, "none", False, 2),
    (2, 2, 1, "none", False, 4), (1, 4, 0, "none", False, 2), (1, 4, 1, "none", True, 2),
]


def _choices(rows: list[tuple]) -> list[Any]:
    from deepshard.dryrun.plan_space import Choice

    return [Choice(*row) for row in rows]


def _rank(rank: int, world: int, port: int, model_path: str, base: dict[str, Any], rows: list[tuple], out: Any) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                       "DEEPSHARD_SHM": "0"})  # the transport a dry run imitates (pairwise TCP)
    import torch
    import torch.distributed as dist

    from deepshard.dryrun.plan_model import load_model_file, training
    from deepshard.dryrun.plan_space import Space, config_for
    from deepshard.dryrun.runner import measure

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = load_model_file(model_path)
    space = Space(world, base["train_batch_size"])
    peaks = []
    for choice in _choices(rows):
        try:
            report = measure(training(model, choice, config_for(base, choice, space), 2), max_steps=0, memory=True)
            peaks.append(report.peak_bytes)
        except Exception as err:  # noqa: BLE001 - reported per configuration
            peaks.append(f"{type(err).__name__}: {err}"[:300])
        dist.barrier()
    out.put((rank, peaks))
    dist.destroy_process_group()


def measured_peaks(model_path: str, base: dict[str, Any], rows: list[tuple], world: int) -> list[list[Any]]:
    """Each rank's measured peak per configuration, from one real gloo world."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, model_path, base, rows, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=7200) for _ in range(world))
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def predicted_peaks(model_path: str, base: dict[str, Any], rows: list[tuple], world: int) -> list[list[Any]]:
    """Each rank's dry-run peak per configuration, predicted as the planner predicts it (its dry runs take
    at most ``Space.max_micro_steps`` micro-batches per step; the real runs take the global batch's)."""
    from deepshard.dryrun.plan_model import load_model_file, training
    from deepshard.dryrun.plan_space import Space, config_for
    from deepshard.dryrun.runner import run_callable

    _one_thread()
    model = load_model_file(model_path)
    space = Space(world, base["train_batch_size"])
    table = []
    for rank in range(world):
        row = []
        for choice in _choices(rows):
            config = config_for(base, choice, space, space.dry_micro_steps(choice))  # as the planner runs it
            try:
                row.append(run_callable(training(model, choice, config, 2), world, rank, max_steps=0).peak_bytes)
            except Exception as err:  # noqa: BLE001
                row.append(f"{type(err).__name__}: {err}"[:300])
        table.append(row)
    return table


def _one_thread() -> None:
    """Run torch's ops on one thread, as each real rank does (several threads on a shared machine are far
    slower, and the planner's dry runs compare with single-threaded ranks)."""
    import torch

    torch.set_num_threads(1)


def _search(model_path: str, *args: Any) -> Any:
    """The planner's search, in a fresh process (its model file is loaded there: its functions do not pickle)."""
    from deepshard.dryrun.plan_model import load_model_file
    from deepshard.dryrun.planner import search

    _one_thread()
    return search(load_model_file(model_path), *args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "examples" / "plan_model.py"))
    parser.add_argument("--config", default=str(ROOT / "examples" / "plan_config.json"))
    parser.add_argument("--world_size", type=int, default=4)
    parser.add_argument("--budgets", default="", help="comma-separated memory budgets whose pick is run for real")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "plan_check.json")
    args = parser.parse_args(argv)
    base = json.loads(Path(args.config).read_text())
    real = measured_peaks(args.model, base, CHOICES, args.world_size)
    with mp.get_context("spawn").Pool(1) as pool:  # a fresh process: the fake group is its whole world
        dry = pool.apply(predicted_peaks, (args.model, base, CHOICES, args.world_size))
    rows, worst = [], 0.0
    for i, choice in enumerate(_choices(CHOICES)):
        r = [real[k][i] for k in range(args.world_size)]
        d = [dry[k][i] for k in range(args.world_size)]
        ok = all(isinstance(x, int) for x in r + d)
        ratio = max(d) / max(r) if ok and max(r) else None
        worst = max(worst, abs(ratio - 1)) if ratio is not None else worst
        rows.append({"choice": choice.label(), "measured": r, "predicted": d, "ratio": ratio})
        shown = f"{max(d) / 2**20:8.2f} MiB predicted, {max(r) / 2**20:8.2f} MiB measured, x{ratio:.3f}" if ok \
            else f"error: {next(x for x in r + d if not isinstance(x, int))}"
        print(f"{choice.label():<50} {shown}", flush=True)
    print(f"{len(rows)} configurations, largest deviation of the predicted peak: {100 * worst:.1f}%")
    picks = [_check_pick(args, base, budget) for budget in args.budgets.split(",") if budget]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"world_size": args.world_size, "rows": rows, "picks": picks}, indent=2) + "\n")
    return 0


def _check_pick(args: argparse.Namespace, base: dict[str, Any], budget: str) -> dict[str, Any]:
    """The planner's pick for ``budget``, run for real: its measured peak must not exceed the budget."""
    from deepshard.dryrun.plan_cli import parse_bytes
    from deepshard.dryrun.plan_model import load_model_file
    from deepshard.dryrun.plan_space import Space
    memory = parse_bytes(budget)
    space = Space(args.world_size, base["train_batch_size"], micros=(1, 2, 4, 8), tps=(1, 2), pps=(1, 2))
    with mp.get_context("spawn").Pool(1) as pool:
        plan = pool.apply(_search, (args.model, base, space, memory))
    if plan.pick is None:
        print(f"budget {budget}: nothing fits")
        return {"budget": memory, "pick": None}
    c = plan.pick.choice
    real = measured_peaks(args.model, base, [(c.tp, c.pp, c.stage, c.offload, c.checkpointing, c.micro)], args.world_size)
    peak = max(r[0] for r in real)
    print(f"budget {budget}: pick {c.label()}, predicted {plan.pick.peak_bytes / 2**20:.2f} MiB, measured "
          f"{peak / 2**20:.2f} MiB: {'within' if peak <= memory else 'OVER'} the budget")
    return {"budget": memory, "pick": c.label(), "predicted": plan.pick.peak_bytes, "measured": peak}


if __name__ == "__main__":
    sys.exit(main())
