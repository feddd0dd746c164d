"""ZeRO stage 3: the awkward cases against single-process PyTorch, memory and traffic against the
formulas, zero.Init's construction memory, GatheredParameters, 16-bit saving and the watchdog."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiproc.harness import run_world
from tests.multiproc.models import make_token_batches, reference_transformer, rel_err
from tests.multiproc.scenarios_stage3 import (RankRoutedBlock, SkipInitModel, accounting, gathered_and_leaf_world,
                                              init_memory, save_models, skip_init_values, transformer_oracle,
                                              watchdog)

FP32_RTOL = 1e-6


@pytest.fixture(scope="module", params=[(3, 2), (3, 4), (2, 2), (0, 4)], ids=lambda sw: f"stage{sw[0]}-world{sw[1]}")
def oracle(request: Any) -> tuple[int, int, dict[str, Any]]:
    stage, world = request.param
    return stage, world, run_world(transformer_oracle, world, stage)[0]


def test_tied_repeated_frozen_transformer_matches_reference(oracle: tuple[int, int, dict[str, Any]]) -> None:
    stage, world, out = oracle
    ref_losses, ref_w = reference_transformer(make_token_batches(4, 8), clip=0.5)
    splits = [k for k in out if k.startswith("m")]
    assert len(splits) == 2
    for key in splits:
        losses, weights = out[key]
        assert losses == pytest.approx(ref_losses, rel=FP32_RTOL), key
        for name, value in ref_w.items():
            assert rel_err(weights[name], value) <= FP32_RTOL, (key, name)
    assert weights["head.weight"].data_ptr() != 0 and torch.equal(weights["head.weight"], weights["embed.weight"])


def test_eval_under_no_grad_matches_reference(oracle: tuple[int, int, dict[str, Any]]) -> None:
    _, _, out = oracle
    from tests.multiproc.models import make_transformer

    ref_losses, ref_w = reference_transformer(make_token_batches(4, 8), clip=0.5)
    model = make_transformer()
    model.load_state_dict(ref_w)
    x, y = make_token_batches(1, 8, seed=77)[0]
    with torch.no_grad():
        expected = float(model.eval()(x, y))
    for key in [k for k in out if k.startswith("eval_")]:
        assert out[key] == pytest.approx(expected, rel=1e-5)


def test_parameters_are_released_between_steps(oracle: tuple[int, int, dict[str, Any]]) -> None:
    stage, _, out = oracle
    if stage != 3:
        pytest.skip("only ZeRO-3 partitions parameters")
    assert out["sharded_after_step"] is True
    assert out["placeholder_shape"] == (0,)  # DeepSpeed's empty placeholder while sharded


@pytest.fixture(scope="module")
def acct() -> dict[str, Any]:
    return run_world(accounting, 2)[0]


def test_model_states_are_16_psi_over_n(acct: dict[str, Any]) -> None:
    r, n = acct["report"], 2
    psi = acct["psi"]
    trainable_params = r["parameters"] - 4 * (-(-acct["frozen"] // n))  # minus the frozen shard (padded)
    model_states = trainable_params + r["gradients"] + r["master_weights"] + r["optimizer_state"]
    assert abs(model_states - 16 * psi / n) <= 0.05 * 16 * psi / n, (model_states, 16 * psi / n, r)
    assert r["gathered_parameters"] == 0  # nothing stays gathered between steps (threshold 0)


def test_comms_volume_is_three_psi_per_step(acct: dict[str, Any]) -> None:
    psi, frozen, comms = acct["psi"], acct["frozen"], acct["comms"]
    gathered = comms["all_gather"]["volume_elements"]
    scattered = comms["reduce_scatter"]["volume_elements"]
    # trainable parameters: gathered in forward and again in backward, gradients reduce-scattered once;
    # the frozen layer is gathered in forward and backward too (it has no gradient to reduce)
    assert abs(scattered - psi) <= 0.02 * psi, (scattered, psi)
    assert abs(gathered - 2 * (psi + frozen)) <= 0.02 * 2 * (psi + frozen), (gathered, psi, frozen)
    assert abs(gathered + scattered - 3 * psi - 2 * frozen) <= 0.02 * 3 * psi


@pytest.fixture(scope="module")
def gathered_and_leaf() -> list[dict[str, Any]]:
    return run_world(gathered_and_leaf_world, 2)


def _deepspeed_part(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """DeepSpeed's per-parameter split, written out: ceil(numel / world) elements a rank, zero-padded."""
    flat = full.reshape(-1)
    chunk = -(-flat.numel() // world)
    padded = torch.cat([flat, flat.new_zeros(chunk * world - flat.numel())])
    return padded[rank * chunk:(rank + 1) * chunk]


def test_gradient_partitions_in_deepspeeds_layout(gathered_and_leaf: list[dict[str, Any]]) -> None:
    """``get_fp32_grad_partitions`` / ``averaged_gradients`` hold each rank's DeepSpeed part of the averaged
    gradient single-process PyTorch computes, accumulated over backward passes, zeroed by the step."""
    from tests.multiproc.scenarios_stage3 import ScaledLinear, grad_partitions_batch

    world = len(gathered_and_leaf)
    ref = ScaledLinear()
    names = [n for n, _ in ref.named_parameters()]
    grads = []
    for micro in range(2):
        for rank in range(world):
            ref(grad_partitions_batch(rank, micro)).backward()
        grads.append({n: p.grad.detach().clone() / world for n, p in ref.named_parameters()})  # sum so far
    for rank, out in enumerate(o["grads"] for o in gathered_and_leaf):
        for key, expected in (("first", grads[0]), ("after_allreduce", grads[0]), ("second", grads[1])):
            parts = out[key]
            assert set(parts) == {0} and set(parts[0]) == {0, 1, 2}, (key, parts)
            for i, name in enumerate(names):
                want = _deepspeed_part(expected[name], world, rank)
                assert parts[0][i].dtype == torch.float32
                assert torch.allclose(parts[0][i], want, rtol=1e-6, atol=1e-7), (rank, key, name, parts[0][i], want)
        for i, name in enumerate(names):
            assert torch.equal(out["averaged"][0][i], out["second"][0][i]), (rank, name)  # fp32 training: the same
            assert not out["after_step"][0][i].any(), (rank, name)
        assert out["alone_is_view"] is True


def test_gathered_parameters_with_modifier_rank(gathered_and_leaf: list[dict[str, Any]]) -> None:
    for out in (o["gathered"] for o in gathered_and_leaf):
        assert out["outside_shape"] == (0,) and out["inside_shape"] == (16, 16)
        assert out["after_modifier"] == pytest.approx(0.25)
        assert out["after_none"] == pytest.approx(0.25)  # the change without modifier_rank was discarded
        assert out["norm_after"] == pytest.approx([3.0] * 16)


@pytest.mark.parametrize("gather", [True, False])
def test_save_16bit_model_gathers_the_full_model(tmp_path: Path, gather: bool) -> None:
    outs = run_world(save_models, 2, str(tmp_path), gather)
    rank0 = outs[0]
    if not gather:
        assert rank0["ok"] is False and not (tmp_path / "model.safetensors").exists()
    else:
        from safetensors.torch import load_file

        assert rank0["ok"] is True
        saved = load_file(str(tmp_path / "model.safetensors"))
        for name, value in rank0["full"].items():
            assert torch.equal(saved[name], value), name
            assert tuple(saved[name].shape) != (0,)
    assert set(rank0["consolidated"]) >= set(rank0["full"]) and outs[1]["consolidated"] == {}
    for name, value in rank0["full"].items():
        assert torch.equal(rank0["consolidated"][name], value), name


def test_zero_init_never_materializes_the_full_model() -> None:
    # fresh interpreters: a rank forked from the preloaded server faults in the shared libraries' pages as it
    # first runs them, which would count in the resident-set peak this measures
    for out in run_world(init_memory, 2, fresh=True):
        assert out["same_output"] is True
        assert out["held"] == out["full_bytes"] // 2
        # peak growth during construction: the shard plus about one layer, far from the full model
        assert out["peak"] < 0.75 * out["full_bytes"], (out["peak"], out["full_bytes"])


def test_watchdog_names_the_rank_that_did_not_arrive() -> None:
    outs = run_world(watchdog, 2, timeout=60)
    message = outs[0]
    assert "did not complete within 3s" in message, message
    assert "Rank(s) [1] did not arrive" in message, message
    assert "all_gather of parameter group" in message


@pytest.mark.parametrize("zero,counts,kept", [
    # default window: the largest group (272 elements) -> the current layer plus one ahead; no reuse
    ({}, [2, 2, 2, 2, 2, 1], [False] * 6),
    # a window of one and a half groups holds whole groups only: still one ahead, never two
    ({"stage3_prefetch_bucket_size": 272 + 136}, [2, 2, 2, 2, 2, 1], [False] * 6),
    # the last layer, reused first in backward, stays gathered at the turn
    ({"stage3_max_reuse_distance": 10**9}, [2, 2, 2, 2, 2, 1], [False] * 5 + [True]),
    # a window of three groups, but at most 2 x 272 elements live: the cap wins. The last two layers
    # are fewer than 3 x 272 gathered elements from their reuse: both are kept at the turn
    ({"stage3_prefetch_bucket_size": 3 * 272, "stage3_max_live_parameters": 2 * 272,
      "stage3_max_reuse_distance": 10**9}, [2, 2, 2, 2, 2, 2], [False] * 4 + [True] * 2),
    ({"stage3_prefetch_bucket_size": 3 * 272, "stage3_max_reuse_distance": 10**9}, [4, 4, 4, 3, 2, 2],
     [False] * 4 + [True] * 2),
    # no prefetch, no reuse: one group at a time, everything released after forward
    ({"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}, [1] * 6, [False] * 6),
])
def test_prefetch_window_live_cap_and_reuse(zero: dict[str, Any], counts: list[int], kept: list[bool]) -> None:
    from tests.multiproc.scenarios_stage3 import gathered_counts

    for res in run_world(gathered_counts, 2, zero):
        assert res["counts"] == counts, res
        assert res["kept_after_forward"] == kept, res
        assert res["all_released"], res


@pytest.mark.parametrize("dtype,rtol", [("fp32", 1e-6), ("bf16", 3e-2)])
def test_optimizer_step_in_backward_matches_reference(dtype: str, rtol: float) -> None:
    """Updating each group during backward gives the losses and weights of single-process PyTorch (fp32)
    and of plain stage 3 (both dtypes), keeps no gradient shard, and still reports the gradient norm."""
    from tests.multiproc.models import make_batches, reference_run, rel_err
    from tests.multiproc.scenarios_stage3 import step_in_backward_world

    res = run_world(step_in_backward_world, 2, dtype)[0]
    fused_losses, fused_weights = res["fused"]
    plain_losses, plain_weights = res["plain"]
    compare = [(plain_losses, plain_weights, rtol if dtype == "bf16" else 1e-6)]
    if dtype == "fp32":
        compare.append((*reference_run(make_batches(4, 8), clip=0.0), 1e-6))
    for ref_losses, ref_weights, tol in compare:
        for a, b in zip(fused_losses, ref_losses):
            assert abs(a - b) <= tol * abs(b), (fused_losses, ref_losses)
        for name, ref in ref_weights.items():
            assert rel_err(fused_weights[name].float(), ref.float()) <= tol, name
    assert res["grad_bytes"] == 0
    assert abs(res["norm"] - res["plain_norm"]) <= 1e-2 * res["plain_norm"], (res["norm"], res["plain_norm"])
    assert "optimizer_step_in_backward" in res["grad_error"]


@pytest.mark.parametrize("change,needle", [
    ({"gradient_clipping": 1.0}, "gradient_clipping is 1.0"),
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps is 2"),
    ({"fp16": {"enabled": True}}, "fp16 is enabled"),
    ({"zero_optimization": {"stage": 2, "optimizer_step_in_backward": True}}, "stage is 2"),
])
def test_optimizer_step_in_backward_refuses_what_needs_every_gradient(change: dict[str, Any], needle: str) -> None:
    import deepshard
    from deepshard.config import ConfigError
    from tests.multiproc.models import make_model

    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                              "zero_optimization": {"stage": 3, "optimizer_step_in_backward": True}}
    config.update(change)
    with pytest.raises(ConfigError, match="optimizer_step_in_backward=true cannot be used: .*" + needle):
        deepshard.initialize(model=make_model(), config=config)


def test_leaf_module_whose_children_run_on_some_ranks_only(gathered_and_leaf: list[dict[str, Any]]) -> None:
    """A leaf block routing each rank's tokens to a different expert: ZeRO-3 reduces the leaf's gradients at
    the end of backward (the other expert's as zeros), equal to one process averaging both ranks' losses."""
    world = len(gathered_and_leaf)
    out = [o["leaf"] for o in gathered_and_leaf]
    model = RankRoutedBlock()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        losses = [model(torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + r)), r % 2)
                  for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
    for rank_out in out:
        for name, value in model.named_parameters():
            assert torch.allclose(rank_out[name], value.detach(), rtol=1e-5, atol=1e-7), name


def test_skip_init_modules_under_zero_init_are_partitioned(gathered_and_leaf: list[dict[str, Any]]) -> None:
    """Modules built by torch.nn.utils.skip_init inside zero.Init (meta device, then to_empty()) hold only
    their shard, ceil(numel / world) elements, like the rest; one ZeRO-3 step from known values equals one
    process averaging both ranks' losses."""
    world = len(gathered_and_leaf)
    model = SkipInitModel()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(skip_init_values()[name])
    losses = [model(torch.randn(2, 5, generator=torch.Generator().manual_seed(r))).pow(2).mean() for r in range(world)]
    (sum(losses) / world).backward()
    for rank_out in (o["skip_init"] for o in gathered_and_leaf):
        for name, (shard, placeholder) in rank_out["shards"].items():
            assert (shard, placeholder) == (-(-dict(model.named_parameters())[name].numel() // world), 0), name
        for name, p in model.named_parameters():
            torch.testing.assert_close(rank_out["after"][name], p.detach() - 0.1 * p.grad, rtol=1e-5, atol=1e-7)
