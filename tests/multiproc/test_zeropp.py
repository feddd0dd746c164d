"""Hybrid sharding (MiCS) and ZeRO++ (hpZ, qwZ, qgZ) on 4 gloo ranks faked as 2 machines of 2: the exact
layouts equal single-process PyTorch in fp32, the quantized ones stay close to it and move the bytes the
design says, across the machine boundary and inside it; checkpoints resume exactly and load at other
layouts. The collectives alone are checked against their unquantized results."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.multiproc.harness import run_world
from tests.multiproc.models import make_token_batches, reference_transformer, rel_err
from tests.multiproc.scenarios_zeropp import STEPS, everything, load_many

FP32_RTOL = 1e-6
ZEROPP = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True}
CASES: list[tuple[str, int, int, int, dict[str, Any]]] = [
    ("plain", 3, 2, 1, {}),
    ("hybrid1", 1, 2, 1, {"mics_shard_size": 2}),
    ("hybrid2", 2, 1, 2, {"mics_shard_size": 2}),
    ("hybrid3", 3, 1, 2, {"mics_shard_size": 2}),
    ("hierarchical3", 3, 2, 1, {"mics_shard_size": 4, "mics_hierarchical_params_gather": True}),
    ("hpz", 3, 1, 2, {"zero_hpz_partition_size": 2}),
    ("qwz", 3, 2, 1, {"zero_quantized_weights": True}),
    ("qgz", 3, 2, 1, {"zero_quantized_gradients": True}),
    ("qgz_stage2", 2, 2, 1, {"zero_quantized_gradients": True}),
    ("zeropp", 3, 2, 1, dict(ZEROPP)),
    ("zeropp_bf16_accumulated", 3, 1, 2, {**ZEROPP, "dtype": "bf16", "zero_quantized_nontrainable_weights": True}),
]
EXACT = ("hybrid1", "hybrid2", "hybrid3", "hierarchical3", "hpz")


@pytest.fixture(scope="module")
def world4(tmp_path_factory: Any) -> dict[str, Any]:
    """One 4-rank world for the collectives, the layouts and the checkpoints (per rank: ``pieces``; rank
    0's ``trained`` and ``saved``); the checkpoints' directories under ``dirs``."""
    tmp = tmp_path_factory.mktemp("zeropp")
    dirs = (str(tmp / "zeropp"), str(tmp / "hybrid"))
    runs = [(dirs[0], ZEROPP, {"mics_shard_size": 2}), (dirs[1], {"mics_shard_size": 2}, {"stage": 2})]
    res = run_world(everything, 4, [(n, s, m, g, dict(z)) for n, s, m, g, z in CASES], runs, timeout=1200)
    return {"pieces": [r["pieces"] for r in res], "trained": res[0]["trained"], "saved": res[0]["saved"],
            "dirs": dirs}


@pytest.fixture(scope="module")
def trained(world4: dict[str, Any]) -> dict[str, Any]:
    return world4["trained"]


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_transformer(make_token_batches(STEPS, 8), clip=0.5)


@pytest.mark.parametrize("name", EXACT)
def test_exact_layouts_equal_single_process_pytorch(trained: dict[str, Any], reference: Any, name: str) -> None:
    """Hybrid sharding at stages 1-3 (replicas all-reduce their shard's gradients), MiCS's hierarchical
    gather and hpZ's secondary shards change where bytes go, not one value (fp32 round-off)."""
    ref_losses, ref_w = reference
    out = trained[name]
    assert out["losses"] == pytest.approx(ref_losses, rel=FP32_RTOL)
    for key, value in ref_w.items():
        assert rel_err(out["weights"][key], value) <= FP32_RTOL, key


@pytest.mark.parametrize("name,loss_rtol,weight_rtol", [("qwz", 2e-3, 0.03), ("qgz", 2e-3, 0.2),
                                                        ("qgz_stage2", 2e-3, 0.2), ("zeropp", 5e-3, 0.2),
                                                        ("zeropp_bf16_accumulated", 2e-2, 0.2)])
def test_quantized_layouts_stay_close(trained: dict[str, Any], reference: Any, name: str, loss_rtol: float,
                                      weight_rtol: float) -> None:
    """8-bit weights move the loss by a few 1e-4; 4-bit gradients move 3 steps of SGD with momentum (lr 0.1)
    by about a tenth of the update: close, and not equal (the quantization did happen)."""
    ref_losses, ref_w = reference
    out = trained[name]
    assert out["losses"] == pytest.approx(ref_losses, rel=loss_rtol)
    errors = [rel_err(out["weights"][k], v) for k, v in ref_w.items() if k != "frozen.weight" and k != "frozen.bias"]
    assert 0 < max(errors) <= weight_rtol


def _bytes(summary: dict[str, Any], *ops: str) -> int:
    return sum(summary[op]["bytes"] for op in ops if op in summary)


def test_quantized_collectives_send_fewer_bytes(trained: dict[str, Any]) -> None:
    plain, qwz, qgz = (trained[n]["summary"] for n in ("plain", "qwz", "qgz"))
    gather = _bytes(qwz, "all_gather") / _bytes(plain, "all_gather")
    assert 0.25 < gather < 0.27  # int8 + one fp32 scale per block of up to 8000
    reduce = _bytes(qgz, "intra:all_to_all", "inter:all_to_all") / _bytes(plain, "reduce_scatter")
    assert 0.125 < reduce < 0.22  # int4 in two hops: (N + M) / N of 1/8, plus scales


def test_bytes_split_by_machine(trained: dict[str, Any]) -> None:
    """The logger's split: plain ZeRO-3 sends 2 of its 3 peers' parts across the machine boundary; hpZ's
    gathers never leave the machine; hpZ + qwZ + qgZ send at most 0.3x plain ZeRO-3's inter-node bytes."""
    plain = trained["plain"]
    volume = sum(v["volume_bytes"] for v in plain["summary"].values())
    assert plain["inter"] == pytest.approx(volume * 2 / 4, rel=1e-3)
    assert plain["intra"] == pytest.approx(volume * 1 / 4, rel=1e-3)
    hpz = trained["hpz"]
    assert hpz["links"]["hpz:all_gather"]["inter_node_bytes"] == 0 < hpz["links"]["hpz:all_gather"]["intra_node_bytes"]
    assert trained["zeropp"]["inter"] <= 0.3 * plain["inter"]
    hybrid = trained["hybrid3"]["links"]
    assert hybrid["shard:all_gather"]["inter_node_bytes"] == 0  # a shard group of one machine's ranks


def test_hpz_keeps_a_secondary_shard(trained: dict[str, Any]) -> None:
    report = trained["hpz"]["report"]
    assert report["secondary_parameters"] > 0
    assert "secondary_parameters" not in trained["plain"]["report"]


def test_collectives_against_unquantized_results(world4: dict[str, Any]) -> None:
    res = world4["pieces"]
    total = sum(r["input"] for r in res)
    chunk = res[0]["shard"].numel()
    shards = torch.cat([r["shard"] for r in res])
    for rank, r in enumerate(res):
        assert r["intra"] == [rank - rank % 2, rank - rank % 2 + 1] and r["inter"] == [rank % 2, rank % 2 + 2]
        exact = total[rank * chunk:(rank + 1) * chunk]
        # each of the 3 other ranks' parts is off by at most half a step of its block's scale, per hop
        assert rel_err(r["rs8"], exact) < 0.02 and rel_err(r["rs4"], exact) < 0.25
        assert torch.equal(r["hgather"], shards)  # hierarchical: the same bytes, reordered
        assert torch.equal(r["qgather"], r["qhgather"]) and torch.equal(r["qgather"], res[0]["qgather"])
        assert 0 < rel_err(r["qgather"], shards) < 0.02


def test_checkpoints_resume_exactly_and_load_at_other_layouts(world4: dict[str, Any]) -> None:
    saved = world4["saved"]
    zeropp, hybrid = world4["dirs"]
    for out in saved:
        assert out["again"] == out["second"]  # the first step after a resume is the uninterrupted run's
        for key, value in out["uninterrupted"].items():
            assert torch.equal(out["resumed"][key], value), key
        for key, value in out["after_first"].items():
            assert torch.equal(out["other"][key], value), key
    elsewhere = run_world(load_many, 2, [(zeropp, {}), (hybrid, {"mics_shard_size": 1})], timeout=300)[0]
    for out, loaded in zip(saved, elsewhere):
        for key, value in out["after_first"].items():
            assert torch.equal(loaded[key], value), key
