"""The engine a training script holds: forward, backward, step, checkpoints.

It owns the training-loop contract (micro-step counting, the accumulation boundary, fp16 loss scaling,
clipping, scheduler stepping, logging, checkpoints) and delegates where model states live and how
gradients are reduced to one strategy object per ZeRO stage (``deepshard.zero``).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from deepshard.checkpoint.deepspeed_format.megatron_meta import (  # noqa: F401 - deepspeed.runtime.engine's name
    checkpoint_parallel_metadata as _checkpoint_parallel_metadata,
)
from deepshard.compile import compile_module, module_is_compiled
from deepshard.config.view import ConfigView
from deepshard.engine_accessors import EngineAccessors
from deepshard.engine_ckpt_names import EngineCheckpointNames
from deepshard.engine_client_calls import EngineClientCalls
from deepshard.engine_coalesce import EngineCoalescing, GradContextMisuse
from deepshard.engine_ds_names import EngineDeepSpeedNames
from deepshard.parts import EngineParts
from deepshard.precision import LossScaler, make_loss_scaler
from deepshard.profiling.engine_tools import EngineTools
from deepshard.step import StepRunner, TrainState
from deepshard.utils.logging import logger
from deepshard.zero.released import ReleasedStrategy
from deepshard.zero.stage3.hints import explain_sharded_parameter_errors
from deepshard.zero.strategy import ZeroStrategy
from deepshard.zero.zero_optimizer import build as build_zero_optimizer


class LossError(ValueError, AssertionError):
    """A loss ``engine.backward`` / ``engine.scale`` cannot use (not one element, or without grad). A
    ValueError; also an AssertionError, which DeepSpeed raises there, so code that catches its error still
    catches this one."""


class _StateField:
    """An engine attribute that reads and writes one counter of ``engine.state``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, engine: Any, owner: Any = None) -> Any:
        return self if engine is None else getattr(engine.state, self.name)

    def __set__(self, engine: Any, value: int) -> None:
        setattr(engine.state, self.name, int(value))


