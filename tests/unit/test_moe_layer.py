"""deepshard's MoE layer on one process, against REFERENCE_MOE 8.3's numbers (measured on DeepSpeed 0.19.8)
and against a plain PyTorch computation of what the layer means (each token's output = the weighted sum of
its experts' outputs). The same layer against DeepSpeed itself, vector by vector: tests/deepspeed_compat/
test_moe_vectors.py."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from deepshard.moe.gate import capacity_for
from deepshard.moe.layer import MoE
from deepshard.moe.utils import is_moe_param


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _layer(**options: Any) -> tuple[MoE, torch.Tensor]:
    """REFERENCE_MOE 8.3's setup: seed 0, the layer first, then 24 tokens of width 16; 4 experts."""
    torch.manual_seed(0)
    layer = MoE(16, _mlp(), num_experts=4, **options)
    return layer, torch.randn(24, 16)


# (options, l_aux, exp_counts) measured on DeepSpeed 0.19.8 (REFERENCE_MOE 8.3)
REFERENCE = [
    ({}, 1.02393, [6, 4, 10, 4]),
    ({"use_rts": False}, 1.02393, [6, 4, 10, 4]),
    ({"drop_tokens": False}, 1.02393, [6, 4, 10, 4]),
    ({"capacity_factor": 2.0}, 1.02393, [6, 4, 10, 4]),
    ({"noisy_gate_policy": "RSample"}, 1.00608, [8, 7, 6, 3]),
    ({"noisy_gate_policy": "Jitter"}, 1.02768, [6, 5, 10, 3]),
    ({"k": 2, "top2_2nd_expert_sampling": False}, 1.02393, [10, 14, 12, 12]),
    ({"k": 2}, 1.02393, [12, 15, 13, 8]),
    ({"k": 3}, 1.00084, [16, 21, 17, 18]),
]


@pytest.mark.parametrize("options,l_aux,counts", REFERENCE)
def test_gating_matches_deepspeeds_measured_numbers(options: dict, l_aux: float, counts: list[int]) -> None:
    layer, x = _layer(**options)
    out, got_l_aux, got_counts = layer(x)
    assert out.shape == x.shape and got_counts.dtype == torch.int64
    assert got_counts.tolist() == counts
    assert got_l_aux.item() == pytest.approx(l_aux, abs=1e-5)
    layer.eval()  # the same l_aux in eval mode (RTS still draws; no noise)
    if not options.get("noisy_gate_policy") and options.get("k", 1) == 1:
        assert layer(x)[1].item() == pytest.approx(l_aux, abs=1e-5)


def _experts_of(layer: MoE) -> list[nn.Module]:
    return list(layer.deepspeed_moe.experts.deepspeed_experts)


def _reference_output(layer: MoE, x: torch.Tensor, k: int) -> torch.Tensor:
    """What an MoE layer computes when nothing is dropped, in plain PyTorch: the top-k experts of each token
    by gate probability, weighted by the probability (top-1) or renormalised over the k (k > 1)."""
    probs = torch.softmax(x.float() @ layer.deepspeed_moe.gate.wg.weight.float().t(), dim=1)
    top, idx = probs.topk(k, dim=1)
    weights = top if k == 1 else top / top.sum(dim=1, keepdim=True)
    experts = _experts_of(layer)
    out = torch.zeros_like(x)
    for s in range(x.shape[0]):
        for j in range(k):
            out[s] += weights[s, j] * experts[int(idx[s, j])](x[s:s + 1])[0]
    return out


@pytest.mark.parametrize("k", [1, 3])
def test_without_dropping_the_output_is_the_weighted_experts(k: int) -> None:
    torch.manual_seed(1)
    layer = MoE(16, _mlp(), num_experts=4, k=k, drop_tokens=False)
    for i, expert in enumerate(_experts_of(layer)):  # make the experts differ (they start as copies)
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.1 * (i + 1) * torch.randn_like(p))
    x = torch.randn(3, 8, 16)
    out, _, counts = layer(x)
    assert out.shape == x.shape and int(counts.sum()) == 24 * k
    torch.testing.assert_close(out.reshape(-1, 16), _reference_output(layer, x.reshape(-1, 16), k))


