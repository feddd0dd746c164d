"""Train a small byte-level GPT on the Python standard library's source, DeepSpeed style.

    deepshard --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/ds_config.json
    python examples/train_gpt.py --deepspeed_config examples/ds_config.json     # one process

The script is written against DeepSpeed's public API only (``import deepshard as deepspeed`` would
read the same). Rank 0 shows a progress bar, logs the loss, and ends with a summary: loss first ->
last, validation loss before and after, tokens/s, and the memory each process holds. The bar is drawn only
where rank 0's output reaches a terminal (``deepshard.utils.progress.bars_on``: the launcher on a terminal
turns it on, ``DEEPSHARD_PROGRESS=0/1`` forces it); in a redirected log the loss lines say the rate and the
time left instead, one plain line per ``--log_every`` steps.

Batch size and process count: the config says ``train_batch_size`` 32 = micro 8 x accumulation 2 x
2 processes. When the script runs on another number of processes, it keeps the global batch (32) and
the micro batch (8) and lets the accumulation steps be derived (4 on one process), so every process
count trains on the same global batches with the same learning-rate schedule.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deepshard  # noqa: E402
from deepshard.accelerator import cpu_has_native_bf16, get_accelerator  # noqa: E402
from deepshard.config import ConfigError  # noqa: E402
from deepshard.utils.progress import bars_on, format_seconds  # noqa: E402
from corpus import ByteWindowDataset, load_stdlib_corpus, train_val_split  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402

# Short column labels for the categories of engine.memory_report(); other keys are shown as named.
MEMORY_LABELS = {"parameters": "params", "gradients": "grads", "master_weights": "master",
                 "optimizer_state": "optim", "buffers": "buffers", "comm_buckets": "buckets",
                 "total": "total", "peak_rss": "peak RSS", "gathered_parameters": "gathered",
                 "offloaded": "offloaded", "offload_buffers": "off.bufs"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="byte-level GPT on the stdlib sources")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the launcher")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps (default: the scheduler's total_num_steps, else 200)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--max_bytes", type=int, default=8_000_000, help="corpus size in bytes")
    parser.add_argument("--log_every", type=int, default=25, help="log the loss every N steps")
    parser.add_argument("--val_batches", type=int, default=8, help="batches per validation pass")
    parser = deepshard.add_config_arguments(parser)
    return parser.parse_args(argv)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def fit_batch_to_world(config: dict[str, Any], world: int) -> dict[str, Any] | None:
    """A copy of ``config`` whose batch keys fit ``world`` processes, or None when they already fit.

    Keeps ``train_batch_size`` and ``train_micro_batch_size_per_gpu`` and drops
    ``gradient_accumulation_steps`` so the engine derives it: 32 = 8 x 2 x 2 becomes 32 = 8 x 4 x 1.
    """
    tbs = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    gas = config.get("gradient_accumulation_steps")
    if not all(isinstance(v, int) for v in (tbs, micro, gas)) or tbs == micro * gas * world:
        return None
    if tbs % (micro * world) != 0:  # a ConfigError: the launcher prints it once, in one line
        raise ConfigError(
            f"train_batch_size {tbs} is not a multiple of train_micro_batch_size_per_gpu {micro} x "
            f"{world} processes = {micro * world}; run on a process count that divides "
            f"{tbs // micro} or edit the config")
    fitted = dict(config)
    del fitted["gradient_accumulation_steps"]
    return fitted


def repeat(loader: Iterable[Any]) -> Iterator[Any]:
    """Iterate ``loader`` forever, starting a new sampler epoch each pass."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def sum_over_ranks(value: float) -> float:
    """The sum of a Python float across all processes (itself on one process)."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def mean_over_ranks(value: float) -> float:
    """The mean of a Python float across all processes (itself on one process)."""
    return sum_over_ranks(value) / world_size()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a one-element list on one process)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


@torch.no_grad()
def validation_loss(engine: Any, dataset: ByteWindowDataset, batches: int, micro: int) -> float:
    """Mean loss over ``batches`` fixed batches spread evenly over ``dataset``, split across ranks."""
    engine.eval()
    offsets = torch.linspace(0, len(dataset) - micro, batches).long().tolist()
    total = 0.0
    for start in offsets[engine.global_rank::world_size()]:
        xs, ys = zip(*(dataset[i] for i in range(start, start + micro)))
        x, y = torch.stack(xs).to(engine.device), torch.stack(ys).to(engine.device)
        total += float(engine(x, y))
    engine.train()
    return sum_over_ranks(total) / batches


def load_config(path: str | None) -> dict[str, Any]:
    if not path:
        raise SystemExit("give a config: --deepspeed_config examples/ds_config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def default_steps(config: dict[str, Any]) -> int:
    params = (config.get("scheduler") or {}).get("params", {})
    return int(params.get("total_num_steps", 200))


def train(engine: Any, loader: Iterable[Any], steps: int, log_every: int, rank: int) -> list[float]:
    """Run ``steps`` optimizer steps; return the rank-averaged loss of each step."""
    batches = repeat(loader)
    gas = engine.gradient_accumulation_steps()
    losses: list[float] = []
    # no bar (no \r redraws) where the output is a log file or a pipe: the loss lines carry the progress
    bar = tqdm(total=steps, desc="train", unit="step", disable=rank != 0 or not bars_on(), dynamic_ncols=True)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        step_loss = 0.0
        for _ in range(gas):
            x, y = next(batches)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / gas
        losses.append(mean_over_ranks(step_loss))
        lr = engine.get_lr()[0]
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.2e}", refresh=False)
        bar.update(1)
        if rank == 0 and (step % log_every == 0 or step == 1 or step == steps):
            line = f"step {step:4d}/{steps}  loss {losses[-1]:.4f}  lr {lr:.3e}"
            if bar.disable:
                elapsed = time.perf_counter() - start
                line += (f"  {step / elapsed:.2f} step/s  elapsed {format_seconds(elapsed)}  "
                         f"left {format_seconds(elapsed / step * (steps - step))}")
            bar.write(line)
    bar.close()
    return losses


def mib(n: int) -> str:
    return f"{n / 2**20:10.1f}"


def print_summary(stats: dict[str, Any], rows: list[dict[str, int]]) -> None:
    """Rank 0's closing report: the loss, throughput and per-process memory table."""
    losses = stats["losses"]
    tail = losses[-10:]
    print("\n=== summary ===")
    print(f"model           {stats['params'] / 1e6:.2f}M parameters, {stats['world']} process(es), "
          f"global batch {stats['batch']} x {stats['block']} tokens")
    print(f"train loss      {losses[0]:.4f} -> {losses[-1]:.4f}  "
          f"(mean of the last {len(tail)} steps {sum(tail) / len(tail):.4f})")
    print(f"val loss        {stats['val_before']:.4f} -> {stats['val_after']:.4f}")
    print(f"throughput      {stats['tokens'] / stats['elapsed']:,.0f} tokens/s, "
          f"{stats['elapsed'] / len(losses) * 1000:.0f} ms/step, {stats['elapsed']:.1f} s total")
    if stats.get("comm_bytes") is not None:
        print(f"communication   {stats['comm_bytes'] / 2**20:.1f} MiB handed to collectives by rank 0's engine")
    keys = [k for k in rows[0] if k not in ("total", "peak_rss")] + ["total", "peak_rss"]
    print("memory per process, MiB (model states held by the engine; 'total' is their sum; "
          "and the peak resident set size):")
    print("  " + "".join(f"{label:>10}" for label in ["rank", *(MEMORY_LABELS.get(k, k)[:9] for k in keys)]))
    for rank, row in enumerate(rows):
        print("  " + f"{rank:>10}" + "".join(mib(row.get(k, 0)) for k in keys))


