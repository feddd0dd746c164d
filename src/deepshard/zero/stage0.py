"""ZeRO stage 0: plain data parallelism.

Every process holds the whole model, its gradients and the whole optimizer state. Gradients are
all-reduced in buckets as backward produces them (``reduce_bucket_size`` elements per bucket),
overlapped with the rest of backward through async collective handles. With fp16/bf16 the optimizer
updates fp32 master weights that are copied back into the module after each step.
"""
from __future__ import annotations

from pathlib import Path

import torch

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint.named_optim import export_optimizer_state, import_optimizer_state
from deepshard.zero.buckets import BucketedAllReduce
from deepshard.zero.master import MasterWeights, param_names, trainable_params
from deepshard.zero.strategy import StrategyContext, ZeroStrategy

MODEL_FILE = "model.safetensors"
OPTIM_TENSORS_FILE = "optimizer.safetensors"
OPTIM_META_FILE = "optimizer.json"


class Stage0Strategy(ZeroStrategy):
    """Bucketed, overlapped all-reduce data parallelism (DDP semantics)."""

    stage = 0

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 ctx: StrategyContext) -> None:
        super().__init__(module, optimizer, ctx)
        self.params = trainable_params(module)
        self.names = param_names(module)
        policy = ctx.precision
        self.masters: MasterWeights | None = None
        if policy.keeps_master_weights:
            # masters come from the fp32 weights, before the module is cast to 16 bits
            self.masters = MasterWeights(self.params, policy.master_dtype)
            if optimizer is not None:
                self.masters.swap_into(optimizer)
        module.to(policy.param_dtype)
        predivide = ctx.gradient_predivide_factor
        if ctx.prescale_gradients and predivide == 1.0:
            predivide = float(ctx.comm.size)
        self.reducer = BucketedAllReduce(
            self.params, ctx.comm, int(ctx.zero_config.reduce_bucket_size),
            comm_dtype=policy.comm_dtype, predivide=predivide, average=ctx.average_gradients)

    # ------------------------------------------------------------------------------------ backward
    def begin_backward(self, reduce: bool) -> None:
        self.reducer.begin_backward(reduce and self.ctx.comm.size > 1)

    def end_backward(self) -> None:
        self.reducer.end_backward()

    # ---------------------------------------------------------------------------------------- step
    def global_grad_norm(self, loss_scale: float) -> float:
        grads = self.reducer.grads()
        if not grads:
            return 0.0
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        total = torch.linalg.vector_norm(torch.stack(norms)).item()
        return total / loss_scale

    def step(self, grad_multiplier: float) -> None:
        if self.optimizer is None:
            raise RuntimeError("engine.step() needs an optimizer: pass optimizer=... to deepshard.initialize "
                               "or add an \"optimizer\" section to the config")
        if self.masters is not None:
            self.masters.set_grads(self.reducer.grads_of(self.masters.params), grad_multiplier)
            self.optimizer.step()
            self.masters.clear_grads()
            self.masters.publish()
        else:
            if grad_multiplier != 1.0:
                torch._foreach_mul_(self.reducer.grads(), grad_multiplier)
            self.optimizer.step()

    def zero_grad(self) -> None:
        self.reducer.zero_()
        for p in self.module.parameters():
            if not p.requires_grad and p.grad is not None:
                p.grad = None

    # --------------------------------------------------------------------------------- checkpoints
    def _master_or_param(self, p: torch.nn.Parameter) -> torch.Tensor:
        if self.masters is not None:
            m = self.masters.master_of(p)
            if m is not None:
                return m
        return p

    def save(self, directory: Path, rank: int) -> list[str]:
        if rank != 0:
            return []
        tensors: dict[str, torch.Tensor] = {}
        master_by_id = {id(p): self._master_or_param(p) for p in self.params}
        for name, value in self.module.state_dict(keep_vars=True).items():
            src = master_by_id.get(id(value), value)
            tensors[name] = src.detach()
        ckpt_io.save_tensors(directory / MODEL_FILE, tensors)
        files = [MODEL_FILE]
        if self.optimizer is not None:
            name_of = {id(self._master_or_param(p)): self.names[id(p)] for p in self.params}
            opt_tensors, meta = export_optimizer_state(self.optimizer, name_of)
            ckpt_io.save_tensors(directory / OPTIM_TENSORS_FILE, opt_tensors)
            ckpt_io.save_json(directory / OPTIM_META_FILE, meta)
            files += [OPTIM_TENSORS_FILE, OPTIM_META_FILE]
        return files

    @torch.no_grad()
    def load(self, directory: Path, load_optimizer_states: bool, strict: bool) -> None:
        saved = ckpt_io.load_tensors(directory / MODEL_FILE)
        load_module_state(self.module, saved, strict, self._master_or_param)
        if load_optimizer_states and self.optimizer is not None:
            if not (directory / OPTIM_META_FILE).exists():
                raise FileNotFoundError(
                    f"{directory} holds no optimizer state ({OPTIM_META_FILE} is missing); load with "
                    "load_optimizer_states=False to restore the weights only")
            by_name = {self.names[id(p)]: self._master_or_param(p) for p in self.params}
            import_optimizer_state(self.optimizer, by_name, ckpt_io.load_tensors(directory / OPTIM_TENSORS_FILE),
                                   ckpt_io.load_json(directory / OPTIM_META_FILE))

    # ---------------------------------------------------------------------------------- accounting
    def memory_report(self) -> dict[str, int]:
        return {
            "parameters": tensor_bytes(self.module.parameters()),
            "gradients": self.reducer.buffer_bytes(),
            "master_weights": self.masters.nbytes() if self.masters is not None else 0,
            "optimizer_state": optimizer_state_bytes(self.optimizer),
            "buffers": tensor_bytes(self.module.buffers()),
            "comm_buckets": 0,
        }

    def full_fp32_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        return self._master_or_param(param).detach().float().clone()

    def full_optimizer_state(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        if self.optimizer is None:
            return None
        value = self.optimizer.state.get(self._master_or_param(param), {}).get(key)
        return None if value is None else value.detach().clone()


def load_module_state(module: torch.nn.Module, saved: dict[str, torch.Tensor], strict: bool,
                      target_of: object) -> None:
    """Copy ``saved`` (a full state dict) into the module, and into fp32 masters where they exist."""
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(f"checkpoint does not match the model: missing keys {missing[:10]}, unexpected keys "
                       f"{unexpected[:10]}; load with load_module_strict=False to load the matching part")
    for name, value in own.items():
        if name not in saved:
            continue
        src = saved[name]
        if tuple(src.shape) != tuple(value.shape):
            raise ValueError(f"checkpoint tensor '{name}' has shape {tuple(src.shape)} but the model's is "
                             f"{tuple(value.shape)}; the checkpoint was saved from a different model")
        target = target_of(value) if isinstance(value, torch.nn.Parameter) else value
        target.data.copy_(src)
        if target is not value:
            value.data.copy_(src)


def tensor_bytes(tensors: object) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights and views count once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:  # type: ignore[attr-defined]
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if torch.is_tensor(v) and v.dim() > 0)