@pytest.mark.parametrize("use_rts", [False, True])
def test_capacity_drops_the_overflow_of_a_full_expert(use_rts: bool) -> None:
    layer, x = _layer(use_rts=use_rts)
    out, _, counts = layer(x)
    capacity = capacity_for(24, 4, 1.0, 4)
    assert capacity == 6 and counts.tolist() == [6, 4, 10, 4]
    probs = torch.softmax(x @ layer.deepspeed_moe.gate.wg.weight.t(), dim=1)
    full = {s for s in range(24) if probs[s].argmax() == 2}  # expert 2 got 10 tokens for 6 slots
    dropped = {s for s in range(24) if out[s].abs().sum() == 0}
    assert len(dropped) == 4 and dropped <= full  # (which four: torch.topk's choice among equals, as DeepSpeed's)
    kept = [s for s in range(24) if s not in dropped]
    torch.testing.assert_close(out[kept], _reference_output(layer, x, 1)[kept])


def test_used_token_leaves_masked_tokens_unrouted() -> None:
    layer, x = _layer(drop_tokens=False)
    mask = torch.ones(24)
    mask[[0, 7, 8]] = 0
    out, _, counts = layer(x, mask)
    assert int(counts.sum()) == 21 and out[[0, 7, 8]].abs().sum() == 0


def test_capacity_arithmetic() -> None:
    assert capacity_for(8, 2, 1.0, 0) == 4 and capacity_for(8, 4, 1.0, 4) == 4 and capacity_for(9, 4, 1.0, 0) == 3
    assert capacity_for(24, 4, 2.0, 4) == 12 and capacity_for(10, 4, 0.5, 1) == 2
    # DeepSpeed multiplies in float32: 35 / 3 * 1.2 is 14.0000000000000018 in double but 14.000001 in float32
    assert capacity_for(35, 3, 1.2, 0) == 15 == math.ceil(float(torch.tensor(35 / 3) * torch.tensor(1.2)))


def test_structure_names_and_expert_markers() -> None:
    torch.manual_seed(0)
    layer = MoE(16, _mlp(), num_experts=4, ep_size=2, use_residual=True)
    names = [n for n, _ in layer.named_parameters()]
    assert names[0] == "deepspeed_moe.gate.wg.weight"
    assert names[1:5] == [f"deepspeed_moe.experts.deepspeed_experts.0.{s}" for s in ("0.weight", "0.bias", "2.weight", "2.bias")]
    assert names[-4:] == ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"][2:] + ["coefficient.weight", "coefficient.bias"]
    assert layer.num_local_experts == 2 and layer.expert_group_name == "ep_size_2"
    experts = [p for n, p in layer.named_parameters() if ".deepspeed_experts." in n]
    dense = [p for n, p in layer.named_parameters() if ".deepspeed_experts." not in n]
    assert len(experts) == 8 and all(is_moe_param(p) and p.group_name == "ep_size_2" for p in experts)
    assert not any(is_moe_param(p) for p in dense)
    first, second = _experts_of(layer)
    assert torch.equal(first[0].weight, second[0].weight) and first[0].weight is not second[0].weight  # deep copies


def test_bad_arguments_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"Number of experts \(3\) should be divisible by expert parallel size \(2\)"):
        MoE(16, _mlp(), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="Unsupported noisy_gate_policy: 'Gauss'"):
        MoE(16, _mlp(), num_experts=2, noisy_gate_policy="Gauss")
    layer = MoE(16, _mlp(), num_experts=2, min_capacity=8)
    with pytest.raises(ValueError, match="fewer than min_capacity=8"):
        layer(torch.randn(4, 16))
    sharded = MoE(16, _mlp(), num_experts=2, ep_size=2)
    with pytest.raises(RuntimeError, match="no expert-parallel group.*deepshard.initialize"):
        sharded(torch.randn(8, 16))


def test_bf16_tokens_come_back_bf16_with_fp32_routing() -> None:
    layer, x = _layer(k=2)
    out32 = layer(x)[0]
    torch.manual_seed(5)
    out16 = layer.to(torch.bfloat16)(x.to(torch.bfloat16))[0]
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out32, atol=0.05, rtol=0.05)
