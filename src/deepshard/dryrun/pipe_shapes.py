"""What a pipeline stage receives from the stage before it, without that stage: the layers before this
stage run on the ``meta`` device (shapes and dtypes only, no memory) on a sample micro-batch's inputs.

A dry run of stage s > 0 has no stage s - 1 to send it activations; the fake world's mailbox answers
its receives from that stage with this header and zero payloads (``fake_world.Mailbox.expect``)."""
from __future__ import annotations

import copy
import itertools
from typing import Any, Iterator, Optional

import torch
from torch import nn

from deepshard.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from deepshard.pipe.p2p import HEADER_LEN, encode_header


def _to_meta(value: Any) -> Any:
    if torch.is_tensor(value):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _meta_layer(entry: Any, tied: dict[str, nn.Module]) -> Any:
    if isinstance(entry, TiedLayerSpec):
        if entry.key not in tied:
            with torch.device("meta"):
                tied[entry.key] = entry.build()
        module = tied[entry.key]
        return (lambda x, m=module, f=entry.forward_fn: f(m, x)) if entry.forward_fn is not None else module
    if isinstance(entry, LayerSpec):
        with torch.device("meta"):
            return entry.build()
    if isinstance(entry, nn.Module):
        return copy.deepcopy(entry).to("meta")
    return entry


def stage_input(module: PipelineModule, inputs: Any, stage: int) -> Any:
    """The (meta) value stage ``stage`` receives when the first stage is given ``inputs``."""
    if module.num_chunks != 1:
        raise NotImplementedError("a dry run of an interleaved pipeline (num_chunks > 1) beyond its first stage is "
                                  "not supported yet: dry-run rank 0 (the first stage)")
    x = _to_meta(inputs)
    tied: dict[str, nn.Module] = {}
    rng = torch.get_rng_state()
    try:
        for entry in module._layer_specs[:module.parts[stage]]:  # the layers of the stages before this one
            x = _meta_layer(entry, tied)(x)
    finally:
        torch.set_rng_state(rng)
    return x


def stage_input_header(module: PipelineModule, inputs: Any, stage: int) -> torch.Tensor:
    """The header stage ``stage - 1`` sends with its activations (``pipe/p2p.py``), on the CPU."""
    value = stage_input(module, inputs, stage)
    tensors = list(value) if isinstance(value, (tuple, list)) else [value]
    header = encode_header(tensors, isinstance(value, (tuple, list)), torch.device("cpu"))
    if header.numel() != HEADER_LEN:
        raise RuntimeError(f"pipeline header of {header.numel()} values, expected {HEADER_LEN}")
    return header


def peek_inputs(data_iter: Optional[Iterator[Any]]) -> tuple[Any, Optional[Iterator[Any]]]:
    """The first item's inputs of ``data_iter``, and an iterator that still yields that item first."""
    if data_iter is None:
        return None, None
    item = next(data_iter)
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ValueError(f"pipeline data items must be (inputs, labels) pairs, got {type(item).__name__}")
    return item[0], itertools.chain([item], data_iter)
