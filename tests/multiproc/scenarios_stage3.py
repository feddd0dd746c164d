"""What each rank runs for the ZeRO-3 tests."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import deepshard
from deepshard.utils import safe_get_full_fp32_param
from tests.multiproc.device import rank_device
from tests.multiproc.models import make_batches, make_model, make_token_batches, make_transformer, micro_slice
from tests.multiproc.scenarios_stage0 import full_weights, run_steps


def z3_config(micro: int, gas: int, dtype: str = "fp32", **zero: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 2000, **zero},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def transformer_oracle(rank: int, world: int, stage: int) -> dict[str, Any]:
    out = {}
    for micro, gas in ((8 // world, 1), (max(4 // world, 1), 8 // (max(4 // world, 1) * world))):
        cfg = z3_config(micro, gas)
        cfg["zero_optimization"]["stage"] = stage
        engine, *_ = deepshard.initialize(model=make_transformer(), config=cfg)
        losses = run_steps(engine, make_token_batches(4, 8), micro, gas, rank, world)
        out[f"m{micro}_g{gas}"] = (losses, full_weights(engine))
        if stage == 3:
            states = [g.state.value for g in engine.strategy.groups]
            out["sharded_after_step"] = all(s == "sharded" for s in states)
            out["placeholder_shape"] = tuple(engine.module.block.linear1.weight.shape)
        # evaluation under no_grad gathers and releases too
        x, y = (t.to(rank_device()) for t in make_token_batches(1, 8, seed=77)[0])  # the CPU unless --device cuda
        with torch.no_grad():
            engine.eval()
            out[f"eval_m{micro}"] = float(engine(x, y))
            engine.train()
    return out


def accounting(rank: int, world: int) -> dict[str, Any]:
    cfg = z3_config(8 // world, 1)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}  # the formula's optimizer: 8 bytes of state
    engine, *_ = deepshard.initialize(model=make_model(), config=cfg)  # no module runs twice per step
    batch = make_batches(2, 8)
    run_steps(engine, batch[:1], 8 // world, 1, rank, world)
    engine.comms_logger.reset()
    run_steps(engine, batch[1:], 8 // world, 1, rank, world)
    model = engine.module
    psi = sum(p.ds_numel for p in model.parameters() if p.requires_grad)
    frozen = sum(p.ds_numel for p in model.parameters() if not p.requires_grad)
    return {"report": engine.memory_report(), "psi": psi, "frozen": frozen,
            "comms": engine.comms_logger.summary()}


def _gathered_mean(w: torch.nn.Parameter) -> float:
    """The mean of ``w``'s full value, read gathered (a frozen parameter has no fp32 master to ask for)."""
    with deepshard.zero.GatheredParameters(w):
        return float(w.detach().float().mean())


