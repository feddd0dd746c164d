"""``deepspeed.checkpoint.ds_to_universal``: of DeepSpeed's universal-checkpoint converter, the check of a
Megatron-DeepSpeed folder's model-state metadata that code reading such folders calls
(:func:`deepshard.checkpoint.deepspeed_format.megatron_meta.aggregate_zero12_metadata`). The conversion
itself is not provided: deepshard's own checkpoints load at another data / tensor / pipeline layout
without one, and ``deepshard convert`` reads DeepSpeed's folders (docs/checkpoints.md)."""
from __future__ import annotations

from typing import Any

from deepshard.checkpoint.deepspeed_format.megatron_meta import aggregate_zero12_metadata

_aggregate_autoep_zero12_metadata = aggregate_zero12_metadata  # DeepSpeed's name for it

__all__ = ["aggregate_zero12_metadata"]


def __getattr__(name: str) -> Any:
    """The converter's other names: an AttributeError that says why and what to use."""
    from deepshard.compat.aliases import missing_attribute

    raise missing_attribute(__name__, name)


if __name__ == "__main__":
    raise SystemExit("deepshard does not convert checkpoints to DeepSpeed's universal format: its own checkpoints "
                     "load at any data / tensor / pipeline layout directly, and `deepshard convert` turns a DeepSpeed "
                     "folder into one; use the real DeepSpeed for a universal checkpoint")
