"""Each rank reads and verifies only the checkpoint files it loads (issue: every rank used to hash every
file of the checkpoint, N x the checkpoint's size at N ranks), and under ZeRO 1-3 only the tensor file of
its own partition (every rank used to read its whole stage's state to take 1/N of it)."""
from __future__ import annotations

from typing import Any

import pytest

from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_checkpoint_reads import checkpoint_reads

SHARED = {"manifest.json", "engine.json", "engine.safetensors"}
WORLD = 4  # pp=2 x dp=2 for the pipeline; dp=4 for the data-parallel run


@pytest.fixture(scope="module")
def reads(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return run_world(checkpoint_reads, WORLD, str(tmp_path_factory.mktemp("reads")), timeout=300)


def _stage_files(result: dict[str, Any], stage: int, dp: int) -> set[str]:
    ranks = range(stage * dp, (stage + 1) * dp)
    names = {f"zero_rank{r}.{ext}" for r in ranks for ext in ("json", "safetensors")}
    return names | {"module_extra.safetensors" if r == 0 else f"module_extra_rank{r}.safetensors" for r in ranks}


def test_a_pipeline_stage_reads_only_its_own_stage_files_each_once(reads: list[dict[str, Any]]) -> None:
    dp = WORLD // 2
    totals = []
    for rank, result in enumerate(reads):
        pipe = result["pipeline"]
        assert pipe["same"] is True
        got, sizes = pipe["reads"], pipe["sizes"]
        own = _stage_files(pipe, pipe["stage"], dp) | SHARED | {f"rng_rank{rank}.safetensors"}
        assert set(got) <= own, f"rank {rank} read {sorted(set(got) - own)} of another stage or rank"
        tensors = {name for name in got if name.startswith("zero_rank") and name.endswith(".safetensors")}
        assert tensors == {f"zero_rank{rank}.safetensors"}, f"rank {rank} read the tensor files {sorted(tensors)}"
        stage_first = pipe["stage"] * dp  # its stage's first data-parallel rank holds the optimizer's groups
        jsons = {name for name in got if name.endswith(".json") and name.startswith("zero_rank")}
        assert jsons <= {f"zero_rank{rank}.json", f"zero_rank{stage_first}.json"}, f"rank {rank} read {sorted(jsons)}"
        for name, n in got.items():  # read once, whole (verified as read): never twice, never another file
            assert n == sizes[name], f"rank {rank} read {n} bytes of {name} ({sizes[name]} bytes)"
        totals.append(sum(n for name, n in got.items() if name not in SHARED))
    whole = sum(n for name, n in reads[0]["pipeline"]["sizes"].items() if name not in SHARED)
    for rank, total in enumerate(totals):  # about its share: a quarter of the per-rank files, not its stage's half
        assert total <= 0.35 * whole, f"rank {rank} read {total} of {whole} per-rank bytes"


@pytest.mark.parametrize("key", ["dp", "dp3"])  # ZeRO-2, ZeRO-3
def test_a_data_parallel_rank_reads_no_other_ranks_rng_and_each_file_once(reads: list[dict[str, Any]], key: str) -> None:
    for rank, result in enumerate(reads):
        dp = result[key]
        assert dp["same"] is True
        got, sizes = dp["reads"], dp["sizes"]
        rngs = {name for name in got if name.startswith("rng_rank")}
        assert rngs == {f"rng_rank{rank}.safetensors"}
        tensors = {name for name in got if name.startswith("zero_rank") and name.endswith(".safetensors")}
        assert tensors == {f"zero_rank{rank}.safetensors"}, f"rank {rank} read the tensor files {sorted(tensors)}"
        state = sum(n for name, n in sizes.items() if name in _tensor_files(sizes))
        read = sum(n for name, n in got.items() if name in _tensor_files(sizes))
        assert read <= 0.35 * state, f"rank {rank} read {read} bytes of zero_rank tensors; the state is {state} bytes"
        jsons = {name for name in got if name.startswith("zero_rank") and name.endswith(".json")}
        assert jsons <= {f"zero_rank{rank}.json", "zero_rank0.json"}, f"rank {rank} read {sorted(jsons)}"

        for name, n in got.items():
            assert n == sizes[name], f"rank {rank} read {n} bytes of {name} ({sizes[name]} bytes)"


def _tensor_files(sizes: dict[str, int]) -> set[str]:
    return {name for name in sizes if name.startswith("zero_rank") and name.endswith(".safetensors")}


def _deepspeed_partitions_of(share: dict[str, list[tuple[int, int]]], numels: list[tuple[str, int]], stage: int,
                             world: int) -> set[int]:
    """The data-parallel ranks whose DeepSpeed optimizer file holds part of ``share``, from DeepSpeed's layout:
    ZeRO-3 cuts each parameter in ``ceil(n / N)`` pieces; ZeRO 1-2 cut the parameters laid end to end in model
    order, padded to a multiple of ``2 N``, in N equal partitions."""
    size = -(-sum(n for _, n in numels) // (2 * world)) * 2
    out, offset = set(), 0
    for name, n in numels:
        piece = -(-n // world)
        for r in range(world):
            lo, hi = (r * piece, (r + 1) * piece) if stage == 3 else (r * size - offset, (r + 1) * size - offset)
            if any(a < min(hi, n) and max(lo, 0) < b for a, b in share.get(name, [(0, n)])):
                out.add(r)
        offset += n
    return out


@pytest.mark.parametrize("key,stage", [("dp", 2), ("dp3", 3)])
def test_a_deepspeed_tag_rank_reads_only_the_optimizer_files_of_its_share(reads: list[dict[str, Any]], key: str,
                                                                        stage: int) -> None:
    """The same state written in DeepSpeed's layout (one optimizer file per data-parallel rank): each rank reads
    the optimizer files holding its share and the model-states file(s) (metadata, buffers, ZeRO-3's frozen
    pieces), each once. deepshard partitions differently (ZeRO-2: a 1/N range of its flat order, gradient order;
    ZeRO-3: 1/N of each module's parameters laid end to end), so a share meets a few of DeepSpeed's
    partitions (model order; ZeRO-3: every parameter cut on its own): those files only. Under ZeRO-2 that is
    2-3 of the 4 files here. Under ZeRO-3 a rank's share of a module's parameters meets every file holding a
    piece of one of them, and DeepSpeed cuts even a bias N ways: on this tiny model every share meets all
    four files (reading only the bytes of a share within a file is not done yet)."""
    files = 0
    for rank, result in enumerate(reads):
        ds = result[key]["deepspeed"]
        assert ds["same"] is True, f"rank {rank}: the state loaded from the DeepSpeed tag differs from the saver's"
        got, sizes = ds["reads"], ds["sizes"]
        optim = {name for name in got if name.endswith("optim_states.pt")}
        expected = {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                    for r in _deepspeed_partitions_of(ds["share"], ds["numels"], stage, WORLD)}
        assert optim == expected, f"rank {rank} read {sorted(optim)}, holding its share: {sorted(expected)}"
        assert set(got) - optim <= {name for name in sizes if name.endswith("model_states.pt")}, sorted(got)
        for name, n in got.items():
            assert n == sizes[name], f"rank {rank} read {n} bytes of {name} ({sizes[name]} bytes)"
        files += len(optim)
    if stage < 3:
        assert files < WORLD * WORLD, "every rank read every optimizer file"
