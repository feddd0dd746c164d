"""One reader per load, chosen once from what the tag directory holds: deepshard's fragment files or the
directory DeepSpeed's ``save_checkpoint`` wrote. Either gives the same two things: the weights and optimizer
state as a :class:`~deepshard.shard_state.FullState` (whole tensors by name, cut to the loading model's own
tensor-parallel parts) for a strategy to take its slices of, and a :class:`Resume` (counters, loss scaler,
LR scheduler, client state) for the engine. Nothing else in deepshard asks which format a tag is in.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Optional

import torch

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint import ledger, schema
from deepshard.checkpoint.deepspeed_format.detect import is_deepspeed_tag
from deepshard.checkpoint.deepspeed_format.read import read_engine_record, read_full_state
from deepshard.checkpoint.deepspeed_format.safe_load import load_pt
from deepshard.checkpoint.fragments import read_fragments
from deepshard.checkpoint.layout import localize
from deepshard.checkpoint.share import LoadShare
from deepshard.checkpoint.state import unflatten_state
from deepshard.checkpoint.verify import ManifestVerifier
from deepshard.shard_state import FullState
from deepshard.topology import ParallelDims
from deepshard.utils.logging import logger

ENGINE_JSON = "engine.json"
ENGINE_TENSORS = "engine.safetensors"


def rng_file(rank: int) -> str:
    """The file of rank ``rank``'s random streams in a deepshard tag."""
    return f"rng_rank{rank}.safetensors"


@dataclass
class Resume:
    """What an engine takes back from a tag besides the weights."""

    global_steps: int
    global_samples: int
    skipped_steps: int
    lr_scheduler: Optional[dict[str, Any]]
    client_state: dict[str, Any]
    loss_scaler: dict[str, Any]
    scaler_same_kind_only: bool = False
    """Take the saved scaler only when this run scales the same way (static or dynamic): a run that
    changed (bf16 saved, fp16 resumed) keeps its configured scaler, as it would starting afresh."""
    rng: Optional[dict[str, torch.Tensor]] = None
    """This rank's random streams, restored when the tag was written on the same grid."""


class TagReader(ABC):
    """A tag directory of one format (see the module docstring)."""

    verified: bool = False
    """Whether each file a rank reads is checked against a manifest as it is read (``verifying``); the
    ranks then agree on the outcome before the engine changes (``collective.agree_on_load``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def verifying(self) -> ContextManager[Any]:
        """The block inside which this rank reads its part of the tag."""
        return contextlib.nullcontext()

    @abstractmethod
    def full_state(self, module: Optional[torch.nn.Module], with_optimizer: bool,
                   share: Optional[LoadShare] = None) -> FullState:
        """Weights (and optimizer state) by name; with ``module``, only its tensors, cut to its own
        tensor-parallel parts; with ``share``, only those ranges need hold the checkpoint's values (a
        reader may read less; see ``checkpoint/share.py``)."""

    @abstractmethod
    def resume(self, rank: int, dims: ParallelDims) -> Resume:
        """The engine's counters and states for global rank ``rank`` of a run on grid ``dims`` (files
        checked first: nothing has been changed when this raises)."""


class DeepShardTag(TagReader):
    """A tag deepshard wrote: fragment files, ``engine.json``, per-rank RNG files and a manifest; every file
    a rank reads is hashed against the manifest while it is read (``checkpoint/verify.py``)."""

    verified = True

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._verifier: Optional[ManifestVerifier] = None

    def verifying(self) -> ContextManager[Any]:
        self._verifier = ManifestVerifier(self.path)
        return ledger.verifying(self._verifier)

    def full_state(self, module: Optional[torch.nn.Module], with_optimizer: bool,
                   share: Optional[LoadShare] = None) -> FullState:
        return read_fragments(self.path, with_optimizer, module, share)

    def resume(self, rank: int, dims: ParallelDims) -> Resume:
        path = self.path
        listed = self._verifier.names() if self._verifier is not None else ckpt_io.verify_manifest(path)
        meta = schema.check(path / ENGINE_JSON, ckpt_io.load_json(path / ENGINE_JSON), schema.ENGINE, "engine file")
        rng_path = path / rng_file(rank)
        saved = {"sp": 1, **meta.get("grid", {"pp": 1, "dp": meta.get("dp_world_size", -1), "tp": 1})}
        same_grid = saved == {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp, "sp": dims.sp}
        rng_saved = any(name.startswith("rng_rank") for name in listed)  # not by converters from DeepSpeed
        if same_grid and rng_saved and rng_path.name not in listed:
            raise ckpt_io.CheckpointError(f"checkpoint {path} is incomplete: {rng_path.name} (rank {rank}'s RNG "
                                          "state; the other ranks' are there) is missing; load another tag")
        try:
            state = unflatten_state(ckpt_io.load_tensors(path / ENGINE_TENSORS), meta["state"])
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise ckpt_io.CheckpointError(f"{path / ENGINE_JSON}'s 'state' does not describe {path / ENGINE_TENSORS} "
                                          f"({type(err).__name__}: {err}): the files are from different saves or "
                                          "edited; load another tag") from err
        return Resume(global_steps=int(meta["global_steps"]), global_samples=int(meta["global_samples"]),
                      skipped_steps=int(meta["skipped_steps"]), lr_scheduler=state.get("scheduler"),
                      client_state=state.get("client_state", {}), loss_scaler=meta["loss_scaler"],
                      rng=ckpt_io.load_tensors(rng_path) if same_grid and rng_saved else None)


class DeepSpeedTag(TagReader):
    """A tag DeepSpeed's ``save_checkpoint`` wrote, read without running a pickle (``deepspeed_format``). With a
    share, a rank reads the optimizer files holding its ranges (on the saving grid: its own) and the
    model-states file(s), each once: what ``full_state`` read is kept until ``resume`` has taken the engine
    record from it (a load calls them in that order; ``resume`` alone reads what it needs)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._kept: dict[Path, Any] = {}

    def _load(self, path: Path) -> Any:
        if path not in self._kept:
            self._kept[path] = load_pt(path)
        return self._kept[path]

    def full_state(self, module: Optional[torch.nn.Module], with_optimizer: bool,
                   share: Optional[LoadShare] = None) -> FullState:
        full = read_full_state(self.path, with_optimizer, share, self._load)
        return localize(full, module) if module is not None else full

    def resume(self, rank: int, dims: ParallelDims) -> Resume:
        try:
            record = read_engine_record(self.path, self._load, rank, list(self._kept))
        finally:
            self._kept.clear()
        logger.info("loading DeepSpeed checkpoint %s (ZeRO stage %d, written by %d data-parallel ranks)",
                    self.path, record.zero_stage, record.dp_world_size)
        return Resume(global_steps=record.global_steps, global_samples=record.global_samples,
                      skipped_steps=record.skipped_steps, lr_scheduler=record.lr_scheduler,
                      client_state=record.client_state, loss_scaler=record.loss_scaler, scaler_same_kind_only=True)


def open_tag(tag_dir: Path) -> TagReader:
    """The reader of ``tag_dir``: DeepSpeed's when DeepSpeed wrote it, else deepshard's."""
    return DeepSpeedTag(tag_dir) if is_deepspeed_tag(tag_dir) else DeepShardTag(tag_dir)


def load_full_state(directory: Path, with_optimizer: bool = True, module: Optional[torch.nn.Module] = None
                    ) -> FullState:
    """The weights (and optimizer state) of the tag ``directory``, whichever format it is in
    (:func:`open_tag`); see :meth:`TagReader.full_state` for ``module``."""
    return open_tag(directory).full_state(module, with_optimizer)
