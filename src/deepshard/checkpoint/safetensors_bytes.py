"""Tensors from the bytes of a safetensors file already in memory (read once, hashed as it was read).

The format is an 8-byte little-endian header length, a JSON header (``name -> {dtype, shape,
data_offsets}`` plus an optional ``__metadata__`` string map), then the tensor data. The safetensors
package parses only ``bytes``, which would mean a second copy of a file that was just read into a
buffer; this reads tensors straight out of the buffer. Nothing is unpickled or executed.
"""
from __future__ import annotations

import json
from typing import Optional

import torch

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def parse(buffer: bytearray, names: Optional[set[str]] = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file held in ``buffer`` (only ``names`` when given).

    Every tensor is its own copy (the buffer can be dropped); raises ``ValueError`` saying what is
    malformed."""
    if len(buffer) < 8:
        raise ValueError(f"{len(buffer)} bytes is shorter than the 8-byte header length")
    header_len = int.from_bytes(buffer[:8], "little")
    if 8 + header_len > len(buffer):
        raise ValueError(f"the header claims {header_len} bytes but the file has {len(buffer) - 8} after its length")
    try:
        header = json.loads(bytes(buffer[8:8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"the header is not JSON ({err})") from err
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + header_len
    view = memoryview(buffer)
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if names is not None and name not in names:
            continue
        tensors[name] = _tensor(view, base, name, info)
    return tensors, metadata


def _tensor(view: memoryview, base: int, name: str, info: object) -> torch.Tensor:
    if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
        raise ValueError(f"tensor {name!r} has no known dtype ({info!r:.80})")
    dtype = _DTYPES[info["dtype"]]
    shape = [int(d) for d in info.get("shape", [])]
    start, end = (int(x) for x in info.get("data_offsets", (0, -1)))
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if end - start != nbytes or start < 0 or base + end > len(view):
        raise ValueError(f"tensor {name!r} ({info['dtype']} {shape}) has data offsets [{start}, {end}] that do not "
                         f"fit its {nbytes} bytes inside the file")
    out = torch.empty(shape, dtype=dtype)
    if nbytes:
        raw = torch.frombuffer(view[base + start:base + end], dtype=torch.uint8)
        out.view(-1).view(torch.uint8).copy_(raw)
    return out
