"""Swap files used in place (``MappedFileBacking``): values survive letting go of the pages, writes
land in the file, discard zeroes without giving the blocks back, close removes the files, and the
sub-grouped optimizer over mapped files equals plain torch with no staging buffer allocated."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from deepshard.zero.offload.mapped import MappedFileBacking
from deepshard.zero.offload.policy import AioSettings
from deepshard.zero.offload.swapper import AsyncSwapper

AIO = AioSettings(block_size=64, queue_depth=2, thread_count=2)


def _rss_file_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    return 0


def test_views_round_trip_and_settle_keeps_values_and_unmaps(tmp_path: Path) -> None:
    back = MappedFileBacking(AsyncSwapper(tmp_path, 0, AIO))
    n = 4 << 20  # 16 MiB of fp32
    back.create("s", torch.float32, n)
    back.create("h", torch.bfloat16, 1000)
    values = torch.randn(n)
    before = _rss_file_kib()
    back.view("s", 0, n).copy_(values)  # type: ignore[union-attr]
    assert _rss_file_kib() - before >= 15 << 10  # the pages are mapped into this process
    back.settle("s", 0, n)
    assert _rss_file_kib() - before < 4 << 10  # ... and no longer after settle (other file pages may come)
    assert torch.equal(back.read_copy("s", 0, n), values)  # the values stayed (in the page cache)
    path = back.swapper.directory / "s.swp"
    with open(path, "rb") as f:  # and are the file's bytes
        f.seek(4 * 1000)
        assert torch.equal(torch.frombuffer(bytearray(f.read(4 * 10)), dtype=torch.float32), values[1000:1010])
    half = torch.randn(100).to(torch.bfloat16)
    back.write("h", 900, half[:100]).wait()
    assert torch.equal(back.read_copy("h", 900, 100), half)
    back.close()
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_discard_zeroes_and_keeps_the_blocks(tmp_path: Path) -> None:
    back = MappedFileBacking(AsyncSwapper(tmp_path, 0, AIO))
    n = 1 << 20
    back.create("g", torch.float32, n)
    back.view("g", 0, n).fill_(3.0)  # type: ignore[union-attr]
    back.settle("g", 0, n)
    path = back.swapper.directory / "g.swp"
    blocks = os.stat(path).st_blocks
    back.discard("g")
    if back.read_copy("g", 0, 8).eq(3.0).all():
        back.close()
        return  # this file system cannot zero ranges: discard changes nothing, which is allowed
    assert torch.equal(back.read_copy("g", 0, n), torch.zeros(n))
    assert os.stat(path).st_blocks == blocks  # still reserved: a write through the mapping needs no new block
    back.view("g", 5, 3).fill_(1.0)  # type: ignore[union-attr]
    assert back.read_copy("g", 4, 5).tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    back.close()


def test_states_use_the_fp32_parameter_file_as_their_masters(tmp_path: Path) -> None:
    """fp32 ZeRO-3 with the parameter shard on disk: no master file; each update lands in the parameter
    file itself (nothing published), equal to plain torch, and checkpoint reads see it."""
    from deepshard.zero.offload.states import StatesSpec
    from deepshard.zero.offload.subgroup_states import SubGroupStates
    from deepshard.zero.partition import FlatLayout

    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s)) for s in ((5, 7), (19,), (3, 3))]
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    layout = FlatLayout(mine, [f"p{i}" for i in range(3)], 10**6, 1, 0)
    params = MappedFileBacking(AsyncSwapper(tmp_path, 0, AIO))
    params.create("params", torch.float32, layout.shard_numel)
    params.write("params", 0, torch.cat([p.detach().reshape(-1) for p in mine]))
    spec = StatesSpec(layout.fragments, layout.shard_numel, torch.device("cpu"), False, None, 0,
                      (params, "params"))
    states = SubGroupStates(spec, MappedFileBacking(AsyncSwapper(tmp_path, 0, AIO)), buffer_count=6, pin=False,
                            sub_group_size=16)
    assert states.has_masters and states.masters_in_params and not states.backing.has("master")
    opt_ref = torch.optim.AdamW(ref, lr=0.01)
    opt = torch.optim.AdamW(states.params, lr=0.01)
    states.bind(opt)
    published: list[int] = []
    for _ in range(3):
        grads = [torch.randn(p.shape) for p in ref]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt_ref.step()
        flat_grad = torch.cat([g.reshape(-1) for g in grads])
        states.step([flat_grad[f.shard_start:f.shard_start + f.numel] for f in states.pieces], 1.0,
                    lambda start, v: published.append(start))
    expected = torch.cat([p.detach().reshape(-1) for p in ref])
    assert published == [] and torch.equal(params.read_copy("params", 0, layout.shard_numel), expected)
    assert torch.equal(torch.cat([states.piece_value(i) for i in range(len(states.pieces))]), expected)
    files = {p.name for p in states.backing.swapper.directory.iterdir() if p.suffix == ".swp"}
    assert files == {"state.exp_avg.swp", "state.exp_avg_sq.swp"}
    states.close()
    params.close()
