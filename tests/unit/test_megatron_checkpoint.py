"""deepshard's reader of Megatron-DeepSpeed 3D checkpoint folders (``deepspeed.checkpoint.DeepSpeedCheckpoint``
and its helpers), checked against references built here: the rank maps against the grid coordinates of
each saved file, the merged layer and ZeRO states against the whole tensors the test cut into files, and
every answer at several target layouts against the real DeepSpeed's reader of the same folder."""
from __future__ import annotations

import itertools
import json
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepshard.checkpoint import DeepSpeedCheckpoint, ZeROCheckpoint, get_model_3d_descriptor, model_3d_desc
from deepshard.checkpoint.deepspeed_format.megatron_meta import (aggregate_zero12_metadata,
                                                                 checkpoint_parallel_metadata)
from tests.deepspeed_compat.ds_support import run_in_deepspeed
from tests.deepspeed_compat.real import needs_deepspeed
from tests.unit.megatron_readout import readout


@pytest.mark.parametrize("target", [(1, 1, 1), (1, 2, 1), (2, 1, 2), (2, 2, 1), (1, 1, 2), (2, 2, 2)])
def test_rank_maps_follow_the_grid_coordinates(target: tuple[int, int, int]) -> None:
    """Saved ZeRO file ``i = dp * (pp*tp) + pp * tp_degree + tp``. A target position ``(p, t)`` takes the saved
    positions in its pipeline and tensor blocks (stage-major), each followed by its data-parallel copies; that
    run is cut into ``target dp`` consecutive pieces (DeepSpeed's order, which its own tests pin)."""
    src = (2, 2, 4)  # pp, tp, dp
    maps = model_3d_desc(*src).reshape(model_3d_desc(*target))
    assert len(maps) == target[2]
    for p, t in itertools.product(range(target[0]), range(target[1])):
        run = [dp * 4 + pp * 2 + tp for pp in range(2) for tp in range(2)
               if pp // (2 // target[0]) == p and tp // (2 // target[1]) == t for dp in range(4)]
        size = len(run) // target[2]
        for d in range(target[2]):
            assert maps[d].get_data(p, t) == run[d * size:(d + 1) * size]
    ok, why = model_3d_desc(*target).can_reshape(model_3d_desc(*src))
    assert ok == (target == src) or (not ok and all("Expansion reshape not supported" in w for w in why))
    with pytest.raises(ValueError, match="cannot reshape"):
        model_3d_desc(1, 1, 1).reshape(model_3d_desc(2, 1, 1))


def _layer_state(full: dict[str, torch.Tensor], tp: int, tp_degree: int) -> dict[str, torch.Tensor]:
    """Megatron's cut of a layer for one tensor-parallel rank: row-parallel weights along dim 1,
    layer norms replicated, the rest along dim 0."""
    out = {}
    for key, value in full.items():
        if key == "input_layernorm.weight":
            out[key] = value.clone()
        else:
            out[key] = value.chunk(tp_degree, dim=1 if key == "self_attention.dense.weight" else 0)[tp].clone()
    return out


def _write_folder(tmp_path: Path, pp: int, tp: int, dp: int, layers: int, step: bool = True) -> dict[str, object]:
    """A Megatron-DeepSpeed tag folder: embedding, ``layers`` transformer layers, final norm; ZeRO files
    holding each rank's flat Adam state with the last rank's padding (and Adam's 0-d ``step``, with ``step``)."""
    torch.manual_seed(0)
    full = {"embedding": {"word_embeddings.weight": torch.randn(8, 4)}, "final": {"weight": torch.randn(4)},
            "layers": [{"self_attention.dense.weight": torch.randn(4, 6), "mlp.dense_h_to_4h.weight": torch.randn(6, 4),
                        "input_layernorm.weight": torch.randn(4)} for _ in range(layers)]}
    files = [("01", full["embedding"])] + [(f"{i + 2:02d}", lay) for i, lay in enumerate(full["layers"])]
    files.append((f"{layers + 3:02d}", full["final"]))
    for layer_id, state in files:
        for t in range(tp):
            part = _layer_state(state, t, tp) if state is not full["final"] else {"weight": state["weight"].clone()}
            if state is full["embedding"]:
                part = {"word_embeddings.weight": state["word_embeddings.weight"].chunk(tp)[t].clone()}
            torch.save(part, tmp_path / f"layer_{layer_id}-model_{t:02d}-model_states.pt")
    dims = {"pp_degree": pp, "tp_degree": tp}
    for mp in range(pp * tp):
        torch.save({"checkpoint_parallel_dimensions": dims, "param_shapes": [{"w": torch.Size([5])}],
                    "iteration": 7, "checkpoint_info": {"mp": mp}, "ds_config": {},
                    "args": Namespace(num_layers=layers, params_dtype=torch.bfloat16)},
                   tmp_path / f"mp_rank_{mp:02d}_model_states.pt")
    moments = torch.arange(float(dp * 3 * pp * tp)).reshape(pp * tp, dp * 3)  # per model-parallel slot
    for d, mp in itertools.product(range(dp), range(pp * tp)):
        pad = 1 if d == dp - 1 else 0
        piece = torch.cat([moments[mp, d * 3:(d + 1) * 3], torch.zeros(pad)])
        moments_of_rank = {"exp_avg": piece, **({"step": torch.tensor(3.0)} if step else {})}
        osd = {"base_optimizer_state": {"state": {0: moments_of_rank}},
               "group_paddings": [pad], "partition_count": [dp]}
        torch.save({"optimizer_state_dict": osd, "param_shapes": []},
                   tmp_path / f"bf16_zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt")
    return {"full": full, "moments": moments}


def test_reader_merges_layers_and_zero_states_to_a_smaller_layout(tmp_path: Path) -> None:
    ref = _write_folder(tmp_path, pp=2, tp=2, dp=2, layers=4)
    assert (get_model_3d_descriptor(str(tmp_path)).pp_degree, ZeROCheckpoint(str(tmp_path)).get_src_dp_degree()) == (2, 2)
    ckpt = DeepSpeedCheckpoint(str(tmp_path), tp_degree=1, pp_degree=1, dp_degree=1)
    assert (ckpt.original_world_size, ckpt.world_size, ckpt.layer_count) == (8, 1, 6)
    assert ckpt.get_iteration() == 7 and ckpt.get_checkpoint_info() == {"mp": 0}
    assert ckpt.get_args() == Namespace(num_layers=4, params_dtype=torch.bfloat16)  # Megatron's args, as saved
    full = ref["full"]
    for got, want in zip(ckpt.get_transformer_state(tp_index=0, pp_index=0), full["layers"]):  # type: ignore[index]
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key])
    torch.testing.assert_close(ckpt.get_embedding_state(0)["word_embeddings.weight"],
                               full["embedding"]["word_embeddings.weight"])  # type: ignore[index]
    torch.testing.assert_close(ckpt.get_final_norm_state(0)["weight"], full["final"]["weight"])  # type: ignore[index]
    # the one target rank reads every ZeRO file: per model-parallel slot, both dp pieces, padding cut
    state = ckpt.get_zero_checkpoint_state(pp_index=0, tp_index=0, dp_index=0)
    moments = ref["moments"]
    expected = torch.cat([moments[mp, d * 3:(d + 1) * 3] for mp in range(4) for d in range(2)])  # type: ignore[index]
    osd = state["optimizer_state_dict"]
    torch.testing.assert_close(osd["base_optimizer_state"]["state"][0]["exp_avg"], expected)
    assert osd["partition_count"] == [1] and osd["group_paddings"] == [0]
    # two stages kept: each reads its own layers, and the files of its own stage
    staged = DeepSpeedCheckpoint(str(tmp_path), tp_degree=1, pp_degree=2, dp_degree=2)
    assert staged.get_pp_transformer_map(1) == ["layer_04", "layer_05"]
    assert [Path(f).name for f in staged.get_2d_parallel_files(tp_index=0, pp_index=1)] == [
        "mp_rank_02_model_states.pt", "mp_rank_03_model_states.pt"]
    with pytest.raises(ValueError, match="a degree can shrink"):
        DeepSpeedCheckpoint(str(tmp_path), tp_degree=4)


