"""Checkpoint file layer: flatten/unflatten, safetensors/JSON I/O, manifest, staging, latest, tags."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from deepshard.checkpoint import (
    CheckpointError,
    commit_staging,
    file_digest,
    flatten_state,
    load_json,
    load_tensors,
    read_latest,
    recover_tag,
    save_json,
    save_tensors,
    staging_dir,
    unflatten_state,
    validate_tag,
    verify_manifest,
    write_latest,
    write_manifest,
)


def assert_same(a: Any, b: Any, path: str = "x") -> None:
    """Exact structural equality: same types, bit-identical tensors, nan == nan, same dict keys."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        if a.numel():
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            assert torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)), path
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, float):
        assert a == b and math.copysign(1.0, a) == math.copysign(1.0, b), f"{path}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def disk_round_trip(obj: Any, tmp_path: Path, prefix: str = "") -> Any:
    tensors, skeleton = flatten_state(obj, prefix)
    save_tensors(tmp_path / "t.safetensors", tensors)
    save_json(tmp_path / "s.json", skeleton)
    return unflatten_state(load_tensors(tmp_path / "t.safetensors"), load_json(tmp_path / "s.json"))


def make_adamw(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-2},
                             {"params": model[2].parameters(), "betas": (0.8, 0.95)}],
                            lr=3e-3, weight_decay=0.1)
    return model, opt


def adamw_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(8, 5, generator=gen)).pow(2).sum().backward()
    opt.step()


def test_adamw_state_dict_round_trip_bit_exact_and_resumes(tmp_path: Path) -> None:
    model, opt = make_adamw(0)
    for s in range(2):
        adamw_step(model, opt, s)
    original = opt.state_dict()
    loaded = disk_round_trip(original, tmp_path, "optimizer")

    assert_same(original["state"], loaded["state"], "state")
    assert set(loaded["state"]) == {0, 1, 2, 3}  # int parameter ids survive as ints
    assert loaded["state"][0]["step"].dim() == 0 and loaded["state"][0]["step"].item() == 2.0
    assert_same(original["param_groups"], loaded["param_groups"], "param_groups")
    assert loaded["param_groups"][1]["betas"] == (0.8, 0.95)
    assert type(loaded["param_groups"][0]["betas"]) is tuple

    # The oracle: resuming from the loaded state gives bit-identical parameters after one more step.
    model2, opt2 = make_adamw(1)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(loaded)
    adamw_step(model, opt, 7)
    adamw_step(model2, opt2, 7)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_nested_client_state_round_trip(tmp_path: Path) -> None:
    shared = torch.arange(6, dtype=torch.int64)
    state = {
        "epoch": 3, "big": 2**70, "neg_zero": -0.0, "tiny": 5e-324, "lr": 0.1,
        "best": math.inf, "worst": -math.inf, "nan": math.nan, "none": None, "flag": True,
        "tuples": (1, (2.5, "a"), [None, (math.nan,)], ()), "empty": {}, "list": [],
        3: "int key", (1, "x"): "tuple key", -1.5: "float key", None: "none key",
        "__tensor__": "a key that looks like a marker",
        "nested": {"a": {"b": [shared, {"c": shared}]}, "rng": torch.get_rng_state()},
        "dtype": torch.bfloat16, "size": torch.Size([2, 3]), "device": torch.device("cpu"),
        "scalar": torch.tensor(1.5, dtype=torch.float64),
    }
    loaded = disk_round_trip(state, tmp_path, "client_state")
    assert_same(state, loaded, "client_state")
    assert type(loaded["size"]) is torch.Size
    # The same tensor object stored once and restored as one object.
    assert loaded["nested"]["a"]["b"][0] is loaded["nested"]["a"]["b"][1]["c"]
    assert len(flatten_state(state, "cs")[0]) == 3


def test_flatten_keys_are_unique_paths() -> None:
    tensors, skeleton = flatten_state({0: torch.zeros(1), "0": torch.ones(1), "a.b": torch.zeros(2),
                                       "a": {"b": torch.ones(2)}}, "opt")
    assert set(tensors) == {"opt[0]", "opt['0']", "opt['a.b']", "opt['a']['b']"}
    assert unflatten_state(tensors, skeleton)[0] is tensors["opt[0]"]


