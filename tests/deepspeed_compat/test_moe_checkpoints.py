"""Real DeepSpeed 0.19.8 MoE checkpoints resumed by deepshard, and deepshard's converted ones by DeepSpeed
(``moe_ckpt_worker.py``'s model: MoE layers of 4 and 2 experts, ep 2, top-2 without sampling).

One DeepSpeed world trains 3 steps, saves at ZeRO 0 (experts in ``layer_<L>_expert_<G>`` files, the optimizer in
``expp_rank_<R>`` files) and ZeRO 2 (the ``ep_size_2`` group partitioned over each expert-parallel rank's
expert-data-parallel ranks), and trains 3 more: the losses a resume must repeat. One deepshard world of 2 loads
both at other stages and ep sizes (the layout changes only where the experts live, so the losses are
DeepSpeed's to round-off); ``deepshard convert --to deepshard`` keeps every expert under its global id. The other
way: deepshard trains the same model (ZeRO 2, ep 2), saves and trains on; ``deepshard convert --to deepspeed``
writes DeepSpeed directories for ZeRO 2 at ep 2 and ZeRO 1 at ep 1, and the same DeepSpeed world resumes them
with deepshard's continuation. One DeepSpeed world in all."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.deepspeed_compat.ds_support import run_in_deepspeed
from tests.multiproc.harness import run_world

WORKER = Path(__file__).with_name("moe_ckpt_worker.py")
TOL = 1e-5  # measured: 0 (the same losses bit for bit) at every case below
# (label, DeepSpeed's directory, deepshard's ZeRO stage, ep size)
CASES = [("z2->z2 ep2", "z2", 2, 2), ("z2->z0 ep1", "z2", 0, 1), ("z2->z3 ep2", "z2", 3, 2),
         ("z0->z1 ep1", "z0", 1, 1), ("z0->z0 ep2", "z0", 0, 2)]


CONVERTED = [("conv_z2_ep2", 2, 2), ("conv_z1_ep1", 1, 1)]


@pytest.fixture(scope="module")
def ds_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    from deepshard.checkpoint.convert_cli import main as convert_main

    root = tmp_path_factory.mktemp("deepspeed_moe")
    mine = run_world(save_native, 2, str(root / "native"), timeout=600)[0]
    for label, stage, ep in CONVERTED:
        assert convert_main([str(root / "native"), str(root / label), "--to", "deepspeed", "--dp", "2", "--stage",
                             str(stage), "--ep", str(ep), "--quiet"]) == 0
    args = ["--library", "deepspeed", "--stage", "0", "2", "--ep", "2", "--save", str(root), "--steps", "3",
            "--then", "3", "--resume", *(f"{label}={root / label}:{stage}:{ep}" for label, stage, ep in CONVERTED)]
    out = run_in_deepspeed([str(WORKER), *args], "the MoE checkpoint run", timeout=900)
    return root, {**json.loads(out.strip().splitlines()[-1]), "deepshard": mine}


def save_native(rank: int, world: int, directory: str) -> dict[str, Any]:
    """(in a deepshard world) 3 steps at ZeRO 2, ep 2, saved in deepshard's format, then 3 more."""
    from tests.deepspeed_compat import moe_ckpt_worker as worker

    return worker.train(worker._library("deepshard"), rank, world, 2, 2, None, directory, 3, 3)


def load_moe_cases(rank: int, world: int, root: str, cases: list[tuple[str, str, int, int]]) -> dict[str, Any]:
    """(in a deepshard world) each case: a fresh engine loads DeepSpeed's directory and trains 3 steps."""
    from tests.deepspeed_compat import moe_ckpt_worker as worker

    deepspeed = worker._library("deepshard")
    return {label: worker.train(deepspeed, rank, world, stage, ep, f"{root}/{source}", None, 3)
            for label, source, stage, ep in cases}


def test_deepshard_resumes_deepspeed_moe_checkpoints(ds_moe: tuple[Path, dict[str, Any]]) -> None:
    root, ds = ds_moe
    assert ds["z0"]["losses"] == ds["z2"]["losses"]  # DeepSpeed's own runs agree: one reference
    got = run_world(load_moe_cases, 2, str(root), CASES, timeout=900)[0]
    for label, source, _, _ in CASES:
        diff = max(abs(a - b) for a, b in zip(got[label]["losses"], ds[source]["then"]))
        assert diff <= TOL, (label, got[label]["losses"], ds[source]["then"])
        assert got[label]["global_steps"] == 6 and got[label]["client_state"] == {"epoch": 3}, got[label]


def test_deepspeed_resumes_converted_deepshard_moe_checkpoints(ds_moe: tuple[Path, dict[str, Any]]) -> None:
    root, ds = ds_moe
    mine = ds["deepshard"]
    assert max(abs(a - b) for a, b in zip(mine["losses"], ds["z2"]["losses"])) <= TOL  # the same run
    for label, _, _ in CONVERTED:
        diff = max(abs(a - b) for a, b in zip(ds[label]["losses"], mine["then"]))
        assert diff <= TOL, (label, ds[label]["losses"], mine["then"])
        assert ds[label]["global_steps"] == 6 and ds[label]["client_state"] == {"epoch": 3}, ds[label]
    files = sorted(p.name for p in (root / "conv_z2_ep2" / "global_step3").iterdir())
    assert files == sorted([f"layer_0_expert_{g}_mp_rank_00_model_states.pt" for g in range(4)]
                           + [f"layer_1_expert_{g}_mp_rank_00_model_states.pt" for g in range(2)]
                           + ["mp_rank_00_model_states.pt"]
                           + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)])


def test_convert_keeps_every_expert_by_global_id(ds_moe: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    from deepshard.checkpoint.convert_cli import main as convert_main
    from deepshard.checkpoint.reader import load_full_state

    root, _ = ds_moe
    for source in ("z0", "z2"):
        assert convert_main([str(root / source), str(tmp_path / source), "--to", "deepshard", "--dp", "3",
                             "--stage", "1", "--quiet"]) == 0
        mine = load_full_state(tmp_path / source / "global_step3")
        experts = sorted((root / source / "global_step3").glob("layer_*_expert_*_model_states.pt"))
        assert len(experts) == 6
        for path in experts:
            for name, value in torch.load(path, weights_only=True).items():  # keyed by global expert id
                assert torch.equal(mine.params[name], value), (source, name)
                assert mine.optim[name]["exp_avg"].numel() == value.numel(), (source, name)
        assert len(mine.params) == 8 + 6 * 4
