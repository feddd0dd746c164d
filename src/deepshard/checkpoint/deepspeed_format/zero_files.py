"""A Megatron-DeepSpeed folder's ZeRO optimizer-state files, mapped onto a (smaller) target layout
(DeepSpeed's ``ZeROCheckpoint``): which saved files each target rank reads, and their states merged."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from deepshard.checkpoint.deepspeed_format.constants import (BASE_OPTIMIZER_STATE, GROUP_PADDINGS,
                                                             OPTIMIZER_STATE_DICT, PARTITION_COUNT)
from deepshard.checkpoint.deepspeed_format.megatron_folder import (check_folder, get_model_3d_descriptor,
                                                                   get_zero_files, load_state, merge_state)
from deepshard.checkpoint.deepspeed_format.rank_maps import model_3d_desc

__all__ = ["ZeROCheckpoint"]


class ZeROCheckpoint:
    """The ZeRO files of tag folder ``dir``, saved at ``source_3d`` (read from the folder when not given);
    the target layout is the saved one until :meth:`reshape`."""

    def __init__(self, dir: str, source_3d: Optional[model_3d_desc] = None) -> None:  # noqa: A002
        check_folder(dir)
        self.dir = dir
        self.file_list = get_zero_files(dir)
        self.num_files = len(self.file_list)
        if not self.num_files:
            raise FileNotFoundError(f"no ZeRO optimizer-state files (*zero_pp_rank_*_optim_states.pt) in {dir}: "
                                    "pass a tag folder DeepSpeed saved with ZeRO")
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.target_3d = model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree)
        self._3d_file_map = self.src_3d.reshape(self.target_3d)

    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    def reshape(self, target_3d_desc: model_3d_desc) -> None:
        """Map the saved files onto ``target_3d_desc`` (no degree may grow)."""
        self._3d_file_map = self.src_3d.reshape(target_3d_desc)
        self.target_3d = target_3d_desc

    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[int]:
        if not 0 <= dp_index < len(self._3d_file_map):
            raise IndexError(f"dp_index {dp_index} is outside the target layout of DP degree {len(self._3d_file_map)}")
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        """The saved ZeRO files target rank ``(pp_index, tp_index, dp_index)`` reads, in merge order."""
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(self, pp_index: int, tp_index: int, dp_index: int, keys_to_ignore: Sequence[str] = (),
                           strip_tensor_paddings: bool = True) -> Any:
        """The states of the rank's files merged (tensors joined in file order); with
        ``strip_tensor_paddings``, each file's optimizer state cut to its unpadded length first, and the
        merged ``partition_count`` set to the target data-parallel degree."""
        merged = None
        for path in self.get_files_for_rank(pp_index, tp_index, dp_index):
            state = load_state(path)
            for key in keys_to_ignore:
                state.pop(key, None)
            if strip_tensor_paddings:
                _strip_paddings(state)
            merged = state if merged is None else merge_state(merged, state)
            optim = merged.get(OPTIMIZER_STATE_DICT) if isinstance(merged, dict) else None
            if isinstance(optim, dict) and optim.get(PARTITION_COUNT):
                optim[PARTITION_COUNT] = [self.target_3d.dp_degree] * len(optim[PARTITION_COUNT])
            if strip_tensor_paddings and isinstance(optim, dict) and optim.get(GROUP_PADDINGS):
                optim[GROUP_PADDINGS] = [0] * len(optim[GROUP_PADDINGS])
        return merged

    def print_3d_index_map(self, tag: Optional[str] = None) -> None:
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, dp_map in enumerate(self._3d_file_map):
            dp_map.print_data(f"dp = {dp_index}")

    def print_3d_file_map(self, tag: Optional[str] = None) -> None:
        if tag:
            print(f"3D file map: {tag}")
        for dp_index, dp_map in enumerate(self._3d_file_map):
            for pp_index in range(dp_map.pp_degree):
                for tp_index in range(dp_map.tp_degree):
                    print(f"{pp_index}, {tp_index}, {dp_index} => "
                          f"{self.get_files_for_rank(pp_index, tp_index, dp_index)}")


def _strip_paddings(state: Any) -> None:
    """Cut each group's optimizer-state tensors (not its ``step``) to the group's unpadded length: the last
    data-parallel rank's partition carries ``group_paddings[g]`` alignment elements."""
    optim = state.get(OPTIMIZER_STATE_DICT) if isinstance(state, dict) else None
    if not isinstance(optim, dict):
        return
    paddings = optim.get(GROUP_PADDINGS)
    groups = (optim.get(BASE_OPTIMIZER_STATE) or {}).get("state") if isinstance(optim.get(BASE_OPTIMIZER_STATE),
                                                                                 dict) else None
    if not paddings or not isinstance(groups, dict):
        return
    for key, group in groups.items():
        pad = paddings[key]
        if not pad:
            continue
        for name, value in group.items():
            if name != "step" and torch.is_tensor(value):
                group[name] = value.narrow(0, 0, value.numel() - pad).clone()
