"""The choices ``deepshard plan`` searches, and the DeepSpeed config each one is.

A :class:`Choice` is ZeRO stage x offload x micro batch x activation checkpointing x tensor parallel x
pipeline stages, for a fixed world size and global batch (the accumulation steps follow). Choices that
cannot be built are refused here with the reason, before any dry run; the rest are tried, and the ones
deepshard itself refuses (its plan check) carry that error as their reason.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterator

OFFLOADS = ("none", "optimizer", "optimizer+params")


@dataclass(frozen=True, order=True)
class Choice:
    """One configuration of the search."""

    tp: int
    pp: int
    stage: int
    offload: str
    checkpointing: bool
    micro: int

    def label(self) -> str:
        off = "" if self.offload == "none" else f" offload={self.offload}"
        ckpt = " ckpt" if self.checkpointing else ""
        return f"tp={self.tp} pp={self.pp} zero={self.stage}{off}{ckpt} micro={self.micro}"


@dataclass(frozen=True)
class Space:
    """What may vary: the world size, the global batch and the values of each knob."""

    world_size: int
    global_batch: int
    stages: tuple[int, ...] = (0, 1, 2, 3)
    offloads: tuple[str, ...] = OFFLOADS
    micros: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    checkpointing: tuple[bool, ...] = (False, True)
    tps: tuple[int, ...] = (1, 2, 4, 8)
    pps: tuple[int, ...] = (1, 2, 4)
    max_micro_steps: int = 4
    """A dry run without a pipeline takes at most this many micro-batches per step; time and collective bytes
    are scaled up to the real count (``dry_micro_steps``)."""

    def micro_steps(self, choice: "Choice") -> int:
        """Micro-batches per optimizer step of ``choice`` (its gradient accumulation steps)."""
        return self.global_batch // (choice.micro * (self.world_size // (choice.tp * choice.pp)))

    def dry_micro_steps(self, choice: "Choice") -> int:
        """Micro-batches per step in ``choice``'s dry run: at most ``max_micro_steps`` without a pipeline
        (memory does not grow with accumulation), all of them with one: a stage holds the buffers of every
        send of a batch until the batch ends (gloo frees a send's buffer only once it is waited on), so its
        peak grows by an activation per micro-batch and neighbour."""
        if choice.pp > 1:
            return self.micro_steps(choice)
        return min(self.micro_steps(choice), self.max_micro_steps)


def refusal(choice: Choice, space: Space, pipeline: bool, checkpointable: bool, tp_ok: bool) -> str | None:
    """Why ``choice`` cannot be built (None: try it). ``pipeline``: model.py describes its layers for a
    pipeline; ``checkpointable``: its ``build_model`` takes ``activation_checkpointing``; ``tp_ok``: it
    allows automatic tensor parallelism."""
    model_parallel = choice.tp * choice.pp
    if space.world_size % model_parallel:
        return f"tp x pp = {model_parallel} does not divide the world size {space.world_size}"
    dp = space.world_size // model_parallel
    if space.global_batch % (choice.micro * dp):
        return (f"the global batch {space.global_batch} is not a multiple of micro batch {choice.micro} x "
                f"data-parallel size {dp}")
    if choice.pp > 1 and not pipeline:
        return "pipeline stages need model.py's pipeline_layers()"
    if choice.tp > 1 and not tp_ok:
        return "model.py says its model does not split for tensor parallelism (tensor_parallel = False)"
    if choice.checkpointing and not checkpointable and choice.pp == 1:
        return "model.py's build_model() takes no activation_checkpointing argument"
    if choice.offload != "none" and choice.stage == 0:
        return "ZeRO stage 0 has no partition to offload"
    if choice.offload == "optimizer+params" and choice.stage != 3:
        return "parameter offload needs ZeRO stage 3"
    if choice.pp > 1 and choice.stage >= 3:
        return "ZeRO stage 3 partitions parameters across the pipeline's data-parallel ranks: not with pipelines"
    return None


def choices(space: Space) -> Iterator[Choice]:
    """Every combination: for each (tp, pp, stage), first without offload or recomputation, then with; the
    micro batches of each layout from small to large."""
    for tp in space.tps:
        for pp in space.pps:
            for stage in space.stages:
                for ckpt in sorted(space.checkpointing):
                    for offload in space.offloads:
                        for micro in sorted(space.micros):
                            yield Choice(tp, pp, stage, offload, ckpt, micro)


def config_for(base: dict[str, Any], choice: Choice, space: Space, micro_steps: int | None = None) -> dict[str, Any]:
    """``base`` (the user's DeepSpeed config) with ``choice`` written into it (``micro_steps``: accumulate
    that many micro-batches instead of the global batch's, for a shorter dry run)."""
    cfg = copy.deepcopy(base)
    dp = space.world_size // (choice.tp * choice.pp)
    gas = micro_steps if micro_steps is not None else space.micro_steps(choice)
    cfg["train_batch_size"] = choice.micro * dp * gas
    cfg["train_micro_batch_size_per_gpu"] = choice.micro
    cfg["gradient_accumulation_steps"] = gas
    zero = dict(cfg.get("zero_optimization") or {})
    zero["stage"] = choice.stage
    zero.pop("offload_optimizer", None)
    zero.pop("offload_param", None)
    if choice.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if choice.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu"}
    cfg["zero_optimization"] = zero
    if choice.tp > 1:
        cfg["tensor_parallel"] = {**(cfg.get("tensor_parallel") or {}), "autotp_size": choice.tp}
    else:
        cfg.pop("tensor_parallel", None)
    if choice.pp > 1:
        cfg["pipeline"] = {**(cfg.get("pipeline") or {}), "stages": choice.pp,
                           "activation_checkpoint_interval": 1 if choice.checkpointing else 0}
    else:
        cfg.pop("pipeline", None)
    return cfg