def test_metadata_checks_and_recorded_dimensions(tmp_path: Path) -> None:
    good = {"param_shapes": {"w": (2,)}, "ds_autoep_layers": None, "ds_config": {}}
    assert aggregate_zero12_metadata([("a", good), ("b", good)]) == ([{"w": (2,)}, {"w": (2,)}], None, False)
    for bad, why in [({**good, "ds_autoep_layers": "dict"}, "must be a list"),
                     ({**good, "ds_autoep_layers": [{"num_experts": 2}]}, "non-empty string"),
                     ({**good, "ds_config": {"use_data_before_expert_parallelism": True}}, "disagrees")]:
        with pytest.raises(RuntimeError, match=why):
            aggregate_zero12_metadata([("a", good), ("b", bad)])
    megatron = SimpleNamespace(get_pipeline_model_parallel_world_size=lambda: 4,
                               get_tensor_model_parallel_world_size=lambda: 2)
    deepspeed_grid = SimpleNamespace(get_pipe_parallel_world_size=lambda: 3, get_slice_parallel_world_size=lambda: 5)
    assert checkpoint_parallel_metadata(megatron)["checkpoint_parallel_dimensions"] == {"pp_degree": 4, "tp_degree": 2}
    assert checkpoint_parallel_metadata(deepspeed_grid)["checkpoint_parallel_dimensions"] == {"pp_degree": 3,
                                                                                                "tp_degree": 5}
    assert checkpoint_parallel_metadata(None)["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": 1}
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DeepSpeedCheckpoint(str(tmp_path / "nowhere"))
    torch.save({}, tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(FileNotFoundError, match="no mp_rank_"):
        DeepSpeedCheckpoint(str(tmp_path))


@needs_deepspeed
def test_reader_answers_as_deepspeeds(tmp_path: Path) -> None:
    """The same folder read by DeepSpeed 0.19.8's ``DeepSpeedCheckpoint`` and by deepshard's, at five target
    layouts: the same files per target rank, the same merged layer and ZeRO states. Adam's 0-d ``step`` is left
    out of the files: DeepSpeed's ``merge_state`` cannot join 0-d tensors (it raises), deepshard keeps the
    first (tested above)."""
    _write_folder(tmp_path, pp=2, tp=2, dp=2, layers=4, step=False)
    out = run_in_deepspeed(["-m", "tests.unit.megatron_readout", str(tmp_path)], "DeepSpeedCheckpoint readout")
    theirs = json.loads(out.split("=====\n", 1)[1].splitlines()[0])
    ours = json.loads(json.dumps(readout(DeepSpeedCheckpoint, str(tmp_path)), sort_keys=True))
    assert set(ours) == set(theirs) and len(ours) == 5
    for target in ours:
        assert ours[target] == theirs[target], target
