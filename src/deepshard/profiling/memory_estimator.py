"""A whole-run memory estimate per process: what DeepSpeed's estimators leave out, added back.

Peak tensor bytes of one process = the persistent model states (parameters, gradients, fp32 masters,
optimizer state, buffers: the categories of ``engine.memory_report()``, from the stage, precision, data-
parallel size and offload) + the larger of the two transient phases:

* **forward/backward**: activations, measured by a dry run of the model on fake tensors (no memory is
  used; the micro-batch's shapes, the compute dtype and the model's own activation checkpointing are
  what they will be), plus what the stage keeps in flight while gradients are reduced (stages 1-2: up
  to two buckets of incoming chunks; stage 3: the largest group gathered with its full gradient, and the
  next one prefetched; the groups are those stage 3 forms, ``stage3_min_gather_size`` included);
* **optimizer step**: 16-bit training makes an fp32 copy of the gradients it owns; a per-tensor Adam
  makes two temporaries the size of its largest tensor.

Checked against peaks measured with :class:`~deepshard.profiling.memory_tracker.TensorMemoryTracker`
on real runs (tests/multiproc/test_memory_estimate.py); docs/tools.md gives the figures.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from deepshard.profiling.flop_count import full_numel
from deepshard.zero.stage3.units import discover_groups

# optimizer state bytes per trainable parameter (fp32 state)
STATE_BYTES: dict[str, int] = {"adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "deepspeedcpuadam": 8,
                               "lamb": 8, "fusedlamb": 8, "lion": 4, "adagrad": 4, "sgd": 4, "sgd_nomomentum": 0}


@dataclass(frozen=True)
class ModelFacts:
    """Parameter counts of a model (tied weights once, ZeRO-3 shards at full size)."""

    trainable: int
    frozen: int
    largest_tensor: int
    group_sizes: tuple[int, ...]  # trainable elements per ZeRO-3 group (a module's own, or a unit's subtree)
    frozen_group_sizes: tuple[int, ...]
    buffer_bytes: int

    @classmethod
    def of(cls, model: torch.nn.Module, min_gather: int = 0) -> "ModelFacts":
        """``min_gather``: ``stage3_min_gather_size`` as stage 3 applies it (0: one group per module)."""
        found, _ = discover_groups(model, min_gather)
        sizes = [(ps[0].requires_grad, sum(full_numel(p) for p in ps)) for _, ps, _ in found]
        groups = [n for trainable, n in sizes if trainable]
        frozen_groups = [n for trainable, n in sizes if not trainable]
        params = [p for p in model.parameters()]
        return cls(trainable=sum(groups), frozen=sum(frozen_groups),
                   largest_tensor=max((full_numel(p) for p in params), default=0),
                   group_sizes=tuple(g for g in groups if g), frozen_group_sizes=tuple(g for g in frozen_groups if g),
                   buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()))


@dataclass
class MemoryEstimate:
    """Bytes per process by category; ``peak`` is the estimate to compare with a measured peak."""

    states: dict[str, int]
    activations: int
    in_flight: int
    step_transient: int
    notes: list[str] = field(default_factory=list)

    @property
    def persistent(self) -> int:
        return sum(self.states.values())

    @property
    def peak(self) -> int:
        return self.persistent + max(self.activations + self.in_flight, self.step_transient)


def _state_bytes(optimizer: Any) -> int:
    if optimizer is None:
        return 0
    name = str(getattr(optimizer, "type", optimizer)).lower()
    params = getattr(optimizer, "params", None) or {}
    if name == "sgd" and not params.get("momentum"):
        return 0
    return STATE_BYTES.get(name, 8)


def _shard(n: int, dp: int) -> int:
    return math.ceil(n / dp)


def model_state_bytes(facts: ModelFacts, stage: int, dp: int, compute_bytes: int, state_bytes: int,
                      persistence_threshold: int = 100_000) -> dict[str, int]:
    """Persistent bytes per category (``engine.memory_report()``'s names) for ZeRO ``stage`` over ``dp``
    processes. ``compute_bytes``: 4 for fp32, 2 for bf16/fp16 (16-bit adds fp32 masters)."""
    psi, frozen = facts.trainable, facts.frozen
    master = 4 if compute_bytes < 4 else 0
    owned = psi if stage == 0 else _shard(psi, dp)
    if stage < 3:
        params, gathered = (psi + frozen) * compute_bytes, 0
        grads = (psi if stage < 2 else owned) * compute_bytes
    else:
        params = sum(_shard(g, dp) for g in facts.group_sizes + facts.frozen_group_sizes) * compute_bytes
        gathered = sum(g for g in facts.group_sizes + facts.frozen_group_sizes
                       if g <= persistence_threshold) * compute_bytes
        grads = owned * compute_bytes
    return {"parameters": params, "gradients": grads, "master_weights": master * owned,
            "optimizer_state": state_bytes * owned, "buffers": facts.buffer_bytes, "gathered_parameters": gathered}


def _fake_copy(tensor: torch.Tensor, mode: Any, dtype: torch.dtype | None) -> torch.Tensor:
    fake = mode.from_tensor(tensor)
    if dtype is not None and fake.is_floating_point():
        fake = fake.to(dtype)
    return fake


@contextlib.contextmanager
def _swapped_tensors(model: torch.nn.Module, mode: Any, dtype: torch.dtype) -> Iterator[list[torch.Tensor]]:
    """Replace every parameter and buffer of ``model`` by a fake copy (tied ones by one copy) for the whole
    block, forward *and* backward (activation checkpointing recomputes with them), then put them back."""
    fakes: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict, str, Any]] = []

    def fake_of(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        if id(t) not in fakes:
            cast = dtype if t.is_floating_point() and (is_param or t.dim() > 0) else None
            f = _fake_copy(t, mode, cast).detach()
            fakes[id(t)] = torch.nn.Parameter(f, requires_grad=t.requires_grad) if is_param else f
        return fakes[id(t)]

    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, value in list(table.items()):
                if value is not None:
                    saved.append((table, name, value))
                    table[name] = fake_of(value, is_param)
    try:
        yield [f for f in fakes.values() if isinstance(f, torch.nn.Parameter)]
    finally:
        for table, name, value in saved:
            table[name] = value


def _scalar(out: Any) -> torch.Tensor:
    loss = out if torch.is_tensor(out) else getattr(out, "loss", None)
    if loss is None:
        loss = out[0]
    return loss if loss.numel() == 1 else loss.float().sum()


def activation_bytes(model: torch.nn.Module, inputs: Sequence[Any], dtype: torch.dtype) -> int:
    """Peak bytes beyond the parameters during one forward and backward of ``model(*inputs)``, measured on
    fake tensors (nothing is allocated). Each gradient is dropped as soon as it is made: the engine keeps
    gradients in its own (persistent) buffers, counted with the model states."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from deepshard.profiling.memory_tracker import TensorMemoryTracker

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _swapped_tensors(model, mode, dtype) as params:
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda t: setattr(t, "grad", None))
        fake_inputs = [_fake_copy(x, mode, dtype) if torch.is_tensor(x) else x for x in inputs]
        device = next((p.device.type for p in params), "cpu")
        tracker = TensorMemoryTracker(device, count_fake=True)
        with mode, tracker:
            base = tracker.current_bytes
            _scalar(model(*fake_inputs)).backward()  # no reference to the output outlives the call
    return max(0, tracker.peak_bytes - base)


