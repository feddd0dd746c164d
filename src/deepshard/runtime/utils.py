"""``deepspeed.runtime.utils`` names that training scripts import."""
from __future__ import annotations

from typing import Any, Callable, Optional


def move_to_device(item: Any, device: Any, criterion_func: Optional[Callable[[Any], bool]] = None) -> Any:
    """``item`` (a tensor, or lists, tuples and dicts of them, nested) on ``device``.

    With ``criterion_func``, an item it accepts is moved in place (its ``.data`` replaced) and returned;
    anything else goes through the containers; a leaf without ``.to`` (an int, a string) is returned as it is
    (DeepSpeed raises AttributeError there)."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if hasattr(item, "to") else item
