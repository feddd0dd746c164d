"""One runner per engine: set up the model, take one training step, report communication and states.

Every runner trains the same fp32-initialized model with ``torch.optim.AdamW`` (fixed lr, same weight
decay) on the same batches, without gradient clipping: DeepSpeed and deepshard clip at 1.0 by default,
so their configs set ``"gradient_clipping": 0.0``. Mixed precision (``bf16``) is each engine's own:

- torch DDP: ``torch.autocast("cpu", torch.bfloat16)`` around the forward (fp32 parameters and
  gradients), ``bucket_cap_mb=25``, ``gradient_as_bucket_view=True`` (gradients live in the buckets,
  no second copy);
- torch FSDP2: ``fully_shard`` on every block, then on the root, with
  ``MixedPrecisionPolicy(param_dtype=bfloat16)`` (fp32 sharded parameters, bf16 compute and
  gradient reduction);
- DeepSpeed: its ``bf16`` section (bf16 module, fp32 master weights), a client ``torch.optim.AdamW``
  (``zero_allow_untested_optimizer``), ``reduce_bucket_size`` = DDP's 25 MB;
- deepshard: its public API only (``deepshard.initialize(model=..., config=...)``, ``engine(x, y)``,
  ``engine.backward``, ``engine.step``, ``engine.memory_report``, ``engine.comms_logger``), with
  ``reduce_bucket_size`` = DDP's 25 MB; ``deepshard-z3-sib`` is stage 3 with its opt-in
  ``optimizer_step_in_backward`` (no gradient shard: 12Ψ/N); ``deepshard-z0-after-backward`` is stage 0
  with ``overlap_comm: false``, the buckets reduced once backward is done (``deepshard-z0-overlap``: ``true``);
  ``deepshard-z3`` keeps stage 3's default ``stage3_min_gather_size`` (each module subtree of at most
  6,553,600 elements, DDP's 25 MB of fp32, gathered as one group, as FSDP2 gathers a block) and
  ``deepshard-z3-per-module`` turns it off (``0``: one group per module), for comparison; none of these
  three comparisons runs unless named in ``--engines``.

A runner that cannot run raises ``EngineUnavailable`` with a status: ``not implemented`` (deepshard
raises NotImplementedError for a stage that has not landed), ``refused: <reason>`` (the engine
rejects the configuration), ``not installed`` (DeepSpeed absent).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.measure import CollectiveCounter, CommCount, ddp_counting_hook
from benchmarks.workloads import Workload

DDP_BUCKET_BYTES = 25 * 1024 * 1024  # torch DDP's default bucket_cap_mb=25


class EngineUnavailable(Exception):
    """The engine cannot run this case; ``status`` goes into the table instead of figures."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class RunContext:
    """What every runner needs to build the same training setup."""

    workload: Workload
    dtype: str  # "fp32" | "bf16"
    rank: int
    world_size: int
    lr: float = 1e-3
    weight_decay: float = 0.01

    @property
    def bf16(self) -> bool:
        return self.dtype == "bf16"

    @property
    def micro_batch(self) -> int:
        return self.workload.global_batch // self.world_size

    def bucket_elements(self, grad_element_size: int) -> int:
        """DDP's 25 MB bucket in elements of the gradient dtype."""
        return DDP_BUCKET_BYTES // grad_element_size


@dataclass(frozen=True)
class EngineSpec:
    """``family`` picks the runner; ``stage`` is the ZeRO stage (the sharding class: DDP 0, FSDP2 3)."""

    name: str
    family: str
    stage: int
    offload: bool = False
    step_in_backward: bool = False  # deepshard's zero_optimization.optimizer_step_in_backward
    overlap_comm: bool | None = None  # deepshard's zero_optimization.overlap_comm (None: left to the stage)
    per_module: bool = False  # deepshard's stage3_min_gather_size 0: one group per module (False: left out)
    default: bool = True  # run when --engines is not given

    @property
    def is_deepshard(self) -> bool:
        return self.family == "deepshard"


ENGINES: dict[str, EngineSpec] = {s.name: s for s in [
    EngineSpec("ddp", "ddp", 0),
    EngineSpec("fsdp2", "fsdp2", 3),
    *(EngineSpec(f"deepspeed-z{k}", "deepspeed", k) for k in range(4)),
    *(EngineSpec(f"deepshard-z{k}", "deepshard", k) for k in range(4)),
    EngineSpec("deepshard-offload", "deepshard", 2, offload=True),
    EngineSpec("deepshard-z3-sib", "deepshard", 3, step_in_backward=True),
    # stage 0 reducing once backward is done (DeepSpeed's stage-0 schedule), to compare with its default
    # (all-reduces overlapped with backward) on a host
    EngineSpec("deepshard-z0-after-backward", "deepshard", 0, overlap_comm=False, default=False),
    EngineSpec("deepshard-z0-overlap", "deepshard", 0, overlap_comm=True, default=False),  # the other forced one
    # stage 3 with one gather group per module, to compare with its default (each module subtree of at most
    # DDP's 25 MB of fp32 one group, as FSDP2 gathers each fully_shard unit: the GPT's blocks; the MLPs'
    # blocks are larger and stay one group per Linear)
    EngineSpec("deepshard-z3-per-module", "deepshard", 3, per_module=True, default=False),
]}


