"""Point-to-point transfers between adjacent pipeline stages: a tensor or a tuple of tensors, with a
small header sent every time (count, dtypes, shapes, whether each needs a gradient), so shapes may change
between micro-batches and batches and nothing hangs on a stale cached shape (DeepSpeed #3195, #5696).

Sends are non-blocking (``isend``; the buffers are held until ``wait_sends``); receives block. Messages
between two ranks are matched in posting order on both gloo and NCCL, which the schedules guarantee
(``simulate.py`` checks it).

Posted receives (CPU / gloo). gloo moves a message only once its receive is posted, and the sender's
transport thread has to wake up to do it; on busy cores that costs milliseconds per message, in the
pipeline's critical path. Between ``begin(counts)`` and ``end()`` (one batch, ``counts`` the messages it
will receive from each rank) the next message's receives are therefore posted ahead: the header at once,
and the payload into buffers shaped like the previous message on that channel. Both ends know that
previous message, so they agree without asking: when the shapes change, the sender first sends a
throwaway payload of the old shapes (received into the posted buffers and dropped), then the real one.
On CUDA devices (NCCL) receives are not posted ahead: a send queued behind a pending receive to the same
peer waits for it on the communicator's stream, and the schedule can need that send first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

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
    """The fixed-size int64 header describing ``tensors`` (built as one list: it is on every transfer's path)."""
    if len(tensors) > MAX_TENSORS:
        raise PipeCommError(f"{len(tensors)} tensors between stages; at most {MAX_TENSORS} are supported: pack "
                            "them into fewer tensors")
    values = [MAGIC, int(is_tuple), len(tensors)]
    for i, t in enumerate(tensors):
        if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
            raise PipeCommError(f"tensor {i} between stages has shape {tuple(t.shape)} and dtype {t.dtype}; "
                                f"supported: up to {MAX_DIMS} dims, dtypes {DTYPES}")
        values += [DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
        values += [0] * (MAX_DIMS - t.dim())
    values += [0] * (HEADER_LEN - len(values))
    return torch.tensor(values, dtype=torch.int64, device=device)


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


Shapes = list[tuple[tuple[int, ...], torch.dtype]]
"""A message's payload as (shape, dtype) per tensor: what a posted receive must match."""


@dataclass
class _Posted:
    """The receives posted ahead for a channel's next message."""

    header: torch.Tensor
    header_work: Any
    shapes: Shapes | None
    """The previous message's shapes, into which ``buffers`` receive (None on a channel's first message:
    only the header is posted)."""
    buffers: list[torch.Tensor]
    works: list[Any]


class StageLink:
    """This rank's sends and receives to its pipeline neighbours (global ranks).

    ``watchdog`` (the pipeline group's, on gloo): every wait on a transfer goes through it, so a transfer
    that never completes (stages that disagree on the micro-batch count, a stage whose data ran out, a
    stage that died) ends after ``DEEPSHARD_TIMEOUT`` (at once when the peer's connection closed) with a
    message naming this stage, the peer, what was expected and each rank's position."""

    def __init__(self, stage: int, rank: int, device: torch.device, post_ahead: bool | None = None,
                 watchdog: Any = None, logger: Any = None) -> None:
        self.stage, self.rank, self.device = stage, rank, device
        self.watchdog = watchdog
        self.logger = logger
        """The engine's comms logger: each message's payload is counted as ``pp:send`` (a pair of ranks)."""
        self.post_ahead = device.type == "cpu" if post_ahead is None else post_ahead
        self._pending: list[tuple[Any, list[torch.Tensor], int]] = []
        self._last_sent: dict[int, Shapes] = {}
        self._last_received: dict[int, Shapes] = {}
        self._posted: dict[int, _Posted] = {}
        self._to_come: dict[int, int] = {}
        self._in_batch = False
        self._abandoned: list[_Posted] = []
        """Receives posted for a message refused on arrival, kept alive with the link."""
        self.received_ahead = 0
        """Messages whose payload arrived in buffers posted ahead."""
        self.throwaways = 0
        """Messages whose shapes changed, received after a throwaway payload."""

    # ------------------------------------------------------------------------------------ batches
    def begin(self, counts: Mapping[int, int]) -> None:
        """Start a batch that will receive ``counts[src]`` messages from each global rank ``src``; with
        ``post_ahead`` their first receives are posted now. Every stage of the batch must call it."""
        if self._posted or any(self._to_come.values()):
            raise PipeCommError(f"stage {self.stage} (rank {self.rank}): the previous batch stopped with transfers "
                                f"still to come ({ {s: n for s, n in self._to_come.items() if n} } messages by rank); "
                                "the stages are out of step after that error: restart the job (or rebuild the engine "
                                "on every stage)")
        self._to_come = {src: n for src, n in counts.items() if n > 0}
        self._in_batch = self.post_ahead
        if self._in_batch:
            for src in self._to_come:
                self._post(src)

    def end(self) -> None:
        """Finish a batch: wait for every send; leave no receive posted."""
        self.wait_sends()
        self._in_batch = False
        left = {s: n for s, n in self._to_come.items() if n}
        if left or self._posted:
            raise PipeCommError(f"stage {self.stage} (rank {self.rank}) ended a batch with messages announced but "
                                f"not received (by rank: {left}); the schedule's receive counts are wrong")

    def _wait(self, work: Any, what: str) -> None:
        """Wait for one transfer, under the watchdog when there is one."""
        if self.watchdog is None:
            work.wait()
        else:
            self.watchdog.wait(work, f"stage {self.stage} (rank {self.rank}): {what}", transfer=True)

    def _post(self, src: int) -> None:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        header_work = dist.irecv(header, src)
        shapes = self._last_received.get(src)
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in shapes or []]
        self._posted[src] = _Posted(header, header_work, shapes, buffers, [dist.irecv(b, src) for b in buffers])

    # -------------------------------------------------------------------------------- transfers
    def send(self, value: Any, dst: int) -> None:
        """Post ``value`` (tensor or tuple) to global rank ``dst`` without waiting."""
        tensors, is_tuple = _as_list(value)
        header = encode_header(tensors, is_tuple, self.device)
        payload = [t.detach().contiguous() for t in tensors]
        shapes = [(tuple(int(d) for d in t.shape), t.dtype) for t in payload]
        posted = self._last_sent.get(dst) if self._in_batch else None  # what the receiver posted for it
        throwaway = ([torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in posted]
                     if posted is not None and posted != shapes else [])
        works = [dist.isend(header, dst)] + [dist.isend(t, dst) for t in throwaway + payload]
        if self.logger is not None:
            for t in payload:
                self.logger.record("pp:send", t.numel(), t.element_size(), group_size=2)
        self._last_sent[dst] = shapes
        if len(self._pending) >= 8:  # drop the buffers of completed sends now and then, not on every send
            self._pending = [p for p in self._pending if not all(x.is_completed() for x in p[0])]
        self._pending.append((works, [header] + throwaway + payload, dst))

    def recv(self, src: int, what: str, expect: Sequence[TensorMeta] | None = None,
             src_stage: int | None = None) -> tuple[list[torch.Tensor], list[TensorMeta], bool]:
        """Receive a message from global rank ``src``; with ``expect``, its shapes and dtypes must match
        (the error names both stages and both shape lists)."""
        posted = self._posted.pop(src, None)
        if self._in_batch and posted is None:
            raise PipeCommError(f"stage {self.stage} (rank {self.rank}) receives more messages from rank {src} than "
                                "the batch announced in begin(); the schedule's receive counts are wrong")
        where = f"receive of {what} from stage {src_stage if src_stage is not None else '?'} (rank {src})"
        if posted is None:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            self._wait(dist.irecv(header, src), where)
        else:
            self._wait(posted.header_work, where)
            header = posted.header
        metas, is_tuple = decode_header(header)
        if expect is not None:
            got = [(m.shape, m.dtype) for m in metas]
            want = [(m.shape, m.dtype) for m in expect]
            if got != want:
                if posted is not None:  # its payload receives may still be written into: never drop them
                    self._abandoned.append(posted)
                raise PipeCommError(f"stage {self.stage} (rank {self.rank}) expected {what} shaped {want} from "
                                    f"stage {src_stage} (rank {src}) but received {got}")
        shapes = [(m.shape, m.dtype) for m in metas]
        tensors: list[torch.Tensor] | None = None
        if posted is not None and posted.shapes is not None:
            for w in posted.works:
                self._wait(w, where)
            if posted.shapes == shapes:
                tensors = posted.buffers
                self.received_ahead += 1
            else:  # a throwaway of the old shapes came first
                self.throwaways += 1
        if tensors is None:
            tensors = []
            for m in metas:
                t = torch.empty(m.shape, dtype=m.dtype, device=self.device)
                self._wait(dist.irecv(t, src), where)
                tensors.append(t)
        self._last_received[src] = shapes
        if self._in_batch:
            self._to_come[src] -= 1
            if self._to_come[src] > 0:
                self._post(src)
        return tensors, metas, is_tuple

    def wait_sends(self) -> None:
        """Wait for every posted send (their buffers may then be freed)."""
        for works, _, dst in self._pending:
            for w in works:
                self._wait(w, f"send to rank {dst}")
        self._pending.clear()
