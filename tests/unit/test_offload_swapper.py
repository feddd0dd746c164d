"""The offload building blocks without a process group: the async swapper (round trips, block size and
threads honoured, a full disk, clean-up), the buffer pool, sub-group planning, the policies built from a
config, and the sub-grouped optimizer against plain torch."""
from __future__ import annotations

import errno
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.config import load_config
from deepshard.zero.offload.backing import FileBacking, HostBacking
from deepshard.zero.offload.buffers import BufferPool
from deepshard.zero.offload.mapped import MappedFileBacking
from deepshard.zero.offload.policy import (AioSettings, CpuOffload, NoOffload, NvmeOffload,
                                           make_offload_policies)
from deepshard.zero.offload.states import StatesSpec
from deepshard.zero.offload.subgroup_states import SubGroupStates
from deepshard.zero.offload.subgroups import plan_subgroups, split_fragments
from deepshard.zero.offload.swapper import AsyncSwapper, CompletedOp, SwapError
from deepshard.zero.partition import FlatLayout, Fragment

AIO = AioSettings(block_size=64, queue_depth=2, thread_count=3)


# ------------------------------------------------------------------------------------------ swapper
def test_round_trip_at_offsets_in_several_dtypes(tmp_path: Path) -> None:
    sw = AsyncSwapper(tmp_path, rank=3, aio=AIO)
    assert sw.directory.parent == tmp_path and sw.directory.name.endswith("-rank3")
    a = torch.randn(1001)
    b = torch.randn(333).to(torch.bfloat16)
    sw.create("f", a.numel() * 4 + b.numel() * 2)
    ops = [sw.write("f", 0, a), sw.write("f", a.numel() * 4, b)]
    for op in ops:
        op.wait()
    got_a, got_b = torch.empty_like(a), torch.empty_like(b)
    sw.read("f", 0, got_a).wait()
    sw.read("f", a.numel() * 4, got_b).wait()
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
    assert sw.bytes_written == sw.bytes_read == a.numel() * 4 + b.numel() * 2
    assert (sw.directory / "f.swp").stat().st_size == sw.nbytes()
    sw.close()


def test_discard_drops_a_files_values_and_keeps_it_usable(tmp_path: Path) -> None:
    sw = AsyncSwapper(tmp_path, rank=0, aio=AIO)
    a = torch.randn(4096)
    sw.create("g", a.numel() * 4)
    sw.write("g", 0, a).wait()
    if not sw.discard("g"):
        pytest.skip("this file system cannot punch holes")
    got = torch.empty_like(a)
    sw.read("g", 0, got).wait()
    assert torch.equal(got, torch.zeros_like(a))  # the dead values are gone, not written back
    assert (sw.directory / "g.swp").stat().st_size == a.numel() * 4  # the file keeps its size
    sw.write("g", 0, -a).wait()  # and takes new values
    sw.read("g", 0, got).wait()
    assert torch.equal(got, -a)
    sw.close()


def test_block_size_and_threads_are_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    real = os.pwrite

    def spy(fd: int, data: Any, offset: int) -> int:
        calls.append((threading.current_thread().name, len(data)))
        time.sleep(0.002)  # slow I/O: every worker thread gets busy
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    sw = AsyncSwapper(tmp_path, 0, AIO)
    t = torch.arange(1000, dtype=torch.float32)  # 4000 bytes: 63 blocks of 64 over 3 threads
    sw.create("x", 4000)
    sw.write("x", 0, t).wait()
    assert max(n for _, n in calls) <= 64 and sum(n for _, n in calls) == 4000
    assert len({name for name, _ in calls}) == 3
    assert all(name.startswith("deepshard-aio") for name, _ in calls)
    sw.close()


def test_full_disk_at_write_is_a_clear_error_and_the_file_is_not_trusted(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    sw = AsyncSwapper(tmp_path, 0, AIO)
    sw.create("opt", 4096)

    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    op = sw.write("opt", 0, torch.zeros(1024))
    with pytest.raises(SwapError) as info:
        op.wait()
    msg = str(info.value)
    assert "no space left" in msg and str(sw.directory / "opt.swp") in msg
    assert "bytes" in msg and "free" in msg and "nvme_path" in msg
    with pytest.raises(SwapError, match="cannot be read"):  # never hand back bytes that were not written
        sw.read("opt", 0, torch.empty(1024))
    sw.close()
    assert not sw.directory.exists()


def test_full_disk_at_reservation_fails_before_anything_is_written(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    sw = AsyncSwapper(tmp_path, 0, AIO)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SwapError) as info:
        sw.create("master", 10 * 2**30)
    assert f"reserving {10 * 2**30} bytes" in str(info.value) and "free" in str(info.value)
    assert [p.name for p in sw.directory.iterdir()] == [".owner.lock"]  # the half-made file is gone
    sw.close()


def test_close_and_garbage_collection_remove_everything(tmp_path: Path) -> None:
    sw = AsyncSwapper(tmp_path, 0, AIO)
    sw.create("a", 100)
    sw.close()
    sw.close()  # twice is fine
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SwapError, match="closed"):
        sw.write("a", 0, torch.zeros(25))
    forgotten = AsyncSwapper(tmp_path, 1, AIO)
    forgotten.create("b", 100)
    forgotten.write("b", 0, torch.ones(25)).wait()
    del forgotten
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_unwritable_path_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SwapError, match="nvme_path"):
        AsyncSwapper(blocker / "sub", 0, AIO)


