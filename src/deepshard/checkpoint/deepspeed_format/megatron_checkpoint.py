"""DeepSpeed's ``DeepSpeedCheckpoint``: the reader of a Megatron-DeepSpeed 3D tag folder that Megatron's
conversion tools drive (``deepspeed_to_megatron``, ``deepspeed_to_transformers``): the saved layout, the
files each rank of a smaller target layout reads, and the layer / ZeRO states merged for it.

Model-state files are read once, at construction, for their metadata (:func:`megatron_meta.slim_metadata`)
and the first file's global entries (``iteration``, ``args``, ``checkpoint_info``,
``universal_checkpoint_info``). Layer files ``layer_NN-model_XX-...`` are grouped by layer: the first is
the embedding, the last the final norm (``final_layer_norm_idx``), the rest the transformer layers, split
evenly over the target pipeline stages. Every file is read through the allowlist (``safe_load``).
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional

import torch

from deepshard.checkpoint.deepspeed_format.constants import (LAYER_FILE_PREFIX, MODEL_FILE_PREFIX, PARAM_SHAPES,
                                                             UNIVERSAL_CHECKPOINT_INFO)
from deepshard.checkpoint.deepspeed_format.megatron_folder import (check_folder, get_files, get_files_with_prefix,
                                                                   get_model_3d_descriptor_from_metadata,
                                                                   get_zero_files, load_state, merge_state)
from deepshard.checkpoint.deepspeed_format.megatron_meta import slim_metadata
from deepshard.checkpoint.deepspeed_format.rank_maps import (meg_2d_parallel_map, model_3d_desc, partition_data,
                                                             reshape_meg_2d_parallel)
from deepshard.checkpoint.deepspeed_format.zero_files import ZeROCheckpoint

__all__ = ["ARGS_KEY", "CHECKPOINT_INFO_KEY", "EMBEDDING_LAYER_INDEX", "FINAL_LAYER_NORM_INDEX", "ITERATION_KEY",
           "LAYER_CONCAT_DIM", "SEQUENTIAL_LAYERS", "DeepSpeedCheckpoint"]

ARGS_KEY = "args"  # the first model-state file's entries Megatron's tools read (get_args, ...)
CHECKPOINT_INFO_KEY = "checkpoint_info"
ITERATION_KEY = "iteration"
_LAYER_FILE = re.compile(r"layer_(\d+)-model_.*")
_GLOBAL_KEYS = (ARGS_KEY, CHECKPOINT_INFO_KEY, UNIVERSAL_CHECKPOINT_INFO)
EMBEDDING_LAYER_INDEX = 0  # the embedding is the first layer file, the final norm the last (the default)
FINAL_LAYER_NORM_INDEX = -1
# Megatron's tensor-parallel layers (these names are imported by Megatron-DeepSpeed's deepspeed_to_megatron):
# these are copies on every tensor-parallel rank (take one) ...
SEQUENTIAL_LAYERS = ["input_layernorm.weight", "input_layernorm.bias", "self_attention.dense.bias",
                     "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.dense_4h_to_h.bias",
                     "position_embeddings.weight"]
# ... these row-parallel weights are split along their input dimension; everything else along dim 0
LAYER_CONCAT_DIM = {"self_attention.dense.weight": 1, "mlp.dense_4h_to_h.weight": 1}


class DeepSpeedCheckpoint:
    """Tag folder ``dir`` read for the target layout ``tp_degree x pp_degree x dp_degree`` (each default: the
    saved degree; a degree may shrink, not grow)."""

    def __init__(self, dir: str, tp_degree: Optional[int] = None, pp_degree: Optional[int] = None,  # noqa: A002
                 dp_degree: Optional[int] = None, final_layer_norm_idx: int = FINAL_LAYER_NORM_INDEX) -> None:
        check_folder(dir)
        self.dir, self.final_layer_norm_idx = dir, final_layer_norm_idx
        self.file_list = get_files(dir)
        self.layer_files = sorted(p for p in self.file_list if _LAYER_FILE.fullmatch(os.path.basename(p)))
        self.mp_rank_files = get_files_with_prefix(self.file_list, MODEL_FILE_PREFIX)
        self._check_files()
        self.model_state_metadata, self.global_state = self._read_model_states()
        source = get_model_3d_descriptor_from_metadata(self.file_list, get_zero_files(dir), self.model_state_metadata)
        self.zero_checkpoint = ZeROCheckpoint(dir, source_3d=source)
        self.layer_keys = self._layer_keys()
        self.layer_count = len(self.layer_keys)
        self.tp_degree = source.tp_degree if tp_degree is None else int(tp_degree)
        self.pp_degree = source.pp_degree if pp_degree is None else int(pp_degree)
        self.dp_degree = source.dp_degree if dp_degree is None else int(dp_degree)
        self.original_world_size = source.world_size()
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        self.old_2d_map = meg_2d_parallel_map(source.pp_degree, source.tp_degree)
        self.old_2d_map.simple_init()
        self.new_2d_map = reshape_meg_2d_parallel(source.pp_degree, source.tp_degree, self.pp_degree, self.tp_degree)
        if self.is_change_pp_degree() or self.is_change_tp_degree() or self.is_change_dp_degree():
            self.zero_checkpoint.reshape(model_3d_desc(self.pp_degree, self.tp_degree, self.dp_degree))
        self._check_degrees()
        self.pp_to_transformer_map = self._pp_transformer_map()
        self.transformer_file_map = self._transformer_file_map()
        self.tp_to_embedding_map = self._tp_layer_map(EMBEDDING_LAYER_INDEX)
        self.tp_to_final_norm_map = self._tp_layer_map(self.final_layer_norm_idx)

    # ------------------------------------------------------------------ construction
    def _check_files(self) -> None:
        needed = [MODEL_FILE_PREFIX] + ([LAYER_FILE_PREFIX, f"{LAYER_FILE_PREFIX}01"] if self.layer_files else [])
        for prefix in needed:
            if not get_files_with_prefix(self.file_list, prefix):
                raise FileNotFoundError(f"{self.dir} is not a DeepSpeed checkpoint tag folder: it has no {prefix}* "
                                        "files (pass the folder of one tag, e.g. <save_dir>/global_step100)")

    def _read_model_states(self) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
        """Each model-state file read once: its slim metadata kept, and the first file's global entries."""
        metadata, global_state = [], {}
        for index, path in enumerate(self.mp_rank_files):
            state = load_state(path)
            metadata.append((path, slim_metadata(state)))
            if index == 0 and isinstance(state, dict):
                global_state[ITERATION_KEY] = state.get(ITERATION_KEY, 0)
                global_state.update({key: state.get(key) for key in _GLOBAL_KEYS})
            del state
        return metadata, global_state

    def _layer_keys(self) -> list[str]:
        ids = {_LAYER_FILE.fullmatch(os.path.basename(p)).group(1) for p in self.layer_files}  # type: ignore[union-attr]
        return [f"{LAYER_FILE_PREFIX}{i}" for i in sorted(ids, key=int)]

    def _check_degrees(self) -> None:
        n_zero = self.zero_checkpoint.num_files
        if len(self.mp_rank_files) % self.tp_degree or n_zero % (self.pp_degree * self.tp_degree):
            raise ValueError(f"{self.dir}: {len(self.mp_rank_files)} model-state and {n_zero} ZeRO files do not "
                             f"divide over tp={self.tp_degree}, pp={self.pp_degree}: pick target degrees that "
                             "divide the saved ones")

    def _tp_layer_map(self, layer_index: int) -> dict[int, list[str]]:
        if not self.layer_files:
            return {}
        files = get_files_with_prefix(self.layer_files, self.layer_keys[layer_index])
        return dict(enumerate(partition_data(files, self.tp_degree)))

    def _transformer_keys(self) -> list[str]:
        return self.layer_keys[1:self.final_layer_norm_idx]

    def _layers_per_stage(self) -> int:
        return max(1, len(self._transformer_keys()) // self.pp_degree) if self.pp_degree > 0 else 1

    def _pp_transformer_map(self) -> dict[int, list[str]]:
        keys, per = self._transformer_keys(), self._layers_per_stage()
        return {p: keys[p * per:(p + 1) * per] for p in range(self.pp_degree)}

    def _transformer_file_map(self) -> dict[tuple[int, int], list[list[str]]]:
        per, files = self._layers_per_stage(), {}
        for index, key in enumerate(self._transformer_keys()):
            runs = partition_data(get_files_with_prefix(self.layer_files, key + "-"), self.tp_degree)
            for tp_index in range(self.tp_degree):
                files.setdefault((tp_index, index // per), []).append(runs[tp_index])
        return files

    # ------------------------------------------------------------------ the layout
    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.zero_checkpoint.get_src_tp_degree()

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.zero_checkpoint.get_src_pp_degree()

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.zero_checkpoint.get_src_dp_degree()

    def _check_index(self, tp_index: int, pp_index: int) -> None:
        if not (0 <= tp_index < self.tp_degree and 0 <= pp_index < self.pp_degree):
            raise IndexError(f"(tp_index={tp_index}, pp_index={pp_index}) is outside the target layout "
                             f"tp={self.tp_degree}, pp={self.pp_degree}")

    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list[str]:
        """The saved model-state files target position ``(tp_index, pp_index)`` reads, in merge order."""
        self._check_index(tp_index, pp_index)
        return [self.mp_rank_files[i] for i in self.new_2d_map.get_data(pp_index=pp_index, tp_index=tp_index)]

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return self.zero_checkpoint.get_files_for_rank(pp_index=pp_index, tp_index=tp_index, dp_index=dp_index)

    def get_pp_transformer_map(self, pp_index: int) -> list[str]:
        self._check_index(0, pp_index)
        return self.pp_to_transformer_map[pp_index]

    def get_embedding_layer_id(self) -> str:
        return self.layer_keys[EMBEDDING_LAYER_INDEX]

    def get_final_norm_layer_id(self) -> str:
        return self.layer_keys[self.final_layer_norm_idx]

    def get_embedding_files(self, tp_index: int) -> list[str]:
        return self._layer_files_of(self.tp_to_embedding_map, tp_index, "embedding")

    def get_final_norm_files(self, tp_index: int) -> list[str]:
        return self._layer_files_of(self.tp_to_final_norm_map, tp_index, "final norm")

    @staticmethod
    def _layer_files_of(table: dict[int, list[str]], tp_index: int, what: str) -> list[str]:
        if tp_index not in table:
            raise IndexError(f"no {what} layer files for tp_index {tp_index} (tensor-parallel ranks: {sorted(table)})")
        return table[tp_index]

    # ------------------------------------------------------------------ states
    def _global(self, key: str) -> Any:
        if key not in self.global_state:
            state = load_state(self.mp_rank_files[0])
            self.global_state[key] = state.get(key) if isinstance(state, dict) else None
        return self.global_state[key]

    def get_iteration(self) -> Any:
        return self._global(ITERATION_KEY) or 0

    def get_args(self) -> Any:
        return self._global(ARGS_KEY)

    def get_checkpoint_info(self, info_key: str = CHECKPOINT_INFO_KEY) -> Any:
        """An entry of the first model-state file (``checkpoint_info`` by default)."""
        return self._global(info_key)

    def get_zero_checkpoint_state(self, pp_index: int, tp_index: int, dp_index: int,
                                  strip_tensor_paddings: bool = True) -> Any:
        return self.zero_checkpoint.get_state_for_rank(pp_index=pp_index, tp_index=tp_index, dp_index=dp_index,
                                                       keys_to_ignore=[PARAM_SHAPES],
                                                       strip_tensor_paddings=strip_tensor_paddings)

    def get_2d_parallel_state(self, tp_index: int, pp_index: int) -> Any:
        """The target position's model-state files merged (``merge_state``: tensors joined along dim 0)."""
        merged = None
        for path in self.get_2d_parallel_files(tp_index=tp_index, pp_index=pp_index):
            state = load_state(path)
            merged = state if merged is None else merge_state(merged, state)
        return merged

    def get_embedding_state(self, tp_index: int) -> dict[str, torch.Tensor]:
        return _merge_layer([load_state(p) for p in self.get_embedding_files(tp_index)])

    def get_final_norm_state(self, tp_index: int) -> dict[str, torch.Tensor]:
        return load_state(self.get_final_norm_files(tp_index)[0])

    def get_transformer_state(self, tp_index: int, pp_index: int) -> list[dict[str, torch.Tensor]]:
        """Each transformer layer of the target position, its saved tensor-parallel parts joined."""
        self._check_index(tp_index, pp_index)
        return [_merge_layer([load_state(p) for p in run])
                for run in self.transformer_file_map.get((tp_index, pp_index), [])]

    # ------------------------------------------------------------------ reports
    def validate_files(self) -> None:
        for path in self.file_list:
            if not os.path.isfile(path):
                print(f"Error: {path} is not existent")

    def show_2d_mapping(self) -> None:
        for p in range(self.pp_degree):
            for t in range(self.tp_degree):
                print(f"[{p}, {t}] = {self.get_2d_parallel_files(tp_index=t, pp_index=p)}")

    def show_tp_embedding_map(self) -> None:
        _dump(self.tp_to_embedding_map, "tp_to_embedding_layers")

    def show_tp_final_norm_map(self) -> None:
        _dump(self.tp_to_final_norm_map, "tp_to_final_norm_layers")

    def show_pp_transformer_map(self) -> None:
        _dump(self.pp_to_transformer_map, "pp_to_transformer_layers")

    def show_transformer_file_map(self) -> None:
        _dump(self.transformer_file_map, "rank_to_transformer_files")


def _merge_layer(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One Megatron layer from its tensor-parallel parts: replicated tensors taken once, row-parallel
    weights joined along dim 1, the rest along dim 0."""
    return {key: parts[0][key] if key in SEQUENTIAL_LAYERS else torch.cat([p[key] for p in parts],
                                                                            LAYER_CONCAT_DIM.get(key, 0))
            for key in parts[0]}


def _dump(table: dict[Any, Any], tag: str) -> None:
    print(f"Dump mapping: {tag}")
    for key, value in table.items():
        print(f"{key} = {value}")
