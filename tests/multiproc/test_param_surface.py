"""ZeRO-3's per-parameter surface as DeepSpeed defines it (``ds_id``, ``ds_status``, ``ds_tensor``,
``all_gather`` / ``partition``, ``module.ds_external_parameters()``), TRL's generation flow (hooks taken off
and put back through ``engine.optimizer.parameter_offload``) and ``register_external_parameter``, on 2
ranks against single-process PyTorch."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.multiproc.harness import run_world
from tests.multiproc.models import make_token_batches, make_transformer, rel_err, train_reference
from tests.multiproc.scenarios_param_surface import (external_batches, external_world, frozen_base_world,
                                                     fused_head_world, generation_world, make_external,
                                                     make_frozen_base, make_fused_head, surface_world)

WORLD = 2
FP32_RTOL = 1e-6


@pytest.fixture(scope="module")
def surface() -> list[dict[str, Any]]:
    return run_world(surface_world, WORLD)


def test_ids_are_positions_and_the_same_on_every_rank(surface: list[dict[str, Any]]) -> None:
    names = [n for n, _ in make_transformer().named_parameters()]
    assert surface[0]["ids"] == [(n, i) for i, n in enumerate(names)]
    assert all(r["ids"] == surface[0]["ids"] and r["module_ids"] == surface[0]["module_ids"] for r in surface)
    assert surface[0]["module_ids"] == list(range(len(list(make_transformer().modules()))))


def test_status_shape_and_persistence_after_initialize(surface: list[dict[str, Any]]) -> None:
    ref = dict(make_transformer().named_parameters())
    for name, status in surface[0]["status"].items():
        # the LayerNorms' groups (32 elements) are the ones under the persistence threshold; by default the
        # block (2,224 elements) is one group (stage3_min_gather_size), its LayerNorms sharded with it
        persistent = name.rsplit(".", 1)[0] == "norm"
        assert surface[0]["persist"][name] is persistent, name
        # with one group per module (stage3_min_gather_size 0) each LayerNorm is its own, kept, as DeepSpeed
        # keeps every parameter of at most the threshold
        alone = name.rsplit(".", 1)[0] in ("norm", "block.norm1", "block.norm2")
        assert surface[0]["persist_per_module"][name] is alone, name
        assert status == ("AVAILABLE" if persistent else "NOT_AVAILABLE"), name
        numel, ds_shape, shape = surface[0]["numel"][name]
        assert (numel, ds_shape) == (ref[name].numel(), tuple(ref[name].shape)), name
        assert shape == (tuple(ref[name].shape) if persistent else (0,)), name


def test_tensors_taken_inside_gathered_parameters_keep_their_values(surface: list[dict[str, Any]]) -> None:
    """The release at the context's exit lets go of the gathered values instead of freeing them in place (as
    DeepSpeed swaps param.data for an empty tensor), so what the user took inside stays whole."""
    for r in surface:
        for name, value in make_transformer().named_parameters():
            assert torch.equal(r["kept"][name], value.detach()), name
            assert torch.equal(r["kept_state"][name], value.detach()), name
        assert r["status_after_kept"] == r["status"]  # released again: as right after initialize


def test_ds_tensor_parts_in_rank_order_are_the_parameter(surface: list[dict[str, Any]]) -> None:
    for name, value in make_transformer().named_parameters():
        parts = [r["fragments"][name] for r in surface]
        assert torch.equal(torch.cat(parts), value.detach().reshape(-1)), name


def test_all_gather_partition_and_status_in_a_forward(surface: list[dict[str, Any]]) -> None:
    ref = make_transformer().frozen.weight.detach()
    for r in surface:
        status, value = r["gathered"]
        assert status == "AVAILABLE" and torch.equal(value, ref)
        assert r["partitioned"] == ("NOT_AVAILABLE", (0,))
        assert r["async"] == ["INFLIGHT", "AVAILABLE", "NOT_AVAILABLE"]
        assert r["multiple"] == "AVAILABLE" and r["released_shape_is_deepspeeds"] is True
        assert r["in_forward"] == ["AVAILABLE"] and r["after_forward"] == "NOT_AVAILABLE"


def test_a_modifier_rank_write_reaches_every_rank_and_ds_tensor(surface: list[dict[str, Any]]) -> None:
    expected = 2.0 * make_transformer().embed.weight.detach()  # head.weight is tied to it
    for r in surface:
        assert torch.equal(r["full_after_write"], expected)
    assert torch.equal(torch.cat([r["fragment_after_write"] for r in surface]), expected.reshape(-1))
    # `ds_tensor.data = t` writes this rank's part (DeepSpeed's partition is the tensor itself): every rank
    # then gathers each rank's values in rank order
    parts = torch.cat([torch.full((r["part_numel"],), float(i + 1)) for i, r in enumerate(surface)])
    for r in surface:
        assert torch.equal(r["full_after_data_set"].reshape(-1), parts.to(r["full_after_data_set"].dtype))


def test_generation_with_hooks_off_then_training_matches_reference() -> None:
    results = run_world(generation_world, WORLD)
    batches = make_token_batches(4, 8)
    x, y = make_token_batches(1, 8, seed=77)[0]
    model = make_transformer()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ref_evals, ref_losses = [], []
    for step in range(3):
        with torch.no_grad():
            ref_evals.append(float(model(x, y)))
        if step < 2:
            ref_losses += train_reference(model, opt, batches[2 * step:2 * step + 2], 0.5)[0]
    ref_w = {k: v.detach() for k, v in model.state_dict().items()}
    for r in results:
        for evals, expected in zip(r["evals"], ref_evals):
            assert evals == pytest.approx([expected] * 3, rel=FP32_RTOL)
        assert r["gathers_inside"] == [0, 0, 0]  # everything was gathered once, outside; no hook gathered
        assert r["hooks_inside"] == 0  # unwrap_model_for_generation took the hooks off, and put them back:
        assert all(n > 0 for n in r["hooks_back"])
        assert r["status_after"] == [["NOT_AVAILABLE"]] * 3
        assert r["losses"] == pytest.approx(ref_losses, rel=FP32_RTOL)
        for name, value in ref_w.items():
            assert rel_err(r["weights"][name], value) <= FP32_RTOL, name
        assert "pass the engine's module (TinyTransformer), not TransformerEncoderLayer" in r["wrong_module"]


def test_register_external_parameter_trains_like_reference() -> None:
    results = run_world(external_world, WORLD)
    model = make_external(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_losses, ref_w = train_reference(model, opt, external_batches(), 0.5)
    for r in results:
        assert r["listed"] == [True] and r["is_external"] is True
        for got in (r, r["undeclared"]):  # registered, and found by reading it in the root's forward
            assert got["losses"] == pytest.approx(ref_losses, rel=FP32_RTOL)
            for name, value in ref_w.items():
                assert rel_err(got["weights"][name], value) <= FP32_RTOL, name
        assert r["undeclared"]["registered"] is True and r["undeclared"]["status"] == "NOT_AVAILABLE"


def test_a_weight_read_directly_in_a_custom_backward_trains_like_reference() -> None:
    """TRL's fused LM-head loss: an autograd function reads ``head.weight`` without calling ``head``,
    gathering it in forward and again in its backward; the gradient is accumulated after the backward
    returns, so the gather must outlast it until the reduction."""
    results = run_world(fused_head_world, WORLD)
    model = make_fused_head()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_losses, ref_w = train_reference(model, opt, external_batches(), 0.5)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=FP32_RTOL)
        for name, value in ref_w.items():
            assert rel_err(r["weights"][name], value) <= FP32_RTOL, name
        assert r["released"] == "NOT_AVAILABLE"  # released once its gradient was reduced


def test_frozen_base_under_non_reentrant_checkpointing_trains_like_reference() -> None:
    """PEFT's shape (frozen base, trainable adapter) with the block checkpointed without reentrancy: the
    recompute must not release the frozen parameter the checkpoint saved (its shape is compared after)."""
    results = run_world(frozen_base_world, WORLD)
    model = make_frozen_base()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ref_losses, ref_w = train_reference(model, opt, external_batches(), 0.5)
    for r in results:
        for got in (r, r["direct"]):  # engine.backward, and loss.backward()
            assert got["losses"] == pytest.approx(ref_losses, rel=FP32_RTOL)
            for name, value in ref_w.items():
                assert rel_err(got["weights"][name], value) <= FP32_RTOL, name
        assert r["after"] == ["NOT_AVAILABLE"]  # everything released after the step
        assert r["direct"]["released"] == [["NOT_AVAILABLE"]] * 3  # and after each backward, before the step
