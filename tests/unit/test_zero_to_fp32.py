"""zero_to_fp32: consolidating checkpoints into fp32 state dicts and Hugging Face-style files.

Checkpoints come from a real engine in a world of one (bf16, so the fp32 masters differ from the module's
16-bit weights) and from fragment files written by hand (a parameter split across two ranks, as ZeRO
stages 1-2 write them), so every value below is compared with a known reference.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from deepshard.checkpoint import CheckpointError, write_latest, write_manifest
from deepshard.checkpoint.consolidate import FROZEN_META_KEY, parse_size, plan_shards
from deepshard.checkpoint.fragments import save_rank_fragments
from deepshard.shard_state import FragmentRecord
from deepshard.utils.logging import logger
from deepshard.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                          get_fp32_state_dict_from_zero_checkpoint,
                                          load_state_dict_from_zero_checkpoint, main)
from tests.multiproc.scenarios_zero_to_fp32 import TiedNet, make_engine, reported_state, train_steps

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A world-of-one engine: 2 steps saved as global_step2 (latest), 1 more saved as 'later'; the
    references come from ``safe_get_full_fp32_param`` (see ``reported_state``)."""
    import torch.distributed as dist

    created_group = not dist.is_initialized()
    save_dir = tmp_path_factory.mktemp("z2fp32") / "ckpt"
    engine = make_engine(stage=0)
    train_steps(engine, 2, seed=0)
    engine.save_checkpoint(save_dir)
    first = reported_state(engine)
    train_steps(engine, 1, seed=1)
    engine.save_checkpoint(save_dir, tag="later", save_latest=False)
    yield {"dir": save_dir, "ref": first, "later": reported_state(engine)}
    if created_group and dist.is_initialized():
        dist.destroy_process_group()


def _assert_matches(sd: dict[str, torch.Tensor], ref: dict[str, dict[str, torch.Tensor]]) -> None:
    assert list(sd) and set(sd) == set(TiedNet().state_dict())
    for name, value in ref["fp32"].items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], value), name
    for name, value in {**ref["frozen"], **ref["buffers"]}.items():
        expected = value.float() if value.is_floating_point() else value
        assert sd[name].dtype == expected.dtype and torch.equal(sd[name], expected), name


# ------------------------------------------------------------------------------ the state dict

def test_state_dict_holds_fp32_masters_tied_names_frozen_and_buffers(ckpt: dict[str, Any]) -> None:
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt["dir"])
    _assert_matches(sd, ckpt["ref"])
    assert sd["head.weight"] is sd["embed.weight"]
    assert sd["seen"].dtype == torch.int64 and int(sd["seen"]) == 3
    assert sd["scale"].dtype == torch.float32 and float(sd["scale"]) == 1.25
    module = ckpt["ref"]["module"]
    assert module["mix.weight"].dtype == torch.bfloat16
    # the masters carry bits the bf16 weights lost: reading the module weights would not pass above
    assert any(not torch.equal(sd[n], module[n].float()) for n in ckpt["ref"]["fp32"])


def test_tag_selection_latest_explicit_and_tag_directory(ckpt: dict[str, Any]) -> None:
    save_dir = ckpt["dir"]
    assert (save_dir / "latest").read_text() == "global_step2"
    _assert_matches(get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="later"), ckpt["later"])
    _assert_matches(get_fp32_state_dict_from_zero_checkpoint(save_dir / "later"), ckpt["later"])
    _assert_matches(get_fp32_state_dict_from_zero_checkpoint(save_dir / "later", tag="later"), ckpt["later"])
    _assert_matches(get_fp32_state_dict_from_zero_checkpoint(str(save_dir), lazy_mode=True), ckpt["ref"])
    assert not torch.equal(ckpt["ref"]["fp32"]["mix.weight"], ckpt["later"]["fp32"]["mix.weight"])


def test_load_state_dict_from_zero_checkpoint_into_a_fresh_model(ckpt: dict[str, Any]) -> None:
    torch.manual_seed(123)
    model = TiedNet()
    loaded = load_state_dict_from_zero_checkpoint(model, ckpt["dir"])
    assert loaded is model
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt["dir"])
    for name, value in model.state_dict().items():
        assert torch.equal(value, sd[name]), name
    assert model.head.weight is model.embed.weight
    with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
        load_state_dict_from_zero_checkpoint(torch.nn.Linear(2, 2), ckpt["dir"])


# ------------------------------------------------------------------------------------ errors

