"""``PipelineEngine``: what ``deepshard.initialize`` returns for a ``PipelineModule``.

``train_batch`` runs one schedule (``pipeline.schedule``: 1F1B by default) over
``gradient_accumulation_steps`` micro-batches as a dispatch table over its actions, then, once: the tied
weights' gradients summed over the stages that hold them, the data-parallel reduction (the ZeRO strategy
of any stage 0-2 reduces the locally accumulated gradients once, after the last backward), and the
one optimizer-step path (``deepshard.step``: the norm over dp then over the model-parallel group).

Seams for 3D composition: ``engine.module`` is this stage's module, ``engine.topology`` the grid,
``engine.reduce_gradients()`` the reduce-once hook.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from deepshard.config.base import dtype_from_name
from deepshard.engine import EngineCore
from deepshard.parts import EngineParts
from deepshard.pipe.grad_accum import SIXTEEN_BIT, Fp32GradSums
from deepshard.pipe.module import PipelineModule
from deepshard.pipe.p2p import StageLink, TensorMeta
from deepshard.pipe.schedule import Action, Kind, build_schedule, schedule_name
from deepshard.pipe.tied import TiedWeights
from deepshard.pipe.weight_grad import DeferWeightGrads, WeightGradStore


class PipelineError(RuntimeError):
    """DeepSpeed's error for calls a pipeline engine does not take."""


@dataclass
class _Unit:
    """One micro-batch's buffers in one model chunk on this stage."""

    first: bool = False
    """This chunk is the model's first virtual stage (it reads the inputs, sends no input gradient)."""
    last: bool = False
    """This chunk is the model's last virtual stage (it computes the loss)."""
    inputs: list[torch.Tensor] = field(default_factory=list)
    input_tuple: bool = False
    outputs: Any = None
    out_tensors: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    grad_out: list[torch.Tensor] | None = None
    grad_in: list[torch.Tensor] | None = None
    store: WeightGradStore | None = None
    """The deferred weight-gradient work of a split backward (zero-bubble schedules)."""


@dataclass
class _BatchRun:
    """The state of one ``train_batch`` / ``eval_batch``."""

    data: Iterator[Any] | None
    micro_batches: int
    units: dict[tuple[int, int], _Unit] = field(default_factory=dict)
    """Keyed by (micro-batch, chunk)."""
    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    train: bool = True
    compute_loss: bool = True
    keep_outputs: bool = False
    split_backward: bool = False


def configure_pipeline(module: PipelineModule, cfg: Any) -> None:
    """The config's pipeline keys applied to the module (the plan check refused what cannot combine):
    the schedule's name checked, the activation-checkpoint interval when the module has none."""
    schedule_name(cfg.pipeline.schedule)  # an unknown name raises here, naming the choices
    if cfg.pipeline.activation_checkpoint_interval and not module.activation_checkpoint_interval:
        module.set_checkpoint_interval(cfg.pipeline.activation_checkpoint_interval)


def configure_recompute(module: PipelineModule, cfg: Any) -> None:
    """The recompute function of the module's checkpointed blocks, unless the module was given its own
    ``activation_checkpoint_func``: ``checkpoint``, or ``non_reentrant_checkpoint`` with
    ``pipeline.use_reentrant: false`` (both non-reentrant on deepshard), with the options of the config's
    ``activation_checkpointing`` section. Set whatever the interval, as ``set_checkpoint_interval`` may
    turn checkpointing on later."""
    if module.activation_checkpoint_func is None:
        from functools import partial

        from deepshard.checkpointing import CheckpointOptions, checkpoint, non_reentrant_checkpoint, options_from_config

        options = options_from_config(cfg.activation_checkpointing)
        if cfg.pipeline.use_reentrant is False:
            module.activation_checkpoint_func = (non_reentrant_checkpoint if options == CheckpointOptions()
                                                 else partial(non_reentrant_checkpoint, options=options))
        else:
            module.activation_checkpoint_func = partial(checkpoint, options=options)


