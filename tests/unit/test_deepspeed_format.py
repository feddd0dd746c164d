"""DeepSpeed checkpoint files without DeepSpeed: the allowlist refuses code, damaged or missing files are
named, DeepSpeed's flat partitions round-trip, and a directory written for one layout reads back whole.
(Real DeepSpeed's files are tested in tests/deepspeed_compat.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepshard.checkpoint.deepspeed_format import UnsafeCheckpointError, load_pt, read_engine_record, read_full_state
from deepshard.checkpoint.deepspeed_format.flat import join_zero3, join_zero12, split_zero3, split_zero12
from deepshard.checkpoint.deepspeed_format.write import Source, write_deepspeed
from deepshard.shard_state import FullState
from deepshard.checkpoint.io import CheckpointError

SHAPES = {"emb.weight": (5, 3), "lin.weight": (7, 5), "lin.bias": (7,), "out.bias": (1,)}


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # what a malicious checkpoint does: unpickling calls os.system
        return os.system, (f"touch {self.marker}",)


def _source(dtype: str = "torch.float32") -> Source:
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    optim = {n: {"exp_avg": torch.randn(p.numel(), generator=g), "exp_avg_sq": torch.rand(p.numel(), generator=g),
                 "step": torch.tensor(4.0)} for n, p in params.items()}
    kinds = {n: {"exp_avg": "elementwise", "exp_avg_sq": "elementwise", "step": "scalar"} for n in params}
    groups = [{"lr": 0.1, "betas": [0.9, 0.99], "__tuples__": ["betas"], "params": list(params)}]
    full = FullState(params, optim, kinds, groups, {"buf": torch.arange(3.0)}, {"tied.weight": "emb.weight"},
                     dict(SHAPES), {"frozen_params": []})
    engine = {"global_steps": 4, "global_samples": 32, "skipped_steps": 1, "param_dtype": dtype,
              "loss_scaler": {"kind": "static", "scale": 1.0}, "grid": {"pp": 1, "dp": 2, "tp": 1}}
    return Source(full, engine, {"last_batch_iteration": 3}, {"epoch": 2}, list(SHAPES))


def _quiet(items, what):
    return items


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_flat_partitions_round_trip(dp: int) -> None:
    values = {n: torch.randn(s).reshape(-1) for n, s in SHAPES.items()}
    parts, padding = join_zero12(values, SHAPES, dp, 2)
    total = sum(v.numel() for v in values.values())
    assert len({p.numel() for p in parts}) == 1 and sum(p.numel() for p in parts) - padding == total
    assert (total + padding) % (2 * dp) == 0
    back = split_zero12(parts, SHAPES, None, "test")
    assert all(torch.equal(back[n], values[n]) for n in SHAPES)
    back3 = split_zero3(join_zero3(values, SHAPES, dp), SHAPES, "test")
    assert all(torch.equal(back3[n], values[n]) for n in SHAPES)


@pytest.mark.parametrize("stage,dp", [(1, 3), (2, 2), (3, 3)])
def test_written_directory_reads_back_whole(tmp_path: Path, stage: int, dp: int) -> None:
    src = _source()
    tag_dir = write_deepspeed(src, tmp_path, "global_step4", dp, stage, _quiet)
    full, record = read_full_state(tag_dir), read_engine_record(tag_dir)
    for name, value in src.full.params.items():
        assert torch.equal(full.params[name], value), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(full.optim[name][key], src.full.optim[name][key]), (name, key)
        assert float(full.optim[name]["step"]) == 4.0
    assert full.param_groups[0]["params"] == list(SHAPES) and full.param_groups[0]["betas"] == [0.9, 0.99]
    assert torch.equal(full.module_extra["buf"], torch.arange(3.0)) and full.aliases == {"tied.weight": "emb.weight"}
    assert (record.global_steps, record.global_samples, record.skipped_steps) == (4, 32, 1)
    assert record.lr_scheduler == {"last_batch_iteration": 3} and record.client_state == {"epoch": 2}
    assert record.zero_stage == stage and record.dp_world_size == dp
    assert (tmp_path / "latest").read_text() == "global_step4"


def _partition_ranges(stage: int, dp: int, rank: int) -> dict[str, list[tuple[int, int]]]:
    """Rank ``rank``'s ranges of each parameter in DeepSpeed's layout (computed here from its definition:
    ZeRO-3 cuts each parameter in ``ceil(n / dp)`` pieces; ZeRO 1-2 cut the concatenation, padded to a multiple
    of ``2 * dp``, in ``dp`` equal partitions)."""
    numels = {n: int(torch.Size(s).numel()) for n, s in SHAPES.items()}
    size = -(-sum(numels.values()) // (2 * dp)) * 2
    out, offset = {}, 0
    for name, n in numels.items():
        piece = -(-n // dp)
        lo, hi = (rank * piece, (rank + 1) * piece) if stage == 3 else (rank * size - offset, (rank + 1) * size - offset)
        lo, hi = max(lo, 0), min(hi, n)
        out[name] = [(lo, hi)] if lo < hi else []
        offset += n
    return out


@pytest.mark.parametrize("stage,dp", [(1, 3), (2, 2), (3, 3)])
def test_a_share_reads_only_the_optimizer_files_holding_it(tmp_path: Path, stage: int, dp: int) -> None:
    from deepshard.checkpoint.ledger import track_io
    from deepshard.checkpoint.share import LoadShare

    src = _source()
    tag_dir = write_deepspeed(src, tmp_path, "global_step4", dp, stage, _quiet)
    for rank in range(dp):
        ranges = _partition_ranges(stage, dp, rank)
        with track_io() as ledger:
            full = read_full_state(tag_dir, share=LoadShare(ranges, {}, rank))
        optim = [name for name in ledger.names_read() if name.endswith("optim_states.pt")]
        assert optim == [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"], (rank, optim)
        assert full.param_groups[0]["params"] == list(SHAPES)
        for name, spans in ranges.items():
            for a, b in spans:
                assert torch.equal(full.params[name].reshape(-1)[a:b], src.full.params[name].reshape(-1)[a:b]), name
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(full.optim[name][key][a:b], src.full.optim[name][key][a:b]), (name, key)
            assert float(full.optim[name]["step"]) == 4.0


def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    tag_dir = tmp_path / "global_step1"
    tag_dir.mkdir()
    (tmp_path / "latest").write_text("global_step1")
    bad = tag_dir / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "global_steps": _RunsACommand(marker)}, bad)
    with pytest.raises(UnsafeCheckpointError) as err:
        load_pt(bad)
    assert str(bad) in str(err.value) and "system" in str(err.value), err.value
    with pytest.raises(UnsafeCheckpointError):
        read_engine_record(tag_dir)
    cli = subprocess.run([sys.executable, "-m", "deepshard.launcher.cli", "convert", str(tmp_path),
                          str(tmp_path / "out"), "--to", "deepshard", "--quiet"], capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 2 and "refused to load" in cli.stderr and str(bad) in cli.stderr, cli.stderr
    assert not marker.exists(), "the pickle's command ran"


def test_truncated_file_is_named(tmp_path: Path) -> None:
    tag_dir = write_deepspeed(_source(), tmp_path, "global_step4", 2, 2, _quiet)
    path = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted") as err:
        read_full_state(tag_dir)
    assert str(path) in str(err.value)


def test_missing_rank_file_is_named(tmp_path: Path) -> None:
    tag_dir = write_deepspeed(_source("torch.bfloat16"), tmp_path, "global_step4", 3, 1, _quiet)
    missing = tag_dir / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    missing.unlink()
    with pytest.raises(CheckpointError, match="rank 2's optimizer file is missing") as err:
        read_full_state(tag_dir)
    assert "zero_pp_rank_2_mp_rank_00_optim_states.pt" in str(err.value)
    (tag_dir / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError):
        read_engine_record(tag_dir)


def test_dynamic_loss_scaler_round_trips(tmp_path: Path) -> None:
    """fp16's dynamic scaler (not runnable on CPU with DeepSpeed): written as DeepSpeed's DynamicLossScaler
    fields (cur_scale, cur_iter, last_overflow_iter, cur_hysteresis) and read back as deepshard's state."""
    src = _source("torch.float16")
    state = {"kind": "dynamic", "scale": 1024.0, "iteration": 7, "last_overflow_iteration": 3, "hysteresis_left": 1}
    src.engine["loss_scaler"] = state
    tag_dir = write_deepspeed(src, tmp_path, "global_step4", 2, 2, _quiet)
    scaler = load_pt(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]["loss_scaler"]
    assert type(scaler).__name__ == "DynamicLossScalerRecord" and scaler.cur_scale == 1024.0 and scaler.dynamic
    assert read_engine_record(tag_dir).loss_scaler == state