class EngineCore(EngineAccessors, EngineClientCalls, EngineDeepSpeedNames, EngineCheckpointNames, torch.nn.Module):
    """What every engine ``deepshard.initialize`` returns shares (DeepSpeed's ``DeepSpeedEngine`` contract
    minus the training calls): the module, the config accessors (``deepshard.engine_accessors``), the counters, the one step path
    (``self.runner``, ``deepshard.step.StepRunner``), reporting, checkpoints, ``destroy``. The two engines
    add their training calls: :class:`DeepShardEngine` (``forward`` / ``backward`` / ``step``) and
    ``deepshard.pipe.engine.PipelineEngine`` (``train_batch`` / ``eval_batch``). ``deepspeed.DeepSpeedEngine``
    is this class, so ``isinstance(engine, deepspeed.DeepSpeedEngine)`` holds for both, as in DeepSpeed.

    Unknown attributes fall through to the wrapped ``module``.
    """

    def __init__(self, parts: EngineParts) -> None:
        """Built complete by ``deepshard.initialize`` (``parallelize.py`` composes ``parts``); nothing is added
        to an engine after this returns."""
        super().__init__()
        topology, config = parts.topology, parts.config
        self.module = parts.module
        self._config = config
        self.accelerator = parts.accelerator
        self.topology = topology
        self.comm = topology.seq_dp  # the replicas (dp x sp): ZeRO and rank-0 duties; topology.dp reads the data
        self.comms_logger = topology.world.logger
        self.world_size = topology.dims.world_size
        self.global_rank = topology.rank
        self.local_rank = parts.local_rank
        self.dp_world_size = topology.dp.size
        self.basic_optimizer = parts.optimizer
        """The torch optimizer (the user's or the config's; DeepSpeed's name)."""
        self.optimizer = build_zero_optimizer(self, parts.optimizer, parts.strategy.stage)
        """DeepSpeed's: the torch optimizer at ZeRO stage 0, the engine's ZeRO optimizer over it at stages 1-3
        (``zero/zero_optimizer.py``; the torch optimizer is its ``.optimizer``)."""
        self.lr_scheduler = parts.lr_scheduler
        self.training_dataloader: Any = None
        self.strategy: ZeroStrategy = parts.strategy
        self.precision = parts.precision
        self.loss_scaler: LossScaler = make_loss_scaler(config.fp16)
        self.monitor = parts.monitor
        self.state = TrainState()
        for group in (topology.world, topology.dp, topology.tp, topology.pp, topology.model_parallel, topology.sp,
                      topology.seq_dp):
            group.progress = self.state  # the watchdog's diagnoses name the step each rank is at
        self._last_loss: torch.Tensor | None = None
        self._window_losses: list[torch.Tensor] = []  # this accumulation window's micro-batch losses
        self.tools = EngineTools(config, parts.accelerator.synchronize, topology.rank)
        self.runner = StepRunner(self.state, self.loss_scaler, config, topology.rank)
        # sequence parallelism, under DeepSpeed's engine names
        self.sequence_parallel = parts.sequence_parallel
        self.sequence_parallel_size = topology.dims.sp
        self.seq_parallel_group = topology.sp.group if parts.sequence_parallel is not None else None
        self.seq_data_parallel_group = topology.seq_dp.group
        self.seq_dp_world_size = topology.seq_dp.size

    pipeline_parallelism: bool = False
    """DeepSpeed's engine flag: True for the pipeline engine."""

    # the training counters live in ``self.state`` (step.TrainState); these keep DeepSpeed's attribute names
    global_steps = _StateField("global_steps")
    global_samples = _StateField("global_samples")
    micro_steps = _StateField("micro_steps")
    skipped_steps = _StateField("skipped_steps")

    # ------------------------------------------------------------------------------ attributes
    if not TYPE_CHECKING:  # type checkers see the engine's own methods only; the module's names at run time
        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                module = self._modules.get("module")
                if module is not None and hasattr(module, name):
                    return getattr(module, name)
                raise AttributeError(f"'{type(self).__name__}' object (and its module "
                                     f"{type(module).__name__}) has no attribute '{name}'") from None

    @property
    def config(self) -> ConfigView:
        """DeepSpeed's ``engine.config``: the config dict as given; attributes read the validated config."""
        return ConfigView(self._config)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def tput_timer(self) -> Any:
        """DeepSpeed's throughput timer (its fields: ``micro_step_count``, ``global_step_count``,
        ``total_elapsed_time``, ...), started at each forward and stopped at each ``step()``."""
        return self.tools.tput_timer

    # ---------------------------------------------------------------------- mixture of experts
    @property
    def has_moe_layers(self) -> bool:
        """Whether the model holds DeepSpeed MoE layers (``deepspeed.moe.layer.MoE``)."""
        return bool(self.num_experts)

    @property
    def num_experts(self) -> list[int]:
        """Each MoE layer's expert count, in module order (DeepSpeed's ``engine.num_experts``)."""
        from deepshard.moe.parallel import moe_layers

        return [layer.num_experts for _, layer in moe_layers(self.module)]

    @property
    def expert_parallel_group(self) -> dict[str, Any]:
        """``ep_size_<P>`` -> the torch process group of this rank's expert-parallel peers."""
        return {name: groups.ep.group for name, groups in self.topology.experts.items()}

    @property
    def expert_data_parallel_group(self) -> dict[str, Any]:
        """``ep_size_<P>`` -> the torch process group of the ranks holding the same experts."""
        return {name: groups.edp.group for name, groups in self.topology.experts.items()}

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the accumulation steps (micro batch stays)."""
        micro, dp = self.train_micro_batch_size_per_gpu(), self.dp_world_size
        if train_batch_size <= 0 or train_batch_size % (micro * dp) != 0:
            raise ValueError(f"train_batch_size ({train_batch_size}) must be a positive multiple of "
                             f"train_micro_batch_size_per_gpu ({micro}) * data-parallel size ({dp}) = {micro * dp}")
        self._config.gradient_accumulation_steps = train_batch_size // (micro * dp)
        self._config.train_batch_size = train_batch_size

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro batch; the accumulation steps stay, so the global batch changes."""
        if micro_batch_size <= 0:
            raise ValueError(f"micro batch size ({micro_batch_size}) must be > 0")
        self._config.train_micro_batch_size_per_gpu = micro_batch_size
        self._config.train_batch_size = micro_batch_size * self.gradient_accumulation_steps() * self.dp_world_size

    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return []
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Each group's momentum as DeepSpeed reports it: the ``betas`` pair of Adam-style optimizers,
        ``momentum`` of the others (SGD, RMSprop)."""
        if self.optimizer is None:
            return []
        return [tuple(g["betas"]) if "betas" in g else g.get("momentum") for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last optimizer step."""
        return self.state.grad_norm

    def was_step_applied(self) -> bool:
        return self.state.step_applied

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def flops_profiler(self) -> Any:
        """The ``FlopsProfiler`` while the ``flops_profiler`` section's profile step runs, else None."""
        return self.tools.flops_profiler

    def get_sequence_parallel_group(self) -> Any:
        """The torch process group of this rank's sequence-parallel peers (None without sequence parallelism)."""
        return self.seq_parallel_group

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (``set_to_none`` is accepted for torch parity; what a cleared gradient reads as is the
        stage's: None at stage 0, as in DeepSpeed)."""
        self.strategy.zero_grad()

    def _take_model_step(self, lr_kwargs: dict[str, Any] | None) -> None:
        self.runner.boundary_step(self, lr_kwargs)

    # ----------------------------------------------------------------------------- reporting
    def _loss_is_logged(self) -> bool:
        """Whether this step's loss is printed or monitored (the same answer on every rank)."""
        cfg, every = self._config, self._config.steps_per_print
        monitored = cfg.tensorboard.enabled or cfg.csv_monitor.enabled or cfg.wandb.enabled
        return bool(monitored or (every and self.global_steps % every == 0))

    def _reported_loss(self) -> float:
        """The loss the step line and ``Train/Samples/train_loss`` show, as DeepSpeed's pipeline engine
        computes it: the mean over the accumulation window's micro-batches, averaged over the
        data-parallel ranks (one scalar all-reduce, only on steps that log). The pipeline engine sets
        ``_last_loss`` to that value itself."""
        window, self._window_losses = self._window_losses, []
        if not window:
            return float(self._last_loss.float().item()) if self._last_loss is not None else float("nan")
        mean = torch.stack([loss.float().reshape(()) for loss in window]).mean()
        if self.comm.size > 1 and self._loss_is_logged():  # every replica (dp x sp) computed a loss
            mean = self.comm.all_reduce_sum_scalar(mean) / self.comm.size
        return float(mean.item())

    def _report_step(self) -> None:
        loss = self._reported_loss()
        if self.monitor is not None and self.monitor.enabled:
            events = [("Train/Samples/train_loss", loss, self.global_samples),
                      ("Train/Samples/lr", self.get_lr()[0] if self.get_lr() else 0.0, self.global_samples)]
            if self.fp16_enabled():
                events.append(("Train/Samples/loss_scale", self.loss_scaler.scale, self.global_samples))
            events += self.tools.events(self.global_samples, self.dp_world_size)
            self.monitor.write_events(events)
        every = self._config.steps_per_print
        if every and self.global_steps % every == 0 and self.global_rank == 0:
            # DeepSpeed's two lines, as its engines write them (log parsers look for these)
            logger.info("[Rank 0] step=%d, skipped=%d, lr=%s, mom=%s", self.global_steps, self.skipped_steps,
                        self.get_lr(), self.get_mom())
            iter_time = self.tools.throughput.take_iter_time()
            rate = self.train_batch_size() / iter_time if iter_time > 0 else 0.0
            logger.info("steps: %d loss: %.4f iter time (s): %.3f samples/sec: %.3f", self.global_steps, loss,
                        iter_time, rate)
            for line in self.tools.print_lines(self.dp_world_size, self.accelerator.memory_allocated(),
                                               self.accelerator.max_memory_allocated(),
                                               memory_is_rss=self.accelerator.kind != "cuda"):
                logger.info(line)

    def memory_report(self) -> dict[str, int]:
        """Bytes this process holds per category (parameters, gradients, master_weights,
        optimizer_state, buffers, comm_buckets; gathered_parameters under ZeRO-3, secondary_parameters with
        hpZ; offloaded and offload_buffers with offload) and ``total``, the resident sum (offloaded bytes excluded)."""
        report = dict(self.strategy.memory_report())
        # 'total' is what this process holds in memory: bytes offloaded to disk are reported apart
        report["total"] = sum(v for k, v in report.items() if k != "offloaded")
        return report

    # ---------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save a checkpoint under ``save_dir/tag`` (default tag ``global_step{N}``). Every rank must call
        it. Atomic: a crash mid-save leaves the previous checkpoint whole."""
        from deepshard.checkpoint.engine_checkpoint import save_engine_checkpoint

        if save_dir is None or not str(save_dir):  # Path("") would be the working directory
            raise ValueError(f"save_checkpoint needs a directory to save into, got save_dir={save_dir!r}; pass "
                             "a path such as 'checkpoints' (created if missing)")
        return save_engine_checkpoint(self, Path(save_dir), tag, client_state or {}, save_latest,
                                      exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None
                        ) -> tuple[str | None, dict | None]:
        """Load ``load_dir/tag`` (default: the tag in ``load_dir/latest``); returns ``(path, client_state)``,
        or ``(None, None)`` when there is nothing to load."""
        from deepshard.checkpoint.engine_load import load_engine_checkpoint

        if custom_load_fn is not None:
            raise NotImplementedError("custom_load_fn is not supported; load the module state yourself "
                                      "after load_checkpoint(..., load_module_only=True)")
        return load_engine_checkpoint(self, Path(load_dir), tag, load_module_strict, load_optimizer_states,
                                      load_lr_scheduler_states, load_module_only)

    def save_16bit_model(self, save_dir: str | Path, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the module's weights in its compute dtype (rank 0). ``*.safetensors`` names give a
        safetensors file; other names a ``torch.save`` file (what Hugging Face expects of ``*.bin``)."""
        from deepshard.checkpoint.engine_checkpoint import save_16bit_model

        return save_16bit_model(self, Path(save_dir), save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The full state dict in the compute dtype, on rank 0 (Accelerate's ``get_state_dict`` calls
        this); every rank must call it under ZeRO-3."""
        from deepshard.checkpoint.engine_checkpoint import consolidated_16bit_state_dict

        return consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None, collate_fn: Any = None,
                     num_local_io_workers: int | None = None) -> Any:
        """A DataLoader giving this rank its share of each global batch."""
        from deepshard.data import build_dataloader

        if data_sampler is not None:
            return torch.utils.data.DataLoader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                                               sampler=data_sampler, collate_fn=collate_fn)
        return build_dataloader(dataset, batch_size or self.train_micro_batch_size_per_gpu(),
                                self.topology.dp.rank, self.dp_world_size, collate_fn,
                                drop_last=self._config.dataloader_drop_last,
                                pin_memory=pin_memory and self.accelerator.kind == "cuda",
                                num_workers=num_local_io_workers or 0,
                                accumulation=self.gradient_accumulation_steps() if self._config.deterministic else None,
                                contiguous=self.strategy.atoms_contiguous)

    def atom_index(self, micro_step: int) -> int:
        """The deterministic mode (docs/determinism.md): which micro-batch of a global batch of
        ``dp x gas`` this rank must train at accumulation step ``micro_step`` (0 .. gas - 1) for every layout
        to give the same bits. The engine's own loader follows it; a loader of your own must too."""
        from deepshard.zero.canonical import atom_index

        return atom_index(self.topology.dp.rank, micro_step, self.dp_world_size, self.gradient_accumulation_steps(),
                          self.strategy.atoms_contiguous)

    def destroy(self) -> None:
        """Release what the engine holds (DeepSpeed's name): the strategy's hooks and files, the
        parameters' ownership, the monitors. The module keeps its current values; the engine is unusable
        afterwards. Safe to call twice."""
        if not isinstance(self.strategy, ReleasedStrategy):
            self.strategy.release()
            self.strategy = ReleasedStrategy(self.strategy)
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


class DeepShardEngine(EngineCoalescing, EngineCore):
    """Returned by ``deepshard.initialize`` for a plain model: DeepSpeed's ``forward`` / ``backward`` /
    ``step`` training calls over the shared core, and ``coalesce_grad_reduction`` (``engine_coalesce.py``)."""

    def __init__(self, parts: EngineParts) -> None:
        super().__init__(parts)
        self._no_sync_depth = 0
        self._boundary_override: bool | None = None

    # ---------------------------------------------------------------------- accumulation boundary
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        if not self._config.managed_gradient_accumulation:
            return True
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary (Accelerate does this); pass the value for every micro-step. Refused, as
        DeepSpeed refuses it, with ``managed_gradient_accumulation`` false: every step() is the boundary."""
        if not self._config.managed_gradient_accumulation:
            raise GradContextMisuse("set_gradient_accumulation_boundary() with managed_gradient_accumulation false: "
                                    "the caller owns the boundary, every step() is one; drop the call, or set "
                                    "managed_gradient_accumulation true to mark boundaries yourself")
        self._boundary_override = bool(is_boundary)

    @property
    def _is_gradient_accumulation_boundary(self) -> bool | None:
        """DeepSpeed's attribute: the boundary set by ``set_gradient_accumulation_boundary`` (None: not set,
        the micro-step counter decides)."""
        return self._boundary_override

    @_is_gradient_accumulation_boundary.setter
    def _is_gradient_accumulation_boundary(self, value: bool | None) -> None:
        self._boundary_override = None if value is None else bool(value)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside skip the gradient reduction (local accumulation only)."""
        if self._coalescing:
            raise GradContextMisuse("no_sync() cannot be used inside a coalesce_grad_reduction() block (it holds "
                                    "the gradients local already); leave the outer block first")
        if not self.strategy.capabilities.no_sync:
            raise GradContextMisuse(f"no_sync() is not compatible with ZeRO stage {self.zero_optimization_stage()}: "
                               "gradients are partitioned as they are produced; use gradient_accumulation_steps")
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    # ------------------------------------------------------------------------------- training
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.tools.on_forward(self, inputs, kwargs)
        with self.tools.time("forward"):
            inputs = self.precision.cast_inputs(inputs)  # DeepSpeed's rule: fp16.auto_cast only, positional only
            with explain_sharded_parameter_errors(self.strategy.capabilities.partitioned_parameters), \
                    self.precision.forward_errors((inputs, kwargs)):
                return self.module(*inputs, **kwargs)

    def compile(self, backend: Any = "inductor", compile_kwargs: dict[str, Any] | None = None) -> None:
        """Compile the wrapped module in place (DeepSpeed's ``engine.compile``): names, hooks and
        checkpoints are unchanged. At ZeRO stage 3 pass ``torch.compile(model)`` to ``initialize``
        instead (see docs/compile-and-checkpointing.md)."""
        if self.strategy.capabilities.partitioned_parameters:
            raise NotImplementedError(
                "engine.compile() at ZeRO stage 3: the stage-3 hooks were set up for eager execution; "
                "compile before initialize instead: deepshard.initialize(model=torch.compile(model), ...)")
        compile_module(self.module, backend, compile_kwargs)

    @property
    def is_compiled(self) -> bool:
        """True when the module's calls go through ``torch.compile``."""
        return module_is_compiled(self.module)

    def _prepare_backward(self) -> None:
        reduce = self.is_gradient_accumulation_boundary() and self._no_sync_depth == 0 and not self._coalescing
        self.strategy.begin_backward(reduce)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """PyTorch-style backward: ``engine.scale(loss).backward()`` then ``engine.step()``."""
        self._check_loss(loss, "scale")
        self._record_loss(loss)
        _, scaled = self.runner.for_backward(loss)
        self._prepare_backward()
        return scaled

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale); gradients are
        reduced across data-parallel ranks at the accumulation boundary. Returns the scaled loss."""
        with self.tools.time("backward"):
            self._check_loss(loss)
            self._record_loss(loss)
            loss, scaled = self.runner.for_backward(loss, divide=scale_wrt_gas)
            self._prepare_backward()
            with self.tools.time("backward_inner"):
                scaled.backward(retain_graph=retain_graph)
            with self.tools.time("backward_allreduce"):
                self.strategy.end_backward()
        return loss

    def _record_loss(self, loss: torch.Tensor) -> None:
        self._last_loss = loss.detach()
        self._window_losses.append(self._last_loss)

    @staticmethod
    def _check_loss(loss: torch.Tensor, caller: str = "backward") -> None:
        if not torch.is_tensor(loss) or loss.numel() != 1:
            shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
            raise LossError(f"engine.{caller} expects the loss as a scalar tensor, got {shape}; reduce it first "
                            "(e.g. loss.mean()), or call output.backward(gradient) yourself for a non-scalar output")
        if not loss.requires_grad:
            raise LossError(f"the loss passed to engine.{caller} does not require grad: was it computed "
                            "under torch.no_grad(), or are all parameters frozen?")

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Apply the update at the accumulation boundary (clipping, fp16 overflow skip, LR schedule);
        a no-op between boundaries except for counting the micro-step."""
        if self._no_sync_depth > 0 or self._coalescing:
            raise GradContextMisuse("engine.step() was called inside engine.no_sync() or "
                                    "engine.coalesce_grad_reduction(); leave the block for the micro-step that "
                                    "should synchronize and step")
        boundary = self.is_gradient_accumulation_boundary()
        with self.tools.time("step"):
            self.strategy.end_backward()
            self.state.step_applied = False
            if boundary:
                self._take_model_step(lr_kwargs)
        self.runner.finish(self, 1, boundary)


DeepSpeedEngine = EngineCore
"""DeepSpeed's class name (``deepspeed.runtime.engine.DeepSpeedEngine``): the base of every engine."""
