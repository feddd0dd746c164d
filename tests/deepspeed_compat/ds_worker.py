"""Train a tiny model with a DeepSpeed-compatible library on CPU, save or resume, print losses as JSON.

Runs under either library: ``--library deepspeed`` (the real DeepSpeed, in its own venv) or
``--library deepshard`` (``import deepshard as deepspeed``). It spawns ``--dp`` gloo processes itself.

    python ds_worker.py --library deepspeed --stage 2 --dp 2 --dtype fp32 --save DIR --steps 3
    python ds_worker.py --library deepspeed --stage 2 --dp 2 --dtype fp32 --load DIR --steps 3

Every step consumes the same global batch of 8 samples whatever the data-parallel size (each rank its
contiguous share), so losses are comparable across layouts. The last line printed is
``{"losses": [...], "client_state": {...}, "global_steps": n}`` from rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys

GLOBAL_BATCH = 8
IN, HID, OUT = 8, 16, 4


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def batch(step: int, rank: int, dp: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g)
    share = GLOBAL_BATCH // dp
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def build_layers():
    import torch

    torch.manual_seed(7)
    return [torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, HID), torch.nn.Tanh(),
            torch.nn.Linear(HID, OUT)]


class Net:
    """Factory for the plain (non-pipeline) model: an nn.Sequential with one persistent buffer."""

    @staticmethod
    def make():
        import torch

        model = torch.nn.Sequential(*build_layers())
        model.register_buffer("scale", torch.tensor([1.5, 0.5]))
        return model


def config(args: argparse.Namespace) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // args.dp // (2 if args.pipeline else 1),
        "gradient_accumulation_steps": 2 if args.pipeline else 1,
        "zero_optimization": {"stage": args.stage},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                      "warmup_num_steps": 10}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 9,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def run(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(_world(args)), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch

    torch.set_num_threads(1)
    deepspeed = _library(args.library)
    deepspeed.init_distributed(dist_backend="gloo")
    engine = _engine(deepspeed, args)
    client: dict = {}
    if args.load:
        _, client = engine.load_checkpoint(args.load, tag=args.tag)
    losses = [_step(engine, args, rank) for _ in range(args.steps)]
    if args.save:
        engine.save_checkpoint(args.save, tag=args.tag, client_state={"epoch": 3, "note": "hello"})
    if rank == 0:
        print(json.dumps({"losses": losses, "client_state": {k: client[k] for k in ("epoch", "note")
                                                             if client and k in client},
                          "global_steps": engine.global_steps, "global_samples": engine.global_samples}),
              flush=True)
    torch.distributed.barrier()


SUITE = [  # (name, ZeRO stage, dtype, pipeline): each saved by a 2-process DeepSpeed run. The pipeline
    # comes last: DeepSpeed keeps its pipeline topology in module state, which a later plain engine trips on
    ("z0", 0, "fp32", False), ("z1", 1, "fp32", False), ("z2", 2, "fp32", False), ("z3", 3, "fp32", False), ("z2_bf16", 2, "bf16", False),
    ("pipe_z1", 1, "fp32", True),
]


def _library(name: str):
    if name == "deepspeed":
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401 - ``deepspeed.comm.torch`` the attribute is torch itself

        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce at init (a C++ build per
        # fresh venv, racing between ranks on one lock file); gloo does the same job for these tests
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        return deepspeed
    import deepshard

    return deepshard


def run_suite(rank: int, args: argparse.Namespace, port: int) -> None:
    """One 2-process world: for each case, train 3 steps and save; a fresh engine loads the directory
    and trains 3 more (DeepSpeed's own resume). ``--resume``: only the second half, on given directories."""
    from pathlib import Path

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch

    torch.set_num_threads(1)
    deepspeed = _library(args.library)
    deepspeed.init_distributed(dist_backend="gloo")
    root = Path(args.suite)
    results: dict = {}
    cases = [_parse_resume(spec) for spec in args.resume] if args.resume else [
        (n, s, d, p, str(root / n)) for n, s, d, p in SUITE if d not in args.leave_out]
    for name, stage, dtype, pipeline, directory in cases:
        case = argparse.Namespace(library=args.library, stage=stage, dp=1 if pipeline else 2, dtype=dtype,
                                  pipeline=pipeline)
        out: dict = {}
        if not args.resume:
            engine = _engine(deepspeed, case)
            out["first"] = [_step(engine, case, rank) for _ in range(3)]
            engine.save_checkpoint(directory, client_state={"epoch": 3, "note": "hello"})
            del engine
        engine = _engine(deepspeed, case)
        _, client = engine.load_checkpoint(directory)
        out["resumed"] = [_step(engine, case, rank) for _ in range(3)]
        out["client_state"] = {k: client[k] for k in ("epoch", "note") if k in (client or {})}
        out["global_steps"] = engine.global_steps
        del engine
        if rank == 0 and args.library == "deepspeed" and not args.resume and not pipeline and stage > 0:
            _zero_to_fp32(directory, root / f"{name}_fp32.pt")
        results[name] = out
        torch.distributed.barrier()
    if rank == 0:
        (root / ("resume.json" if args.resume else "results.json")).write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # DeepSpeed's engines leave C++ threads that abort the interpreter's exit ("terminate called
    # without an active exception", seen after a ZeRO-0 engine); the results are written, so leave now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _parse_resume(spec: str) -> tuple:
    name, rest = spec.split("=", 1)
    directory, stage, dtype = rest.rsplit(":", 2)
    return name, int(stage), dtype, False, directory


def _zero_to_fp32(directory: str, target) -> None:
    """DeepSpeed's own consolidation of the checkpoint, saved for deepshard's to be compared with."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(directory)
    torch.save({k: v.detach().clone() for k, v in state.items()}, target)


def _engine(deepspeed, args):
    import torch

    if args.pipeline:
        import importlib

        pipe = importlib.import_module(f"{deepspeed.__name__}.pipe")  # deepspeed.pipe or deepshard.pipe
        model = pipe.PipelineModule(layers=build_layers(), num_stages=2, loss_fn=torch.nn.MSELoss(),
                               partition_method="uniform")
    else:
        model = Net.make()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(args))
    return engine


def _step(engine, args, rank: int) -> float:
    import torch

    step = engine.global_steps
    if args.pipeline:
        x, y = batch(step, rank % args.dp, args.dp)  # stage-major ranks: rank = stage * dp + data index
        half = x.shape[0] // 2
        micro = iter([(x[:half], y[:half]), (x[half:], y[half:])])
        return float(engine.train_batch(data_iter=micro))
    x, y = batch(step, rank, args.dp)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    out = engine(x.to(dtype))
    loss = torch.nn.functional.mse_loss(out.float(), y)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    return float(mean) / args.dp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--library", choices=["deepspeed", "deepshard"], default="deepspeed")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--dp", type=int, default=2, help="data-parallel size (with --pipeline: 2 stages of it)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--pipeline", action="store_true")
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--tag")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--suite", help="run every case of tests/deepspeed_compat's matrix in one world and write "
                   "the results (JSON) into this directory (checkpoints under it)")
    p.add_argument("--resume", nargs="*", default=[], metavar="NAME=DIR:STAGE:DTYPE",
                   help="with --suite: DeepSpeed resumes these directories (3 steps each) instead")
    p.add_argument("--leave_out", nargs="*", default=[], choices=["bf16"],
                   help="with --suite: leave out the cases in these dtypes (ones DeepSpeed refuses on this CPU)")
    args = p.parse_args()
    if args.library == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.multiprocessing as mp

    if args.suite:
        mp.spawn(run_suite, args=(args, _port()), nprocs=2, join=True)
        return
    mp.spawn(run, args=(args, _port()), nprocs=_world(args), join=True)


def _world(args: argparse.Namespace) -> int:
    return args.dp * (2 if args.pipeline else 1)


if __name__ == "__main__":
    sys.exit(main())
