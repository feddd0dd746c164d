"""``deepspeed.runtime.zero.partition_parameters``: the stage-3 construction API under DeepSpeed's path.

``Init`` and ``GatheredParameters`` are deepshard's (:mod:`deepshard.zero`). DeepSpeed's ``Init`` also
wraps torch's tensor constructors to place and cast new tensors; deepshard's does not (it partitions each
module's parameters when the module's ``__init__`` returns), so the constructor hook that transformers
swaps (``zero_wrapper_for_fp_tensor_constructor``) is the identity here, and ``_orig_torch_arange`` is
torch's own ``arange``. ``ZeroParamStatus`` is the state ``param.ds_status`` reports
(:mod:`deepshard.zero.stage3.param_status`). ``CUDAQuantizer`` is ZeRO++'s weight quantizer
(:mod:`deepshard.compat.cuda_quantizer`).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from deepshard.accelerator import get_accelerator
from deepshard.compat.cuda_quantizer import CUDAQuantizer
from deepshard.zero import (GatheredParameters, Init, ZeroParamStatus, register_external_parameter,
                            unregister_external_parameter)
from deepshard.zero.stage3.init import single_rank_group_contradiction

_contradicting_single_rank_pg_error = single_rank_group_contradiction
"""DeepSpeed's private name of the check ``zero.Init`` makes before partitioning (a one-rank group under a
multi-process launch)."""

_orig_torch_arange = torch.arange

partitioned_param_data_shape = [0]
"""The shape of a ZeRO-3 parameter's ``.data`` while it is released (its values are in ``ds_tensor``)."""


class MultipleAllGatherHandles:
    """Several handles of ``param.all_gather(async_op=True)`` waited on as one, as DeepSpeed's class."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = list(handles)

    def wait(self, handle_dependency: bool = True) -> None:
        """Wait for every handle, passing ``handle_dependency`` on by keyword."""
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., Any], target_fp_dtype: torch.dtype | None = None,
                                           target_device: Any = None) -> Callable[..., Any]:
    """The constructor ``fn`` unchanged: deepshard's ``Init`` does not redirect tensor constructors."""
    return fn


__all__ = ["CUDAQuantizer", "GatheredParameters", "Init", "MultipleAllGatherHandles", "ZeroParamStatus", "get_accelerator", "register_external_parameter",
           "partitioned_param_data_shape", "unregister_external_parameter", "zero_wrapper_for_fp_tensor_constructor"]