class MySampler:
    pass


@pytest.mark.parametrize("obj, prefix, expected", [
    ({"data": {"sampler": MySampler()}}, "client_state",
     "client_state['data']['sampler'] is a MySampler, which cannot be stored without pickle"),
    ([1, lambda x: x], "sched", "sched[1] is a function"),
    ({"s": {1, 2}}, "", "state['s'] is a set"),
    ({"m": torch.nn.Linear(1, 1)}, "cs", "cs['m'] is a Linear, which cannot be stored without pickle; "
     "store obj.state_dict()"),
    ({MySampler(): 1}, "cs", "cs key"),
])
def test_unstorable_value_names_its_path(obj: Any, prefix: str, expected: str) -> None:
    with pytest.raises(TypeError) as info:
        flatten_state(obj, prefix)
    assert expected in str(info.value)


def test_cycle_is_refused() -> None:
    loop: dict[str, Any] = {"a": []}
    loop["a"].append(loop)
    with pytest.raises(ValueError, match=r"state\['a'\]\[0\] contains itself"):
        flatten_state(loop)


def test_unflatten_missing_tensor_is_a_checkpoint_error() -> None:
    tensors, skeleton = flatten_state({"w": torch.zeros(2)}, "m")
    with pytest.raises(CheckpointError, match=r"references tensor \"m\['w'\]\""):
        unflatten_state({}, skeleton)
    with pytest.raises(CheckpointError, match="malformed __float__"):
        unflatten_state({}, {"__float__": "bogus"})


def test_save_load_tensors_dtypes_shared_and_metadata(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = torch.randn(4, 6)
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16), "fp16": torch.randn(7).half(),
        "fp64": torch.randn(2, 2, dtype=torch.float64), "i64": torch.arange(-3, 3),
        "u8": torch.randint(0, 255, (9,), dtype=torch.uint8), "bool": torch.tensor([True, False]),
        "zero_d": torch.tensor(2.0), "empty": torch.zeros(0, 3),
        "base": base, "view": base[1:3], "transposed": base.t(), "alias": base,
        "grad": torch.ones(3, requires_grad=True) * 2,
    }
    expected = {k: v.detach().clone() for k, v in tensors.items()}
    save_tensors(tmp_path / "x.safetensors", tensors, metadata={"kind": "test", "step": "5"})
    loaded = load_tensors(tmp_path / "x.safetensors")
    assert set(loaded) == set(expected)
    for k in expected:
        assert_same(expected[k], loaded[k], k)
    assert loaded["view"].data_ptr() != loaded["base"].data_ptr()
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"kind": "test", "step": "5", "deepshard_file": "x.safetensors"}
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temporary file left
    with pytest.raises(TypeError, match="metadata must map str to str"):
        save_tensors(tmp_path / "y.safetensors", {"a": base}, metadata={"step": 5})  # type: ignore[dict-item]


