"""Mixture of experts on CPU (gloo): deepshard at expert-parallel size 1 and 2 against DeepSpeed-MoE on the
same model, tokens and optimizer.

    python benchmarks/moe_bench.py [--deepspeed-python /path/to/venv/bin/python] [--nprocs 2] [--stage 2]

The model is a stack of ``--layers`` blocks (LayerNorm, then DeepSpeed's ``MoE`` layer with ``--experts``
experts of a 4x MLP, top-2, capacity factor 1.25), written once against DeepSpeed's API: each library runs it
as its ``deepspeed``. Every case trains ``--warmup`` + ``--steps`` steps on the same tokens (``--tokens`` per
rank of width ``--dim``), AdamW (torch's in both: DeepSpeed builds no C++ op, its processes start with
``tests/deepspeed_compat/ds_boot`` first on the path, and a case that hangs is killed after ``--timeout``),
ZeRO ``--stage``, and reports per rank:

- the median step time of the slowest rank and tokens per second (with ``--rounds N`` every case runs N
  times, the cases interleaved so that a change in the machine's load touches each alike; the median round);
- the expert and dense parameters this rank holds (the expert count must divide by ep), its peak RSS, the
  bytes of every tensor alive after the last step (parameters, gradients, optimizer state: both libraries
  measured alike), and under deepshard its ``memory_report`` (model-state bytes by category);
- the all-to-all bytes of one step as deepshard's comms logger counts them (``ep:all_to_all``: the tensors
  handed to the collective), against the analytic volume: every MoE layer sends its ``[E, capacity, dim]``
  buffer twice forward and twice backward, ``(P - 1) / P`` of it leaving the rank.

Short runs on a shared machine give ratios, not absolute speeds: re-measure on a quiet one.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.deepspeed_launch import DEFAULT_DS_PYTHON, deepspeed_env, free_port, start, wait_all  # noqa: E402

EXTENSIONS = "~/.cache/deepshard/moe-bench-torch-extensions"
"""DeepSpeed builds no op here (``deepspeed_launch``'s ``no_builds``): a folder of its own all the same, so that
a lock another program left cannot stall the run."""


# ----------------------------------------------------------------------------------------- the worker
def _model(torch: Any, deepspeed: Any, args: argparse.Namespace) -> Any:
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(args.dim)
            expert = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(), nn.Linear(4 * args.dim, args.dim))
            self.moe = deepspeed.moe.layer.MoE(args.dim, expert, num_experts=args.experts, ep_size=args.ep, k=2,
                                               capacity_factor=1.25, eval_capacity_factor=1.25, min_capacity=4)

        def forward(self, x: Any) -> tuple[Any, Any]:
            out, l_aux, _ = self.moe(self.norm(x))
            return x + out, l_aux

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(args.dim, args.dim), nn.Linear(args.dim, args.dim)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))

        def forward(self, x: Any) -> Any:
            h, aux = self.inp(x), 0.0
            for block in self.blocks:
                h, l_aux = block(h)
                aux = aux + l_aux
            return self.out(h).pow(2).mean() + 0.01 * aux

    torch.manual_seed(0)
    return Model()


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One rank (environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    if args.library == "deepshard":
        import deepshard.compat as compat

        compat.install(replace_installed=True)
    import deepspeed  # under DeepSpeed: ds_boot's sitecustomize ran first, no C++ op is built (gloo all-reduces)
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.set_num_threads(max(1, args.threads))
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = _model(torch, deepspeed, args)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "zero_optimization": {"stage": args.stage},
              "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, args.tokens, args.dim, generator=g)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and args.library == "deepshard":
            engine.comms_logger.reset()
        start = time.perf_counter()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    from deepspeed.moe.utils import is_moe_param

    from benchmarks.measure import live_tensor_bytes

    params = list(engine.module.parameters())
    out: dict[str, Any] = {
        "rank": rank, "world": world, "step_s": statistics.median(times[args.warmup:]), "losses": losses,
        "expert_params": sum(p.numel() for p in params if is_moe_param(p)),
        "dense_params": sum(p.numel() for p in params if not is_moe_param(p)),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tensor_bytes": live_tensor_bytes(),
    }
    if args.library == "deepshard":
        out["memory_report"] = engine.memory_report()
        comms = engine.comms_logger.summary()
        out["all_to_all_bytes_per_step"] = comms.get("ep:all_to_all", {}).get("bytes", 0) / max(args.steps, 1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return out


# ----------------------------------------------------------------------------------------- the driver
def run_case(args: argparse.Namespace, library: str, ep: int, python: str) -> list[dict[str, Any]]:
    """One case on ``args.nprocs`` fresh processes; every rank's result. A rank that fails, or a case past
    ``--timeout``, ends the case (every rank killed) with the ranks' output in the error."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        procs, logs = [], []
        for rank in range(args.nprocs):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nprocs),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DEEPSHARD_ACCELERATOR": "cpu",
                   "OMP_NUM_THREADS": str(args.threads),
                   "PYTHONPATH": os.pathsep.join(p for p in (str(HERE.parent / "src"), os.environ.get("PYTHONPATH"))
                                                 if p)}
            if library == "deepspeed":
                env = deepspeed_env(env, args.torch_extensions_dir, no_builds=True)
            cmd = [python, str(Path(__file__).resolve()), "--worker", "--library", library, "--ep", str(ep),
                   "--out", f"{tmp}/rank{rank}.json", *_shared(args)]
            logs.append(open(f"{tmp}/rank{rank}.log", "w"))
            procs.append(start(cmd, env, logs[-1]))
        failure = wait_all(procs, args.timeout)
        for log in logs:
            log.close()
        if failure is not None:
            tails = "\n".join(Path(f"{tmp}/rank{r}.log").read_text()[-3000:] for r in range(args.nprocs))
            raise RuntimeError(f"{library} ep {ep}: {failure}\n{tails}")
        return [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(args.nprocs)]


