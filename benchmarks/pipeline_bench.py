"""Pipeline benchmark: step time of ``PipelineEngine`` per schedule on ``pp`` processes (CPU, gloo) against
the same model and batch on one process, under torch DDP on the same ``pp`` processes, and under
DeepSpeed's own ``PipelineEngine`` on the same ``pp`` processes; each schedule's measured bubble against
the analytic one; the peak activation memory of each stage against the schedule's in-flight count.

    python benchmarks/pipeline_bench.py [--pp 2] [--micro-batches 8] [--steps 5] [--json out.json]
    .venv-bench/bin/python benchmarks/pipeline_bench.py ...   # with DeepSpeed (make bench's venv)

- The measured bubble is the idle fraction of the pipeline's time on its busiest stage (the one that sets
  the pace): ``1 - (its compute time) / (step time - its optimizer step)``. Compute time is the forward and
  backward passes (``F``, ``B``, ``BI``, ``BW``; DeepSpeed's ``ForwardPass`` and ``BackwardPass``);
  transfers, waits and the gradient reduction count as bubble, the optimizer step (after the pipeline has
  drained) does not. The idle time the other stages have on top, because they have less work, is reported
  apart as imbalance (``1 - mean compute / busiest compute``); ``mean bubble`` is the idle fraction averaged
  over all stages (the two together). The analytic bubble is ``(p-1)/(m+p-1)`` for GPipe and 1F1B and the
  simulator's (``deepshard.pipe.simulate``) for the others, with the pass costs measured on one process.
  The replayed bubble is the simulator's for the busiest stage fed every pass's measured duration (the
  stages as unequal, and each pass as slow, as they were): replayed over analytic is what the workload
  and the machine's jitter add; measured over replayed is what the engine adds (transfers, the
  reduction, Python between passes).
- DDP: the same layers (tied embedding/head) whole on every process, each process a slice of the global
  batch (``micro-batches / pp`` micro-batches of the same size, accumulated under ``no_sync`` but the last).
- DeepSpeed: the same layers as ``deepspeed.pipe`` ``LayerSpec``/``TiedLayerSpec``, its ``TrainSchedule``
  (1F1B order), ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` as here, the same
  optimizer (torch AdamW, lr 1e-4, no weight decay). Skipped, with the reason printed, when
  ``import deepspeed`` fails. ``DS_ACCELERATOR=cpu`` is set for it; its CPU shared-memory collective op
  (a C++ build at start, used only by ``inference_all_reduce``) is not built.
- Activation memory: bytes of the tensors autograd saves for backward (``saved_tensors_hooks``), counted
  once per storage from the moment they are saved until the graph holding them is freed, parameters left
  out; for ``zb-h1`` also the weight pass's records (layer inputs and output gradients) until the weight
  pass. The peak per stage is taken over the first (warm-up) step, whose timing is not used; the hooks
  are off in the timed steps. It is divided by the simulator's peak in-flight micro-batch count of the
  stage (for DeepSpeed: 1F1B's, the order its TrainSchedule runs).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
from typing import Any, Callable

HIDDEN, BLOCKS, SEQ, MICRO, VOCAB = 256, 8, 64, 4, 512
BASE_SEED = 1234
OPTIM = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}


# ------------------------------------------------------------------------------------------- model
def _parts() -> tuple[Any, Any, Callable[..., Any]]:
    """The layer classes and loss shared by the three engines (built in each process)."""
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(HIDDEN)
            self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

        def forward(self, x: Any) -> Any:
            return x + self.fc2(F.gelu(self.fc1(self.ln(x))))

    class Embed(nn.Embedding):
        def __init__(self) -> None:
            super().__init__(VOCAB, HIDDEN)

    def loss_fn(logits: Any, labels: Any) -> Any:
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    return Block, Embed, loss_fn


def _head(module: Any, x: Any) -> Any:
    return x @ module.weight.t()


def _specs(layer_spec: Any, tied_spec: Any) -> list[Any]:
    Block, Embed, _ = _parts()
    return ([tied_spec("embed", Embed)] + [layer_spec(Block) for _ in range(BLOCKS)]
            + [tied_spec("embed", Embed, forward_fn=_head)])


CHUNKS = 2  # model chunks per stage for the interleaved schedule


def _model(pp: int, chunks: int = 1) -> Any:
    from deepshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    return PipelineModule(_specs(LayerSpec, TiedLayerSpec), num_stages=pp, loss_fn=_parts()[2], seed_layers=True,
                          base_seed=BASE_SEED, partition_method="type:block", num_chunks=chunks)


def _whole_model() -> Any:
    """The same layers on one process, for DDP: embedding, blocks, the embedding's weight as the head."""
    import torch
    from torch import nn

    Block, Embed, _ = _parts()

    class Whole(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(BASE_SEED)
            self.embed = Embed()
            blocks = []
            for i in range(BLOCKS):
                torch.manual_seed(BASE_SEED + 1 + i)
                blocks.append(Block())
            self.blocks = nn.Sequential(*blocks)

        def forward(self, ids: Any) -> Any:
            return _head(self.embed, self.blocks(self.embed(ids)))

    return Whole()


def _data(m: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),) * 2 for _ in range(m)]


