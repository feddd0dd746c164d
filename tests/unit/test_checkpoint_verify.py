"""Per-rank checkpoint verification: files hashed while read, counted, parsed from memory; the full check
as a command."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint.ledger import track_io, verifying
from deepshard.checkpoint.safetensors_bytes import parse
from deepshard.checkpoint.verify import ManifestVerifier, main as verify_main


def _checkpoint(tmp_path: Path) -> Path:
    tag = tmp_path / "t"
    ckpt_io.save_tensors(tag / "a.safetensors", {"w": torch.arange(6.0).view(2, 3), "i": torch.tensor([7, 8])})
    ckpt_io.save_tensors(tag / "b.safetensors", {"v": torch.ones(5, dtype=torch.bfloat16)})
    ckpt_io.save_json(tag / "c.json", {"k": 1})
    ckpt_io.write_manifest(tag, ["a.safetensors", "b.safetensors", "c.json"])
    ckpt_io.write_latest(tmp_path, "t")
    return tag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.uint8, torch.float64])
def test_parse_matches_safetensors(dtype: torch.dtype) -> None:
    tensors = {"x": (torch.arange(12) % 3).to(dtype).view(3, 4), "scalar": torch.tensor(2).to(dtype),
               "empty": torch.zeros(0, 2, dtype=dtype)}
    got, meta = parse(bytearray(st_save(tensors, metadata={"m": "v"})))
    assert meta == {"m": "v"} and sorted(got) == sorted(tensors)
    for name, value in tensors.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value)
    only, _ = parse(bytearray(st_save(tensors)), names={"x"})
    assert list(only) == ["x"]


def test_parse_refuses_malformed_files() -> None:
    data = bytearray(st_save({"x": torch.ones(4)}))
    with pytest.raises(ValueError, match="shorter than"):
        parse(data[:5])
    with pytest.raises(ValueError, match="do not fit"):
        parse(data[:-4])
    with pytest.raises(ValueError, match="claims"):
        parse(bytearray((10**9).to_bytes(8, "little")) + data[8:])


def test_verified_reads_hash_each_file_once_and_count_it(tmp_path: Path) -> None:
    tag = _checkpoint(tmp_path)
    size = (tag / "a.safetensors").stat().st_size
    with track_io() as io, verifying(ManifestVerifier(tag)) as verifier:
        tensors = ckpt_io.load_tensors(tag / "a.safetensors")
        assert ckpt_io.load_json(tag / "c.json") == {"k": 1}
    assert torch.equal(tensors["w"], torch.arange(6.0).view(2, 3)) and torch.equal(tensors["i"], torch.tensor([7, 8]))
    assert verifier.verified == {"a.safetensors", "c.json"}  # b was not read, so not hashed
    assert io.read[str(tag / "a.safetensors")] == size
    assert io.names_read() == ["a.safetensors", "c.json", "manifest.json"]


def test_a_damaged_file_is_named_when_read_and_others_still_load(tmp_path: Path) -> None:
    tag = _checkpoint(tmp_path)
    data = bytearray((tag / "b.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (tag / "b.safetensors").write_bytes(bytes(data))
    with verifying(ManifestVerifier(tag)):
        assert set(ckpt_io.load_tensors(tag / "a.safetensors")) == {"w", "i"}  # not b's business
        with pytest.raises(ckpt_io.CheckpointError, match=r"damaged: b.safetensors is corrupted"):
            ckpt_io.load_tensors(tag / "b.safetensors")
    (tag / "b.safetensors").write_bytes(bytes(data[:-3]))
    with verifying(ManifestVerifier(tag)), pytest.raises(ckpt_io.CheckpointError, match=r"b.safetensors is truncated"):
        ckpt_io.load_tensors(tag / "b.safetensors")
    ckpt_io.save_json(tag / "stray.json", {})
    with verifying(ManifestVerifier(tag)), pytest.raises(ckpt_io.CheckpointError, match="not recorded"):
        ckpt_io.load_json(tag / "stray.json")


def test_without_a_verifier_reads_are_counted_not_hashed(tmp_path: Path) -> None:
    tag = _checkpoint(tmp_path)
    with track_io() as io:
        ckpt_io.load_tensors(tag / "b.safetensors")
        ckpt_io.save_json(tmp_path / "out.json", {"a": 1})
    assert io.files_read == 1 and io.bytes_read == (tag / "b.safetensors").stat().st_size
    assert io.files_written == 1 and io.written[str(tmp_path / "out.json")] == (tmp_path / "out.json").stat().st_size


def test_write_manifest_takes_known_records_without_rereading(tmp_path: Path) -> None:
    tag = _checkpoint(tmp_path)
    known = {"a.safetensors": ckpt_io.file_entry(tag / "a.safetensors")}
    with track_io() as io:
        ckpt_io.write_manifest(tag, ["a.safetensors", "c.json"], known=known)
    assert str(tag / "a.safetensors") not in io.read and str(tag / "c.json") in io.read
    ckpt_io.verify_manifest(tag)


def test_verify_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tag = _checkpoint(tmp_path)
    assert verify_main([str(tmp_path)]) == 0  # the save directory: its latest tag
    assert verify_main([str(tag)]) == 0
    assert "3 files" in capsys.readouterr().out
    (tag / "c.json").write_text('{"k": 2}\n')
    assert verify_main([str(tmp_path), "--tag", "t"]) == 1
    assert "c.json" in capsys.readouterr().err
