"""Sequence-parallel step time on CPU (gloo): one process against Ulysses and ring, and against
DeepSpeed's own Ulysses (``deepspeed.sequence.layer.DistributedAttention``) on the same model and tokens.

    python benchmarks/sp_step_bench.py [--deepspeed-python /path/to/venv/bin/python] [--seq 4096]

Every case trains the same 2-layer causal transformer on the same tokens (total sequence ``--seq``) for
one forward + backward per step and reports the median step of ``--steps`` after a warm-up, for
``--repeats`` interleaved rounds, with the global loss (it must agree across cases: the same model on the
same tokens). Cases:

- ``one process``: torch's ``scaled_dot_product_attention`` on the whole sequence;
- ``deepshard ulysses/ring spN``: deepshard's ``SequenceParallel`` (its own attention kernel);
- ``deepshard DistributedAttention spN`` and ``deepspeed DistributedAttention spN``: the DeepSpeed API
  around torch's attention, run by each library (DeepSpeed's in the interpreter given by
  ``--deepspeed-python``, with ``DS_ACCELERATOR=cpu``; left out when it is not given).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DIM, HEADS, LAYERS, VOCAB = 256, 8, 2, 512


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------------------- the worker
def _model(torch: Any) -> Any:
    nn = torch.nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.o = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
            self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
            self.n1, self.n2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)

        def forward(self, x: Any, attend: Any) -> Any:
            b, s, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, s, 3, HEADS, DIM // HEADS).unbind(2)  # [b, s, h, d]
            x = x + self.o(attend(q, k, v).reshape(b, s, DIM))
            return x + self.mlp(self.n2(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
            self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

        def forward(self, ids: Any, attend: Any) -> Any:
            x = self.emb(ids)
            for layer in self.layers:
                x = layer(x, attend)
            return self.head(x)

    torch.manual_seed(0)
    return Model()


def _sdpa(torch: Any) -> Any:
    def attend(q: Any, k: Any, v: Any, *_: Any) -> Any:  # [b, s, h, d] in and out
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)
    return attend


def _attention_for(case: dict[str, Any], torch: Any, dist: Any, seq: int) -> tuple[Any, Any]:
    """The attention function and the shard of the token ids (positions) this rank holds."""
    world, rank = dist.get_world_size(), dist.get_rank()
    positions = torch.arange(seq)
    if case["impl"] == "torch":
        return _sdpa(torch), positions
    if case["impl"] == "DistributedAttention":
        if case["lib"] == "deepspeed":
            from deepspeed.sequence.layer import DistributedAttention
        else:
            from deepshard.sp.ulysses import DistributedAttention
        dist_attn = DistributedAttention(_sdpa(torch), dist.group.WORLD, scatter_idx=2, gather_idx=1)
        return (lambda q, k, v: dist_attn(q, k, v, 0)), positions.chunk(world)[rank]
    from deepshard.sp import SequenceParallel
    from deepshard.topology import ParallelDims, Topology

    sp = SequenceParallel.build(Topology.build(ParallelDims(sp=world)), case["impl"], None)
    shard = sp.shard_batch({"input_ids": positions[None], "labels": positions[None]})["input_ids"][0]

    def attend(q: Any, k: Any, v: Any) -> Any:
        return sp.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), seq).transpose(1, 2)
    return attend, shard


def worker(case: dict[str, Any]) -> None:
    if case["lib"] == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
    else:
        import deepshard as deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // case["world"]))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    seq = case["seq"]
    model = _model(torch)
    attend, positions = _attention_for(case, torch, dist, seq)
    tokens = torch.randint(0, VOCAB, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    ids, labels = tokens[:, :-1][:, positions], tokens[:, 1:][:, positions]
    times, loss_value = [], 0.0
    for step in range(case["warmup"] + case["steps"]):
        dist.barrier()
        start = time.perf_counter()
        logits = model(ids, attend)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / seq
        loss.backward()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        total = loss.detach().clone()
        dist.all_reduce(total)
        model.zero_grad(set_to_none=True)
        if step >= case["warmup"]:
            times.append(float(elapsed))
            loss_value = float(total)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"seconds": statistics.median(times), "loss": loss_value}), flush=True)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------- the driver
def run_case(python: str, case: dict[str, Any], timeout: float) -> dict[str, Any]:
    port, world = _port(), case["world"]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), PYTHONPATH=str(Path(__file__).resolve().parent.parent / "src"),
               OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)))
    if case["lib"] == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
        env.pop("PYTHONPATH")  # DeepSpeed's interpreter must not see deepshard's sources
    procs = [subprocess.Popen([python, __file__, "--worker", json.dumps(case)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    if any(p.returncode for p in procs):
        bad = next(i for i, p in enumerate(procs) if p.returncode)
        raise RuntimeError(f"{label(case)}: rank {bad} exited {procs[bad].returncode}:\n{outs[bad][1][-2000:]}")
    line = next(x for x in outs[0][0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def label(case: dict[str, Any]) -> str:
    if case["impl"] == "torch":
        return "one process (torch SDPA)"
    return f"{case['lib']} {case['impl']} sp{case['world']}"


def cases(seq: int, with_deepspeed: bool, warmup: int, steps: int) -> list[dict[str, Any]]:
    base = {"seq": seq, "warmup": warmup, "steps": steps}
    out = [dict(base, lib="deepshard", impl="torch", world=1)]
    for world in (2, 4):
        out.append(dict(base, lib="deepshard", impl="ulysses", world=world))
        out.append(dict(base, lib="deepshard", impl="ring", world=world))
        out.append(dict(base, lib="deepshard", impl="DistributedAttention", world=world))
        if with_deepspeed:
            out.append(dict(base, lib="deepspeed", impl="DistributedAttention", world=world))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=4096, help="total tokens of the sequence (default 4096)")
    parser.add_argument("--deepspeed-python", default=os.environ.get("DEEPSPEED_PYTHON"),
                        help="an interpreter with DeepSpeed installed (default: $DEEPSPEED_PYTHON; none: skipped)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    todo = cases(args.seq, bool(args.deepspeed_python), args.warmup, args.steps)
    runs: dict[str, list[dict[str, Any]]] = {label(c): [] for c in todo}
    for repeat in range(args.repeats):
        for case in todo:
            python = args.deepspeed_python if case["lib"] == "deepspeed" else sys.executable
            result = run_case(python, case, args.timeout)
            runs[label(case)].append(result)
            print(f"[{repeat + 1}/{args.repeats}] {label(case):40s} {result['seconds'] * 1000:8.0f} ms  "
                  f"loss {result['loss']:.6f}", flush=True)
    base = statistics.median(r["seconds"] for r in runs[label(todo[0])])
    print(f"\n{args.seq} tokens, {LAYERS} layers, dim {DIM}, {HEADS} heads, causal, fp32, forward + backward; "
          f"median of {args.repeats} interleaved repeats (spread: fastest-slowest)")
    print(f"{'case':40s} {'step ms (spread)':>22s} {'x one process':>14s} {'loss':>10s}")
    for name, rs in runs.items():
        secs = sorted(r["seconds"] for r in rs)
        mid = statistics.median(secs)
        print(f"{name:40s} {f'{mid * 1000:.0f} ({secs[0] * 1000:.0f}-{secs[-1] * 1000:.0f})':>22s} {mid / base:14.2f} "
              f"{rs[-1]['loss']:10.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
