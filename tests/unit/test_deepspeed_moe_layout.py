"""DeepSpeed's MoE checkpoint names (deepshard.checkpoint.deepspeed_format.experts): a rank's local expert ids
become global ids as DeepSpeed's ``_save_moe_checkpoint`` numbers them (expert-parallel rank e of P holds
experts e * E / P ...), and each layer's ep size is recovered from the optimizer groups without ZeRO. The same
code against real DeepSpeed checkpoints: tests/deepspeed_compat/test_moe_checkpoints.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from deepshard.checkpoint.deepspeed_format.experts import MoeLayer, global_name, layer_ep_sizes, local_names
from deepshard.checkpoint.io import CheckpointError

A = MoeLayer(0, 8, "a.deepspeed_moe.experts.deepspeed_experts.", (".0.weight", ".0.bias"))
B = MoeLayer(1, 2, "b.deepspeed_moe.experts.deepspeed_experts.", (".w",))


def test_local_ids_become_global() -> None:
    assert global_name("a.deepspeed_moe.experts.deepspeed_experts.1.0.bias", [A, B], 3, 4) == \
        "a.deepspeed_moe.experts.deepspeed_experts.7.0.bias"  # rank 3 of 4 holds experts 6 and 7
    assert global_name("b.deepspeed_moe.experts.deepspeed_experts.0.w", [A, B], 1, 2) == \
        "b.deepspeed_moe.experts.deepspeed_experts.1.w"
    assert global_name("a.deepspeed_moe.gate.wg.weight", [A, B], 1, 2) == "a.deepspeed_moe.gate.wg.weight"
    assert local_names([A, B], {0: 4, 1: 2}, 4) == [f"{A.prefix}{i}{t}" for i in (0, 1) for t in A.tails]


def test_each_layers_ep_size_from_the_groups() -> None:
    where = Path("tag")
    assert layer_ep_sizes([A, B], [(2, 10)], where) == {0: 2, 1: 2}
    # A split 4 ways holds 2 experts of 2 tensors, B split 2 ways 1 expert of 1 tensor
    assert layer_ep_sizes([A, B], [(4, 4), (2, 1)], where) == {0: 4, 1: 2}
    with pytest.raises(CheckpointError, match="cannot tell"):
        layer_ep_sizes([A, B], [(4, 3), (2, 3)], where)