def test_load_tensors_missing_and_truncated(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    with pytest.raises(CheckpointError, match="model.safetensors does not exist"):
        load_tensors(path)
    save_tensors(path, {"w": torch.randn(100)})
    data = path.read_bytes()
    path.write_bytes(data[:-40])
    with pytest.raises(CheckpointError, match=r"model.safetensors .*truncated or corrupted"):
        load_tensors(path)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_tensors(path)


def test_json_round_trip_and_errors(tmp_path: Path) -> None:
    save_json(tmp_path / "a.json", {"b": [1, 2.5, None], "a": "x"})
    text = (tmp_path / "a.json").read_text()
    assert text.index('"a"') < text.index('"b"') and "\n  " in text  # sorted, indented
    assert load_json(tmp_path / "a.json") == {"a": "x", "b": [1, 2.5, None]}
    with pytest.raises(TypeError, match="flatten_state"):
        save_json(tmp_path / "n.json", {"x": math.nan})
    (tmp_path / "bad.json").write_text('{"a": [1, 2')
    with pytest.raises(CheckpointError, match=r"bad.json is not valid JSON \(line 1"):
        load_json(tmp_path / "bad.json")
    with pytest.raises(CheckpointError, match="nope.json does not exist"):
        load_json(tmp_path / "nope.json")


def write_checkpoint(directory: Path, seed: int) -> list[str]:
    torch.manual_seed(seed)
    (directory / "zero").mkdir(parents=True, exist_ok=True)
    save_tensors(directory / "model.safetensors", {"w": torch.randn(64, 64)})
    save_tensors(directory / "zero" / "rank0.safetensors", {"m": torch.randn(300)})
    save_json(directory / "meta.json", {"seed": seed})
    return ["model.safetensors", "zero/rank0.safetensors", "meta.json"]


def test_manifest_detects_truncation_corruption_and_loss(tmp_path: Path) -> None:
    ckpt = tmp_path / "global_step1"
    files = write_checkpoint(ckpt, 0)
    write_manifest(ckpt, files)
    manifest = load_json(ckpt / "manifest.json")
    assert manifest["format"] == "deepshard-checkpoint" and manifest["version"] == 1
    assert manifest["files"]["meta.json"] == {"bytes": (ckpt / "meta.json").stat().st_size,
                                              "sha256": file_digest(ckpt / "meta.json")}
    verify_manifest(ckpt)

    shard = ckpt / "zero" / "rank0.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[:-10])
    with pytest.raises(CheckpointError, match=r"damaged: zero/rank0.safetensors is truncated.*"
                                              r"\d+ bytes on disk.*Load another tag"):
        verify_manifest(ckpt)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    shard.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"damaged: zero/rank0.safetensors is corrupted"):
        verify_manifest(ckpt)
    shard.write_bytes(good)
    verify_manifest(ckpt)
    (ckpt / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="damaged: meta.json is missing"):
        verify_manifest(ckpt)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json"):
        verify_manifest(ckpt)
    with pytest.raises(CheckpointError, match="meta.json was not written"):
        write_manifest(ckpt, files)
    with pytest.raises(ValueError, match="relative path"):
        write_manifest(ckpt, ["../escape"])


def test_commit_staging_replaces_existing_tag(tmp_path: Path) -> None:
    for seed in (1, 2):
        stage = staging_dir(tmp_path, "global_step5")
        assert stage == tmp_path / ".tmp-global_step5" and not any(stage.iterdir())
        write_manifest(stage, write_checkpoint(stage, seed))
        commit_staging(stage, tmp_path / "global_step5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step5"]
    verify_manifest(tmp_path / "global_step5")
    assert load_json(tmp_path / "global_step5" / "meta.json") == {"seed": 2}
    torch.manual_seed(2)
    assert torch.equal(load_tensors(tmp_path / "global_step5" / "model.safetensors")["w"],
                       torch.randn(64, 64))


def test_crash_before_commit_leaves_previous_tag_intact(tmp_path: Path) -> None:
    stage = staging_dir(tmp_path, "t")
    write_manifest(stage, write_checkpoint(stage, 1))
    commit_staging(stage, tmp_path / "t")
    write_latest(tmp_path, "t")
    before = {p.name: file_digest(p) for p in (tmp_path / "t").rglob("*") if p.is_file()}

    stage = staging_dir(tmp_path, "t")          # a second save of the same tag ...
    write_checkpoint(stage, 2)                  # ... dies after writing, before manifest and commit
    after = {p.name: file_digest(p) for p in (tmp_path / "t").rglob("*") if p.is_file()}
    assert after == before and read_latest(tmp_path) == "t"
    verify_manifest(tmp_path / "t")
    assert load_json(tmp_path / "t" / "meta.json") == {"seed": 1}
    assert not any(staging_dir(tmp_path, "t").iterdir())  # the next save clears the debris


