"""Sequence parallelism on one GPU: deepshard's Ulysses and ring attention at world size 1 on NCCL against
torch's own scaled-dot-product attention (the CUDA flash / memory-efficient kernels), and the longest
sequence one GPU trains with and without activation checkpointing and tiled MLP / loss.

    python -m benchmarks.gpu.sp_gpu --out sp.json                   # on a GPU machine
    python -m benchmarks.gpu.sp_gpu --device cpu --size tiny        # checks the script on a CPU

Three kinds of case, each in a fresh process (``common.run_case``):

- ``numerics-<mode>-<dtype>``: one attention forward and backward on random q, k, v (8 query heads over 2
  key/value heads, causal) through ``SequenceParallel`` (world size 1, so the whole sequence on one rank)
  and through ``F.scaled_dot_product_attention``; the largest difference of the output and of the q, k, v
  gradients against a float64 reference on the same device (fp32 on CUDA where float64 is slow:
  documented per case), for both, so the figure reads "deepshard's error vs torch's error".
- ``step-<impl>-<seq>``: one training step (forward, backward) of a small causal transformer in bf16 at a
  long sequence: ``sdpa`` (torch's kernel picks flash / efficient), ``ulysses`` and ``ring``
  (deepshard's attention at sp 1); median of the timed steps, peak device memory.
- ``longest-<variant>``: the longest sequence (doubling, then halving the last step) for which one
  forward and backward of the same model fits the device: ``plain`` (SDPA, nothing recomputed),
  ``ckpt`` (every block under ``torch.utils.checkpoint``), ``ckpt-tiled`` (and the MLP and the loss over
  the vocabulary tiled with ``deepshard.sp.tiled``: one slice's intermediates at a time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.common import (case_main, cuda_available, init_single_process_group,  # noqa: E402
                                   peak_device_memory, run_case, stop_on_signals, synchronize)

SIZES: dict[str, dict[str, Any]] = {
    # dim, heads, kv heads, layers, vocabulary; the step sequences and the numerics sequence
    "gpu": {"dim": 1024, "heads": 8, "kv_heads": 2, "layers": 4, "vocab": 32000, "steps_seq": [8192, 32768],
            "numerics_seq": 4096, "longest_start": 8192, "longest_cap": 2**22},
    "tiny": {"dim": 64, "heads": 8, "kv_heads": 2, "layers": 2, "vocab": 256, "steps_seq": [128],
             "numerics_seq": 64, "longest_start": 64, "longest_cap": 1024},
}


# ------------------------------------------------------------------------------------------- the model
def build_model(size: dict[str, Any], device: str, dtype: Any, attend: Callable[..., Any],
                checkpoint: bool, tiled: bool) -> Any:
    import torch
    from torch import nn

    dim, heads, kv_heads = size["dim"], size["heads"], size["kv_heads"]
    head_dim = dim // heads

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x: Any) -> Any:
            return self.down(torch.nn.functional.gelu(self.up(x)))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * kv_heads * head_dim)
            self.o, self.mlp = nn.Linear(dim, dim), MLP()
            self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

        def _mlp(self, x: Any) -> Any:
            if not tiled:
                return self.mlp(x)
            from deepshard.sp.tiled import TiledMLP

            shards = max(1, x.shape[1] // 4096)
            return TiledMLP.apply(lambda module, piece: module(piece), self.mlp, x, shards, None)

        def _inner(self, x: Any) -> Any:
            b, s, _ = x.shape
            h = self.n1(x)
            q = self.q(h).view(b, s, heads, head_dim).transpose(1, 2)
            k, v = self.kv(h).view(b, s, 2, kv_heads, head_dim).unbind(2)
            out = attend(q, k.transpose(1, 2), v.transpose(1, 2), s)
            x = x + self.o(out.transpose(1, 2).reshape(b, s, dim))
            return x + self._mlp(self.n2(x))

        def forward(self, x: Any) -> Any:
            if checkpoint:
                return torch.utils.checkpoint.checkpoint(self._inner, x, use_reentrant=False)
            return self._inner(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(size["vocab"], dim), nn.Linear(dim, size["vocab"], bias=False)
            self.blocks = nn.ModuleList(Block() for _ in range(size["layers"]))
            self.norm = nn.LayerNorm(dim)

        def loss(self, ids: Any, labels: Any) -> Any:
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            x = self.norm(x)
            if not tiled:
                logits = self.head(x).float()
                return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            from deepshard.sp.tiled import TiledFusedLogitsLoss

            def piece_loss(head: Any, hidden: Any, target: Any) -> Any:
                return torch.nn.functional.cross_entropy(head(hidden).float(), target, reduction="sum")

            shards = max(1, x.shape[1] // 4096)
            total = TiledFusedLogitsLoss.apply(piece_loss, self.head, x, labels, None, shards, None, "sum")
            return total / labels.numel()

    torch.manual_seed(0)
    return Model().to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------------------- attention
def attention_for(impl: str) -> Callable[..., Any]:
    """``attend(q, k, v, seq_len)`` on [b, heads, s, d] (k and v with fewer heads)."""
    import torch

    if impl == "sdpa":
        def sdpa(q: Any, k: Any, v: Any, seq_len: int) -> Any:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return sdpa
    from deepshard.sp import SequenceParallel
    from deepshard.topology import ParallelDims, Topology

    sp = SequenceParallel.build(Topology.build(ParallelDims(sp=1)), impl)

    def deepshard_sp(q: Any, k: Any, v: Any, seq_len: int) -> Any:
        return sp.attention(q, k, v, seq_len)
    return deepshard_sp


# ---------------------------------------------------------------------------------------------- cases
def run_numerics(case: dict[str, Any]) -> dict[str, Any]:
    import torch

    device, size = case["device"], SIZES[case["size"]]
    init_single_process_group(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[case["dtype"]]
    ref_dtype = torch.float64 if device == "cpu" else torch.float32
    seq, heads, kv, head_dim = size["numerics_seq"], size["heads"], size["kv_heads"], 64
    gen = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(1, h, seq, head_dim, device=device, generator=gen) for h in (heads, kv, kv)]
    grad_out = torch.randn(1, heads, seq, head_dim, device=device, generator=gen)

    def run(fn: Callable[..., Any], as_dtype: Any) -> tuple[Any, list[Any]]:
        inputs = [t.detach().clone().to(as_dtype).requires_grad_() for t in base]
        out = fn(*inputs, seq)
        out.backward(grad_out.to(as_dtype))
        return out.detach().to(ref_dtype), [t.grad.to(ref_dtype) for t in inputs]

    ref_out, ref_grads = run(attention_for("sdpa"), ref_dtype)
    result: dict[str, Any] = {"status": "ok", "seq": seq, "reference_dtype": str(ref_dtype)}
    for name in ("sdpa", case["mode"]):
        out, grads = run(attention_for(name), dtype)
        result[name] = {"out": float((out - ref_out).abs().max()),
                        **{f"d{x}": float((g - r).abs().max()) for x, g, r in zip("qkv", grads, ref_grads)}}
    return result


def _batch(size: dict[str, Any], seq: int, device: str) -> tuple[Any, Any]:
    import torch

    tokens = torch.randint(0, size["vocab"], (1, seq + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _one_step(model: Any, ids: Any, labels: Any, device: str) -> float:
    synchronize(device)
    loss = model.loss(ids, labels)
    loss.backward()
    value = float(loss)  # a device synchronization
    model.zero_grad(set_to_none=True)
    return value


def run_step(case: dict[str, Any]) -> dict[str, Any]:
    import torch

    device, size, seq = case["device"], SIZES[case["size"]], case["seq"]
    init_single_process_group(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(size, device, dtype, attention_for(case["impl"]), checkpoint=False, tiled=False)
    ids, labels = _batch(size, seq, device)
    times, loss = [], 0.0
    for step in range(case["warmup"] + case["steps"]):
        t0 = time.perf_counter()
        loss = _one_step(model, ids, labels, device)
        if step >= case["warmup"]:
            times.append(time.perf_counter() - t0)
    tokens_s = seq / statistics.median(times)
    return {"status": "ok", "seq": seq, "step_s": statistics.median(times), "tokens_s": tokens_s, "loss": loss,
            "peak_bytes": peak_device_memory(device)}


def _fits(size: dict[str, Any], device: str, variant: str, seq: int) -> bool:
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = None
    try:
        model = build_model(size, device, dtype, attention_for("sdpa"), checkpoint=variant != "plain",
                            tiled=variant == "ckpt-tiled")
        ids, labels = _batch(size, seq, device)
        _one_step(model, ids, labels, device)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


def run_longest(case: dict[str, Any]) -> dict[str, Any]:
    device, size, variant = case["device"], SIZES[case["size"]], case["variant"]
    init_single_process_group(device)
    seq, best, tried = size["longest_start"], 0, []
    while seq <= size["longest_cap"] and _fits(size, device, variant, seq):
        best, seq = seq, seq * 2
        tried.append(best)
    if best and seq <= size["longest_cap"]:
        middle = best + best // 2
        if _fits(size, device, variant, middle):
            best = middle
            tried.append(middle)
    return {"status": "ok", "longest_seq": best, "fitted": tried, "capped": seq > size["longest_cap"]}


def run(case: dict[str, Any]) -> dict[str, Any]:
    return {"numerics": run_numerics, "step": run_step, "longest": run_longest}[case["kind"]](case)


# ----------------------------------------------------------------------------------------- the driver
def cases(device: str, size: str, warmup: int, steps: int) -> list[dict[str, Any]]:
    base = {"device": device, "size": size}
    out = [dict(base, kind="numerics", mode=m, dtype=d, name=f"numerics-{m}-{d}")
           for m in ("ulysses", "ring") for d in ("fp32", "bf16")]
    for seq in SIZES[size]["steps_seq"]:
        out += [dict(base, kind="step", impl=i, seq=seq, warmup=warmup, steps=steps, name=f"step-{i}-{seq}")
                for i in ("sdpa", "ulysses", "ring")]
    out += [dict(base, kind="longest", variant=v, name=f"longest-{v}") for v in ("plain", "ckpt", "ckpt-tiled")]
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| case | result |", "| --- | --- |"]
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | {r.get('status')}: {str(r.get('detail', ''))[:120]} |")
        elif r["name"].startswith("numerics"):
            mode = r["name"].split("-")[1]
            lines.append(f"| {r['name']} | max error vs {r['reference_dtype']}: deepshard out {r[mode]['out']:.2e} "
                         f"dq {r[mode]['dq']:.2e}; torch SDPA out {r['sdpa']['out']:.2e} dq {r['sdpa']['dq']:.2e} |")
        elif r["name"].startswith("step"):
            peak = r.get("peak_bytes")
            lines.append(f"| {r['name']} | {r['step_s'] * 1e3:.1f} ms, {r['tokens_s']:.0f} tokens/s"
                         f"{'' if peak is None else f', peak {peak / 2**30:.2f} GiB'} |")
        else:
            lines.append(f"| {r['name']} | {r['longest_seq']} tokens{' (the cap)' if r['capped'] else ''} |")
    return "\n".join(lines)


def main() -> int:
    if "--case" in sys.argv:
        return case_main(run, sys.argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=tuple(SIZES), default=None, help="default: gpu on cuda, tiny on cpu")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for all cases together")
    parser.add_argument("--case-timeout", type=float, default=60.0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--log-dir", default="/tmp/deepshard-gpu-bench/sp")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    stop_on_signals()
    size = args.size or ("gpu" if args.device == "cuda" else "tiny")
    results: list[dict[str, Any]] = []
    payload: dict[str, Any] = {"size": size, "model": SIZES[size], "results": results}
    if args.device == "cuda" and not cuda_available():
        payload["skipped"] = "no CUDA device"
    else:
        deadline = time.monotonic() + args.budget
        try:
            for case in cases(args.device, size, args.warmup, args.steps):
                left = deadline - time.monotonic()
                if left < 5:
                    results.append({"name": case["name"], "status": "skipped", "detail": "phase budget spent"})
                    continue
                results.append(run_case("benchmarks.gpu.sp_gpu", case, min(args.case_timeout, left),
                                        Path(args.log_dir)))
        except KeyboardInterrupt:
            payload["stopped"] = "the phase's time limit"
    Path(args.out).write_text(json.dumps(payload, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