def estimate_run_memory(model: torch.nn.Module, config: Any, inputs: Sequence[Any], dp_size: int = 1
                        ) -> MemoryEstimate:
    """The whole-run estimate for ``model`` trained with ``config`` (a DeepShardConfig) on micro-batches
    shaped like ``inputs`` over ``dp_size`` data-parallel processes."""
    zcfg = config.zero_optimization
    stage, dtype = int(zcfg.stage), config.model_dtype
    compute = torch.tensor([], dtype=dtype).element_size()
    facts = ModelFacts.of(model, zcfg.gather_unit_size if stage == 3 else 0)
    states = model_state_bytes(facts, stage, dp_size, compute, _state_bytes(config.optimizer),
                               int(zcfg.stage3_param_persistence_threshold))
    notes = []
    if zcfg.offload_optimizer is not None or zcfg.offload_param is not None:
        notes.append("offload sections are set: the offloaded categories are counted as if resident")
    acts = activation_bytes(model, inputs, dtype)
    owned = facts.trainable if stage == 0 else _shard(facts.trainable, dp_size)
    if stage in (1, 2):
        bucket = min(int(zcfg.reduce_bucket_size), facts.trainable)
        in_flight = 2 * bucket * compute * (dp_size - 1) // max(dp_size, 1)
    elif stage == 3:
        big = sorted((g for g in facts.group_sizes + facts.frozen_group_sizes
                      if g > int(zcfg.stage3_param_persistence_threshold)), reverse=True) + [0, 0]
        in_flight = (2 * big[0] + big[1]) * compute  # gathered + its full gradient, the next one prefetched
    else:
        in_flight = 0
    fp32_grad_copy = 4 * owned if compute < 4 else 0
    step = fp32_grad_copy + 2 * 4 * min(facts.largest_tensor, owned if stage else facts.largest_tensor)
    return MemoryEstimate(states, acts, in_flight, step, notes)


def format_estimate(est: MemoryEstimate) -> str:
    """A table of the estimate in MiB."""
    mib = 1024 ** 2
    rows = [(k, v) for k, v in est.states.items()] + [
        ("activations (fwd+bwd peak)", est.activations), ("in flight during backward", est.in_flight),
        ("optimizer-step transient", est.step_transient), ("persistent total", est.persistent),
        ("estimated peak", est.peak)]
    lines = [f"{name:<28} {value / mib:10.2f} MiB" for name, value in rows]
    return "\n".join(lines + [f"note: {n}" for n in est.notes])