def test_crash_between_renames_is_recoverable(tmp_path: Path) -> None:
    stage = staging_dir(tmp_path, "t")
    write_manifest(stage, write_checkpoint(stage, 1))
    commit_staging(stage, tmp_path / "t")
    assert recover_tag(tmp_path, "t") is False
    os.rename(tmp_path / "t", tmp_path / ".old-t-0")   # commit_staging's first rename, then a crash
    assert recover_tag(tmp_path, "t") is True
    verify_manifest(tmp_path / "t")
    assert not (tmp_path / ".old-t-0").exists()
    (tmp_path / ".old-t-0").mkdir()                     # crash after publishing, before cleanup
    assert recover_tag(tmp_path, "t") is True and not (tmp_path / ".old-t-0").exists()
    verify_manifest(tmp_path / "t")


def test_commit_without_staging_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="staging directory .* does not exist"):
        commit_staging(tmp_path / ".tmp-x", tmp_path / "x")


def test_latest_file(tmp_path: Path) -> None:
    assert read_latest(tmp_path) is None
    write_latest(tmp_path, "global_step10")
    assert (tmp_path / "latest").read_text() == "global_step10"
    assert read_latest(tmp_path) == "global_step10"
    write_latest(tmp_path, "global_step20")
    assert read_latest(tmp_path) == "global_step20"
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match="does not hold a valid tag"):
        read_latest(tmp_path)


@pytest.mark.parametrize("tag", ["global_step100", "epoch-3.best", "v1_final", "a"])
def test_validate_tag_accepts(tag: str) -> None:
    assert validate_tag(tag) == tag


@pytest.mark.parametrize("tag, problem", [
    ("", "is empty"), ("a/b", "path separator"), ("a\\b", "path separator"), ("..", "'..'"),
    ("x..y", "'..'"), (".hidden", "starts with '.'"), ("global step", "whitespace"),
    ("tab\t", "whitespace"), ("x" * 201, "at most 200"),
])
def test_validate_tag_refuses(tag: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        validate_tag(tag)
    assert problem in str(info.value) and "global_step100" in str(info.value)


def test_staging_dir_validates_tag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="path separator"):
        staging_dir(tmp_path, "../x")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------------
# write failures name the file, the directory, the bytes needed and free; interrupted saves repaired
# --------------------------------------------------------------------------------------------------

def test_a_full_file_system_is_refused_before_writing_with_the_numbers(tmp_path: Path, monkeypatch: Any) -> None:
    from deepshard.checkpoint import io as ckpt_io

    monkeypatch.setattr(ckpt_io, "free_bytes", lambda directory: 1000)
    with pytest.raises(ckpt_io.CheckpointWriteError) as info:
        save_tensors(tmp_path / "big.safetensors", {"w": torch.zeros(1000)})
    msg = str(info.value)
    assert f"cannot write big.safetensors in {tmp_path}" in msg and "No space left on device" in msg, msg
    assert "needs 4,3" in msg and "1,000 bytes free" in msg and "free at least" in msg, msg
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    assert isinstance(info.value, OSError) and isinstance(info.value, CheckpointError)


def test_an_os_error_while_writing_names_the_file_and_the_fix(tmp_path: Path, monkeypatch: Any) -> None:
    import safetensors.torch as st

    def denied(tensors: Any, filename: str, metadata: Any = None) -> None:
        raise PermissionError(13, "Permission denied", filename)

    monkeypatch.setattr(st, "save_file", denied)
    with pytest.raises(CheckpointError) as info:
        save_tensors(tmp_path / "x.safetensors", {"w": torch.zeros(4)})
    msg = str(info.value)
    assert "cannot write x.safetensors" in msg and "Permission denied" in msg and "writable" in msg, msg
    assert list(tmp_path.iterdir()) == []


def test_repair_save_dir_restores_aside_copies_and_removes_stale_staging(tmp_path: Path) -> None:
    from deepshard.checkpoint.io import repair_save_dir

    (tmp_path / ".old-a-0").mkdir()                       # crash between the renames of tag a
    (tmp_path / "b").mkdir()
    (tmp_path / ".old-b-0").mkdir()                       # crash after b was published
    (tmp_path / ".tmp-c").mkdir()                         # an interrupted save of c
    (tmp_path / ".tmp-d").mkdir()                         # the save under way
    done = repair_save_dir(tmp_path, keep="d")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-d", "a", "b"]
    assert len(done) == 3, done