# ------------------------------------------------------------------------------ activation memory
class _Held:
    """A saved tensor, packed: releases its count when autograd frees the graph that holds it."""

    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, meter: "SavedBytes", ptr: int, tensor: Any) -> None:
        self.meter, self.ptr, self.tensor = meter, ptr, tensor

    def __del__(self) -> None:
        self.meter._release(self.ptr)


class SavedBytes:
    """Bytes autograd holds for backward: every saved tensor's storage counted once while any graph holds
    it, parameters (and views of them) left out; ``extra`` adds tensors held outside autograd (the split
    backward's records). ``peak`` is the highest ``live + extra`` seen."""

    def __init__(self, params: Any) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}
        self.now = self.extra = self.peak = 0
        self.on = False

    def hooks(self) -> Any:
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: Any) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.params:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, storage.nbytes()]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now + self.extra)
        else:
            entry[0] += 1
        return _Held(self, ptr, t)

    @staticmethod
    def _unpack(packed: Any) -> Any:
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[ptr]
            self.now -= entry[1]

    def set_extra(self, tensors: Any) -> None:
        seen: dict[int, int] = {}
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.live and ptr not in self.params:
                seen[ptr] = t.untyped_storage().nbytes()
        self.extra = sum(seen.values())
        self.peak = max(self.peak, self.now + self.extra)


def _timed_steps(train: Callable[[], Any], steps: int, meter: SavedBytes, busy: dict[str, Any]) -> dict[str, Any]:
    """Step 0 warms up and measures activations (hooks on); steps 1..steps are timed (hooks off).
    ``busy["t"]`` is the compute time the step's passes add, ``busy["opt"]`` its optimizer step's time,
    ``busy["passes"]`` its passes as (kind, micro-batch, chunk, seconds): returned as ``trace``, and their
    mean per kind over the timed steps as ``pass_s``."""
    import torch.distributed as dist

    times, computes, spans, trace = [], [], [], []
    for step in range(steps + 1):
        dist.barrier()
        busy["t"] = busy["opt"] = 0.0
        busy["passes"] = []
        meter.on = step == 0
        t0 = time.perf_counter()
        if meter.on:
            with meter.hooks():
                train()
        else:
            train()
        dt = time.perf_counter() - t0
        if step:
            times.append(dt)
            computes.append(busy["t"])
            spans.append(dt - busy["opt"])
            trace.append(busy["passes"])
    meter.on = False
    return {"step_s": statistics.median(times), "compute_s": statistics.median(computes),
            "span_s": statistics.median(spans), "act_bytes": meter.peak,
            "pass_s": _mean_per_kind(trace), "trace": trace}


def _mean_per_kind(trace: list[list[tuple[str, int, int, float]]]) -> dict[str, float]:
    """Each pass kind's mean duration over the timed steps (the warm-up, slowed by the hooks, left out)."""
    per_kind: dict[str, list[float]] = {}
    for step in trace:
        for kind, _, _, dt in step:
            per_kind.setdefault(kind, []).append(dt)
    return {kind: statistics.mean(v) for kind, v in per_kind.items()}


def _timed_optimizer(owner: Any, name: str, busy: dict[str, float]) -> None:
    """Wrap ``owner.name`` (the optimizer step) so its time lands in ``busy["opt"]``."""
    fn = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            busy["opt"] += time.perf_counter() - t0
    setattr(owner, name, timed)


