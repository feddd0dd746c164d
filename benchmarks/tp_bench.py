"""Tensor parallelism against data parallelism on one model: step time, model-state bytes per process and
tensor-parallel traffic against the analytic volume.

    python benchmarks/tp_bench.py                       # LLaMA-style model (transformers), 2 processes
    python benchmarks/tp_bench.py --hidden 256 --layers 2 --steps 4    # smaller, faster

Cases, each in fresh processes on gloo (CPU): torch DDP, torch FSDP2 (``fully_shard`` per decoder layer),
deepshard ZeRO-0 (dp=2) and deepshard automatic TP (``"tensor_parallel": {"autotp_size": 2}``, dp=1),
all on the same global batch. The TP traffic per step is compared with the formula: per decoder layer
and micro-batch 4 all-reduces of X = b*s*h (2 forward, 2 backward; Megatron), plus one for the
vocab-parallel embedding (forward) and one for the lm_head's input gradient, and the all-gather of the
logits (b*s*V) that the gathered lm_head does so the model's own loss sees full logits.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      bos_token_id=0, eos_token_id=1, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def batch(args: argparse.Namespace, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


def _state_bytes(model: torch.nn.Module, optimizer: Any) -> int:
    """Parameters + gradients + optimizer state held by this process."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensors: this rank's shard

    total = sum(local(p).numel() * p.element_size() * 2 for p in model.parameters())
    states = optimizer.state.values() if optimizer is not None else []
    for state in states:
        total += sum(local(v).numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total


def _setup(case: str, model: torch.nn.Module) -> tuple[Any, Any, Any]:
    """(forward-backward-step callable, module, optimizer) for ``case``."""
    if case in ("ddp", "fsdp2"):
        if case == "ddp":
            module = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            module = fully_shard(model)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

        def step(ids: torch.Tensor) -> float:
            loss = module(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return float(loss.detach())
        return step, module, opt
    import deepshard

    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 0}}
    if case == "deepshard-tp2":
        cfg["tensor_parallel"] = {"autotp_size": 2}
    engine, *_ = deepshard.initialize(model=model, config=cfg)

    def step(ids: torch.Tensor) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return float(loss.detach())
    step.engine = engine  # type: ignore[attr-defined]
    return step, engine.module, engine.strategy.optimizer if hasattr(engine.strategy, "optimizer") else None


def _worker(rank: int, world: int, port: int, case: str, args: argparse.Namespace, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DEEPSHARD_ACCELERATOR": "cpu"})
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    step, module, opt = _setup(case, build(args))
    per_rank = args.batch // world if case != "deepshard-tp2" else args.batch  # tp ranks share the batch
    times, losses = [], []
    engine = getattr(step, "engine", None)
    for i in range(args.warmup + args.steps):
        ids = batch(args, i)
        ids = ids if case == "deepshard-tp2" else ids[rank * per_rank:(rank + 1) * per_rank]
        if engine is not None and i == args.warmup:
            engine.comms_logger.reset()
        dist.barrier()
        start = time.perf_counter()
        losses.append(step(ids))
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    last = torch.tensor([losses[-1]])
    dist.all_reduce(last)  # the global batch's loss: dp ranks hold halves, tp ranks the same value
    result = {"case": case, "step_s": statistics.median(times), "state_bytes": _state_bytes(module, opt),
              "loss": float(last) / world}
    if engine is not None:
        result["comm"] = {k: {**v, "per_step": v["elements"] / args.steps}
                          for k, v in engine.comms_logger.summary().items()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def run(case: str, args: argparse.Namespace) -> dict[str, Any]:
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "r.json")
    mp.spawn(_worker, args=(2, port, case, args, out), nprocs=2, join=True)
    with open(out) as f:
        return json.load(f)


def tp_formula(args: argparse.Namespace) -> dict[str, float]:
    """Elements per step handed to tp collectives by one rank (the comms logger's ``elements``)."""
    x = args.batch * args.seq * args.hidden
    return {"tp:all_reduce": (4 * args.layers + 2) * x, "tp:all_gather": args.batch * args.seq * args.vocab}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cases", nargs="+", default=["ddp", "fsdp2", "deepshard-z0", "deepshard-tp2"])
    args = parser.parse_args()
    rows = [run(case, args) for case in args.cases]
    print(f"model: LLaMA-style h={args.hidden} L={args.layers} heads={args.heads} V={args.vocab}, "
          f"global batch {args.batch} x {args.seq} tokens, 2 processes (gloo, CPU)\n")
    print("| case | step (s) | model states / process (MB) | last loss |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['step_s']:.3f} | {r['state_bytes'] / 2**20:.1f} | {r['loss']:.4f} |")
    tp = next((r for r in rows if r["case"] == "deepshard-tp2"), None)
    if tp is not None:
        print("\n| tp collective | measured elements / step | formula | ratio |\n| --- | --- | --- | --- |")
        for op, want in tp_formula(args).items():
            got = tp["comm"].get(op, {}).get("per_step", 0.0)
            print(f"| {op} | {got:.0f} | {want:.0f} | {got / want:.4f} |")


if __name__ == "__main__":
    main()
