"""Per-rank bodies for the tensor-parallel layer tests: one world of 4 ranks checks tp=2 (two tp groups of a
2 x 2 grid) and tp=4 against the plain single-process model."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepshard.comm.group import CommGroup
from deepshard.comm.logger import CommsLogger
from deepshard.topology import ParallelDims, Topology
from deepshard.tp import (ColumnParallelLinear, RowParallelLinear, clip_tp_grad_norm_, shard_of,
                          tensor_parallel_rng, vocab_parallel_cross_entropy)
from deepshard.tp.params import tp_split_dim
from tests.multiproc.scenarios_autotp import autotp_checks
from tests.multiproc.tp_models import GPTConfig, PlainGPT, TPBlock, TPGPT, make_tokens, plain_name


def _slice_of(full: torch.Tensor, p: torch.Tensor, group: CommGroup) -> torch.Tensor:
    dim = tp_split_dim(p)
    if dim is None:
        return full
    return shard_of(full, dim, group.rank, group.size, getattr(p, "tp_fused_parts", None))


def _max_diff(tp_model: nn.Module, plain: nn.Module, group: CommGroup, grads: bool) -> float:
    ref = dict(plain.named_parameters())
    worst = 0.0
    for name, p in tp_model.named_parameters():
        full = ref[plain_name(name)]
        full = full.grad if grads else full.detach()
        mine = p.grad if grads else p.detach()
        worst = max(worst, float((mine - _slice_of(full, p, group)).abs().max()))
    return worst


def _train_pair(cfg: GPTConfig, group: CommGroup, sp: bool, dp_rank: int) -> dict[str, float]:
    """Three SGD steps with clipping, TP model vs plain model, the same batches; the worst differences."""
    torch.manual_seed(0)
    plain = PlainGPT(cfg)
    torch.manual_seed(0)
    model = TPGPT(cfg, group, sp=sp)
    out = {"init": _max_diff(model, plain, group, grads=False), "loss": 0.0, "grad": 0.0, "norm": 0.0}
    # SGD with momentum: sensitive to the gradient's magnitude, and free of Adam's amplification of
    # round-off in near-zero gradients (g / sqrt(v) turns a 1e-9 difference into a 1e-2-sized step)
    opt_ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for ids, labels in make_tokens(cfg, batch=4, steps=3, seed=3 + dp_rank):
        loss_ref = plain(ids, labels)
        loss_ref.backward()
        loss = model(ids, labels)
        loss.backward()
        out["loss"] = max(out["loss"], abs(float(loss.detach()) - float(loss_ref.detach())))
        out["grad"] = max(out["grad"], _max_diff(model, plain, group, grads=True))
        norm_ref = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        norm = clip_tp_grad_norm_(model.parameters(), 0.5, group)
        out["norm"] = max(out["norm"], abs(float(norm) - float(norm_ref)))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    out["params"] = _max_diff(model, plain, group, grads=False)
    return out


def _block_traffic(cfg: GPTConfig, group: CommGroup, sp: bool) -> dict[str, Any]:
    """The tp traffic of one block's forward and backward on ``[b, s, h]`` activations."""
    torch.manual_seed(1)
    block = TPBlock(cfg, group, sp)
    b = 2
    x = torch.randn(b, cfg.seq // (group.size if sp else 1), cfg.hidden, requires_grad=True)
    group.logger.reset()
    block(x).sum().backward()
    return {"ops": group.logger.summary(), "X": b * cfg.seq * cfg.hidden, "h": cfg.hidden}


def _cross_entropy(group: CommGroup) -> dict[str, float]:
    torch.manual_seed(7)
    logits = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 16, (3, 5))
    target[0, 1] = target[2, 4] = -100
    ref = F.cross_entropy(logits.reshape(-1, 16), target.reshape(-1))
    ref.backward()
    local = shard_of(logits.detach(), -1, group.rank, group.size).clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, group)
    loss.backward()
    per_token = vocab_parallel_cross_entropy(local.detach(), target, group, reduction="none")
    ref_tokens = F.cross_entropy(logits.detach().reshape(-1, 16), target.reshape(-1), reduction="none")
    return {"loss": abs(float(loss) - float(ref)),
            "grad": float((local.grad - shard_of(logits.grad, -1, group.rank, group.size)).abs().max()),
            "tokens": float((per_token.reshape(-1) - ref_tokens).abs().max())}


def _linear_pair(group: CommGroup) -> dict[str, float]:
    """Column with gathered output, then row taking a full input, against two nn.Linear."""
    torch.manual_seed(11)
    ref1, ref2 = nn.Linear(8, 12), nn.Linear(12, 6)
    col = ColumnParallelLinear.from_linear(ref1, group, gather_output=True)
    row = RowParallelLinear.from_linear(ref2, group, input_is_parallel=False)
    x = torch.randn(5, 8)
    xr, xt = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yr, yt = ref2(torch.tanh(ref1(xr))), row(torch.tanh(col(xt)))
    yr.square().sum().backward()
    yt.square().sum().backward()
    return {"out": float((yr - yt).abs().max()), "xgrad": float((xr.grad - xt.grad).abs().max()),
            "wgrad": float((row.weight.grad - shard_of(ref2.weight.grad, 1, group.rank, group.size)).abs().max()),
            "bgrad": float((row.bias.grad - ref2.bias.grad).abs().max())}


def _dropout_streams(group: CommGroup) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    tracker = tensor_parallel_rng(seed=5, tp_rank=group.rank)
    with tracker.fork():
        inside = torch.rand(6)
    after_fork = torch.rand(6)
    torch.manual_seed(5)
    no_fork = torch.rand(6)
    with tracker.fork():
        inside_again = torch.rand(6)
    return {"inside": inside, "inside_again": inside_again, "outside": after_fork, "no_fork": no_fork}


def tp_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Layers and automatic TP (below), then the engine (``scenarios_tp_engine``): one spawned world pays
    the interpreters' start-up once."""
    from tests.multiproc.scenarios_tp_engine import tp_engine_world

    out = tp_layers_world(rank, world)
    out["engine"] = tp_engine_world(rank, world, tmp)
    return out


def tp_layers_world(rank: int, world: int) -> dict[str, Any]:
    """Layers and automatic TP on tp=2 (a 2 x 2 grid's tp groups) and tp=4 (the world as the tp group)."""
    topo = Topology.build(ParallelDims(dp=2, tp=2), logger=CommsLogger())
    tp4 = CommGroup(group=None, logger=CommsLogger(), name="tp")
    cfg = GPTConfig()
    out: dict[str, Any] = {"rank": rank, "labels": topo.tp.name}
    for t, group, dp_rank in ((2, topo.tp, topo.coord.dp), (4, tp4, 0)):
        for sp in (False, True):
            out[f"train_tp{t}_sp{int(sp)}"] = _train_pair(cfg, group, sp, dp_rank)
            out[f"traffic_tp{t}_sp{int(sp)}"] = _block_traffic(cfg, group, sp)
        out[f"ce_tp{t}"] = _cross_entropy(group)
        out[f"linear_tp{t}"] = _linear_pair(group)
        out[f"dropout_tp{t}"] = _dropout_streams(group)
        out[f"autotp_tp{t}"] = autotp_checks(group, dp_rank)
    return out