# ------------------------------------------------------------------------------------ the engines
def _deepshard_rank(rank: int, world: int, schedule: str, m: int, steps: int) -> dict[str, Any]:
    import deepshard
    from deepshard.pipe.schedule import COMPUTE

    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m, "optimizer": OPTIM,
           "pipeline": {"schedule": schedule}}
    engine = deepshard.initialize(model=_model(world, CHUNKS if schedule == "interleaved" else 1), config=cfg)[0]
    meter = SavedBytes(engine.module.parameters())
    busy: dict[str, Any] = {"t": 0.0, "opt": 0.0}
    _timed_optimizer(engine, "_take_model_step", busy)
    for kind in COMPUTE:
        fn = engine._dispatch[kind]

        def timed(run: Any, a: Any, fn: Any = fn, kind: Any = kind) -> None:
            t0 = time.perf_counter()
            fn(run, a)
            dt = time.perf_counter() - t0
            busy["t"] += dt
            busy["passes"].append((kind.value, a.micro_batch, a.chunk, dt))
            if meter.on:  # the split backward's records wait outside autograd until the weight pass
                meter.set_extra(t for u in run.units.values() if u.store is not None
                                for rec in u.store.pending for t in rec[:2])
        engine._dispatch[kind] = timed
    data = _data(m)
    res = _timed_steps(lambda: engine.train_batch(iter(data)), steps, meter, busy)
    engine.destroy()
    return res


def _ddp_rank(rank: int, world: int, schedule: str, m: int, steps: int) -> dict[str, Any]:
    import contextlib

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    if m % world:
        raise ValueError(f"DDP over {world} processes needs micro-batches divisible by {world}, got {m}")
    model = _whole_model()
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), **OPTIM["params"])
    loss_fn = _parts()[2]
    k = m // world
    local = _data(m)[rank * k:(rank + 1) * k]  # this process's slice of the global batch
    meter = SavedBytes(model.parameters())
    busy: dict[str, Any] = {"t": 0.0, "opt": 0.0}
    _timed_optimizer(opt, "step", busy)

    def train() -> None:
        for i, (x, y) in enumerate(local):
            with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
                t0 = time.perf_counter()
                (loss_fn(ddp(x), y) / k).backward()  # the last backward also all-reduces
                busy["t"] += time.perf_counter() - t0
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed_steps(train, steps, meter, busy)


def _deepspeed_rank(rank: int, world: int, schedule: str, m: int, steps: int) -> dict[str, Any]:
    import logging

    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe import schedule as ds_schedule

    if os.path.basename(os.path.dirname(getattr(deepspeed, "__file__", None) or "")) != "deepspeed":
        raise RuntimeError(f"`import deepspeed` gives {deepspeed!r}, not DeepSpeed (deepshard's stand-in?)")
    deepspeed.utils.logger.setLevel(logging.WARNING)
    # On CPU, DeepSpeed's torch backend JIT-compiles a shared-memory C++ op at start (minutes on a busy
    # 2-core machine; a run stopped mid-build leaves a lock that hangs every later one). The op serves
    # only inference_all_reduce; training's all-reduces go through torch.distributed (gloo), as here.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group opened in _child
    model = PipelineModule(_specs(LayerSpec, TiedLayerSpec), num_stages=world, loss_fn=_parts()[2],
                           seed_layers=True, base_seed=BASE_SEED, partition_method="type:block",
                           seed_fn=lambda seed: torch.manual_seed(int(seed)))  # its default seeder rejects numpy ints
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m,
           "optimizer": {"type": OPTIM["type"], "params": {**OPTIM["params"], "torch_adam": True}},
           "steps_per_print": 10 ** 9}
    engine = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                  config=cfg)[0]
    meter = SavedBytes(engine.module.parameters())
    busy: dict[str, Any] = {"t": 0.0, "opt": 0.0}
    table = dict(engine._INSTRUCTION_MAP)  # the engine looks instructions up through the instance
    for cls, key, kind in ((ds_schedule.ForwardPass, "t", "F"), (ds_schedule.BackwardPass, "t", "B"),
                           (ds_schedule.OptimizerStep, "opt", "")):
        fn = table[cls]

        def timed(self: Any, fn: Any = fn, key: str = key, kind: str = kind, **kwargs: Any) -> None:
            t0 = time.perf_counter()
            fn(self, **kwargs)
            dt = time.perf_counter() - t0
            busy[key] += dt
            if kind:  # its passes run each kind in micro-batch order (buffers are reused, ids are not kept)
                micro = sum(1 for k, *_ in busy["passes"] if k == kind)
                busy["passes"].append((kind, micro, 0, dt))
        table[cls] = timed
    engine._INSTRUCTION_MAP = table
    data = _data(m)
    return _timed_steps(lambda: engine.train_batch(iter(data)), steps, meter, busy)


ENGINES = {"deepshard": _deepshard_rank, "ddp": _ddp_rank, "deepspeed": _deepspeed_rank}


def _child(rank: int, world: int, port: int, engine: str, schedule: str, m: int, steps: int, out: Any) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "DEEPSHARD_ACCELERATOR": "cpu", "DS_ACCELERATOR": "cpu"})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out.put((rank, ENGINES[engine](rank, world, schedule, m, steps)))
    except Exception as exc:  # reported by the parent, which stops the other ranks
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        return
    dist.destroy_process_group()