def gathered_parameters(rank: int, world: int) -> dict[str, Any]:
    engine, *_ = deepshard.initialize(model=make_transformer(), config=z3_config(8 // world, 1))
    w = engine.module.frozen.weight
    out: dict[str, Any] = {"outside_shape": tuple(w.shape)}
    with deepshard.zero.GatheredParameters(w, modifier_rank=0):
        out["inside_shape"] = tuple(w.shape)
        if rank == 0:
            w.fill_(0.25)
    out["after_modifier"] = _gathered_mean(w)  # frozen: safe_get_full_fp32_param answers None, as DeepSpeed's
    with deepshard.zero.GatheredParameters([w, engine.module.head.weight], modifier_rank=None):
        w.fill_(-1.0)  # discarded: no modifier rank
    out["after_none"] = _gathered_mean(w)
    # a trainable parameter, in bf16 masters too
    with deepshard.zero.GatheredParameters(engine.module.norm.weight, modifier_rank=1), torch.no_grad():
        if rank == 1:
            engine.module.norm.weight.fill_(3.0)
    out["norm_after"] = safe_get_full_fp32_param(engine.module.norm.weight).tolist()
    return out


def save_models(rank: int, world: int, tmp: str, gather: bool) -> dict[str, Any]:
    engine, *_ = deepshard.initialize(model=make_transformer(), config=z3_config(
        8 // world, 1, "bf16", stage3_gather_16bit_weights_on_model_save=gather))
    run_steps(engine, make_token_batches(2, 8), 8 // world, 1, rank, world)
    ok = engine.save_16bit_model(tmp, "model.safetensors")
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    full = {}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            full[n] = safe_get_full_fp32_param(p).to(torch.bfloat16)
        else:  # a frozen parameter has no fp32 copy (safe_get_full_fp32_param answers None): read it gathered
            with deepshard.zero.GatheredParameters([p]):
                full[n] = p.detach().clone()
    return {"ok": ok, "consolidated": consolidated, "full": full}


def _set_mmap_threshold() -> None:
    """Make freed large blocks go back to the OS so the resident set tracks live tensors."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    except OSError:
        pass


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _current_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Wide(torch.nn.Module):
    def __init__(self, layers: int = 16, width: int = 1024) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def init_memory(rank: int, world: int) -> dict[str, Any]:
    _set_mmap_threshold()
    torch.manual_seed(0)
    full_bytes = 16 * 1024 * 1024 * 4
    init = deepshard.zero.Init  # imports the package (lazy) before the baseline: its modules are not the model
    base = _current_rss()
    _reset_peak()
    with init():
        model = Wide()
    peak = _peak_rss() - base
    held = sum(p.ds_tensor.numel() * 4 for p in model.parameters())
    torch.manual_seed(0)
    reference = Wide()
    engine, *_ = deepshard.initialize(model=model, config=z3_config(2, 1))
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # the engine's x: the CPU unless the suite runs with --device cuda (the reference: CPU)
        same = abs(float(engine(x.to(rank_device()))) - float(reference(x))) < 1e-6
    return {"peak": peak, "full_bytes": full_bytes, "held": held, "same_output": same}


def watchdog(rank: int, world: int) -> str:
    os.environ["DEEPSHARD_TIMEOUT"] = str(3 / 60)
    engine, *_ = deepshard.initialize(model=make_transformer(), config=z3_config(8 // world, 1))
    x, y = (t.to(rank_device()) for t in make_token_batches(1, 8)[0])  # the CPU unless --device cuda
    if rank == 1:  # rank 1 does something else entirely: rank 0's gather can never complete
        import time

        time.sleep(10)
        return "rank 1 slept"
    try:
        engine(x[:4], y[:4])
        return "no error"
    except RuntimeError as e:
        return str(e)


def gathered_counts(rank: int, world: int, zero: dict[str, Any]) -> dict[str, Any]:
    """How many non-persistent groups are gathered as each Linear of a 6-layer stack starts its forward
    (second step: the order is recorded), and which stay gathered after forward, for the prefetch knobs."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(6)]
    model = torch.nn.Sequential(*layers)
    cfg = z3_config(2, 1, **{"stage3_param_persistence_threshold": 0, **zero})
    if "stage3_prefetch_bucket_size" not in zero:
        del cfg["zero_optimization"]["stage3_prefetch_bucket_size"]  # the default: derived from the model
    engine, *_ = deepshard.initialize(model=model, config=cfg)
    groups = engine.strategy.groups
    seen: list[int] = []

    def count(module: torch.nn.Module, args: Any) -> None:
        seen.append(sum(g.state.value != "sharded" for g in groups))

    for layer in layers:
        layer.register_forward_pre_hook(count)  # runs after deepshard's own pre-hook
    x = torch.randn(2, 16).to(rank_device())  # the CPU unless the suite runs with --device cuda
    for _ in range(2):
        seen.clear()
        loss = engine(x).pow(2).mean()
        after_forward = [g.state.value != "sharded" for g in groups]
        engine.backward(loss)
        engine.step()
    return {"counts": seen, "kept_after_forward": after_forward,
            "window": engine.strategy.hooks.prefetch_elements,
            "all_released": all(g.state.value == "sharded" for g in groups)}


def step_in_backward_world(rank: int, world: int, dtype: str) -> dict[str, Any]:
    """Stage 3 with optimizer_step_in_backward (fp32/bf16 AdamW, no clipping) and the same run without it,
    from the same seed and batches; also what it keeps and what it refuses."""
    from tests.multiproc.scenarios_stage0 import train

    zero = {"stage": 3, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 10,
            "stage3_prefetch_bucket_size": 300}
    out: dict[str, Any] = {}
    engines: list[Any] = []
    out["fused"] = train(rank, world, 8 // world, 1, 4, dtype=dtype, clip=0.0, stage=3, engine_out=engines,
                         extra={"zero_optimization": {**zero, "optimizer_step_in_backward": True}})
    engine = engines[-1]
    out["grad_bytes"] = engine.memory_report()["gradients"]
    out["norm"] = engine.get_global_grad_norm()
    try:
        from deepshard.utils import safe_get_full_grad

        safe_get_full_grad(engine.module.embed.weight)
        out["grad_error"] = ""
    except RuntimeError as err:
        out["grad_error"] = str(err)
    out["plain"] = train(rank, world, 8 // world, 1, 4, dtype=dtype, clip=0.0, stage=3, engine_out=engines,
                         extra={"zero_optimization": zero})
    out["plain_norm"] = engines[-1].get_global_grad_norm()
    return out


class RankRoutedBlock(torch.nn.Module):
    """A mixture-of-experts-like block: each rank's tokens go through one expert chosen by the rank, so on
    any rank the other expert gets no gradient (the case ZeRO-3 leaf modules exist for)."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden) for _ in range(2)])
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.head(torch.relu(self.experts[expert](x))).pow(2).mean()


def leaf_routed_world(rank: int, world: int) -> dict[str, Any]:
    """Two steps of ZeRO-3 on a rank-routed leaf block; the full parameters after them."""
    import deepshard
    from deepshard.utils import set_z3_leaf_modules

    model = RankRoutedBlock()
    set_z3_leaf_modules(model, [RankRoutedBlock])
    cfg = {**z3_config(1, 1), "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        engine.backward(engine(x, rank % 2))
        engine.step()
    with deepshard.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


class ScaledLinear(torch.nn.Module):
    """A Linear (weight and bias share a ZeRO-3 group, split across ranks unlike DeepSpeed's per-parameter
    split) times a bare parameter alone in its group (split as DeepSpeed splits it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(5, 7)
        self.scale = torch.nn.Module()
        self.scale.weight = torch.nn.Parameter(torch.randn(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) * self.scale.weight).pow(2).mean()


def grad_partitions_batch(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(2, 5, generator=torch.Generator().manual_seed(10 * micro + rank))


def grad_partitions_world(rank: int, world: int) -> dict[str, Any]:
    """DeepSpeed's views of the reduced gradients (``averaged_gradients``, ``get_fp32_grad_partitions``) after
    one backward, after ``allreduce_gradients()`` (must not reduce twice) and after a second backward without
    zero_grad (accumulated); whether the part of the parameter alone in its group is a view of the store."""
    model = ScaledLinear()
    cfg = {**z3_config(2, 1, stage3_min_gather_size=0), "gradient_clipping": 0.0}
    engine, *_ = deepshard.initialize(model=model, config=cfg)
    opt = engine.optimizer  # DeepSpeed's names on the engine's ZeRO optimizer

    def snapshot() -> dict[int, dict[int, torch.Tensor]]:  # the parts are views of the live gradient store
        return {gi: {i: t.clone() for i, t in parts.items()} for gi, parts in opt.get_fp32_grad_partitions().items()}

    out: dict[str, Any] = {}
    engine.backward(engine(grad_partitions_batch(rank, 0)))
    out["first"] = snapshot()
    engine.allreduce_gradients()
    out["after_allreduce"] = snapshot()
    engine.backward(engine(grad_partitions_batch(rank, 1)))
    out["second"] = snapshot()
    averaged = opt.averaged_gradients
    store = engine.strategy.grads.tensor
    alone = averaged[0][2]
    out["alone_is_view"] = (alone.untyped_storage().data_ptr() == store.untyped_storage().data_ptr())
    out["averaged"] = {gi: [t.clone() for t in ts] for gi, ts in averaged.items()}
    engine.step()
    out["after_step"] = snapshot()
    return out


class _SkipInitBlock(torch.nn.Module):
    """A module with submodules of its own that takes ``device=`` (what skip_init needs)."""

    def __init__(self, width: int, device: Any = None) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(width, width, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x))


class SkipInitModel(torch.nn.Module):
    """Submodules built by ``torch.nn.utils.skip_init`` (on the meta device, then ``to_empty()``), one of
    them nested, beside an ordinary one."""

    def __init__(self) -> None:
        super().__init__()
        from torch.nn.utils import skip_init

        self.first = skip_init(torch.nn.Linear, 5, 3)
        self.block = skip_init(_SkipInitBlock, 3)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.first(x)))


def skip_init_values() -> dict[str, torch.Tensor]:
    """The values the skip_init test writes into the model (skip_init leaves memory uninitialized)."""
    gen = torch.Generator().manual_seed(7)
    shapes = {"first.weight": (3, 5), "first.bias": (3,), "block.inner.weight": (3, 3), "block.inner.bias": (3,),
              "head.weight": (1, 3), "head.bias": (1,)}
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def skip_init_world(rank: int, world: int) -> dict[str, Any]:
    """A model with skip_init submodules built under zero.Init: each parameter's shard size, then one
    ZeRO-3 SGD step from known values (written through GatheredParameters from rank 0)."""
    with deepshard.zero.Init():
        model = SkipInitModel()
    out: dict[str, Any] = {"shards": {n: (getattr(p, "ds_tensor", p).numel(), p.numel())
                                      for n, p in model.named_parameters()}}
    params = dict(model.named_parameters())
    with deepshard.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
        if rank == 0:
            for name, value in skip_init_values().items():
                params[name].copy_(value)
    cfg = {**z3_config(2, 1), "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepshard.initialize(model=model, config=cfg)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    with deepshard.zero.GatheredParameters(list(engine.module.parameters())):
        out["after"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return out


def gathered_and_leaf_world(rank: int, world: int) -> dict[str, Any]:
    """One world for GatheredParameters, the leaf-module case, the gradient partitions and skip_init under
    zero.Init (each spawned world costs seconds)."""
    return {"gathered": gathered_parameters(rank, world), "leaf": leaf_routed_world(rank, world),
            "grads": grad_partitions_world(rank, world), "skip_init": skip_init_world(rank, world)}
