"""What a new user hits first, on 2 processes: zero.Init partitions classes first imported inside it,
bf16 keeps buffers' dtypes (unless data_types.buffer_dtype says otherwise) at every stage, and disk
offload with default sizes trains exactly like the in-memory run with a staging pool that is a fraction
of the shard."""
from __future__ import annotations

from typing import Any

import pytest

from tests.multiproc.harness import run_world
from tests.multiproc.models import rel_err
from tests.multiproc.scenarios_first_use import first_use

WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return run_world(first_use, WORLD, str(tmp_path_factory.mktemp("first_use")), timeout=240)


def test_zero_init_partitions_classes_imported_inside_the_context(results: list[dict[str, Any]]) -> None:
    for res in results:
        late = res["late_import"]
        assert late["shards"] == {"weight": ((301,), 151, 0), "proj.weight": ((5, 6), 15, 0),
                                  "proj.bias": ((5,), 3, 0)}
        assert late["weight_ok"] and late["after_whole"] and late["hook_removed"]


def test_bf16_keeps_buffer_dtypes_unless_configured(results: list[dict[str, Any]]) -> None:
    for res in results:
        for (stage, buffer_dtype), r in res["buffers"].items():
            want = "torch.bfloat16" if buffer_dtype else "torch.float32"
            assert r["dtypes"] == {"inv_freq": want, "count": "torch.int64"}, (stage, buffer_dtype)
            assert r["inv_freq_exact"] and r["count"] == 7, (stage, buffer_dtype)
            got, ref = r["forward"]
            assert got == ref, (stage, buffer_dtype, got, ref)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_default_offload_sizes_train_like_memory(results: list[dict[str, Any]], dtype: str) -> None:
    for res in results:
        r = res["default_offload"][dtype]
        (ref_losses, ref_weights), (losses, weights) = r["ref"], r["got"]
        # the offloaded AdamW steps with torch's fused CPU kernel, the in-memory one with its default loop:
        # the same update to a few units in the last place
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        assert all(rel_err(weights[n], v) <= 1e-6 for n, v in ref_weights.items())
        assert r["pool_count"] == 6 and r["subgroups"] == 1  # a tiny shard is one sub-group
        # only the buffers one sub-group needs are ever allocated: masters + 2 Adam states + its gradient
        assert 0 < r["offload_buffers"] <= 4 * 4 * r["shard_numel"]
