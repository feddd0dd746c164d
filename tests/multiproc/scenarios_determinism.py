"""Per-rank bodies of tests/multiproc/test_determinism.py: the same training run at every ZeRO stage (and
with optimizer offload), whose parameters, losses and gradient norms must agree bit for bit, and the
reduced gradient against the canonical sum computed here from each rank's own gradient."""
from __future__ import annotations

from typing import Any

import torch

from tests.multiproc.models import make_token_batches, make_transformer

MICRO = 2
STEPS = 4
CLIP = 0.05  # below the gradient norm: clipping is active in every step
VARIANTS: list[tuple[int, str]] = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "cpu")]
"""(ZeRO stage, offload_optimizer device) of every run."""


def config(stage: int, world: int, dtype: str, offload: str, gas: int = 1,
           deterministic: bool = False) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 700, "stage3_param_persistence_threshold": 40}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
        "train_batch_size": MICRO * gas * world, "gradient_clipping": CLIP, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.99], "weight_decay": 0.01}},
        "zero_optimization": zero}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if deterministic:
        cfg["deterministic"] = True
    return cfg


def atom(batch: tuple[torch.Tensor, torch.Tensor], index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` of a global batch."""
    x, y = batch
    return x[index * MICRO:(index + 1) * MICRO], y[index * MICRO:(index + 1) * MICRO]


def train(rank: int, world: int, stage: int, dtype: str, offload: str) -> dict[str, Any]:
    """``STEPS`` steps on the tied, twice-called transformer; every rank returns what it saw."""
    import deepshard
    from deepshard.utils import safe_get_full_fp32_param

    engine, *_ = deepshard.initialize(model=make_transformer(), config=config(stage, world, dtype, offload))
    losses, norms = [], []
    for batch in make_token_batches(STEPS, MICRO * world):
        loss = engine(*atom(batch, rank))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
        norms.append(engine.get_global_grad_norm())
    params = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()
              if p.requires_grad}  # a frozen parameter has no fp32 copy (None)
    engine.destroy()
    return {"losses": losses, "norms": norms, "params": params}


def canonical_sum(values: list[torch.Tensor]) -> torch.Tensor:
    """The canonical order over ranks, written out: split after the largest power of two below the span."""
    if len(values) == 1:
        return values[0].clone()
    half = 1
    while half * 2 < len(values):
        half *= 2
    return canonical_sum(values[:half]) + canonical_sum(values[half:])


def reduced_gradient(rank: int, world: int, stage: int) -> bool:
    """After one backward, every parameter's reduced gradient is ``canonical_sum(per-rank gradients) / world``,
    the per-rank gradients computed here in one process from each rank's micro-batch."""
    import deepshard
    from deepshard.utils import safe_get_full_grad

    batch = make_token_batches(1, MICRO * world)[0]
    engine, *_ = deepshard.initialize(model=make_transformer(), config=config(stage, world, "fp32", "none"))
    engine.backward(engine(*atom(batch, rank)))
    got = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters() if p.requires_grad}
    engine.destroy()
    local = []
    for r in range(world):
        model = make_transformer()
        model(*atom(batch, r)).backward()
        local.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    factor = 1.0 / world
    return all(torch.equal(got[n], canonical_sum([g[n] for g in local]).mul_(factor)) for n in got)


def stage_world(rank: int, world: int, root: str | None = None) -> dict[Any, Any]:
    """Every variant in fp32 and bf16, and the reduced-gradient check at stages 0 and 3 (rank 0 keeps
    the results); with ``root``, also the deterministic mode's runs (``layout_world``) under ``"layouts"``."""
    out: dict[Any, Any] = {"reduced": {s: reduced_gradient(rank, world, s) for s in (0, 3)}}
    for dtype in ("fp32", "bf16"):
        for stage, offload in VARIANTS:
            out[(dtype, stage, offload)] = train(rank, world, stage, dtype, offload)
    if root is not None:
        out["layouts"] = layout_world(rank, world, root)
    return out if rank == 0 else {"reduced": out["reduced"]}


# ------------------------------------------------------------------ the deterministic mode (layout invariance)
ATOMS = 4
"""Micro-batches per global batch: dp=1 x accumulation 4, dp=2 x 2 and dp=4 x 1 train the same ones."""
LAYOUT_STEPS = 2
LAYOUT_VARIANTS: list[tuple[int, str]] = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "cpu")]


def layout_run(rank: int, world: int, stage: int, offload: str, steps: int, first: int = 0,
               load: str | None = None, save: str | None = None) -> dict[str, torch.Tensor]:
    """``steps`` global batches from batch ``first`` with ``"deterministic": true`` at dp=``world`` x
    accumulation ``ATOMS / world`` (rank ``r``'s micro-step ``m`` trains the micro-batch
    ``engine.atom_index(m)`` names: ``m x world + r``, or ``r x gas + m`` at stages 0 and 1);
    every parameter's full fp32 value at the end."""
    import deepshard
    from deepshard.utils import safe_get_full_fp32_param

    gas = ATOMS // world
    engine, *_ = deepshard.initialize(model=make_transformer(),
                                      config=config(stage, world, "fp32", offload, gas=gas, deterministic=True))
    if load is not None:
        engine.load_checkpoint(load)
    for batch in make_token_batches(first + steps, MICRO * ATOMS)[first:]:
        for m in range(gas):
            engine.backward(engine(*atom(batch, engine.atom_index(m))))
            engine.step()
    if save is not None:
        engine.save_checkpoint(save)
    params = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()
              if p.requires_grad}  # a frozen parameter has no fp32 copy (None)
    engine.destroy()
    return params


def layout_world(rank: int, world: int, root: str) -> dict[Any, Any]:
    """Every variant at this world's layout; at dp=2 also the first half saved under ``root``, at dp=4
    also the second half resumed from it."""
    half = LAYOUT_STEPS // 2
    out: dict[Any, Any] = {}
    for stage, offload in LAYOUT_VARIANTS:
        where = f"{root}/zero{stage}-{offload}"
        out[(stage, offload)] = layout_run(rank, world, stage, offload, LAYOUT_STEPS)
        if world == 2:
            layout_run(rank, world, stage, offload, half, save=where)
        if world == 4:
            out[(stage, offload, "resumed")] = layout_run(rank, world, stage, offload, LAYOUT_STEPS - half,
                                                          first=half, load=where)
    return out if rank == 0 else {}