def _shared(args: argparse.Namespace) -> list[str]:
    return ["--dim", str(args.dim), "--experts", str(args.experts), "--layers", str(args.layers), "--tokens",
            str(args.tokens), "--stage", str(args.stage), "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--threads", str(args.threads)]


def analytic_all_to_all(args: argparse.Namespace, ep: int) -> tuple[float, float]:
    """(bytes handed to the all-to-alls per rank and step, bytes leaving the rank) for fp32 tokens."""
    capacity = max(math.ceil(args.tokens / args.experts * 1.25 * 2), 4)
    buffer = args.experts * capacity * args.dim * 4
    handed = 4 * args.layers * buffer if ep > 1 else 0.0
    return handed, handed * (ep - 1) / ep


def summarize(args: argparse.Namespace, library: str, ep: int, rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One row from every round of a case: the median over rounds of the slowest rank's median step, the
    largest RSS and tensor bytes of any rank and round."""
    step = statistics.median(max(r["step_s"] for r in ranks) for ranks in rounds)
    ranks = rounds[0]
    handed, leaving = analytic_all_to_all(args, ep)
    row = {"case": f"{library} ep{ep}", "step_s": round(step, 4),
           "step_s_rounds": [round(max(r["step_s"] for r in rs), 4) for rs in rounds],
           "tokens_per_s": round(args.tokens * args.nprocs / step, 1),
           "expert_params_per_rank": ranks[0]["expert_params"], "dense_params": ranks[0]["dense_params"],
           "peak_rss_mb": round(max(r["peak_rss_mb"] for rs in rounds for r in rs), 1),
           "tensor_mb": round(max(r["tensor_bytes"] for rs in rounds for r in rs) / 2**20, 2),
           "final_loss": ranks[0]["losses"][-1],
           "analytic_all_to_all_bytes": handed, "analytic_bytes_leaving_rank": leaving}
    if "all_to_all_bytes_per_step" in ranks[0]:
        row["measured_all_to_all_bytes"] = ranks[0]["all_to_all_bytes_per_step"]
        report = ranks[0]["memory_report"]
        row["model_state_bytes"] = sum(report.get(k, 0) for k in ("parameters", "gradients", "master_weights",
                                                                 "optimizer_state"))
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--library", default="deepshard", help=argparse.SUPPRESS)
    p.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON,
                   help="python of DeepSpeed's venv ('' : deepshard only)")
    p.add_argument("--torch-extensions-dir", default=EXTENSIONS)
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="runs of every case, interleaved; the median is reported")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a case may take (then it is killed)")
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        Path(args.out).write_text(json.dumps(worker(args)))
        return 0
    libraries = [("deepshard", sys.executable)]
    if args.deepspeed_python and Path(args.deepspeed_python).exists():
        libraries.append(("deepspeed", args.deepspeed_python))
    else:
        print(f"no DeepSpeed python at {args.deepspeed_python!r} (--deepspeed-python): deepshard only", flush=True)
    cases = [(library, ep, python) for ep in (1, args.nprocs) for library, python in libraries]
    results: dict[tuple[str, int], list[list[dict[str, Any]]]] = {}
    for round_ in range(args.rounds):  # interleaved: a change in the machine's load touches every case alike
        for library, ep, python in cases:
            ranks = run_case(args, library, ep, python)
            results.setdefault((library, ep), []).append(ranks)
            print(f"round {round_ + 1} {library} ep{ep}: step {max(r['step_s'] for r in ranks):.4f} s", flush=True)
    rows = [summarize(args, library, ep, results[(library, ep)]) for library, ep, _ in cases]
    head = (f"{'case':<16}{'step s':>9}{'tokens/s':>10}{'experts/rank':>14}{'RSS MB':>9}{'tensor MB':>11}"
            f"{'a2a B/step':>12}{'analytic':>11}")
    print(head)
    for r in rows:
        print(f"{r['case']:<16}{r['step_s']:>9}{r['tokens_per_s']:>10}{r['expert_params_per_rank']:>14}"
              f"{r['peak_rss_mb']:>9}{r['tensor_mb']:>11}{r.get('measured_all_to_all_bytes', '-')!s:>12}"
              f"{r['analytic_all_to_all_bytes']:>11.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
