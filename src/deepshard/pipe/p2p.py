"""Point-to-point transfers between adjacent pipeline stages: a tensor or a tuple of tensors, with a
small header sent every time (count, dtypes, shapes, whether each needs a gradient), so shapes may change
between micro-batches and batches and nothing hangs on a stale cached shape (DeepSpeed #3195, #5696).

Sends are non-blocking (``isend``; the buffers are held until ``wait_sends``); receives block. Messages
between two ranks are matched in posting order on both gloo and NCCL, which the schedules guarantee
(``simulate.py`` checks it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

MAX_TENSORS = 8
MAX_DIMS = 8
_PER_TENSOR = 3 + MAX_DIMS
HEADER_LEN = 3 + MAX_TENSORS * _PER_TENSOR
MAGIC = 0x5049504531  # "PIPE1"
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
          torch.uint8, torch.int8, torch.int16]


class PipeCommError(RuntimeError):
    """A transfer between stages that does not fit what the receiver expects."""


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _as_list(value: Any) -> tuple[list[torch.Tensor], bool]:
    if torch.is_tensor(value):
        return [value], False
    if isinstance(value, (tuple, list)) and all(torch.is_tensor(t) for t in value):
        return list(value), True
    raise PipeCommError(f"a pipeline stage must pass a tensor or a tuple of tensors to the next stage, got "
                        f"{type(value).__name__}{' with non-tensor items' if isinstance(value, (tuple, list)) else ''}")


def encode_header(tensors: Sequence[torch.Tensor], is_tuple: bool, device: torch.device) -> torch.Tensor:
    """The fixed-size int64 header describing ``tensors``."""
    if len(tensors) > MAX_TENSORS:
        raise PipeCommError(f"{len(tensors)} tensors between stages; at most {MAX_TENSORS} are supported: pack "
                            "them into fewer tensors")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1], header[2] = MAGIC, int(is_tuple), len(tensors)
    for i, t in enumerate(tensors):
        if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
            raise PipeCommError(f"tensor {i} between stages has shape {tuple(t.shape)} and dtype {t.dtype}; "
                                f"supported: up to {MAX_DIMS} dims, dtypes {DTYPES}")
        base = 3 + i * _PER_TENSOR
        header[base] = DTYPES.index(t.dtype)
        header[base + 1] = int(t.requires_grad)
        header[base + 2] = t.dim()
        header[base + 3:base + 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header.to(device)


def decode_header(header: torch.Tensor) -> tuple[list[TensorMeta], bool]:
    h = header.cpu().tolist()
    if h[0] != MAGIC:
        raise PipeCommError("a pipeline message header is corrupt (sends and receives out of step between "
                            "stages: do all stages run the same schedule and micro-batch count?)")
    metas = []
    for i in range(h[2]):
        base = 3 + i * _PER_TENSOR
        ndim = h[base + 2]
        metas.append(TensorMeta(tuple(h[base + 3:base + 3 + ndim]), DTYPES[h[base]], bool(h[base + 1])))
    return metas, bool(h[1])


class StageLink:
    """This rank's sends and receives to its pipeline neighbours (global ranks)."""

    def __init__(self, stage: int, rank: int, device: torch.device) -> None:
        self.stage, self.rank, self.device = stage, rank, device
        self._pending: list[tuple[Any, list[torch.Tensor]]] = []

    def send(self, value: Any, dst: int) -> None:
        """Post ``value`` (tensor or tuple) to global rank ``dst`` without waiting."""
        tensors, is_tuple = _as_list(value)
        header = encode_header(tensors, is_tuple, self.device)
        payload = [t.detach().contiguous() for t in tensors]
        works = [dist.isend(header, dst)] + [dist.isend(t, dst) for t in payload]
        self._pending = [(w, held) for w, held in self._pending if not all(x.is_completed() for x in w)]
        self._pending.append((works, [header] + payload))

    def recv(self, src: int, what: str, expect: Sequence[TensorMeta] | None = None,
             src_stage: int | None = None) -> tuple[list[torch.Tensor], list[TensorMeta], bool]:
        """Receive a message from global rank ``src``; with ``expect``, its shapes and dtypes must match
        (the error names both stages and both shape lists)."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.recv(header, src)
        metas, is_tuple = decode_header(header)
        if expect is not None:
            got = [(m.shape, m.dtype) for m in metas]
            want = [(m.shape, m.dtype) for m in expect]
            if got != want:
                raise PipeCommError(f"stage {self.stage} (rank {self.rank}) expected {what} shaped {want} from "
                                    f"stage {src_stage} (rank {src}) but received {got}")
        tensors = []
        for m in metas:
            t = torch.empty(m.shape, dtype=m.dtype, device=self.device)
            dist.recv(t, src)
            tensors.append(t)
        return tensors, metas, is_tuple

    def wait_sends(self) -> None:
        """Wait for every posted send (their buffers may then be freed)."""
        for works, _ in self._pending:
            for w in works:
                w.wait()
        self._pending.clear()


def metas_of(tensors: Sequence[torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]
