"""What each rank runs for the ZeRO-3 per-parameter surface tests (DeepSpeed's ``ds_*`` attributes, the
hook object generation code removes and restores, external parameters)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import deepshard
from deepshard.zero import ZeroParamStatus
from tests.multiproc.device import rank_device
from tests.multiproc.models import make_token_batches, make_transformer, micro_slice
from tests.multiproc.scenarios_stage0 import full_weights, run_steps
from tests.multiproc.scenarios_stage3 import z3_config

NORM_NUMEL = 32  # TinyTransformer's LayerNorms (weight + bias of width 16): kept gathered, nothing else is


def _status(p: torch.nn.Parameter) -> str:
    return p.ds_status.name


def surface_world(rank: int, world: int) -> dict[str, Any]:
    """The attributes after initialize, tensors taken inside GatheredParameters read after it, all_gather /
    partition, status inside a forward, ds_tensor after a write-back by GatheredParameters."""
    cfg = z3_config(8 // world, 1, stage3_param_persistence_threshold=NORM_NUMEL)
    engine, *_ = deepshard.initialize(model=make_transformer(), config=cfg)
    model = engine.module
    out: dict[str, Any] = {
        "ids": [(n, p.ds_id) for n, p in model.named_parameters()],
        "module_ids": [m.ds_id for m in model.modules()],
        "status": {n: _status(p) for n, p in model.named_parameters()},
        "persist": {n: p.ds_persist for n, p in model.named_parameters()},
        "numel": {n: (p.ds_numel, tuple(p.ds_shape), tuple(p.shape)) for n, p in model.named_parameters()},
        "fragments": {n: p.ds_tensor.detach().clone() for n, p in model.named_parameters()},
    }
    with deepshard.zero.GatheredParameters(list(model.parameters())):  # what DeepSpeed's TestZeroToFP32 keeps:
        kept = {n: p.detach().cpu() for n, p in model.named_parameters()}  # on a CPU, the parameter's storage
        state = model.state_dict()
    out["kept"] = {n: t.clone() for n, t in kept.items()}  # read after the release
    out["kept_state"] = {k: v.clone() for k, v in state.items()}
    out["status_after_kept"] = {n: _status(p) for n, p in model.named_parameters()}
    per_module = deepshard.initialize(model=make_transformer(), config=z3_config(  # DeepSpeed's groups: one a module
        8 // world, 1, stage3_param_persistence_threshold=NORM_NUMEL, stage3_min_gather_size=0))[0]
    out["persist_per_module"] = {n: p.ds_persist for n, p in per_module.module.named_parameters()}
    per_module.destroy()
    w = model.frozen.weight
    w.all_gather()
    out["gathered"] = (_status(w), w.detach().clone())
    w.partition()
    out["partitioned"] = (_status(w), tuple(w.shape))
    handle = w.all_gather(async_op=True)
    out["async"] = [_status(w)]
    handle.wait()
    out["async"].append(_status(w))
    model.frozen.bias.partition()  # its group is the weight's: released together
    out["async"].append(_status(w))
    from deepshard.compat.partition_parameters import MultipleAllGatherHandles, partitioned_param_data_shape

    MultipleAllGatherHandles([w.all_gather(async_op=True)]).wait(handle_dependency=False)  # DeepSpeed's keyword
    out["multiple"] = _status(w)
    w.partition()
    out["released_shape_is_deepspeeds"] = list(w.shape) == partitioned_param_data_shape
    seen: list[str] = []
    model.frozen.register_forward_pre_hook(lambda m, a: seen.append(_status(m.weight)))  # after deepshard's
    x, y = (t.to(rank_device()) for t in make_token_batches(1, 8, seed=5)[0])
    with torch.no_grad():
        engine(x, y)
    out["in_forward"], out["after_forward"] = seen, _status(w)
    with deepshard.zero.GatheredParameters(model.head.weight, modifier_rank=1):
        if rank == 1:
            with torch.no_grad():
                model.head.weight.mul_(2.0)
    out["fragment_after_write"] = model.head.weight.ds_tensor.detach().clone()
    out["full_after_write"] = full_weights(engine)["head.weight"]
    part = model.head.weight.ds_tensor  # DeepSpeed's tests set a partition's values this way
    part.data = torch.full_like(part.data, float(rank + 1))
    out["part_numel"] = part.numel()
    out["full_after_data_set"] = full_weights(engine)["head.weight"]
    return out


def _remove_hooks(engine: Any) -> None:
    """What TRL's ``remove_hooks`` does to a DeepSpeed ZeRO-3 engine, call for call."""
    offload = engine.optimizer.parameter_offload
    for module in [offload.module]:
        params = [p for _, p in module.named_parameters(recurse=True)]
        params += [p for _, p in module.ds_external_parameters()]
        for p in params:
            p.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks:
        hook.remove()
    for hook in offload.backward_hooks:
        hook.remove()
    offload.forward_hooks = []
    offload.backward_hooks = []