def test_errors_name_the_problem(ckpt: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"'global_step9'.*\['global_step2', 'later'\]"):
        get_fp32_state_dict_from_zero_checkpoint(ckpt["dir"], tag="global_step9")
    with pytest.raises(ValueError, match="path separator"):
        get_fp32_state_dict_from_zero_checkpoint(ckpt["dir"], tag="../ckpt")
    no_latest = tmp_path / "no_latest"
    shutil.copytree(ckpt["dir"] / "later", no_latest / "later")
    with pytest.raises(ValueError, match=r"no 'latest' file.*\['later'\]"):
        get_fp32_state_dict_from_zero_checkpoint(no_latest)
    (no_latest / "latest").write_text("gone")
    with pytest.raises(FileNotFoundError, match="names tag 'gone'"):
        get_fp32_state_dict_from_zero_checkpoint(no_latest)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_checkpoint_is_refused(ckpt: dict[str, Any], tmp_path: Path, damage: str) -> None:
    tag_dir = tmp_path / "later"
    shutil.copytree(ckpt["dir"] / "later", tag_dir)
    target = tag_dir / "zero_rank0.safetensors"
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[-3] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(bytes(data[:-8]))
    else:
        target.unlink()
    with pytest.raises(CheckpointError, match="zero_rank0.safetensors"):
        get_fp32_state_dict_from_zero_checkpoint(tag_dir)


# ------------------------------------------------------------------- hand-made partitioned ckpt