def run(engine: str, pp: int, schedule: str, m: int, steps: int, timeout: float = 600.0) -> dict[str, Any]:
    """One engine on ``pp`` fresh processes; a dict of the slowest rank's step time, the busiest stage's
    bubble, the imbalance and mean bubble, each stage's peak activation bytes, or ``error`` with the first
    rank's reason."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_child, args=(r, pp, port, engine, schedule, m, steps, out)) for r in range(pp)]
    for p in procs:
        p.start()
    rows: list[tuple[int, dict[str, Any]]] = []
    deadline = time.monotonic() + timeout
    error = None
    while len(rows) < pp:
        try:
            rows.append(out.get(timeout=max(1.0, deadline - time.monotonic())))
        except queue.Empty:
            error = f"no result within {timeout:.0f} s"
            break
        if "error" in rows[-1][1]:
            error = f"rank {rows[-1][0]}: {rows[-1][1]['error']}"
            break
    for p in procs:
        if error:
            p.join(5)
            if p.is_alive():
                p.terminate()
        p.join()
    row: dict[str, Any] = {"engine": engine, "pp": pp, "schedule": schedule, "m": m}
    if error:
        return {**row, "error": error}
    res = [r for _, r in sorted(rows, key=lambda x: x[0])]
    busiest = max(res, key=lambda r: r["compute_s"])
    return {**row, "step_s": max(r["step_s"] for r in res), "bubble": 1.0 - busiest["compute_s"] / busiest["span_s"],
            "mean_bubble": statistics.mean(1.0 - r["compute_s"] / r["span_s"] for r in res),
            "imbalance": 1.0 - statistics.mean(r["compute_s"] for r in res) / busiest["compute_s"],
            "compute_s": [r["compute_s"] for r in res], "act_bytes": [r["act_bytes"] for r in res],
            "pass_s": res[0].get("pass_s", {}),
            "busiest": res.index(busiest), "traces": [r["trace"] for r in res]}


# ------------------------------------------------------------------------------------------ report
def _ms(row: dict[str, Any]) -> str:
    return f"{row['step_s'] * 1e3:8.1f}" if "step_s" in row else "     n/a"


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> str:
    return f"{a['step_s'] / b['step_s']:.2f}" if "step_s" in a and "step_s" in b else "n/a"


def main() -> None:
    from deepshard.pipe.schedule import Costs, build_schedule
    from deepshard.pipe.simulate import simulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one engine's run may take")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    m, pp = args.micro_batches, args.pp
    load_before = os.getloadavg()[0]
    base = run("deepshard", 1, "1f1b", m, args.steps, args.timeout)
    if "error" in base:
        raise SystemExit(f"the one-process run failed: {base['error']}")
    f, b = base["pass_s"]["F"] / pp, base["pass_s"]["B"] / pp
    costs = Costs(forward=f, backward_input=b / 2, backward_weight=b / 2)

    def analytic(schedule: str) -> Any:
        if schedule == "interleaved":  # each chunk's passes cost 1/CHUNKS of the stage's
            per_chunk = Costs(f / CHUNKS, b / 2 / CHUNKS, b / 2 / CHUNKS)
            return simulate(build_schedule(schedule, pp, m, CHUNKS), m, CHUNKS, costs=per_chunk)
        return simulate(build_schedule(schedule, pp, m), m, costs=costs)

    def replayed(schedule: str, row: dict[str, Any]) -> float:
        """The busiest stage's bubble in the simulator fed each timed step's measured pass durations (median
        over steps): what the schedule alone leaves idle with the passes as long as they were, unequal
        stages and jitter included, transfers and everything between passes left out."""
        from deepshard.pipe.schedule import Kind

        chunks = CHUNKS if schedule == "interleaved" else 1
        bubbles = []
        for step in range(len(row["traces"][0])):
            durations = {(rank, Kind(kind), micro, chunk): dt for rank, trace in enumerate(row["traces"])
                         for kind, micro, chunk, dt in trace[step]}
            sim = simulate(build_schedule(schedule, pp, m, chunks), m, chunks, durations=durations)
            bubbles.append(sim.stage_bubble(row["busiest"]))
        return statistics.median(bubbles)

    ddp = run("ddp", pp, "-", m, args.steps, args.timeout)
    if importlib.util.find_spec("deepspeed") is None:
        ds: dict[str, Any] = {"engine": "deepspeed", "pp": pp, "schedule": "TrainSchedule", "m": m,
                              "error": "skipped: `import deepspeed` fails here (not installed: run this script "
                                       "from make bench's .venv-bench, or pip install deepspeed)"}
    else:
        ds = run("deepspeed", pp, "TrainSchedule", m, args.steps, args.timeout)
        ds["schedule"] = "TrainSchedule"
    if "error" not in ds:
        sim = analytic("1f1b")  # DeepSpeed's TrainSchedule runs the 1F1B order
        ds["bubble_analytic"], ds["in_flight"] = sim.bubble_fraction, sim.peak_in_flight
        ds["bubble_replayed"] = replayed("1f1b", ds)
    rows = [base]
    for schedule in ("gpipe", "1f1b", "interleaved", "zb-h1"):
        if schedule == "interleaved" and (pp < 2 or m % pp):
            print("deepshard interleaved: skipped (needs pp >= 2 and micro-batches a multiple of pp)")
            continue
        row = run("deepshard", pp, schedule, m, args.steps, args.timeout)
        if "error" in row:
            print(f"deepshard {schedule}: {row['error']}")
            continue
        sim = analytic(schedule)
        row["bubble_analytic"], row["in_flight"] = sim.bubble_fraction, sim.peak_in_flight
        row["bubble_replayed"] = replayed(schedule, row)
        row["speedup_vs_pp1"] = base["step_s"] / row["step_s"]
        rows.append(row)
    base["in_flight"] = simulate(build_schedule("1f1b", 1, m), m).peak_in_flight
    ddp["in_flight"] = [1] * pp  # each process: one micro-batch's forward and backward at a time

    print(f"\nstep time (median of {args.steps} steps after one warm-up; pp={pp}, m={m} micro-batches of {MICRO}; "
          f"1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, {os.cpu_count()} cores)")
    for r in rows + [ddp, ds]:
        if "error" in r:
            print(f"  {r['engine']:9s} pp={r['pp']} {r['schedule']:13s}: {r['error']}")
            continue
        bub = (f"measured bubble {r['bubble']:.3f} (imbalance {r['imbalance']:.3f}, mean over stages "
               f"{r['mean_bubble']:.3f})" if r["engine"] != "ddp" else "(data parallel: no bubble)")
        ana = f"  analytic {r['bubble_analytic']:.3f}" if "bubble_analytic" in r else ""
        print(f"  {r['engine']:9s} pp={r['pp']} {r['schedule']:13s}: step {_ms(r)} ms  {bub}{ana}"
              + (f"  speed-up vs pp=1 {r['speedup_vs_pp1']:.2f}" if "speedup_vs_pp1" in r else ""))

    print("\nratios per schedule (deepshard pp step / DDP step, / DeepSpeed PipelineEngine step; measured bubble / "
          "analytic; measured / replayed: the simulator fed this run's measured passes)")
    for r in rows[1:]:
        print(f"  {r['schedule']:6s}: vs DDP {_ratio(r, ddp)}  vs DeepSpeed {_ratio(r, ds)}  bubble "
              f"{r['bubble']:.3f} / {r['bubble_analytic']:.3f} = {r['bubble'] / r['bubble_analytic']:.2f}; "
              f"/ {r['bubble_replayed']:.3f} = {r['bubble'] / r['bubble_replayed']:.2f}")
    if "error" not in ds:
        print(f"  DeepSpeed TrainSchedule: vs DDP {_ratio(ds, ddp)}  bubble {ds['bubble']:.3f} / "
              f"{ds['bubble_analytic']:.3f} = {ds['bubble'] / ds['bubble_analytic']:.2f}; "
              f"/ {ds['bubble_replayed']:.3f} = {ds['bubble'] / ds['bubble_replayed']:.2f}")

    print("\npeak activation memory per stage (autograd saved tensors; zb-h1 also its weight-pass records) "
          "against the simulator's peak in-flight micro-batches")
    for r in rows + [ddp, ds]:
        if "error" in r:
            continue
        unit = "rank" if r["engine"] == "ddp" else "stage"
        cells = [f"{unit} {s}: {a / 2 ** 20:7.2f} MiB / {n} in flight = {a / 2 ** 20 / max(n, 1):6.2f} MiB per mb"
                 for s, (a, n) in enumerate(zip(r["act_bytes"], r["in_flight"]))]
        print(f"  {r['engine']:9s} pp={r['pp']} {r['schedule']:13s}: " + "; ".join(cells))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"pipeline": rows, "ddp": ddp, "deepspeed": ds}, fh, indent=1)


if __name__ == "__main__":
    main()
