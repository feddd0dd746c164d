"""ZeRO-Offload / ZeRO-Infinity on 2 processes: every offload combination reproduces the same run
without offload (fp32 and bf16: bit for bit, as the update arithmetic is the same; fp16 too), through
checkpoints, and leaves nothing on disk once the engines are destroyed."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiproc.harness import run_world
from tests.multiproc.models import rel_err
from tests.multiproc.scenarios_offload import checkpoints, everything

WORLD = 2
FP32_RTOL = 1e-6


def _same(got: tuple[list[float], dict], ref: tuple[list[float], dict], rtol: float) -> None:
    losses, weights = got
    ref_losses, ref_weights = ref
    assert len(losses) == len(ref_losses) > 0
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {i}: loss {a} with offload vs {b} without"
    assert set(weights) == set(ref_weights)
    for name, value in ref_weights.items():
        assert rel_err(weights[name], value) <= rtol, name


@pytest.fixture(scope="module")
def world(tmp_path_factory: Any) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("swap")
    return tmp, run_world(everything, WORLD, str(tmp))[0]


@pytest.fixture(scope="module")
def equiv(world: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[Any, Any]]:
    return world[0] / "equivalence", world[1]["equivalence"]


CASES = [("nvme-opt", 1, "fp32"), ("nvme-opt", 1, "bf16"), ("nvme-opt", 2, "fp32"), ("nvme-opt", 2, "bf16"),
         ("nvme-opt", 3, "fp32"), ("nvme-opt", 3, "bf16"), ("nvme-both", 3, "fp32"), ("nvme-both", 3, "bf16"),
         ("nvme-param", 3, "bf16"), ("nvme-param", 3, "fp32"), ("nvme-sched", 2, "fp32"), ("nvme-sgd", 3, "fp32"),
         ("nvme-fp16", 2, "fp16"),
         ("cpu-forced", 2, "bf16"), ("cpu-forced", 3, "bf16")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-stage{c[1]}-{c[2]}")
def test_offload_reproduces_the_run_without_offload(equiv: tuple[Path, dict], case: tuple[str, int, str]) -> None:
    ref, got = equiv[1][case]
    _same(got, ref, FP32_RTOL)  # bf16/fp16 too: the same fp32 update on the same values
    if case[0] == "nvme-sched":
        assert got[0] != pytest.approx(equiv[1][("nvme-opt", 2, "fp32")][1][0], rel=1e-6)  # the schedule acted


def test_swap_files_are_removed_when_engines_are_destroyed(equiv: tuple[Path, dict]) -> None:
    tmp, out = equiv
    assert out["left_on_disk"] == []
    assert list(tmp.iterdir()) == []


def test_zero3_transformer_with_everything_on_disk(world: tuple[Path, dict[str, Any]]) -> None:
    out = world[1]["transformer"]
    _same(out["nvme"], out["ref"], FP32_RTOL)
    assert list((world[0] / "transformer").iterdir()) == []


@pytest.fixture(scope="module")
def acct(world: tuple[Path, dict[str, Any]]) -> dict[Any, Any]:
    return world[1]["accounting"]


@pytest.mark.parametrize("stage", [2, 3])
def test_memory_report_counts_offloaded_bytes_apart(acct: dict[Any, Any], stage: int) -> None:
    ref, got = acct[(stage, "ref")]["report"], acct[(stage, "nvme")]["report"]
    shard = acct[(stage, "nvme")]["shard"]
    assert ref["offloaded"] == 0 and ref["master_weights"] == 4 * shard
    assert got["master_weights"] == 0
    assert got["optimizer_state"] < 0.05 * ref["optimizer_state"]  # only Adam's scalar step counters stay
    # masters + 2 Adam states (stage 3: + the bf16 parameter shard and the bf16 gradient shard)
    expected = 12 * shard + (4 * shard if stage == 3 else 0)
    frozen = got["offloaded"] - expected
    assert 0 <= frozen <= 2 * 16 * 16, (got, shard)  # stage 3 also puts the frozen layer's shard on disk
    assert (frozen == 0) == (stage == 2)
    if stage == 3:
        assert got["parameters"] == 0 and ref["parameters"] > 0
        assert got["gradients"] == 0 and ref["gradients"] == 2 * shard  # the gradient shard is on disk too
    # buffer_count x sub-group elements x 4 bytes, + 2 gradient buffers at stage 3 (gradient shard on disk),
    # 1 at stage 2 (a sub-group's 16-bit gradients cast to fp32 for the step)
    assert 0 < got["offload_buffers"] <= (6 + (2 if stage == 3 else 1)) * 4 * 60


@pytest.mark.parametrize("stage", [2, 3])
def test_safe_get_full_helpers_read_offloaded_state(acct: dict[Any, Any], stage: int) -> None:
    ref, got = acct[(stage, "ref")], acct[(stage, "nvme")]
    # the offloaded states step with torch's fused CPU Adam, the reference with its default loop (on a GPU,
    # its CUDA kernels): the same values to a few units in the last place
    for key in ("fp32", "exp_avg_sq"):
        for name, value in ref[key].items():
            assert value.abs().sum() > 0, (key, name)
            torch.testing.assert_close(got[key][name], value, rtol=1e-5, atol=1e-12, msg=f"{key} {name}")
    names = {"master.swp", "state.exp_avg.swp", "state.exp_avg_sq.swp"}
    assert names <= set(got["files"])
    assert ("params.swp" in got["files"]) == (stage == 3)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("where", ["ref", "nvme"])
def test_safe_set_full_helpers_write_offloaded_state(acct: dict[Any, Any], stage: int, where: str) -> None:
    """bf16 training: a written fp32 value lands in the fp32 masters (on disk with nvme) and, in bf16, in the
    model (stage 3: this rank's ds_tensor); a written state in the (offloaded) state."""
    got = acct[(stage, where)]["written"]
    for name, (value, fp32, exp_avg_sq) in got["full"].items():
        assert torch.equal(fp32, value) and torch.equal(exp_avg_sq, value / 2), name
        if stage == 2:
            assert torch.equal(got["model"][name], value.to(torch.bfloat16)), name
            continue
        local, ds_tensor = got["local"][name]
        assert local.dtype == torch.float32 and ds_tensor.dtype == torch.bfloat16
        assert torch.equal(ds_tensor, local.to(torch.bfloat16)), name
        assert local.numel() == 0 or any(torch.equal(local, value.reshape(-1)[i:i + local.numel()])
                                         for i in range(value.numel() - local.numel() + 1)), name


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: Any) -> list[dict[int, dict[str, Any]]]:
    return run_world(checkpoints, WORLD, str(tmp_path_factory.mktemp("ckpt")))


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_with_offload_resumes_exactly(ckpts: list[dict[int, dict[str, Any]]], stage: int) -> None:
    for rank_out in ckpts:
        r = rank_out[stage]
        assert r["resumed"][0] == r["full"][0]  # exact float equality, every step
        for name, value in r["full"][1].items():
            assert torch.equal(value, r["resumed"][1][name]), name
        _same(r["into_plain"], (r["full"][0][3:], r["full"][1]), FP32_RTOL)  # loads without offload too
        assert r["left_on_disk"] == []
