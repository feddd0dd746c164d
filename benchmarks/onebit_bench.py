"""1-bit Adam against AdamW on the GPT demo (examples/gpt_model.py, bytes of the stdlib sources): the same
seed, data, global batch and schedule on ``world`` processes (CPU, gloo, ZeRO stage 0), the loss per step
and the bytes each process moves per step (the comms logger's all-reduce = 2x accounting).

    python benchmarks/onebit_bench.py [--steps 150] [--freeze 40] [--world 2] [--json out.json]

Prints the loss at a few steps, the mean loss of the last 20 steps, the validation loss at the end, and
the bytes per step before and after ``freeze_step``.
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

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MICRO, LR, WARMUP = 8, 1e-3, 20


def _config(kind: str, freeze: int) -> dict[str, Any]:
    params: dict[str, Any] = {"lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.0}
    optimizer = {"type": "AdamW", "params": params}
    if kind == "onebit":
        optimizer = {"type": "OneBitAdam", "params": {**params, "freeze_step": freeze}}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "optimizer": optimizer,
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                         "warmup_num_steps": WARMUP}},
            "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}


def _rank(rank: int, world: int, port: int, kind: str, steps: int, freeze: int, out: Any) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DEEPSHARD_ACCELERATOR": "cpu"})
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(EXAMPLES))
    import deepshard
    from corpus import ByteWindowDataset, load_stdlib_corpus, train_val_split
    from gpt_model import GPT, GPTConfig

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1234)
    cfg = GPTConfig()
    engine, _, _, _ = deepshard.initialize(model=GPT(cfg), config=_config(kind, freeze))
    train, val = (ByteWindowDataset(d, cfg.block_size) for d in train_val_split(load_stdlib_corpus(2_000_000)))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(7))
    losses, volumes = [], []
    for step in range(steps):
        engine.comms_logger.reset()
        idx = order[(step * world + rank) * MICRO:(step * world + rank + 1) * MICRO].tolist()
        x, y = (torch.stack(t) for t in zip(*(train[i] for i in idx)))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        volumes.append(engine.comms_logger.total_volume_bytes())
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    engine.eval()
    with torch.no_grad():
        vals = [float(engine(*(torch.stack(t) for t in zip(*(val[j] for j in range(i, i + MICRO))))))
                for i in range(0, 16 * MICRO, MICRO)]
    if rank == 0:
        out.put({"losses": losses, "volumes": volumes, "val": sum(vals) / len(vals),
                 "params": sum(p.numel() for p in engine.module.parameters())})
    dist.destroy_process_group()


def run(kind: str, steps: int, freeze: int, world: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, kind, steps, freeze, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=3600)
    for p in procs:
        p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--freeze", type=int, default=40)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {kind: run(kind, args.steps, args.freeze, args.world) for kind in ("adamw", "onebit")}
    marks = sorted({0, args.freeze - 1, args.freeze, args.steps // 2, args.steps - 1})
    print(f"GPT demo, {results['adamw']['params']:,} parameters, {args.world} processes, global batch "
          f"{MICRO * args.world} x 128 bytes, freeze_step {args.freeze}")
    print(f"{'':>8}" + "".join(f"{'loss@' + str(m + 1):>11}" for m in marks)
          + f"{'last-20':>10}{'val':>8}{'B/step warm':>14}{'B/step after':>14}")
    for kind, r in results.items():
        tail = sum(r["losses"][-20:]) / 20
        print(f"{kind:>8}" + "".join(f"{r['losses'][m]:>11.4f}" for m in marks)
              + f"{tail:>10.4f}{r['val']:>8.4f}{r['volumes'][0]:>14,}{r['volumes'][-1]:>14,}")
    if args.json:
        Path(args.json).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
