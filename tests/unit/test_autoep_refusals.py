"""AutoEP's refusals of MoE blocks it cannot route for (a block that reads its fused experts itself, under a
``preset_model`` other than Mixtral's, or without a router or top-k) come before anything changes: no block
re-classed, no experts module sliced, no expert-parallel group made (the topology is never reached)."""
from __future__ import annotations

import pytest
import torch

from deepshard.moe.autoep import apply_autoep
from deepshard.moe.autoep_layer import AutoEPMoELayer
from tests.multiproc.inline_moe import InlineMoELM


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("damage, error, words", [
    (None, NotImplementedError, "preset_model 'mixtral' only"),
    ("top_k", ValueError, "no top-k"),
])
def test_refused_block_leaves_the_model_unchanged(damage: str | None, error: type, words: str) -> None:
    torch.manual_seed(0)
    model = InlineMoELM()
    preset = "qwen3_moe" if damage is None else "mixtral"
    if damage is not None:  # the last block only: the first passes its check, and must still be left as it was
        delattr(model.model.layers[1].mlp, damage)
    before = _snapshot(model)
    with pytest.raises(error, match=words) as info:
        apply_autoep(model, None, 2, preset)  # type: ignore[arg-type]  # never reached: the checks come first
    assert ("model.layers.1.mlp" if damage else "model.layers.0.mlp") in str(info.value)
    assert not any(isinstance(m, AutoEPMoELayer) for m in model.modules())
    after = _snapshot(model)
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