def _hand_made(root: Path, record_frozen: bool) -> dict[str, torch.Tensor]:
    """Two ranks' fragment files: 'w' (3x4) split 5 + 7 across ranks, 'b' whole on rank 1, 'tied' an
    alias of 'w', plus a bf16 frozen weight, a float buffer and an int buffer. Returns the expected dict."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    b = torch.tensor([0.5, -1.0, 2.0, 3.25, 1e-3])
    extra = {"frozen.weight": torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16), "buf": torch.tensor([0.125]),
             "n": torch.tensor(4)}
    shapes = {"w": (3, 4), "b": (5,)}
    meta = {"zero_stage": 2, "dp_world_size": 2, **({FROZEN_META_KEY: ["frozen.weight"]} if record_frozen else {})}
    tag_dir = root / "global_step1"
    tag_dir.mkdir(parents=True)
    files = save_rank_fragments(tag_dir, 0, [FragmentRecord("w", 0, 5, w.reshape(-1)[:5])], shapes, None,
                                {"tied": "w"}, extra, meta)
    files += save_rank_fragments(tag_dir, 1, [FragmentRecord("w", 5, 7, w.reshape(-1)[5:]),
                                              FragmentRecord("b", 0, 5, b)], shapes, None, {"tied": "w"},
                                 None, {"zero_stage": 2, "dp_world_size": 2})
    write_manifest(tag_dir, files)
    write_latest(root, "global_step1")
    return {"w": w, "b": b, "tied": w, "frozen.weight": torch.tensor([[1.5, -2.0]]), "buf": extra["buf"],
            "n": extra["n"]}


def test_fragments_from_several_ranks_are_reassembled(tmp_path: Path) -> None:
    expected = _hand_made(tmp_path, record_frozen=True)
    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert set(sd) == set(expected)
    for name, value in expected.items():
        assert sd[name].dtype == value.dtype and torch.equal(sd[name], value), name
    assert sd["tied"] is sd["w"]
    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path, exclude_frozen_parameters=True)
    assert set(sd) == set(expected) - {"frozen.weight"}


def test_exclude_frozen_without_a_record_keeps_everything_and_warns(tmp_path: Path) -> None:
    expected = _hand_made(tmp_path, record_frozen=False)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path, exclude_frozen_parameters=True)
    finally:
        logger.removeHandler(handler)
    assert set(sd) == set(expected)
    assert any("does not record" in r.getMessage() and r.levelno == logging.WARNING for r in records)


# ------------------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("text, value", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("10KB", 10_000),
                                         ("2GiB", 2 * 2**30), ("1.5kb", 1500), ("300B", 300), ("42", 42),
                                         (4096, 4096)])
def test_parse_size(text: Any, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["5 parsecs", "GB", "-1KB", "0", 0, -5, 1.5, True])
def test_parse_size_rejects(bad: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="max_shard_size"):
        parse_size(bad)


def test_plan_shards_fills_in_order_keeps_shared_storage_together() -> None:
    a, b, c = torch.zeros(100), torch.zeros(100), torch.zeros(100)  # 400 bytes each
    big = torch.zeros(500)  # 2000 bytes: over the limit, alone
    assert plan_shards({"a": a, "b": b, "c": c}, 1000) == [["a", "b"], ["c"]]
    assert plan_shards({"a": a, "big": big, "c": c}, 1000) == [["a"], ["big"], ["c"]]
    assert plan_shards({"a": a, "b": b, "a2": a, "c": c}, 1000) == [["a", "a2", "b"], ["c"]]
    assert plan_shards({}, 1000) == [[]]


# ------------------------------------------------------------------------------------ writing

def _read_shard(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)


def _expected_total(sd: dict[str, torch.Tensor], safe: bool) -> int:
    tensors = list(sd.values()) if safe else list({id(t): t for t in sd.values()}.values())
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_sharded_output_and_index_reload_to_the_same_dict(ckpt: dict[str, Any], tmp_path: Path,
                                                          safe: bool) -> None:
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt["dir"])
    out = tmp_path / "out"
    convert_zero_checkpoint_to_fp32_state_dict(ckpt["dir"], out, max_shard_size=300, safe_serialization=safe)
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    index = json.loads((out / f"{stem}.{ext}.index.json").read_text())
    shards = sorted(p.name for p in out.iterdir() if p.name.endswith(ext))
    n = len(shards)
    assert n > 2 and shards == [f"{stem}-{i:05d}-of-{n:05d}.{ext}" for i in range(1, n + 1)]
    assert not (out / f"{stem}.{ext}").exists()
    assert set(index["weight_map"]) == set(sd) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"] == {"total_size": _expected_total(sd, safe)}
    union: dict[str, torch.Tensor] = {}
    for name in shards:
        part = _read_shard(out / name)
        assert set(part) == {k for k, f in index["weight_map"].items() if f == name}
        union.update(part)
    assert set(union) == set(sd)
    for key, value in sd.items():
        assert union[key].dtype == value.dtype and torch.equal(union[key], value), key
    if not safe:  # torch.save keeps the tie: one storage for both names
        assert union["head.weight"].untyped_storage().data_ptr() == union["embed.weight"].untyped_storage().data_ptr()


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_single_file_output_and_stale_shards_removed(ckpt: dict[str, Any], tmp_path: Path, safe: bool) -> None:
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt["dir"])
    out = tmp_path / "out"
    convert_zero_checkpoint_to_fp32_state_dict(ckpt["dir"], out, max_shard_size="300B", safe_serialization=safe)
    (out / "README.md").write_text("keep me")
    convert_zero_checkpoint_to_fp32_state_dict(ckpt["dir"], out, safe_serialization=safe)
    single = "model.safetensors" if safe else "pytorch_model.bin"
    assert sorted(os.listdir(out)) == sorted([single, "README.md"])
    reloaded = _read_shard(out / single)
    assert set(reloaded) == set(sd) and all(torch.equal(reloaded[k], sd[k]) for k in sd)
    if safe:
        from safetensors import safe_open

        with safe_open(str(out / single), "pt") as f:
            assert f.metadata() == {"format": "pt"}


# ---------------------------------------------------------------------------------------- CLI

def test_cli_end_to_end_in_a_subprocess(ckpt: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "deepshard.utils.zero_to_fp32", str(ckpt["dir"]), str(out),
                           "--safe_serialization", "--max_shard_size", "300B", "-t", "later"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    n = len(list(out.glob("model-*.safetensors")))
    assert n > 2 and f"wrote {n} file(s)" in proc.stdout and "model.safetensors.index.json" in proc.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    union: dict[str, torch.Tensor] = {}
    for name in set(index["weight_map"].values()):
        union.update(_read_shard(out / name))
    _assert_matches(union, ckpt["later"])


def test_cli_summary_and_errors(ckpt: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(ckpt["dir"]), str(tmp_path / "o")]) == 0
    stdout = capsys.readouterr().out
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt["dir"])
    distinct = {id(t): t for t in sd.values()}
    assert f"{len(sd)} tensors ({len(distinct)} distinct)" in stdout
    assert f"{sum(t.numel() for t in distinct.values()):,} elements" in stdout
    assert "wrote 1 file(s)" in stdout and "pytorch_model.bin" in stdout
    assert main([str(ckpt["dir"]), str(tmp_path / "o2"), "-t", "nope"]) == 1
    assert "tag 'nope' does not exist" in capsys.readouterr().err
    assert main([str(ckpt["dir"]), str(tmp_path / "o3"), "--max_shard_size", "lots"]) == 1
    assert "max_shard_size 'lots'" in capsys.readouterr().err
    assert not (tmp_path / "o3").exists()  # a bad size fails before anything is read or written
    with pytest.raises(FileNotFoundError):
        main([str(tmp_path / "missing"), str(tmp_path / "o4"), "--debug"])