def test_queue_depth_bounds_outstanding_operations(tmp_path: Path) -> None:
    sw = AsyncSwapper(tmp_path, 0, AioSettings(block_size=4096, queue_depth=2, thread_count=1))
    sw.create("q", 40 * 4000)
    data = [torch.full((1000,), float(i)) for i in range(40)]
    ops = [sw.write("q", i * 4000, t) for i, t in enumerate(data)]
    sw.wait()
    assert all(op.done() for op in ops)
    assert sw._slots._value == 2  # every slot came back
    out = torch.empty(40 * 1000)
    sw.read("q", 0, out).wait()
    assert torch.equal(out, torch.cat(data))
    sw.close()


# -------------------------------------------------------------------------------------- buffer pool
def test_buffer_pool_bounds_blocks_and_grows_only_when_it_must() -> None:
    pool = BufferPool(3, 16)
    two = pool.acquire(2)
    assert two is not None and pool.allocated_bytes == 32
    assert pool.acquire(2, block=False) is None  # only one left
    op = _PendingOp()
    pool.release_after(two, [op])
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(3)))
    waiter.start()
    waiter.join(0.2)
    assert not got  # waits for the write to give its buffers back
    op.finish()
    waiter.join(5)
    assert got and len(got[0]) == 3 and pool.allocated_bytes == 48
    pool.release(got[0])
    assert len(pool.acquire(5)) == 5  # more than exist, none on the way back: grows rather than deadlocks
    assert pool.count == 5


class _PendingOp(CompletedOp):
    def __init__(self) -> None:
        super().__init__()
        self._event.clear()

    def finish(self) -> None:
        self._finish()


# ---------------------------------------------------------------------------------------- sub-groups
def test_fragments_are_cut_at_sub_group_boundaries() -> None:
    frags = [Fragment("a", 0, 0, 7, 0, 0), Fragment("b", 1, 3, 10, 20, 7), Fragment("c", 2, 0, 4, 40, 20)]
    pieces = split_fragments(frags, 5)
    got = [(p.name, p.start, p.numel, p.flat_start, p.shard_start) for p in pieces]
    assert got == [("a", 0, 5, 0, 0), ("a", 5, 2, 5, 5), ("b", 3, 3, 20, 7), ("b", 6, 5, 23, 10),
                   ("b", 11, 2, 28, 15), ("c", 0, 4, 40, 20)]
    groups = plan_subgroups(pieces, 5)  # [17, 20) is padding: never read or written
    assert [(g.start, g.end, list(g.pieces)) for g in groups] == [
        (0, 5, [0]), (5, 10, [1, 2]), (10, 15, [3]), (15, 17, [4]), (20, 24, [5])]
    with pytest.raises(ValueError, match="sub_group_size"):
        split_fragments(frags, 0)


# ------------------------------------------------------------------------------------------ policies
def _policies(zero: dict[str, Any], aio: dict[str, Any] | None = None, kind: str = "cpu") -> tuple:
    cfg = load_config({"train_batch_size": 2, "zero_optimization": zero, **({"aio": aio} if aio else {})},
                      dp_world_size=1)
    return make_offload_policies(cfg.zero_optimization, cfg.aio, kind)


def test_policies_follow_deepspeed_keys_and_defaults(tmp_path: Path) -> None:
    opt, param = _policies({"stage": 3, "sub_group_size": 1000,
                            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 7}},
                           {"block_size": 4096, "queue_depth": 16, "thread_count": 4})
    assert opt == NvmeOffload(path=tmp_path, buffer_count=None, pin_memory=False, sub_group_size=1000,
                              aio=AioSettings(4096, 16, 4))
    assert isinstance(param, NvmeOffload) and param.buffer_count == 7 and param.buffer_size == 100_000_000
    assert param.max_in_cpu == 1_000_000_000
    opt, param = _policies({"stage": 2, "offload_optimizer": {"device": "cpu"},
                            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}})
    assert opt == CpuOffload(pin_memory=False, active=False) and not opt.moves_states  # a CPU run: no-op
    assert param == NoOffload()  # offload_param means nothing below stage 3
    opt, _ = _policies({"stage": 1, "offload_optimizer": {"device": "cpu"}}, kind="cuda")
    assert opt.moves_states and opt.pin_memory
    # (offload at stage 0 is refused by the plan check: tests/unit/test_plan.py)


