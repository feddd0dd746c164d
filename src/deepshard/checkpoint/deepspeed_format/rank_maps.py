"""Which saved ranks' files each rank of a smaller layout reads (DeepSpeed's ``model_3d_desc`` and
``meg_2d_parallel_map``, as Megatron-DeepSpeed's checkpoint tools call them).

A Megatron-DeepSpeed checkpoint numbers its model-parallel files ``i = pp * tp_degree + tp`` and its ZeRO
files ``i + dp * (pp_degree * tp_degree)``. Shrinking a layout merges neighbours: tensor-parallel ranks of
one stage are cut into ``new_tp`` consecutive runs, then each tensor-parallel column's stages into ``new_pp``
consecutive runs, then every entry is widened over the saved data-parallel copies and those are cut into
``new_dp`` consecutive runs. A map answers ``get_data(pp_index, tp_index)``: the saved indices, in order.
Growing a degree is not possible this way (``can_reshape`` says why).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["meg_2d_parallel_map", "model_3d_desc", "partition_data", "reshape_meg_2d_parallel"]


def partition_data(data_list: Sequence[Any], num_partitions: int) -> list[list[Any]]:
    """``data_list`` cut into ``num_partitions`` consecutive runs of equal length."""
    if num_partitions < 1 or len(data_list) % num_partitions:
        raise ValueError(f"cannot cut {len(data_list)} items into {num_partitions} equal runs: the target degree "
                         "must divide the saved one")
    size = len(data_list) // num_partitions
    return [list(data_list[i:i + size]) for i in range(0, len(data_list), size)]


class meg_2d_parallel_map:  # noqa: N801 - DeepSpeed's name
    """Saved file indices per ``(pp_index, tp_index)`` of a pipeline x tensor-parallel layout."""

    def __init__(self, pp_degree: int, tp_degree: int) -> None:
        self.pp_degree = int(pp_degree)
        self.tp_degree = int(tp_degree)
        self.map: dict[str, list[int]] = {}

    def simple_init(self) -> None:
        """Every position holds its own file: ``(pp, tp) -> [pp * tp_degree + tp]``."""
        self.map = {self._make_key(p, t): [p * self.tp_degree + t]
                    for p in range(self.pp_degree) for t in range(self.tp_degree)}

    def add_data(self, pp_index: int, tp_index: int, data: list[int]) -> None:
        """Append ``data`` (a list of saved indices) to position ``(pp_index, tp_index)``."""
        self._validate_indices(pp_index, tp_index)
        if not isinstance(data, list):
            raise TypeError(f"add_data takes a list of file indices, got {type(data).__name__}")
        self.map.setdefault(self._make_key(pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index: Optional[int] = None, tp_index: Optional[int] = None) -> list[int]:
        """The indices of one position; ``None`` for an index: every stage / tensor rank, in order."""
        self._validate_indices(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [i for p in pps for t in tps for i in self.map.get(self._make_key(p, t), [])]

    def print_data(self, tag: str) -> None:
        print(tag)
        for key, value in self.map.items():
            print(f"{key} = {value}")

    def _validate_indices(self, pp_index: Optional[int], tp_index: Optional[int]) -> None:
        for index, degree, dim in ((pp_index, self.pp_degree, "pp"), (tp_index, self.tp_degree, "tp")):
            if index is not None and not 0 <= index < degree:
                raise IndexError(f"{dim}_index {index} is outside a layout of {dim} degree {degree}")

    @staticmethod
    def _make_key(pp_index: int, tp_index: int) -> str:
        return f"{pp_index},{tp_index}"


def reshape_meg_2d_parallel(old_pp_degree: int, old_tp_degree: int, new_pp_degree: int, new_tp_degree: int,
                            verbose: bool = False) -> meg_2d_parallel_map:
    """The saved ``old_pp x old_tp`` files each position of a ``new_pp x new_tp`` layout reads."""
    if new_pp_degree > old_pp_degree or new_tp_degree > old_tp_degree:
        raise ValueError(f"cannot reshape pp={old_pp_degree}, tp={old_tp_degree} to pp={new_pp_degree}, "
                         f"tp={new_tp_degree}: a degree can shrink (merging files), not grow")
    current = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    current.simple_init()
    if new_tp_degree != old_tp_degree:
        merged = meg_2d_parallel_map(old_pp_degree, new_tp_degree)
        for p in range(old_pp_degree):
            for t, run in enumerate(partition_data(current.get_data(pp_index=p), new_tp_degree)):
                merged.add_data(p, t, run)
        current = merged
    if new_pp_degree != old_pp_degree:
        merged = meg_2d_parallel_map(new_pp_degree, current.tp_degree)
        for t in range(current.tp_degree):
            for p, run in enumerate(partition_data(current.get_data(tp_index=t), new_pp_degree)):
                merged.add_data(p, t, run)
        current = merged
    if verbose:
        current.print_data("reshaped 2d map:")
    return current


class model_3d_desc:  # noqa: N801 - DeepSpeed's name
    """A pipeline x tensor x data-parallel layout (degrees), and how a saved one maps onto a smaller one."""

    def __init__(self, pp_degree: int = 1, tp_degree: int = 1, dp_degree: int = 1) -> None:
        self.pp_degree = int(pp_degree)
        self.tp_degree = int(tp_degree)
        self.dp_degree = int(dp_degree)

    def reshape(self, target_3d_desc: "model_3d_desc", verbose: bool = False) -> list[meg_2d_parallel_map]:
        """One 2D map per target data-parallel index: the saved ZeRO file indices each target rank reads."""
        ok, errors = self.can_reshape(target_3d_desc)
        if not ok:
            raise ValueError(f"cannot reshape {self.get_desc()} to {target_3d_desc.get_desc()}: {'; '.join(errors)}")
        flat = reshape_meg_2d_parallel(self.pp_degree, self.tp_degree, target_3d_desc.pp_degree,
                                       target_3d_desc.tp_degree, verbose=verbose)
        size_2d = self.pp_degree * self.tp_degree
        maps = [meg_2d_parallel_map(flat.pp_degree, flat.tp_degree) for _ in range(target_3d_desc.dp_degree)]
        for p in range(flat.pp_degree):
            for t in range(flat.tp_degree):
                widened = [i + d * size_2d for i in flat.get_data(p, t) for d in range(self.dp_degree)]
                for dp_map, run in zip(maps, partition_data(widened, target_3d_desc.dp_degree)):
                    dp_map.add_data(p, t, run)
        return maps

    def get_desc(self) -> str:
        return f"PP,TP,DP = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def is_valid(self, pp_index: int, tp_index: int, dp_index: int) -> tuple[bool, list[str]]:
        """Whether the indices lie inside this layout, and what is wrong otherwise."""
        errors = [f"{dim} indexing error: index {index} >= degree {degree}"
                  for index, degree, dim in ((pp_index, self.pp_degree, "PP"), (tp_index, self.tp_degree, "TP"),
                                             (dp_index, self.dp_degree, "DP")) if index >= degree]
        return not errors, errors

    def can_reshape(self, target_3d_desc: "model_3d_desc") -> tuple[bool, list[str]]:
        """Whether this saved layout maps onto ``target_3d_desc`` (no degree may grow), and why not."""
        errors = [f"Expansion reshape not supported - {dim}: {mine} ---> {theirs}"
                  for dim, mine, theirs in (("PP", self.pp_degree, target_3d_desc.pp_degree),
                                            ("TP", self.tp_degree, target_3d_desc.tp_degree),
                                            ("DP", self.dp_degree, target_3d_desc.dp_degree)) if theirs > mine]
        return not errors, errors

    def __repr__(self) -> str:
        return f"model_3d_desc(pp_degree={self.pp_degree}, tp_degree={self.tp_degree}, dp_degree={self.dp_degree})"
