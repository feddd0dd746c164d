"""``deepspeed.checkpoint.utils``: helpers Accelerate calls when it saves a model's state dict, and the file
names of DeepSpeed's checkpoint layout (:mod:`deepshard.checkpoint.deepspeed_format.names`)."""
from __future__ import annotations

from typing import Any

import torch

from deepshard.checkpoint.deepspeed_format.names import (get_layer_ckpt_name_for_rank, get_model_ckpt_name_for_rank,
                                                         get_zero_ckpt_name_for_rank)


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """A copy of ``item`` (tensors, nested in dicts / lists / tuples) whose tensors are fresh, compact
    copies on ``device``, so saving one does not write the whole storage a view points into."""
    if torch.is_tensor(item):
        return item.detach().to(device).clone()
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item


__all__ = ["clone_tensors_for_torch_save", "get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank",
           "get_zero_ckpt_name_for_rank"]