# ------------------------------------------------------------------------ sub-grouped optimizer step
def _states(backing: Any, params: list[torch.nn.Parameter], mixed: bool) -> SubGroupStates:
    layout = FlatLayout(params, [f"p{i}" for i in range(len(params))], 10**6, 1, 0)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    spec = StatesSpec(layout.fragments, layout.shard_numel, torch.device("cpu"), mixed,
                      None if mixed else (lambda f: flat[f.flat_start:f.flat_start + f.numel]), 0)
    states = SubGroupStates(spec, backing, buffer_count=6, pin=False, sub_group_size=16)
    states.write_masters(0, flat)
    states.flush()
    return states


@pytest.mark.parametrize("backing", ["file", "mapped", "host"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_sub_grouped_step_equals_one_plain_step(tmp_path: Path, backing: str, kind: str) -> None:
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s)) for s in ((5, 7), (19,), (3, 3))]
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]

    def make(ps: list, **kernel: bool) -> torch.optim.Optimizer:
        if kind == "sgd":
            return torch.optim.SGD([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.3}], lr=0.1, momentum=0.9)
        return torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], lr=0.01, **kernel)

    # the offloaded states step a default AdamW with torch's fused CPU kernel (deepshard.optim.kernels)
    opt_ref = make(ref) if kind == "sgd" else make(ref, fused=True)
    back = {"file": lambda: FileBacking(AsyncSwapper(tmp_path, 0, AIO)), "host": lambda: HostBacking(False),
            "mapped": lambda: MappedFileBacking(AsyncSwapper(tmp_path, 0, AIO))}[backing]()
    states = _states(back, mine, mixed=True)
    opt = make(mine)
    index = {id(q): i for i, q in enumerate(mine)}
    for group in opt.param_groups:  # what ZeRO's _swap_into does: the pieces replace the parameters
        group["params"] = [states.params[j] for p in group["params"] for j, piece in enumerate(states.pieces)
                           if piece.name == f"p{index[id(p)]}"]
    states.bind(opt)
    assert all(g.get("fused") is (True if kind == "adamw" else None) for g in opt.param_groups)
    assert len(states.subgroups) == 4  # 63 elements in sub-groups of 16
    published = torch.zeros(states.shard_numel)
    for step in range(3):
        grads = [torch.randn(p.shape) for p in ref]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt_ref.step()
        flat_grad = torch.cat([g.reshape(-1) for g in grads])
        piece_grads = [flat_grad[p.shard_start:p.shard_start + p.numel] for p in states.pieces]
        states.step(piece_grads, 1.0, lambda start, v: published[start:start + v.numel()].copy_(v))
        for g_ref, g in zip(opt_ref.param_groups, opt.param_groups):
            g_ref["lr"] *= 0.5  # a scheduler: acts through the user's param groups
            g["lr"] *= 0.5
    # the fused kernel's vector lanes and scalar tail round differently: cut into sub-groups, its results
    # match one plain step to the last place or two, the loop kernel's (SGD) bit for bit
    same = torch.equal if kind == "sgd" else (lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=0))
    assert same(published, torch.cat([p.detach().reshape(-1) for p in ref]))
    key = "exp_avg_sq" if kind == "adamw" else "momentum_buffer"
    state = torch.cat([states.piece_state(i)[key] for i in range(len(states.pieces))])
    assert same(state, torch.cat([opt_ref.state[p][key].reshape(-1) for p in ref]))
    assert all(len(g["params"]) > 0 for g in opt.param_groups)  # restored after each step
    if backing != "file":  # used in place: no staging buffer was ever allocated
        assert states.pool.allocated_bytes == 0
    states.close()
    assert list(tmp_path.iterdir()) == []


_OWNER = """
import os, signal, sys, time
from deepshard.zero.offload.swapper import AsyncSwapper
swapper = AsyncSwapper(sys.argv[1], rank=0)
swapper.create("state", 1 << 16)
print(swapper.directory, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def _start_owner(root: Path, how: str) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(root), how], stdout=subprocess.PIPE, text=True,
                            env=env)
    directory = Path(proc.stdout.readline().strip())  # type: ignore[union-attr]
    assert directory.is_dir()
    return proc, directory


def test_swap_files_of_a_killed_process_are_reclaimed_by_the_next_swapper(tmp_path: Path) -> None:
    from deepshard.zero.offload import reclaim

    proc, dead = _start_owner(tmp_path, "kill")
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert (dead / "state.swp").stat().st_size == 1 << 16  # left behind: the process could not clean up
    live = AsyncSwapper(tmp_path / "live", rank=1)          # a live run in a sibling path is never touched
    os.utime(dead / reclaim.LOCK_NAME, (time.time() - 60, time.time() - 60))
    fresh = AsyncSwapper(tmp_path, rank=0)
    assert fresh.reclaimed == [dead] and not dead.exists()
    again = AsyncSwapper(tmp_path, rank=1)                  # the live one's lock is held: kept
    assert fresh.directory.exists() and again.reclaimed == [] and live.directory.exists()
    for s in (live, fresh, again):
        s.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live"]


def test_a_rank_stopped_with_sigterm_removes_its_swap_files(tmp_path: Path) -> None:
    proc, directory = _start_owner(tmp_path, "sleep")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not directory.exists()
