"""ZeRO-3's parameter groups (``deepshard.zero.stage3.units``): one per module, or one per small subtree
with ``stage3_min_gather_size``. Checked against the module tree itself (sizes counted by hand)."""
from __future__ import annotations

import pytest
from torch import nn

from deepshard.config.zero import ZeroConfig
from deepshard.zero.stage3.units import discover_groups


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)  # 2d
        self.fc1 = nn.Linear(d, 4 * d)  # 4d^2 + 4d
        self.fc2 = nn.Linear(4 * d, d)  # 4d^2 + d


class _Net(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(2))
        self.head = nn.Linear(d, 10, bias=False)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)


BLOCK = 2 * 8 + (4 * 64 + 32) + (4 * 64 + 8)  # 568 elements


def _layout(net: nn.Module, min_gather: int) -> list[tuple[str, list[str]]]:
    groups, _ = discover_groups(net, min_gather)
    return [(name, names) for name, _, names in groups]


def test_one_group_per_module_when_off() -> None:
    layout = _layout(_Net(), 0)
    assert [name for name, _ in layout] == ["embed", "blocks.0.norm", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.norm",
                                            "blocks.1.fc1", "blocks.1.fc2", "head", "frozen"]


@pytest.mark.parametrize("min_gather, units", [(BLOCK, ["blocks.0", "blocks.1"]), (BLOCK - 1, []),
                                               (2 * BLOCK, ["blocks"]), (10**9, ["blocks"])])
def test_small_subtrees_coalesce_into_one_group(min_gather: int, units: list[str]) -> None:
    net = _Net()
    groups, unit_ids = discover_groups(net, min_gather)
    named = dict(net.named_modules())
    assert sorted(n for n, m in named.items() if id(m) in unit_ids) == units
    names = [name for name, _, _ in groups]
    for unit in units:  # the unit's whole subtree in one group, in registration order
        params = [f"{unit}.{n}" for n, _ in named[unit].named_parameters()]
        assert (unit, params) in _layout(net, min_gather)
    # modules with parameters of their own that no unit covers keep their groups; the root is never a unit,
    # nor is a lone module (embed, head: a group already); every parameter is in exactly one group
    assert {"embed", "head", "frozen"} <= set(names)
    every = [n for _, _, ns in groups for n in ns]
    assert sorted(every) == sorted(n for n, _ in net.named_parameters()) and len(every) == len(set(every))


def test_trainable_and_frozen_stay_apart_inside_a_unit() -> None:
    net = _Net()
    net.blocks[0].fc2.requires_grad_(False)
    groups, _ = discover_groups(net, BLOCK)
    first = [(name, [p.requires_grad for p in ps]) for name, ps, _ in groups if name == "blocks.0"]
    assert first == [("blocks.0", [True] * 4), ("blocks.0", [False, False])]


def test_a_unit_never_mixes_domains() -> None:
    """A subtree whose parameters are reduced over different ranks (an expert-parallel MoE layer's experts
    beside its gate) is no unit; its submodules still can be."""
    net = _Net()
    blocks = net.blocks
    domain = lambda p: 1 if p is blocks[1].fc2.weight else 0  # noqa: E731 - one "expert" parameter
    _, unit_ids = discover_groups(net, 10**9, domain)
    named = {id(m): n for n, m in net.named_modules()}
    assert sorted(named[u] for u in unit_ids) == ["blocks.0"]
    _, unit_ids = discover_groups(net, 10**9, lambda p: 0)
    assert sorted(named[u] for u in unit_ids) == ["blocks"]


def test_the_config_key() -> None:
    assert ZeroConfig(stage=3).min_gather_size == 25 * 2**20 // 4  # on by default: DDP's 25 MB bucket of fp32
    assert ZeroConfig(stage=3, stage3_min_gather_size=0).min_gather_size == 0
    assert ZeroConfig(stage=3).gather_unit_size == 25 * 2**20 // 4
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        # quantized blocks spanning a LayerNorm's and a Linear's values lose precision: off unless asked for
        assert ZeroConfig(stage=3, **{key: True}).gather_unit_size == 0
        assert ZeroConfig(stage=3, stage3_min_gather_size=9, **{key: True}).gather_unit_size == 9
    assert ZeroConfig(stage=3, stage3_min_gather_size=2_000_000).min_gather_size == 2_000_000
    with pytest.raises(ValueError):
        ZeroConfig(stage=3, stage3_min_gather_size=-1)