def _generate(engine: Any, x: torch.Tensor, y: torch.Tensor, out: dict[str, Any]) -> None:
    engine.comms_logger.reset()
    with torch.no_grad():
        out["evals"].append([float(engine.module(x, y)) for _ in range(3)])
    out["gathers_inside"].append(engine.comms_logger.summary().get("all_gather", {}).get("calls", 0))


def generation_world(rank: int, world: int) -> dict[str, Any]:
    """TRL's generation flow before training starts (GRPO) and between steps: gather everything, take the
    hooks off, run forwards, put the hooks back; then train. Counts the gathers inside. The second round
    goes through ``unwrap_model_for_generation`` (DeepSpeed's context manager for it)."""
    cfg = z3_config(8 // world, 1)
    engine, *_ = deepshard.initialize(model=make_transformer(), config=cfg)
    x, y = (t.to(rank_device()) for t in make_token_batches(1, 8, seed=77)[0])
    out: dict[str, Any] = {"evals": [], "gathers_inside": []}
    batches = make_token_batches(4, 8)
    losses: list[float] = []
    for step in range(3):
        if step == 1:  # DeepSpeed's own context manager for the same flow (deepspeed.runtime.zero)
            with deepshard.zero.unwrap_model_for_generation(engine):
                out["hooks_inside"] = len(engine.optimizer.parameter_offload.forward_hooks)
                _generate(engine, x, y, out)
        else:
            with deepshard.zero.GatheredParameters(list(engine.module.parameters())):
                _remove_hooks(engine)
                _generate(engine, x, y, out)
                offload = engine.optimizer.parameter_offload
                offload._register_deepspeed_module(offload.module)
        out.setdefault("hooks_back", []).append(len(engine.optimizer.parameter_offload.forward_hooks))
        out.setdefault("status_after", []).append(sorted({_status(p) for p in engine.module.parameters()}))
        if step < 2:
            losses += run_steps(engine, batches[2 * step:2 * step + 2], 8 // world, 1, rank, world)
    out["losses"] = losses
    out["weights"] = full_weights(engine)
    try:
        engine.optimizer.parameter_offload._register_deepspeed_module(engine.module.block)
    except ValueError as exc:
        out["wrong_module"] = str(exc)
    return out


class ExternalNet(nn.Module):
    """``b`` uses ``a.weight`` inside its own forward (passed in), so ZeRO-3 must gather it there."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = _UsesWeight()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return nn.functional.mse_loss(self.b(h, self.a.weight), y)


class _UsesWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (h @ weight.t()) * self.scale


def make_external(register: bool) -> ExternalNet:
    torch.manual_seed(3)
    model = ExternalNet()
    if register:
        deepshard.zero.register_external_parameter(model.b, model.a.weight)
    return model


def external_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(3)]


def external_world(rank: int, world: int) -> dict[str, Any]:
    engine, *_ = deepshard.initialize(model=make_external(True), config=z3_config(8 // world, 1))
    model = engine.module
    listed = [p is model.a.weight for _, p in model.b.ds_external_parameters()]
    losses = run_steps(engine, external_batches(), 8 // world, 1, rank, world)
    dist.barrier()
    out = {"listed": listed, "is_external": model.a.weight.is_external_param, "losses": losses,
           "weights": full_weights(engine)}
    # undeclared: the root reads a.weight (released after a's forward) and passes it to b; reading it gathers it
    # and registers it on the root, as DeepSpeed does
    engine, *_ = deepshard.initialize(model=make_external(False), config=z3_config(8 // world, 1))
    model = engine.module
    out["undeclared"] = {"losses": run_steps(engine, external_batches(), 8 // world, 1, rank, world),
                         "weights": full_weights(engine), "registered": list(model._external_params.values()) ==
                         [model.a.weight], "status": _status(model.a.weight)}
    return out


def _gather_if_partitioned(*params: torch.nn.Parameter) -> Any:
    """TRL's ``maybe_gather_lm_head_ctx``: gather only what is not already AVAILABLE."""
    import contextlib

    todo = [p for p in params if p.ds_status != ZeroParamStatus.AVAILABLE] if hasattr(params[0], "ds_id") else []
    return deepshard.zero.GatheredParameters(todo) if todo else contextlib.nullcontext()


class _HeadLogits(torch.autograd.Function):
    """A fused LM head as TRL writes one: the weight is read directly (its module is never called), in
    forward and again in backward, each time inside a gather."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        return hidden @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, weight = ctx.saved_tensors
        with _gather_if_partitioned(weight):
            return grad @ weight, grad.t() @ hidden


class FusedHeadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        with _gather_if_partitioned(self.head.weight):
            out = _HeadLogits.apply(h, self.head.weight)
        return nn.functional.mse_loss(out, y)


def make_fused_head() -> FusedHeadNet:
    torch.manual_seed(5)
    return FusedHeadNet()


def fused_head_world(rank: int, world: int) -> dict[str, Any]:
    engine, *_ = deepshard.initialize(model=make_fused_head(), config=z3_config(8 // world, 1))
    losses = run_steps(engine, external_batches(), 8 // world, 1, rank, world)
    return {"losses": losses, "weights": full_weights(engine),
            "released": engine.module.head.weight.ds_status.name}


class _Scale(nn.Module):
    """A frozen norm-like scale: its parameter is saved for backward as itself."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _AdaptedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = _Scale()
        self.base = nn.Linear(8, 8)
        self.base.requires_grad_(False)
        self.adapter = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.scale(x)
        return torch.tanh(self.base(h) + self.adapter(h))


class FrozenBaseNet(nn.Module):
    """A LoRA-shaped model: a frozen base (a scale and a Linear) with a small trainable adapter, the block
    under non-reentrant activation checkpointing (PEFT + TRL's default)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = _AdaptedBlock()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.block, self.inp(x), use_reentrant=False)  # an input that requires grad
        return nn.functional.mse_loss(self.out(h), y)


def make_frozen_base() -> FrozenBaseNet:
    torch.manual_seed(6)
    return FrozenBaseNet()


def frozen_base_world(rank: int, world: int) -> dict[str, Any]:
    # a prefetch window of one group: the frozen scale is still partitioned when the recompute reaches it
    engine, *_ = deepshard.initialize(model=make_frozen_base(),
                                      config=z3_config(8 // world, 1, stage3_prefetch_bucket_size=8))
    losses = run_steps(engine, external_batches(), 8 // world, 1, rank, world)
    out = {"losses": losses, "weights": full_weights(engine),
           "after": sorted({p.ds_status.name for p in engine.module.parameters()})}
    # the same with PyTorch's own loss.backward() (no engine.backward): the backward is opened and closed
    # around autograd's run, and what the recompute gathered is released when it ends
    engine, *_ = deepshard.initialize(model=make_frozen_base(),
                                      config=z3_config(8 // world, 1, stage3_prefetch_bucket_size=8))
    losses, released = [], []
    for batch in external_batches():
        x, y = micro_slice(batch, 8 // world, 0, rank, world)
        loss = engine(x, y)
        loss.backward()
        released.append(sorted({p.ds_status.name for p in engine.module.parameters()}))
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    out["direct"] = {"losses": losses, "weights": full_weights(engine), "released": released}
    return out
