"""A user's own Megatron-style layers (marked only with ``tensor_model_parallel`` / ``partition_dim`` /
``partition_stride``, as Megatron and DeepSpeed mark them) trained under ``initialize(mpu=...)`` on a
dp=2 x tp=2 grid: the reported global gradient norm, the clipped update and the parameters equal plain
PyTorch's (the split parameters counted over the tensor-parallel group, the replicated bias once)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

STEPS, CLIP, ROWS = 3, 0.05, 4


class MegatronStyleMpu:
    """What Megatron-DeepSpeed passes as ``mpu``: torch process groups and ranks, nothing deepshard."""

    def __init__(self, topology: Any) -> None:
        self.t = topology

    def get_data_parallel_group(self) -> Any:
        return self.t.dp.group

    def get_data_parallel_rank(self) -> int:
        return self.t.dp.rank

    def get_data_parallel_world_size(self) -> int:
        return self.t.dp.size

    def get_tensor_model_parallel_group(self) -> Any:
        return self.t.tp.group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.t.tp.rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.t.tp.size


class UserParallelMLP(nn.Module):
    """Column-parallel then row-parallel linear, written by a user (deepshard's layers not used)."""

    def __init__(self, plain: nn.Sequential, tp: Any) -> None:
        super().__init__()
        from deepshard.tp import shard_of

        self.tp = tp
        w1, b1, w2, b2 = (t.detach() for t in (plain[0].weight, plain[0].bias, plain[2].weight, plain[2].bias))
        self.w1 = nn.Parameter(shard_of(w1, 0, tp.rank, tp.size).clone())
        self.b1 = nn.Parameter(shard_of(b1, 0, tp.rank, tp.size).clone())
        self.w2 = nn.Parameter(shard_of(w2, 1, tp.rank, tp.size).clone())
        self.b2 = nn.Parameter(b2.clone())  # replicated over tp
        for p, dim in ((self.w1, 0), (self.b1, 0), (self.w2, 1)):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepshard.tp import copy_to_tp_region, reduce_from_tp_region

        h = F.gelu(F.linear(copy_to_tp_region(x, self.tp), self.w1, self.b1))
        return reduce_from_tp_region(F.linear(h, self.w2), self.tp) + self.b2


def _plain() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    return [(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 8, generator=g)) for _ in range(STEPS)]


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for x, y in _data():
        F.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return norms, {"w1": model[0].weight, "b1": model[0].bias, "w2": model[2].weight, "b2": model[2].bias}


def megatron_attribute_layers(rank: int, world: int = 4) -> dict[str, float]:
    """Worst differences against plain PyTorch, at ZeRO stages 0 and 1 (4 ranks: dp=2 x tp=2)."""
    import deepshard
    from deepshard.tp import shard_of
    from deepshard.topology import ParallelDims, Topology
    from tests.multiproc.device import rank_device

    topo = Topology.build(ParallelDims(dp=2, tp=2))
    ref_norms, ref = _reference()
    out: dict[str, float] = {}
    for stage in (0, 1):
        model = UserParallelMLP(_plain(), topo.tp)
        cfg = {"train_micro_batch_size_per_gpu": ROWS // 2, "gradient_clipping": CLIP,
               "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_optimization": {"stage": stage}}
        engine, *_ = deepshard.initialize(model=model, config=cfg, mpu=MegatronStyleMpu(topo))
        half, device = topo.dp.rank * (ROWS // 2), rank_device()  # the CPU unless the suite runs with --device cuda
        norms = []
        for x, y in _data():
            x, y = x[half:half + ROWS // 2].to(device), y[half:half + ROWS // 2].to(device)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
            norms.append(engine.get_global_grad_norm())
        want = {"w1": shard_of(ref["w1"], 0, topo.tp.rank, 2), "b1": shard_of(ref["b1"], 0, topo.tp.rank, 2),
                "w2": shard_of(ref["w2"], 1, topo.tp.rank, 2), "b2": ref["b2"]}
        got = {name: engine.strategy.full_fp32_param(p).cpu() for name, p in model.named_parameters()}
        out[f"z{stage}_norm"] = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
        out[f"z{stage}_params"] = max(float((got[k] - want[k].detach()).abs().max()) for k in want)
        engine.destroy()
    return out
