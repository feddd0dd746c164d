"""deepshard's MoE layer against real DeepSpeed 0.19.8's on the same seed: every gating mode (top-1 with
and without RTS, no-drop, RSample, Jitter, used_token, eval; top-2 with and without sampling; top-3;
residual), two forward/backward passes each. Outputs, l_aux and gradients must agree to 1e-4 relative
(measured: bit-identical), exp_counts exactly, and the generator must be left where DeepSpeed leaves it (the
same random draws in the same order). The gating functions of ``deepspeed.moe.sharded_moe`` too, called
directly in each mode, dense and sparse: every returned tensor equal to DeepSpeed's."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from tests.deepspeed_compat.ds_support import require_deepspeed, run_in_deepspeed
from tests.deepspeed_compat.moe_vectors import CASES, GATING, run_case, run_gating

SCRIPT = Path(__file__).with_name("moe_vectors.py")


@pytest.fixture()
def shim() -> Iterator[None]:
    """``import deepspeed`` answered by deepshard for the test (whatever was imported before is put back)."""
    import deepshard.compat as compat

    compat.uninstall()
    saved = sys.modules.pop("deepspeed", None)
    compat.install(replace_installed=True)
    yield
    compat.uninstall()
    if saved is not None:
        sys.modules["deepspeed"] = saved


@pytest.fixture(scope="module")
def deepspeed_vectors(tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_deepspeed()
    root = tmp_path_factory.mktemp("moe_vectors")
    run_in_deepspeed([str(SCRIPT), str(root / "ds.json")], "DeepSpeed's MoE layer run (moe_vectors.py)", timeout=300)
    return json.loads((root / "ds.json").read_text())


def _close(ours: list[float], theirs: list[float], what: str) -> None:
    a, b = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    assert a.shape == b.shape, what
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), f"{what}: max diff {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("case", list(CASES))
def test_moe_layer_matches_deepspeed(shim: None, deepspeed_vectors: dict, case: str) -> None:
    ours, theirs = run_case(CASES[case]), deepspeed_vectors[case]
    for step, (a, b) in enumerate(zip(ours[:2], theirs[:2])):
        assert a["counts"] == b["counts"], f"{case} step {step}: exp_counts {a['counts']} vs DeepSpeed's {b['counts']}"
        _close([a["l_aux"]], [b["l_aux"]], f"{case} step {step} l_aux")
        _close(a["out"], b["out"], f"{case} step {step} output")
    a, b = ours[2], theirs[2]
    assert a["names"] == b["names"]  # DeepSpeed's parameter names, in its order
    assert sorted(a["grads"]) == sorted(b["grads"])
    for name in a["grads"]:
        _close(a["grads"][name], b["grads"][name], f"{case} gradient of {name}")
    _close(a["x_grad"], b["x_grad"], f"{case} input gradient")
    assert a["next_draws"] == b["next_draws"], f"{case}: the layer drew other random numbers than DeepSpeed's"


@pytest.mark.parametrize("name", list(GATING))
def test_gating_function_matches_deepspeed(shim: None, deepspeed_vectors: dict, name: str) -> None:
    ours, theirs = run_gating(name), deepspeed_vectors["gating"][name]
    assert sorted(ours) == sorted(theirs)
    for part in ours:
        assert len(ours[part]) == len(theirs[part]), f"{name} {part}: {len(ours[part])} values vs DeepSpeed's"
        for i, (a, b) in enumerate(zip(ours[part], theirs[part])):
            if isinstance(a, list):
                _close(a, b, f"{name} {part}[{i}]")
            else:
                assert a == pytest.approx(b, rel=1e-5), f"{name} {part}[{i}]: {a} vs DeepSpeed's {b}"
