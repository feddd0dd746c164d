"""3D parallelism: a GPT written with deepshard.tp's layers, cut into 2 pipeline stages, on a
pp=2 x dp=2 x tp=2 grid (8 processes) with ZeRO-1, against the same model written with plain layers in
one process (same seed, same global batch)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepshard.comm.group import CommGroup
from deepshard.tp import ColumnParallelLinear, VocabParallelEmbedding, shard_of, vocab_parallel_cross_entropy
from deepshard.tp.params import tp_split_dim
from tests.multiproc.tp_models import GPTConfig, PlainBlock, TPBlock

CFG = GPTConfig()
MICRO, GAS, STEPS = 1, 2, 3


class PlainEmbed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(CFG.vocab, CFG.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class PlainHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(CFG.hidden), nn.Linear(CFG.hidden, CFG.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class TPEmbed(nn.Module):
    def __init__(self, group: CommGroup) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(CFG.vocab, CFG.hidden, group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class TPHead(nn.Module):
    """Vocab-parallel logits; the loss (vocab_parallel_cross_entropy) never gathers them."""

    def __init__(self, group: CommGroup) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(CFG.hidden), ColumnParallelLinear(CFG.hidden, CFG.vocab, group, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def _plain_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [PlainEmbed()] + [PlainBlock(CFG) for _ in range(CFG.layers)] + [PlainHead()]


def _tp_layers(group: CommGroup) -> list[nn.Module]:
    torch.manual_seed(0)  # every layer built on every rank: the same draws as the plain model
    return [TPEmbed(group)] + [TPBlock(CFG, group, sp=False) for _ in range(CFG.layers)] + [TPHead(group)]


def _batches(dp: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, CFG.vocab, (MICRO * GAS * dp, CFG.seq + 1), generator=g) for _ in range(STEPS)]


def _config(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "gradient_clipping": 0.5,
            "zero_optimization": {"stage": stage}}


def _reference(dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    from deepshard.pipe import PipelineModule

    model = PipelineModule(_plain_layers(), num_stages=1, stage_id=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for ids in _batches(dp):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CFG.vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _data(dp: int, dp_rank: int):
    for ids in _batches(dp):
        for k in range(GAS):
            row = ids[(dp_rank * GAS + k) * MICRO:(dp_rank * GAS + k + 1) * MICRO]
            yield row[:, :-1], row[:, 1:]


def three_d_world(rank: int, world: int) -> dict[int, dict[str, Any]]:
    """pp=2 x dp=2 x tp=2 trained at ZeRO-1 and ZeRO-2 (one grid, a fresh model each): worst loss and
    parameter differences against the plain model, per stage."""
    from deepshard.topology import ParallelDims, Topology

    topo = Topology.build(ParallelDims(pp=2, dp=2, tp=2))
    ref_losses, ref = _reference(topo.dims.dp)
    return {stage: _train_3d(topo, stage, ref_losses, ref) for stage in (1, 2)}


def _train_3d(topo: Any, stage: int, ref_losses: list[float], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    import deepshard
    from deepshard.pipe import PipelineModule

    tp = topo.tp
    model = PipelineModule(_tp_layers(tp), topology=topo,
                           loss_fn=lambda logits, labels: vocab_parallel_cross_entropy(logits, labels, tp))
    engine, *_ = deepshard.initialize(model=model, config=_config(stage), mpu=topo)
    it = _data(topo.dims.dp, topo.coord.dp)
    losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    traffic = topo.world.logger.summary()
    worst = 0.0
    for name, p in model.named_parameters():
        mine = engine.strategy.full_fp32_param(p)
        dim = tp_split_dim(p)
        want = ref[name] if dim is None else shard_of(ref[name], dim, tp.rank, tp.size, p.tp_fused_parts)
        worst = max(worst, float((mine - want).abs().max()))
    engine.destroy()
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "params": worst,
            "stage": topo.coord.pp, "n_params": sum(1 for _ in model.parameters()),
            "tp_traffic": traffic.get("tp:all_reduce", {}).get("calls", 0), "traffic": traffic}
