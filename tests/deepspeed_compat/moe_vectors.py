"""The MoE layer's vectors under whichever library answers ``import deepspeed`` (DeepSpeed 0.19.8 in its
venv, or deepshard through its shim): REFERENCE_MOE 8.3's setup (seed 0, 24 tokens of width 16, 4 experts
of a 16-32-16 MLP) in every gating mode, two forwards and backwards each; and the gating functions of
``deepspeed.moe.sharded_moe`` (``top1gating`` / ``top2gating`` / ``topkgating``, dense and sparse) on seeded
logits, with the sparse routes' dispatch and combine; written as JSON.

    python moe_vectors.py OUT.json            # run by test_moe_vectors.py under both libraries
"""
from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch import nn

CASES: dict[str, dict[str, Any]] = {
    "top1": {}, "top1_no_rts": {"use_rts": False}, "top1_no_drop": {"drop_tokens": False},
    "top1_cf2": {"capacity_factor": 2.0}, "top1_rsample": {"noisy_gate_policy": "RSample"},
    "top1_jitter": {"noisy_gate_policy": "Jitter"}, "top1_used_token": {"used": True},
    "top1_min_capacity_8": {"min_capacity": 8}, "top1_eval": {"eval": True},
    "top2_no_sampling": {"k": 2, "top2_2nd_expert_sampling": False}, "top2": {"k": 2},
    "top2_no_drop": {"k": 2, "drop_tokens": False}, "top2_eval": {"k": 2, "eval": True, "eval_capacity_factor": 0.5},
    "top3": {"k": 3}, "top3_no_drop": {"k": 3, "drop_tokens": False},
    "top1_residual": {"use_residual": True}, "top2_residual": {"k": 2, "use_residual": True},
}
MASKED = [1, 5, 9, 13, 20]  # the used_token case's unrouted tokens


def run_case(options: dict[str, Any]) -> list[dict[str, Any]]:
    """Two forward/backward passes of one layer; then its gradients and the generator's next draws."""
    from deepspeed.moe.layer import MoE

    options = dict(options)
    evaluate, used = options.pop("eval", False), options.pop("used", False)
    torch.manual_seed(0)
    layer = MoE(16, nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), num_experts=4, **options)
    x = torch.randn(24, 16, requires_grad=True)
    if evaluate:
        layer.eval()
    mask = None
    if used:
        mask = torch.ones(24)
        mask[MASKED] = 0
    steps = []
    for _ in range(2):
        y, l_aux, counts = layer(x) if mask is None else layer(x, mask)
        (y.pow(2).sum() + l_aux).backward()
        steps.append({"l_aux": l_aux.item(), "counts": counts.tolist(), "out": y.detach().reshape(-1).tolist()})
    grads = {n: p.grad.reshape(-1).tolist() for n, p in layer.named_parameters() if p.grad is not None}
    steps.append({"grads": grads, "x_grad": x.grad.reshape(-1).tolist(),
                  "names": [n for n, _ in layer.named_parameters()], "next_draws": torch.rand(3).tolist()})
    return steps


GATING: dict[str, tuple[str, tuple[Any, ...], dict[str, Any]]] = {
    "top1": ("top1gating", (1.0, 0), {"use_rts": False}),
    "top1_rts": ("top1gating", (0.5, 0), {}),
    "top1_no_drop": ("top1gating", (1.0, 0), {"drop_tokens": False}),
    "top1_rsample": ("top1gating", (1.0, 2), {"noisy_gate_policy": "RSample"}),
    "top2": ("top2gating", (1.0, 0), {}),
    "top2_no_sampling": ("top2gating", (0.5, 0), {"top2_2nd_expert_sampling": False}),
    "top2_no_drop": ("top2gating", (1.0, 0), {"drop_tokens": False}),
    "top3_probs": ("topkgating", (3, 0.5, 0), {}),
    "top3_position": ("topkgating", (3, 0.5, 0), {"drop_policy": "position"}),
    "top2k_position_min_capacity": ("topkgating", (2, 0.25, 9), {"drop_policy": "position"}),
    "top3_no_drop": ("topkgating", (3, 1.0, 0), {"drop_tokens": False}),
}
"""Gating-function calls: (function, positional arguments after the logits, keyword arguments)."""


def _listed(value: Any) -> Any:
    return value.detach().reshape(-1).tolist() if isinstance(value, torch.Tensor) else value


def run_gating(name: str) -> dict[str, Any]:
    """One gating call, dense then sparse (each from seed 1: 24 tokens, 6 experts), and the sparse
    routes' dispatch buffer and combined output for seeded tokens and expert outputs."""
    import deepspeed.moe.sharded_moe as sharded_moe

    function, args, options = GATING[name]
    out: dict[str, Any] = {}
    for sparse in (False, True):
        torch.manual_seed(1)
        logits = torch.randn(24, 6)
        result = getattr(sharded_moe, function)(logits, *args, sparse_routes=sparse, **options)
        out["sparse" if sparse else "dense"] = [_listed(v) for v in result]
    l_aux, capacity, experts, indices, locations, gates, _ = result
    capacity = int(capacity)
    slots = sharded_moe._route_slots(indices, locations, experts, capacity)
    hidden, expert_out = torch.randn(24, 8), torch.randn(experts * capacity, 8)
    out["encoded"] = _listed(sharded_moe._sparse_encode(hidden, slots, experts, capacity))
    out["decoded"] = _listed(sharded_moe._sparse_decode(expert_out, slots, gates, 24))
    return out


def main(out: str) -> None:
    vectors: dict[str, Any] = {name: run_case(options) for name, options in CASES.items()}
    vectors["gating"] = {name: run_gating(name) for name in GATING}
    json.dump(vectors, open(out, "w"))


if __name__ == "__main__":
    main(sys.argv[1])
