"""Tensor and 3D parallelism against data parallelism on one model: step time, peak memory and model-state
bytes per process, and tensor-parallel traffic against the analytic volume.

    python benchmarks/tp_bench.py                       # both tables (needs transformers)
    python benchmarks/tp_bench.py --hidden 128 --layers 2 --vocab 512 --seq 32 --steps 2   # tiny, fast
    python benchmarks/tp_bench.py --skip-3d             # only the 2-process table

Table 1, 2 processes, a LLaMA-style model from ``transformers`` (``LlamaForCausalLM`` built from a config):
torch DDP, torch FSDP2 (``fully_shard`` per decoder layer), deepshard ZeRO-0 (dp=2), deepshard automatic TP
(``"tensor_parallel": {"autotp_size": 2}``, dp=1) and DeepSpeed's AutoTP (``deepspeed.tp_model_init`` and the
same config key) when DeepSpeed is importable, all on the same global batch. Its TP traffic per step is
compared with the formula: per decoder layer and micro-batch 4 all-reduces of X = b*s*h (2 forward, 2
backward; Megatron), one for the vocab-parallel embedding (forward) and one for the lm_head's input gradient,
and the all-gather of the logits (b*s*V) that the gathered lm_head does so the model's own loss sees them.

Table 2, 4 processes, the same architecture written as a list of layers (embedding, decoder blocks with
fused qkv and gate_up projections, norm + head), once with ``torch.nn`` layers (torch DDP and FSDP2 over 4
ranks) and once with ``deepshard.tp``'s Megatron layers cut into a ``deepshard.pipe.PipelineModule``:
pp=2 x tp=2 x dp=1 and pp=2 x tp=1 x dp=2, ZeRO-1. Under the same seed both versions start from the same
weights, and every case trains on the same global batch, so the losses agree.

Memory per process: ``peak RSS`` is the resident-set high-water mark (``VmHWM``) over the measured steps,
reset (``/proc/self/clear_refs``) once the model and engine are built, so the transient full-model build
is not in it; ``over idle`` subtracts the resident set of the same process before the model was built
(interpreter, torch, transformers, process group). Model states: parameters + gradients + optimizer
state this process holds (deepshard's ``engine.memory_report()``; the local shards for FSDP2), against
16Psi/(p*t*d)-style formulas (fp32 AdamW, 16 bytes per parameter).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HF_CASES = ["ddp", "fsdp2", "deepshard-z0", "deepshard-tp2", "deepspeed-autotp2"]
LAYER_CASES = ["ddp", "fsdp2", "deepshard-pp2-tp2-dp1", "deepshard-pp2-tp1-dp2"]


# --------------------------------------------------------------------------------------- measurement
def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> bool:
    """Start a fresh VmHWM (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _torch_state_bytes(model: nn.Module, optimizer: Any) -> int:
    """Parameters + gradients + optimizer state held by this process (FSDP2's DTensors: the local shard)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        total += sum(local(v).numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total


def _deepshard_state_bytes(engine: Any) -> int:
    report = engine.memory_report()
    return sum(report.get(k, 0) for k in ("parameters", "gradients", "master_weights", "optimizer_state"))


# ------------------------------------------------------------------------------- table 1: HF LLaMA
def build_hf(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=ffn_size(args),
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      bos_token_id=0, eos_token_id=1, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def ffn_size(args: argparse.Namespace) -> int:
    return args.hidden * 8 // 3 // 8 * 8


def _hf_setup(case: str, args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    """Callables for one case of table 1: ``step(global_ids) -> loss`` and ``state() -> bytes``."""
    model = build_hf(args)
    tp = case in ("deepshard-tp2", "deepspeed-autotp2")
    per_rank = args.batch if tp else args.batch // world  # tp ranks share the batch

    def mine(ids: torch.Tensor) -> torch.Tensor:
        return ids if tp else ids[rank * per_rank:(rank + 1) * per_rank]

    if case in ("ddp", "fsdp2"):
        if case == "ddp":
            module = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            module = fully_shard(model)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

        def step(ids: torch.Tensor) -> float:
            ids = mine(ids)
            loss = module(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # keep the gradient buffers counted, as DDP holds them
            return float(loss.detach())
        return {"step": step, "state": lambda: _torch_state_bytes(module, opt)}

    if case == "deepspeed-autotp2":
        return _deepspeed_autotp_setup(model, args, mine)

    import deepshard

    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": per_rank, "gradient_accumulation_steps": 1,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "gradient_clipping": 0.0,
                           "zero_optimization": {"stage": 0}}
    if case == "deepshard-tp2":
        cfg["tensor_parallel"] = {"autotp_size": 2}
    engine, *_ = deepshard.initialize(model=model, config=cfg)

    def ds_step(ids: torch.Tensor) -> float:
        ids = mine(ids)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return float(loss.detach())
    return {"step": ds_step, "state": lambda: _deepshard_state_bytes(engine), "logger": engine.comms_logger}


def _deepspeed_autotp_setup(model: nn.Module, args: argparse.Namespace,
                            mine: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """DeepSpeed's training AutoTP at tp=2 on the CPU accelerator; raises whatever DeepSpeed raises."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if "site-packages" not in (deepspeed.__file__ or "") and "dist-packages" not in (deepspeed.__file__ or ""):
        raise RuntimeError(f"`deepspeed` resolves to {deepspeed.__file__}, not an installed DeepSpeed")
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
           "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 0},
           "gradient_clipping": 0.0, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if hasattr(deepspeed, "tp_model_init"):
        model = deepspeed.tp_model_init(model, tp_size=2, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    grad_bytes = [0]

    def step(ids: torch.Tensor) -> float:
        ids = mine(ids)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        # DeepSpeed frees the gradients in step(): count them here, where they are held
        grad_bytes[0] = sum(p.grad.numel() * p.grad.element_size() for p in engine.module.parameters()
                            if p.grad is not None)
        engine.step()
        return float(loss.detach())

    def state() -> int:
        held = sum(p.numel() * p.element_size() for p in engine.module.parameters()) + grad_bytes[0]
        return held + sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                          if torch.is_tensor(v))
    unsplit = [name for name, p in engine.module.named_parameters()
               if p.dim() == 2 and tuple(p.shape) == shapes.get(name.removeprefix("module."))]
    return {"step": step, "state": state, "version": deepspeed.__version__, "unsplit": unsplit}


# ------------------------------------------------------------------ table 2: the same model as layers
def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dimension of ``[b, heads, s, d]``."""
    s, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], -1) * sin


NORM_EPS = 1e-6  # LLaMA's RMSNorm epsilon


def _column(i: int, o: int, tp: Any, parts: tuple[int, ...] | None = None) -> nn.Module:
    if tp is None:
        return nn.Linear(i, o, bias=False)
    from deepshard.tp import ColumnParallelLinear

    return ColumnParallelLinear(i, o, tp, bias=False, parts=parts)


def _row(i: int, o: int, tp: Any) -> nn.Module:
    if tp is None:
        return nn.Linear(i, o, bias=False)
    from deepshard.tp import RowParallelLinear

    return RowParallelLinear(i, o, tp, bias=False)


class Embed(nn.Module):
    def __init__(self, args: argparse.Namespace, tp: Any) -> None:
        super().__init__()
        if tp is None:
            self.table = nn.Embedding(args.vocab, args.hidden)
        else:
            from deepshard.tp import VocabParallelEmbedding

            self.table = VocabParallelEmbedding(args.vocab, args.hidden, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids)


class Block(nn.Module):
    """A LLaMA decoder layer (RMSNorm, causal attention with rotary embeddings, SwiGLU), q/k/v and
    gate/up fused into one matrix each; with ``tp`` the Megatron split (heads and the ffn over tp)."""

    def __init__(self, args: argparse.Namespace, tp: Any) -> None:
        super().__init__()
        h, f = args.hidden, ffn_size(args)
        self.head_dim = h // args.heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(h, eps=NORM_EPS), nn.RMSNorm(h, eps=NORM_EPS)
        self.qkv, self.o = _column(h, 3 * h, tp, parts=(h, h, h)), _row(h, h, tp)
        self.gate_up, self.down = _column(h, 2 * f, tp, parts=(f, f)), _row(f, h, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.qkv(self.attn_norm(x)).chunk(3, -1))
        att = F.scaled_dot_product_attention(_rope(q), _rope(k), v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Head(nn.Module):
    """Final norm and an untied output matrix; with ``tp`` the logits stay split over the vocabulary."""

    def __init__(self, args: argparse.Namespace, tp: Any) -> None:
        super().__init__()
        self.norm, self.out = nn.RMSNorm(args.hidden, eps=NORM_EPS), _column(args.hidden, args.vocab, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def layer_list(args: argparse.Namespace, tp: Any) -> list[nn.Module]:
    torch.manual_seed(0)  # every layer built on every rank in the same order: the same draws everywhere
    return [Embed(args, tp)] + [Block(args, tp) for _ in range(args.layers)] + [Head(args, tp)]


class PlainLM(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer_list(args, None))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = ids
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(x.reshape(-1, x.shape[-1]), labels.reshape(-1))


def layer_model_params(args: argparse.Namespace) -> tuple[int, int]:
    """(all parameters, the replicated ones under TP: the RMSNorm weights)."""
    h, f, v, n = args.hidden, ffn_size(args), args.vocab, args.layers
    replicated = (2 * n + 1) * h
    return 2 * v * h + n * (4 * h * h + 3 * h * f) + replicated, replicated


def _grid(case: str) -> tuple[int, int, int]:
    pp, tp, dp = (int(part[2:]) for part in case.split("-")[1:])
    return pp, tp, dp


def _layer_setup(case: str, args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    """Callables for one case of table 2 (global batch ``[batch, seq + 1]`` token ids)."""
    if case in ("ddp", "fsdp2"):
        model = PlainLM(args)
        if case == "ddp":
            module = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                if isinstance(layer, Block):
                    fully_shard(layer)
            module = fully_shard(model)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
        per_rank = args.batch // world

        def step(ids: torch.Tensor) -> float:
            rows = ids[rank * per_rank:(rank + 1) * per_rank]
            loss = module(rows[:, :-1], rows[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return float(loss.detach())
        return {"step": step, "state": lambda: _torch_state_bytes(module, opt)}

    import deepshard
    from deepshard.pipe import PipelineModule
    from deepshard.topology import ParallelDims, Topology
    from deepshard.tp import vocab_parallel_cross_entropy

    pp, tp_size, dp = _grid(case)
    topo = Topology.build(ParallelDims(pp=pp, dp=dp, tp=tp_size))
    tp = topo.tp if tp_size > 1 else None

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if tp is not None:
            return vocab_parallel_cross_entropy(logits, labels, tp)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    model = PipelineModule(layer_list(args, tp), topology=topo, loss_fn=loss_fn)
    micro = args.micro
    gas = args.batch // (micro * dp)
    if gas * micro * dp != args.batch:
        raise ValueError(f"global batch {args.batch} is not micro {micro} x dp {dp} x an integer")
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 1}}
    engine, *_ = deepshard.initialize(model=model, config=cfg, mpu=topo)
    d = topo.coord.dp

    def data(ids: torch.Tensor):
        for k in range(gas):
            rows = ids[(d * gas + k) * micro:(d * gas + k + 1) * micro]
            yield rows[:, :-1], rows[:, 1:]

    def pipe_step(ids: torch.Tensor) -> float:
        return float(engine.train_batch(data(ids)))

    stage = {"stage": topo.coord.pp, "blocks": sum(isinstance(m, Block) for m in model.modules()),
             "embed": any(isinstance(m, Embed) for m in model.modules()),
             "head": any(isinstance(m, Head) for m in model.modules()), "gas": gas}
    return {"step": pipe_step, "state": lambda: _deepshard_state_bytes(engine), "logger": engine.comms_logger,
            "stage": stage, "loss_is_global": True}


# ------------------------------------------------------------------------------------------ running
def _worker(rank: int, world: int, port: int, table: str, case: str, args: argparse.Namespace, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DEEPSHARD_ACCELERATOR": "cpu"})
    torch.set_num_threads(1)
    result: dict[str, Any] = {"case": case, "rank": rank}
    try:
        if table == "hf":
            import transformers  # noqa: F401 - in the idle baseline, as torch is
        dist.init_process_group("gloo", rank=rank, world_size=world)
        idle = _proc_status_bytes("VmRSS")
        run = (_hf_setup if table == "hf" else _layer_setup)(case, args, rank, world)
        logger = run.get("logger")
        result["peak_reset"] = _reset_peak_rss()
        times, losses = [], []
        for i in range(args.warmup + args.steps):
            g = torch.Generator().manual_seed(1000 + i)
            width = args.seq if table == "hf" else args.seq + 1
            ids = torch.randint(0, args.vocab, (args.batch, width), generator=g)
            if logger is not None and i == args.warmup:
                logger.reset()
            dist.barrier()
            start = time.perf_counter()
            losses.append(run["step"](ids))
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        result.update(status="ok", times=times, losses=losses, state_bytes=run["state"](), idle_rss=idle,
                      peak_rss=_proc_status_bytes("VmHWM"), loss_is_global=run.get("loss_is_global", False))
        for key in ("stage", "version", "unsplit"):
            if key in run:
                result[key] = run[key]
        if logger is not None:
            result["comm"] = {k: {**v, "per_step": v["elements"] / args.steps} for k, v in logger.summary().items()}
    except Exception as exc:  # noqa: BLE001 - a case that does not run is a result, with its reason
        result.update(status="failed", reason=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
    with open(out.format(rank=rank), "w") as f:
        json.dump(result, f)
    if result["status"] != "ok":
        os._exit(1)  # do not wait in destroy_process_group for ranks that may be stuck in a collective
    dist.destroy_process_group()


def run_case(table: str, case: str, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(prefix="tp_bench_"), "rank{rank}.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, port, table, case, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):  # one rank failed: give the others a moment
            deadline = min(deadline, time.monotonic() + 10)
        time.sleep(0.5)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    ranks = []
    for r in range(world):
        try:
            with open(out.format(rank=r)) as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            ranks.append({"case": case, "rank": r, "status": "failed",
                          "reason": f"no result (exit code {procs[r].exitcode}; timeout {args.timeout}s?)"})
    return ranks


def run_table(table: str, cases: list[str], world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case of one table, each on ``world`` fresh processes, summarized."""
    return [summarize(case, run_case(table, case, world, args), world) for case in cases]


def summarize(case: str, ranks: list[dict[str, Any]], world: int) -> dict[str, Any]:
    failed = [r for r in ranks if r["status"] != "ok"]
    if failed:
        first = next((r for r in failed if "trace" in r), failed[0])
        return {"case": case, "status": "failed", "reason": first["reason"], "trace": first.get("trace", "")}
    per_step = [max(ts) for ts in zip(*(r["times"] for r in ranks))]  # a step ends when its slowest rank does
    if ranks[0].get("loss_is_global"):
        loss = ranks[0]["losses"][-1]
    else:
        loss = sum(r["losses"][-1] for r in ranks) / world  # dp ranks: equal shares; tp ranks: equal values
    return {"case": case, "status": "ok", "step_s": statistics.median(per_step),
            "state": [r["state_bytes"] for r in ranks], "peak": [r["peak_rss"] for r in ranks],
            "over_idle": [r["peak_rss"] - r["idle_rss"] for r in ranks], "loss": loss,
            "peak_reset": all(r.get("peak_reset") for r in ranks), "ranks": ranks}


# --------------------------------------------------------------------------------------- formulas
def tp_formula(args: argparse.Namespace) -> dict[str, float]:
    """Elements per step handed to tp collectives by one rank of table 1 (the comms logger's ``elements``)."""
    x = args.batch * args.seq * args.hidden
    return {"tp:all_reduce": (4 * args.layers + 2) * x, "tp:all_gather": args.batch * args.seq * args.vocab}


def tp_formula_3d(args: argparse.Namespace, stage: dict[str, Any]) -> float:
    """``tp:all_reduce`` elements per step on one rank of a pipeline stage: per micro-batch 4 X per block,
    X for the embedding's forward, X for the head's input gradient, 3 b*s for the vocab-parallel loss."""
    x = args.micro * args.seq * args.hidden
    per_micro = 4 * stage["blocks"] * x
    per_micro += x if stage["embed"] else 0
    per_micro += x + 3 * args.micro * args.seq if stage["head"] else 0
    return stage["gas"] * per_micro


def hf_params(args: argparse.Namespace) -> tuple[int, int]:
    h, f, v, n = args.hidden, ffn_size(args), args.vocab, args.layers
    replicated = (2 * n + 1) * h
    return 2 * v * h + n * (4 * h * h + 3 * h * f) + replicated, replicated


def state_formula(case: str, psi: int, psi_r: int, world: int) -> tuple[float, str]:
    """(bytes, the formula in words) for fp32 AdamW: 16 bytes per parameter, split as the case splits."""
    if case == "ddp" or case == "deepshard-z0":
        return 16 * psi, "16Ψ"
    if case == "fsdp2":
        return 16 * psi / world, f"16Ψ/{world}"
    if case in ("deepshard-tp2", "deepspeed-autotp2"):
        return 16 * (psi - psi_r) / 2 + 16 * psi_r, "16(Ψ−Ψr)/2 + 16Ψr"
    pp, t, d = _grid(case)  # ZeRO-1: parameters and gradients split by pp x tp, Adam's states also by dp
    return 8 * psi / (pp * t) + 8 * psi / (pp * t * d), f"8Ψ/(p·t) + 8Ψ/(p·t·d), p={pp} t={t} d={d}"


# ------------------------------------------------------------------------------------------ output
def _mb(x: float) -> str:
    return f"{x / 2**20:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def print_table(title: str, rows: list[dict[str, Any]], psi: int, psi_r: int, world: int) -> None:
    print(f"\n{title}\n")
    print("| case | step (s) | vs DDP | vs FSDP2 | peak RSS / process (MB), max | over idle (MB), max | "
          "model states / process (MB), max | formula (MB) | states / formula | last loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = {r["case"]: r for r in rows if r["status"] == "ok"}
    ddp, fsdp = ok.get("ddp", {}).get("step_s"), ok.get("fsdp2", {}).get("step_s")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['case']} | did not run: {r['reason'][:300]} | | | | | | | | |")
            continue
        want, words = state_formula(r["case"], psi, psi_r, world)
        print(f"| {r['case']} | {r['step_s']:.3f} | {_ratio(r['step_s'], ddp)} | {_ratio(r['step_s'], fsdp)} | "
              f"{_mb(max(r['peak']))} | {_mb(max(r['over_idle']))} | {_mb(max(r['state']))} | "
              f"{words} = {_mb(want)} | {max(r['state']) / want:.4f} | {r['loss']:.4f} |")
    for r in rows:
        if r["status"] == "ok":
            print(f"  {r['case']}: per rank peak RSS {[_mb(x) for x in r['peak']]} MB, over idle "
                  f"{[_mb(x) for x in r['over_idle']]} MB, states {[_mb(x) for x in r['state']]} MB"
                  + ("" if r["peak_reset"] else " (peak not reset after setup: includes the model build)"))


def print_failures(rows: list[dict[str, Any]]) -> None:
    """For each case that did not run, the last lines of its rank's traceback."""
    for r in rows:
        if r["status"] != "ok":
            print(f"\n{r['case']} did not run. Last lines of rank's traceback:\n"
                  + "\n".join(r.get("trace", "").strip().splitlines()[-6:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--micro", type=int, default=1, help="micro-batch of the pipeline cases (table 2)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--cases", nargs="+", default=HF_CASES, help="table 1 cases (2 processes)")
    parser.add_argument("--cases-3d", nargs="+", default=LAYER_CASES, help="table 2 cases (4 processes)")
    parser.add_argument("--skip-hf", action="store_true", help="leave out table 1")
    parser.add_argument("--skip-3d", action="store_true", help="leave out table 2")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if args.hidden % args.heads:
        parser.error("--hidden must be a multiple of --heads")
    dump: dict[str, Any] = {"args": vars(args)}
    started = time.perf_counter()

    if not args.skip_hf:
        rows = run_table("hf", args.cases, 2, args)
        psi, psi_r = hf_params(args)
        print_table(f"Table 1: LLaMA-style model (transformers LlamaForCausalLM) h={args.hidden} L={args.layers} "
                    f"heads={args.heads} V={args.vocab}, Ψ={psi:,} (Ψr={psi_r:,} replicated norms), global batch "
                    f"{args.batch} x {args.seq} tokens, AdamW fp32, 2 processes (gloo, CPU), median of "
                    f"{args.steps} steps after {args.warmup} warm-up", rows, psi, psi_r, 2)
        tp = next((r for r in rows if r["case"] == "deepshard-tp2" and r["status"] == "ok"), None)
        if tp is not None:
            print("\n| tp collective (deepshard-tp2) | measured elements / step | formula | ratio |\n"
                  "| --- | --- | --- | --- |")
            for op, want in tp_formula(args).items():
                got = tp["ranks"][0]["comm"].get(op, {}).get("per_step", 0.0)
                print(f"| {op} | {got:.0f} | {want:.0f} | {got / want:.4f} |")
        for r in rows:
            if r["status"] == "ok" and "version" in r["ranks"][0]:
                print(f"\n{r['case']}: DeepSpeed {r['ranks'][0]['version']}; 2-D parameters it left whole: "
                      f"{r['ranks'][0].get('unsplit')}")
        print_failures(rows)
        dump["hf"] = rows

    if not args.skip_3d:
        rows = run_table("layers", args.cases_3d, 4, args)
        psi, psi_r = layer_model_params(args)
        print_table(f"Table 2: the same architecture as a layer list (fused qkv / gate_up, untied head), "
                    f"Ψ={psi:,} (Ψr={psi_r:,}), global batch {args.batch} x {args.seq} tokens, pipeline "
                    f"micro-batch {args.micro}, AdamW fp32, ZeRO-1 for the pipeline cases, 4 processes (gloo, CPU)",
                    rows, psi, psi_r, 4)
        three_d = [r for r in rows if r["status"] == "ok" and r["case"].startswith("deepshard-") and
                   _grid(r["case"])[1] > 1]
        if three_d:
            print("\n| case | rank (stage) | blocks | tp:all_reduce elements / step | formula | ratio |\n"
                  "| --- | --- | --- | --- | --- | --- |")
            for r in three_d:
                for rank in r["ranks"]:
                    want = tp_formula_3d(args, rank["stage"])
                    got = rank["comm"].get("tp:all_reduce", {}).get("per_step", 0.0)
                    print(f"| {r['case']} | {rank['rank']} ({rank['stage']['stage']}) | {rank['stage']['blocks']} | "
                          f"{got:.0f} | {want:.0f} | {got / want:.4f} |")
        print_failures(rows)
        dump["layers"] = rows
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dump, f, indent=1, default=str)


if __name__ == "__main__":
    main()
