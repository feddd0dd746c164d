"""The stage-to-stage message header (no process group): what it encodes comes back, and what cannot be
sent is refused with the reason."""
from __future__ import annotations

import pytest
import torch

from deepshard.pipe.p2p import HEADER_LEN, PipeCommError, _as_list, decode_header, encode_header


def test_header_round_trip_keeps_shapes_dtypes_and_grad_flags() -> None:
    tensors = [torch.zeros(2, 3, 4, requires_grad=True), torch.zeros(5, dtype=torch.int64),
               torch.zeros((), dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.bool)]
    header = encode_header(tensors, True, torch.device("cpu"))
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    metas, is_tuple = decode_header(header)
    assert is_tuple
    assert [(m.shape, m.dtype, m.requires_grad) for m in metas] == [
        ((2, 3, 4), torch.float32, True), ((5,), torch.int64, False), ((), torch.bfloat16, False),
        ((1, 2), torch.bool, False)]
    metas, is_tuple = decode_header(encode_header([torch.ones(7)], False, torch.device("cpu")))
    assert not is_tuple and metas[0].shape == (7,)


def test_refusals() -> None:
    with pytest.raises(PipeCommError, match="at most 8"):
        encode_header([torch.zeros(1)] * 9, True, torch.device("cpu"))
    with pytest.raises(PipeCommError, match="complex64"):
        encode_header([torch.zeros(1, dtype=torch.complex64)], False, torch.device("cpu"))
    with pytest.raises(PipeCommError, match="corrupt"):
        decode_header(torch.zeros(HEADER_LEN, dtype=torch.int64))
    with pytest.raises(PipeCommError, match="tensor or a tuple of tensors"):
        _as_list({"x": torch.zeros(1)})