def fp32_where_bf16_is_emulated(config: dict) -> dict | None:
    """The config with bf16 off when it asks for bf16 on a CPU that only emulates it (no avx512_bf16 /
    amx_bf16: 17x slower than fp32 on the demo), else None. The demo should end in minutes anywhere."""
    if not (config.get("bf16") or {}).get("enabled") or get_accelerator().device.type != "cpu":
        return None
    if cpu_has_native_bf16() is not False:
        return None
    if int(os.environ.get("RANK", "0")) == 0:
        print("this CPU has no native bf16 (no avx512_bf16 / amx_bf16 flag): the demo trains in fp32 instead "
              "of the config's bf16", flush=True)
    return {**config, "bf16": {**config["bf16"], "enabled": False}}


def build_data(args: argparse.Namespace, block: int) -> tuple[ByteWindowDataset, ByteWindowDataset]:
    train_bytes, val_bytes = train_val_split(load_stdlib_corpus(args.max_bytes))
    return ByteWindowDataset(train_bytes, block), ByteWindowDataset(val_bytes, block)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deepshard.init_distributed()
    config = load_config(args.deepspeed_config)
    fitted = fit_batch_to_world(config, world_size())
    fitted = fp32_where_bf16_is_emulated(fitted or config) or fitted
    if fitted is not None:  # pass the adjusted dict instead of the file (not both)
        args.deepspeed_config, config = None, fitted
    steps = args.steps or default_steps(config)

    torch.manual_seed(args.seed)
    model_config = GPTConfig()
    model = GPT(model_config)
    n_params = model.num_parameters()  # counted before the engine wraps (and later shards) it
    train_set, val_set = build_data(args, model_config.block_size)
    engine, _, loader, _ = deepshard.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=train_set,
        config=fitted)
    rank, micro = engine.global_rank, engine.train_micro_batch_size_per_gpu()
    batch = micro * engine.gradient_accumulation_steps() * engine.dp_world_size

    val_before = validation_loss(engine, val_set, args.val_batches, micro)
    start = time.perf_counter()
    # the engine's own log lines (steps_per_print) go through tqdm.write, above the progress bar
    with logging_redirect_tqdm(loggers=[logging.getLogger("deepshard")]):
        losses = train(engine, loader, steps, args.log_every, rank)
    elapsed = time.perf_counter() - start
    val_after = validation_loss(engine, val_set, args.val_batches, micro)

    memory = dict(engine.memory_report())
    memory["peak_rss"] = peak_rss_bytes()
    rows = gather_objects(memory)
    comms = getattr(engine, "comms_logger", None)
    if rank == 0:
        print_summary({"losses": losses, "val_before": val_before, "val_after": val_after,
                       "elapsed": elapsed, "tokens": steps * batch * model_config.block_size,
                       "params": n_params, "world": engine.dp_world_size,
                       "batch": batch, "block": model_config.block_size,
                       "comm_bytes": comms.total_bytes() if comms is not None else None}, rows)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0 if math.isfinite(losses[-1]) else 1


if __name__ == "__main__":
    sys.exit(main())
