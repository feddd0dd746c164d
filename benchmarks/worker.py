"""One rank of one benchmark case: ``python -m benchmarks.worker CASE_JSON RANK``.

Started by ``benchmarks.spawn`` with the rendezvous environment (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE) and ``MALLOC_MMAP_THRESHOLD_``. It builds the workload's model, hands it to the engine's
runner, trains ``warmup + steps`` steps and writes ``rank{R}.json`` next to the case file: per-step
times and losses, communication of the measured steps, the train-phase peak RSS, live tensor bytes and
(deepshard) ``memory_report()``.

Timing: a barrier before every step, then the wall time of forward + backward + optimizer step on this
rank; the driver takes the slowest rank per step and the median over the measured steps.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _train(runner: Any, case: dict[str, Any], workload: Any, rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from benchmarks.measure import PeakRSS, current_rss, live_tensor_bytes

    peak = PeakRSS()
    peak.reset()
    warmup, steps, seed = int(case["warmup"]), int(case["steps"]), int(case["seed"])
    times: list[float] = []
    cpu: list[float] = []  # CPU seconds of the whole process (every thread: compute, gloo's) per step
    losses: list[float] = []
    for step in range(warmup + steps):
        x, y = workload.batch(seed, step, rank, world_size)
        if step == warmup:
            runner.comm_reset()
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(runner.step(x, y))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    comm = runner.comm_ops()
    return {"step_times": times, "step_cpu_times": cpu, "losses": losses, "comm_ops": comm, "peak_rss": peak.peak(),
            "peak_method": peak.method, "rss_end": current_rss(), "live_tensor_bytes": live_tensor_bytes(),
            "model_state": runner.model_state()}


def run_rank(case: dict[str, Any], rank: int) -> dict[str, Any]:
    """Everything one rank does; returns the JSON-able result (never raises for engine problems)."""
    world_size = int(case["nprocs"])
    threads = int(case.get("threads", 1))
    import torch

    torch.set_num_threads(threads)
    import torch.distributed as dist

    from benchmarks.engines import EngineUnavailable, RunContext, make_runner
    from benchmarks.measure import current_rss
    from benchmarks.workloads import make_workload

    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=float(case.get("timeout", 600))))
    result: dict[str, Any] = {"rank": rank, "status": "ok", "rss_base": current_rss()}
    try:
        if case["engine"] == "collectives":  # the backend's own cost, no engine
            from benchmarks.measure import time_collectives

            result["collective_seconds"] = time_collectives(int(case["numel"]))
            return result
        workload = make_workload(case["workload"], quick=bool(case.get("quick")))
        runner = make_runner(case["engine"])
        model = workload.build_model(int(case["seed"]))
        runner.setup(model, RunContext(workload, case["dtype"], rank, world_size, lr=float(case["lr"])))
        del model
        result["rss_after_setup"] = current_rss()
        result.update(_train(runner, case, workload, rank, world_size))
    except EngineUnavailable as exc:
        result.update(status=exc.status, reason=exc.reason)
    finally:
        with contextlib.suppress(Exception):  # the result is known; teardown errors do not change it
            dist.destroy_process_group()
    return result


def main(argv: list[str]) -> int:
    case_path, rank = Path(argv[0]), int(argv[1])
    case = json.loads(case_path.read_text())
    out = case_path.parent / f"rank{rank}.json"
    try:
        result = run_rank(case, rank)
    except BaseException:  # noqa: BLE001 - the driver must see every rank's failure
        result = {"rank": rank, "status": "error", "reason": traceback.format_exc()}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)
    return 0 if result["status"] != "error" else 1


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (about a second with torch loaded): the result is written
