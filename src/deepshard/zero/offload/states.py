"""Where a rank's optimizer side of the shard lives, and how the optimizer steps over it.

ZeRO stages 1-3 hand the optimizer *pieces*: 1-D parameters that are views of the rank's fp32 values
(the master weights in 16-bit training, the model's own fp32 parameters otherwise). A
:class:`ShardStates` owns those pieces, the master weights and the optimizer state's placement, and
runs the update; the strategy only supplies gradients and a ``publish`` callback that copies updated
fp32 values of a shard range into the model's parameters. Two implementations:

- :class:`ResidentStates` (here): everything in device memory, one ``optimizer.step()``: ZeRO as
  without offload.
- ``SubGroupStates`` (``subgroup_states.py``): masters and states off the device (host memory or
  disk), stepped one sub-group at a time.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from deepshard.optim.kernels import fuse_host_adam
from deepshard.optim.whole_vectors import step_whole_vectors

from deepshard.zero.partition import Fragment

if TYPE_CHECKING:
    from deepshard.zero.offload.backing import Backing

# publish(shard_start, fp32 values): copy updated values of shard range [start, start + numel) to the model
Publish = Callable[[int, torch.Tensor], None]


@dataclass
class StatesSpec:
    """What a strategy tells the factory about its shard.

    ``values`` gives the resident fp32 value of a fragment when the model's own parameters are the
    fp32 values the optimizer updates (fp32 training with the parameters in memory); ``None`` when they
    are not (the ZeRO-3 shard on disk), which makes the states keep master weights."""

    fragments: list[Fragment]
    shard_numel: int
    device: torch.device
    keeps_master_weights: bool
    values: Callable[[Fragment], torch.Tensor] | None
    rank: int
    shared_masters: "tuple[Backing, str] | None" = None
    """Where the fp32 values already are when the parameter shard is fp32 and on disk, mapped into
    memory: ``(backing, name)`` of that shard. Offloaded states on disk then use it as their master
    weights instead of keeping a second copy (no ``master`` file: a fifth less disk traffic per step)."""

    @property
    def offloaded_masters(self) -> bool:
        """Whether offloaded states keep fp32 master weights: in 16-bit training, when the parameters
        are not resident, or when they are on an accelerator (the optimizer steps on the host)."""
        return self.keeps_master_weights or self.values is None or self.device.type != "cpu"


class ShardStates(ABC):
    """The optimizer's pieces, their master weights and optimizer state (see the module docstring)."""

    pieces: list[Fragment]
    params: list[torch.nn.Parameter]
    has_masters: bool
    optimizer: torch.optim.Optimizer | None = None
    steps_on_host: bool = True  # the optimizer updates these states on the CPU

    def bind(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The optimizer whose param groups hold ``params``; on the host, torch's Adam/AdamW step with
        torch's fused kernel unless the user chose a kernel (``deepshard.optim.kernels``)."""
        self.optimizer = optimizer
        if optimizer is not None and self.steps_on_host:
            fuse_host_adam(optimizer, "zero_optimization")

    def bound(self) -> torch.optim.Optimizer:
        """The optimizer :meth:`bind` gave, for the update (the strategy refuses a step without one first)."""
        if self.optimizer is None:
            raise RuntimeError("the ZeRO optimizer states have no optimizer to step: pass optimizer=... to "
                               "deepshard.initialize or add an \"optimizer\" section to the config")
        return self.optimizer

    @abstractmethod
    def write_masters(self, start: int, values: torch.Tensor) -> None:
        """Set the fp32 master weights of shard range ``[start, start + values.numel())`` (no-op without
        masters); call ``flush`` before relying on them."""

    def flush(self) -> None:
        """Finish outstanding writes."""

    @abstractmethod
    def step(self, grads: list[torch.Tensor], multiplier: float, publish: Publish) -> None:
        """``grads[i]``: the reduced gradient of piece ``i``; multiply it by ``multiplier``, run the
        optimizer, and publish the updated values."""

    def step_pieces(self, indices: list[int], grads: list[torch.Tensor], multiplier: float,
                    publish: Publish) -> None:
        """Update only pieces ``indices`` (their reduced gradients ``grads``), for an optimizer step taken
        during backward, group by group."""
        raise NotImplementedError(f"{type(self).__name__} updates all pieces at once; an optimizer step in "
                                  "backward needs the states on the device (no offload)")

    @abstractmethod
    def piece_value(self, i: int) -> torch.Tensor:
        """The fp32 value of piece ``i`` (1-D)."""

    @abstractmethod
    def piece_state(self, i: int) -> dict[str, Any]:
        """The optimizer state of piece ``i``."""

    def records(self) -> Iterator[tuple[int, torch.Tensor, dict[str, Any]]]:
        """``(i, value, state)`` for every piece (for checkpoints)."""
        for i in range(len(self.pieces)):
            yield i, self.piece_value(i), self.piece_state(i)

    @abstractmethod
    def load(self, values: Callable[[int], torch.Tensor | None],
             states: Callable[[int], dict[str, Any] | None] | None) -> None:
        """Set piece values (``None``: keep) and, when ``states`` is given, replace the optimizer state."""

    @abstractmethod
    def write_piece(self, i: int, value: torch.Tensor | None, state: dict[str, torch.Tensor]) -> None:
        """Overwrite piece ``i``'s fp32 value (unless ``value`` is None) and the elementwise optimizer states
        named in ``state`` (each must exist already: the optimizer creates them at its first step). The
        caller publishes a new value to the model (``deepshard.utils.safe_set_*``)."""

    @abstractmethod
    def memory(self) -> dict[str, int]:
        """Bytes: ``master_weights`` (resident), ``offloaded`` (host or disk), ``offload_buffers``."""

    def close(self) -> None:
        """Release files and buffers."""


class ResidentStates(ShardStates):
    """Masters (when kept) and optimizer state on the compute device; one ``optimizer.step()``."""

    def __init__(self, spec: StatesSpec) -> None:
        self.steps_on_host = spec.device.type == "cpu"
        self.pieces = list(spec.fragments)
        self.has_masters = spec.keeps_master_weights or spec.values is None
        self.masters = (torch.zeros(spec.shard_numel, dtype=torch.float32, device=spec.device)
                        if self.has_masters else None)
        self.params = []
        for p in self.pieces:
            value = (self.masters[p.shard_start:p.shard_start + p.numel] if self.masters is not None
                     else spec.values(p))  # type: ignore[misc]
            self.params.append(torch.nn.Parameter(value, requires_grad=True))

    @torch.no_grad()
    def write_masters(self, start: int, values: torch.Tensor) -> None:
        if self.masters is not None:
            self.masters[start:start + values.numel()].copy_(values.reshape(-1))

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], multiplier: float, publish: Publish) -> None:
        mixed = self.masters is not None
        for fp, src in zip(self.params, grads):
            if mixed:
                g = src.to(torch.float32, copy=True)
                fp.grad = g.mul_(multiplier) if multiplier != 1.0 else g
            else:
                fp.grad = src
        if not mixed and multiplier != 1.0 and grads:
            torch._foreach_mul_(grads, multiplier)
        step_whole_vectors(self.bound())
        if mixed:
            for fp in self.params:
                fp.grad = None
            publish(0, self.masters)  # type: ignore[arg-type]

    def step_pieces(self, indices: list[int], grads: list[torch.Tensor], multiplier: float,
                    publish: Publish) -> None:
        """torch optimizers skip parameters whose ``.grad`` is None: only ``indices`` get one."""
        params = [self.params[i] for i in indices]
        for fp, src in zip(params, grads):
            g = src.to(torch.float32) if src.dtype != torch.float32 else src
            fp.grad = g.mul_(multiplier) if multiplier != 1.0 else g
        step_whole_vectors(self.bound())
        for fp in params:
            fp.grad = None
        if self.masters is not None:
            for i in indices:
                piece = self.pieces[i]
                publish(piece.shard_start, self.masters[piece.shard_start:piece.shard_start + piece.numel])

    def piece_value(self, i: int) -> torch.Tensor:
        return self.params[i].detach()

    def piece_state(self, i: int) -> dict[str, Any]:
        if self.optimizer is None:
            return {}
        return dict(self.optimizer.state.get(self.params[i], {}))

    @torch.no_grad()
    def load(self, values: Callable[[int], torch.Tensor | None],
             states: Callable[[int], dict[str, Any] | None] | None) -> None:
        for i, fp in enumerate(self.params):
            v = values(i)
            if v is not None:
                fp.copy_(v.reshape(fp.shape))
        if states is None or self.optimizer is None:
            return
        self.optimizer.state.clear()
        index = {id(fp): i for i, fp in enumerate(self.params)}
        # in the param groups' order, the order a step creates the state in, so that the optimizer's
        # state_dict() after a load lists its entries as before the save (pieces are in layout order)
        for fp in (fp for group in self.optimizer.param_groups for fp in group["params"] if id(fp) in index):
            state = states(index[id(fp)])
            if state:
                self.optimizer.state[fp] = state

    @torch.no_grad()
    def write_piece(self, i: int, value: torch.Tensor | None, state: dict[str, torch.Tensor]) -> None:
        fp = self.params[i]
        if value is not None:
            fp.copy_(value.reshape(-1))
        held = self.optimizer.state.get(fp, {}) if self.optimizer is not None else {}
        for key, v in state.items():
            check_writable(key, (k for k, t in held.items() if torch.is_tensor(t) and t.dim() > 0), held,
                           self.pieces[i].name)
            held[key].copy_(v.reshape(-1))

    def memory(self) -> dict[str, int]:
        return {"master_weights": 0 if self.masters is None else self.masters.numel() * 4,
                "offloaded": 0, "offload_buffers": 0}


def check_writable(key: str, elementwise: Iterable[str], held: dict[str, Any], name: str) -> None:
    """Refuse a write of optimizer state ``key`` of a piece of parameter ``name`` unless it is one of the
    piece's ``elementwise`` states (``held``: its states by name, scalars included, for the message)."""
    elementwise = set(elementwise)
    if key in elementwise:
        return
    if key in held:
        raise ValueError(f"optimizer state {key!r} of parameter '{name}' is a scalar ({held[key]!r}), not a "
                         "per-element tensor: only elementwise states (such as Adam's exp_avg) can be written")
    have = sorted(elementwise) or "none yet"
    raise KeyError(f"parameter '{name}' has no optimizer state {key!r} to write (it has {have}): the optimizer "
                   "creates its state at its first step; write optimizer states after a step")