class Runner:
    """Base: ``setup`` once, ``step`` per batch; communication and model-state figures on request."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.count = CommCount()

    def setup(self, model: torch.nn.Module, ctx: RunContext) -> None:
        raise NotImplementedError

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on this rank's batch; returns this rank's loss."""
        raise NotImplementedError

    def comm_reset(self) -> None:
        self.count.reset()

    def comm_ops(self) -> dict[str, dict[str, int]]:
        """Per-op counters since ``comm_reset`` (calls, elements, bytes, volume_elements, volume_bytes)."""
        return {op: dict(s) for op, s in self.count.ops.items()}

    def model_state(self) -> dict[str, int] | None:
        """Bytes per category as the engine itself reports them (deepshard only)."""
        return None


def _adamw(params: Any, ctx: RunContext) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=ctx.lr, weight_decay=ctx.weight_decay)


class DDPRunner(Runner):
    def setup(self, model: torch.nn.Module, ctx: RunContext) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.ctx = ctx
        self.model = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_BYTES / 2**20,
                                             gradient_as_bucket_view=True)
        self.model.register_comm_hook(None, ddp_counting_hook(self.count))
        self.opt = _adamw(self.model.parameters(), ctx)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.zero_grad()
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if self.ctx.bf16 else contextlib.nullcontext())
        with autocast:
            loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        return float(loss.item())


class FSDP2Runner(Runner):
    def setup(self, model: torch.nn.Module, ctx: RunContext) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.counter = CollectiveCounter().install()
        self.counter.count = self.count
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if ctx.bf16 else MixedPrecisionPolicy()
        for block in ctx.workload.block_modules(model):
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        self.model = model
        self.opt = _adamw(model.parameters(), ctx)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.zero_grad()
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        return float(loss.item())


class DeepSpeedRunner(Runner):
    def setup(self, model: torch.nn.Module, ctx: RunContext) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed
        except ImportError as exc:
            raise EngineUnavailable("not installed", f"pip install deepspeed ({exc})") from None
        self.counter = CollectiveCounter().install()
        self.counter.count = self.count
        self.ctx = ctx
        grad_size = 2 if ctx.bf16 else 4
        config = {
            "train_micro_batch_size_per_gpu": ctx.micro_batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": self.spec.stage,
                                  "reduce_bucket_size": ctx.bucket_elements(grad_size),
                                  "allgather_bucket_size": ctx.bucket_elements(grad_size)},
            "bf16": {"enabled": ctx.bf16},
            "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; DDP and FSDP2 do not clip
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        try:
            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters(), ctx),
                                                       config=config)
        except Exception as exc:  # noqa: BLE001 - whatever DeepSpeed rejects is a result, not a crash
            raise EngineUnavailable("refused", f"{type(exc).__name__}: {exc}") from None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.ctx.bf16 and x.is_floating_point():
            x = x.to(torch.bfloat16)
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.item())


class DeepShardRunner(Runner):
    def setup(self, model: torch.nn.Module, ctx: RunContext) -> None:
        import deepshard

        self.ctx = ctx
        grad_size = 2 if ctx.bf16 else 4
        zero: dict[str, Any] = {"stage": self.spec.stage, "reduce_bucket_size": ctx.bucket_elements(grad_size)}
        if self.spec.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        if self.spec.step_in_backward:
            zero["optimizer_step_in_backward"] = True
        if self.spec.overlap_comm is not None:
            zero["overlap_comm"] = self.spec.overlap_comm
        if self.spec.per_module:
            zero["stage3_min_gather_size"] = 0
        config = {
            "train_micro_batch_size_per_gpu": ctx.micro_batch,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": ctx.lr, "weight_decay": ctx.weight_decay}},
            "zero_optimization": zero,
            "bf16": {"enabled": ctx.bf16},
            "gradient_clipping": 0.0,  # the default is 1.0 (as in DeepSpeed); DDP and FSDP2 do not clip
            "steps_per_print": 10**9,
        }
        try:
            self.engine, _, _, _ = deepshard.initialize(model=model, config=config)
        except NotImplementedError as exc:
            raise EngineUnavailable("not implemented", str(exc)) from None
        if self.spec.offload and not any("offload" in key for key in self.engine.memory_report()):
            raise EngineUnavailable("not implemented", "offload_optimizer was accepted but memory_report() "
                                    "has no offloaded category")

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.ctx.bf16 and x.is_floating_point():  # inputs reach the model as given, as in DeepSpeed
            x = x.to(torch.bfloat16)
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.item())

    def comm_reset(self) -> None:
        self.engine.comms_logger.reset()

    def comm_ops(self) -> dict[str, dict[str, int]]:
        out = {}
        for op, s in self.engine.comms_logger.summary().items():
            size = s["bytes"] // s["elements"] if s["elements"] else 0
            out[op] = {**s, "volume_bytes": s["volume_elements"] * size}
        return out

    def model_state(self) -> dict[str, int] | None:
        return dict(self.engine.memory_report())


_RUNNERS: dict[str, type[Runner]] = {"ddp": DDPRunner, "fsdp2": FSDP2Runner, "deepspeed": DeepSpeedRunner,
                                     "deepshard": DeepShardRunner}


def make_runner(name: str) -> Runner:
    """The runner for an engine name in ``ENGINES``."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from: {', '.join(ENGINES)}")
    spec = ENGINES[name]
    return _RUNNERS[spec.family](spec)