class PipelineEngine(EngineCore):
    """DeepSpeed's ``PipelineEngine`` contract: ``train_batch`` / ``eval_batch``; ``forward``, ``backward``
    and ``step`` raise ``PipelineError``. It shares the engine core (accessors, checkpoints, reporting) and
    its one step path (``self.runner``) with the plain engine; it inherits no training call."""

    pipeline_parallelism = True

    def __init__(self, parts: EngineParts) -> None:
        if parts.tied is None or not isinstance(parts.module, PipelineModule):
            raise TypeError(f"PipelineEngine trains a PipelineModule with its tied-weight groups (EngineParts.tied); "
                            f"got a {type(parts.module).__name__} with tied={parts.tied!r}: build it with "
                            "deepshard.initialize, which picks the engine by model kind")
        super().__init__(parts)
        self.module: PipelineModule = parts.module
        self.tied: TiedWeights = parts.tied
        self.grad_sums = _fp32_grad_sums(self.module, self.precision.param_dtype, self._config)
        dims, coord = self.topology.dims, self.topology.coord
        self.num_stages, self.stage_id = dims.pp, coord.pp
        self.num_chunks = self.module.num_chunks
        self.link = StageLink(self.stage_id, self.global_rank, self.device,
                              watchdog=self.topology.pp.watchdog if self.device.type == "cpu" else None,
                              logger=self.comms_logger)
        self._data_iter: Iterator[Any] | None = None
        self._batch_fn: Callable[[Any], Any] | None = None
        self._plans: dict[tuple[str, int, bool], tuple[list[Action], dict[int, int]]] = {}
        self._dispatch: dict[Kind, Callable[[_BatchRun, Action], None]] = {
            Kind.FORWARD: self._forward, Kind.BACKWARD: self._backward, Kind.BACKWARD_INPUT: self._backward_input,
            Kind.BACKWARD_WEIGHT: self._backward_weight, Kind.SEND_ACT: self._send_act, Kind.RECV_ACT: self._recv_act,
            Kind.SEND_GRAD: self._send_grad, Kind.RECV_GRAD: self._recv_grad}

    # ----------------------------------------------------------------------------------- public API
    def destroy(self) -> None:
        if self.grad_sums is not None:
            self.grad_sums.remove()
            self.grad_sums = None
        super().destroy()

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator ``train_batch()`` pulls from when it is given none."""
        self._data_iter = iterator

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Post-process every item pulled from the data iterator."""
        self._batch_fn = fn

    def _reentrant_activation_checkpointing(self) -> bool:
        """DeepSpeed's name of ``module.checkpoints_reentrant()``: whether the first stage's inputs are made
        to require grad."""
        return self.module.checkpoints_reentrant()

    def reset_activation_shape(self) -> None:
        """Shapes travel with every message here: nothing is cached, nothing to reset."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns the loss averaged
        over micro-batches and data-parallel ranks, on every stage."""
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() was called with gradients disabled (inside torch.no_grad()); "
                                "use eval_batch() for forward-only passes")
        self.module.train()
        m = self.gradient_accumulation_steps()
        name = schedule_name(self._config.pipeline.schedule)
        # operator-level split (weight_grad.py); with activation checkpointing the recomputed forward
        # would not record, so the split falls back to two autograd traversals
        split = name == "zb-h1" and not self.module.activation_checkpoint_interval
        run = _BatchRun(self._iterator(data_iter), m, split_backward=split)
        self.tools.throughput.start()
        self.tools.tput_timer.start()
        with self.tools.time("backward"):  # the whole schedule: forwards, backwards, transfers, reduction
            actions, receives = self._plan(name, m)
            self.link.begin(receives)
            for action in actions:
                self._dispatch[action.kind](run, action)
            self.link.end()
            self.reduce_gradients()
        loss = self._batch_loss(run, average=True)
        self._last_loss = loss
        with self.tools.time("step"):
            self._take_model_step(None)
        self.runner.finish(self, m, True)
        return loss

    def eval_batch(self, data_iter: Iterator[Any] | None = None, return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward only over ``num_micro_batches`` (default: the accumulation steps). Returns the loss
        (mean over micro-batches with ``reduce_output='avg'``, else the list; averaged over data-parallel
        ranks and sent to every stage with ``bcast_loss``); with ``return_logits``, ``(loss, outputs)`` with
        every micro-batch's outputs on the last stage (None elsewhere)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output={reduce_output!r}: use 'avg' or None")
        self.module.eval()
        m = num_micro_batches or self.gradient_accumulation_steps()
        run = _BatchRun(self._iterator(data_iter), m, train=False, compute_loss=compute_loss,
                        keep_outputs=return_logits)
        with torch.no_grad():  # the forwards (and their transfers) of the training schedule's order
            actions, receives = self._plan("gpipe" if self.num_chunks == 1 else "interleaved", m, forward_only=True)
            self.link.begin(receives)
            for action in actions:
                self._dispatch[action.kind](run, action)
            self.link.end()
        self.module.train()
        loss: Any = None
        if compute_loss:
            loss = self._batch_loss(run, average=reduce_output == "avg", broadcast=bcast_loss)
        if return_logits:
            return loss, (run.outputs if self.is_last_stage() else None)
        return loss

    def reduce_gradients(self) -> None:
        """The reduce-once hook: tied gradients summed over their stages, then the strategy reduces the
        locally accumulated gradients over the data-parallel group."""
        if self.grad_sums is not None:
            self.grad_sums.flush()  # the fp32 sums of the micro-batches' gradients, rounded once
        self.tied.all_reduce_grads()
        self.runner.reduce_once(self.strategy)

    # ------------------------------------------------------------------------------------- data
    def _iterator(self, data_iter: Iterator[Any] | None) -> Iterator[Any] | None:
        if not (self.is_first_stage() or self.is_last_stage()):
            return None  # middle stages never read data
        if data_iter is not None:
            return data_iter
        if self._data_iter is None and self.training_dataloader is not None:
            from deepshard.data import RepeatingLoader

            self._data_iter = RepeatingLoader(self.training_dataloader)
        if self._data_iter is None:
            raise PipelineError("train_batch() needs data: pass data_iter=, call set_dataiterator(), or give "
                                "training_data= to deepshard.initialize")
        return self._data_iter

    def _next_item(self, run: _BatchRun, index: int) -> tuple[Any, Any]:
        if run.data is None:
            raise PipelineError("this stage has no data iterator")
        try:
            item = next(run.data)
        except StopIteration:
            raise PipelineError(f"the data iterator ran out at micro-batch {index} of {run.micro_batches}: a "
                                "batch needs gradient_accumulation_steps items (wrap the loader in "
                                "deepshard.utils.RepeatingLoader)") from None
        if self._batch_fn is not None:
            item = self._batch_fn(item)
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise PipelineError(f"pipeline data items must be (inputs, labels) pairs, got {type(item).__name__}")
        return item[0], item[1]

    def _plan(self, name: str, m: int, forward_only: bool = False) -> tuple[list[Action], dict[int, int]]:
        """This stage's actions of schedule ``name`` over ``m`` micro-batches (only the forwards and their
        transfers with ``forward_only``), and how many messages they receive from each peer rank (what the
        link posts ahead for); built once per (name, m)."""
        key = (name, m, forward_only)
        if key not in self._plans:
            actions = build_schedule(name, self.num_stages, m, self.num_chunks)[self.stage_id]
            if forward_only:
                actions = [a for a in actions if a.kind in (Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT)]
            receives: dict[int, int] = {}
            for a in actions:
                if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                    receives[self._peer(a)] = receives.get(self._peer(a), 0) + 1
            self._plans[key] = (actions, receives)
        return self._plans[key]

    def _peer(self, a: Action) -> int:
        """The global rank of the action's peer stage (in this rank's data and tensor coordinates)."""
        return self.topology.dims.stage_rank(self.global_rank, a.peer)

    def _is_first(self, a: Action) -> bool:
        return self.stage_id == 0 and a.chunk == 0

    def _is_last(self, a: Action) -> bool:
        return self.stage_id == self.num_stages - 1 and a.chunk == self.num_chunks - 1

    # ------------------------------------------------------------------------------------ actions
    def _forward(self, run: _BatchRun, a: Action) -> None:
        unit = run.units.setdefault((a.micro_batch, a.chunk), _Unit())
        unit.first, unit.last = self._is_first(a), self._is_last(a)
        labels = None
        if unit.first or unit.last:  # a rank reads each micro-batch once: at its first or last chunk
            inputs, labels = self._next_item(run, a.micro_batch)
            if unit.first:
                inputs = _to_device(inputs, self.device)
                unit.inputs, unit.input_tuple = _as_list(inputs)
                if run.train and self.module.checkpoints_reentrant():  # a reentrant recompute needs them
                    unit.inputs = [t.detach().clone().requires_grad_(True) if t.is_floating_point() else t
                                   for t in unit.inputs]
        fed = unit.inputs if unit.first else [_fresh(t) for t in unit.inputs]
        # DeepSpeed's rule at every stage's input (its cast is a hook on the PipelineModule): fp16.auto_cast only
        x = self.precision.cast_inputs(tuple(fed) if unit.input_tuple else fed[0])
        with self.precision.forward_errors(x):
            if run.split_backward:
                unit.store = WeightGradStore(self.grad_sums.add if self.grad_sums is not None else None)
                with DeferWeightGrads(unit.store):
                    out = self.module(x, chunk=a.chunk)
            else:
                out = self.module(x, chunk=a.chunk)
        unit.outputs = out
        unit.out_tensors = _as_list(out)[0]
        if unit.last:
            if run.keep_outputs:
                run.outputs.append(out.detach() if torch.is_tensor(out) else tuple(t.detach() for t in out))
            if run.compute_loss or run.train:
                fn = self.module.loss_fn
                loss = fn(out, _to_device(labels, self.device)) if fn is not None else out
                if not torch.is_tensor(loss) or loss.numel() != 1:
                    raise PipelineError("the last stage must produce a scalar loss: give PipelineModule a "
                                        "loss_fn(outputs, labels) or make the last layer return the loss")
                unit.loss = loss
                run.losses.append(loss.detach().float())
        if not run.train and unit.last:
            run.units.pop((a.micro_batch, a.chunk), None)  # forward only: nothing to keep

    def _send_act(self, run: _BatchRun, a: Action) -> None:
        unit = run.units[(a.micro_batch, a.chunk)]
        self.link.send(unit.outputs, self._peer(a))
        if not run.train:
            run.units.pop((a.micro_batch, a.chunk), None)

    def _recv_act(self, run: _BatchRun, a: Action) -> None:
        tensors, _, is_tuple = self.link.recv(self._peer(a), f"activations of micro-batch {a.micro_batch}",
                                              src_stage=a.peer)
        if run.train:
            for t in tensors:
                if t.is_floating_point():
                    t.requires_grad_(True)
        run.units[(a.micro_batch, a.chunk)] = _Unit(inputs=tensors, input_tuple=is_tuple)

    def _recv_grad(self, run: _BatchRun, a: Action) -> None:
        unit = run.units[(a.micro_batch, a.chunk)]
        expect = [TensorMeta(tuple(t.shape), t.dtype, False) for t in unit.out_tensors if t.is_floating_point()]
        unit.grad_out, _, _ = self.link.recv(self._peer(a), f"output gradients of micro-batch {a.micro_batch}",
                                            expect, src_stage=a.peer)

    def _send_grad(self, run: _BatchRun, a: Action) -> None:
        unit = run.units[(a.micro_batch, a.chunk)]
        self.link.send(tuple(unit.grad_in or []), self._peer(a))
        if unit.outputs is None:  # the weight pass (if any) is done too
            run.units.pop((a.micro_batch, a.chunk), None)

    def _roots(self, unit: _Unit) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What backward starts from: the scaled loss on the last virtual stage, else the outputs that
        need a gradient with the received gradients."""
        if unit.last:
            _, scaled = self.runner.for_backward(unit.loss)
            return [scaled], [torch.ones_like(scaled)]
        floats = [t for t in unit.out_tensors if t.is_floating_point()]
        pairs = [(t, g) for t, g in zip(floats, unit.grad_out or []) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _input_grads(self, unit: _Unit) -> list[torch.Tensor]:
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in unit.inputs if t.is_floating_point()]

    def _backward(self, run: _BatchRun, a: Action) -> None:
        unit = run.units[(a.micro_batch, a.chunk)]
        roots, grads = self._roots(unit)
        if roots:
            torch.autograd.backward(roots, grads)
        unit.grad_in = self._input_grads(unit) if not unit.first else []
        unit.outputs, unit.out_tensors, unit.loss, unit.grad_out = None, [], None, None
        if unit.first:
            run.units.pop((a.micro_batch, a.chunk), None)

    def _backward_input(self, run: _BatchRun, a: Action) -> None:
        """ZB-H1's first half: the input gradients (and the cheap non-linear parameters' gradients); the
        linear layers' weight GEMMs wait in ``unit.store``. Without a store: gradients of the stage inputs
        only, the graph kept for a second traversal in the weight pass."""
        unit = run.units[(a.micro_batch, a.chunk)]
        if unit.store is not None:
            roots, grads = self._roots(unit)
            if roots:
                torch.autograd.backward(roots, grads)
            unit.grad_in = self._input_grads(unit) if not unit.first else []
            unit.out_tensors, unit.loss, unit.grad_out = [], None, None
            return
        inputs = [t for t in unit.inputs if t.is_floating_point() and t.requires_grad]
        roots, grads = self._roots(unit)
        unit.grad_out = grads
        if inputs and roots:
            got = torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)
            by_id = {id(t): g for t, g in zip(inputs, got)}
            unit.grad_in = [by_id.get(id(t)) if by_id.get(id(t)) is not None else torch.zeros_like(t)
                            for t in unit.inputs if t.is_floating_point()]
        else:
            unit.grad_in = [torch.zeros_like(t) for t in unit.inputs if t.is_floating_point()]
        unit.out_tensors = roots  # the weight pass starts from the same roots

    def _backward_weight(self, run: _BatchRun, a: Action) -> None:
        """ZB-H1's second half: parameter gradients, accumulated locally (reduced once per batch)."""
        unit = run.units[(a.micro_batch, a.chunk)]
        if unit.store is not None:
            unit.store.run()
        elif unit.out_tensors:
            params = [p for p in self.module.parameters() if p.requires_grad]
            torch.autograd.backward(unit.out_tensors, unit.grad_out, inputs=params)
        run.units.pop((a.micro_batch, a.chunk), None)  # its input gradient was sent right after the input pass

    # ------------------------------------------------------------------------------------- losses
    def _batch_loss(self, run: _BatchRun, average: bool = True, broadcast: bool = True) -> Any:
        """The micro-batch losses averaged (or listed), averaged over dp, sent from the last stage to all."""
        m = run.micro_batches
        if self.is_last_stage():
            values = torch.stack(run.losses) if run.losses else torch.zeros(m)
        else:
            values = torch.zeros(m, dtype=torch.float32)
        values = values.to(self.device).float()
        if self.dp_world_size > 1:
            self.topology.dp.all_reduce(values)
            values /= self.dp_world_size
        if broadcast and self.num_stages > 1:
            self.topology.pp.broadcast(values, src=self.num_stages - 1)
        return values.mean() if average else list(values.unbind())


def _fp32_grad_sums(module: PipelineModule, param_dtype: torch.dtype, cfg: Any) -> Fp32GradSums | None:
    """16-bit stages sum their micro-batches' gradients in fp32 unless ``data_types.grad_accum_dtype``
    names the training dtype (DeepSpeed's pipeline default is fp32 too)."""
    if param_dtype not in SIXTEEN_BIT:
        return None
    accum = cfg.data_types.grad_accum_dtype
    if accum is not None and dtype_from_name(accum) != torch.float32:
        return None  # the training dtype itself (any other is refused with the config)
    return Fp32GradSums(module.parameters())


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A received activation as the stage's layers see it: a copy of the leaf that collects the input
    gradient, so a first layer that works in place (``ReLU(inplace=True)``) writes into the copy."""
    return t.clone() if t.requires_grad else t


def _as_list(value: Any) -> tuple[list[torch.Tensor], bool]:
    if torch.is_tensor(value):
        return [value], False
    if isinstance(value, (tuple, list)):
        return list(value), True
    raise PipelineError(f"stage inputs and outputs must be tensors or tuples of tensors, got {type(value).__name__}")


def _to_device(value: Any, device: torch.device) -> Any:
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value
