"""``deepshard.zero.Init``: construct a model already partitioned, so no process ever holds all of it.

Inside the context, when a module's (outermost) ``__init__`` returns, each of its direct parameters is
broadcast from rank 0 (so every rank starts identical), cut into N equal chunks, and only this rank's
chunk is kept (``param.ds_tensor``); ``param.data`` becomes an empty placeholder and ``param.ds_shape``
keeps the real shape, as in DeepSpeed. Peak memory during construction is the shard plus the largest
module's own parameters. ``deepshard.initialize`` with ZeRO stage 3 adopts these shards.

Every ``nn.Module`` subclass's ``__init__`` is wrapped on entry; a class created while the context is
open (defined in it, or first imported in it, as ``transformers`` does with its model classes) is
wrapped as it is created, through ``nn.Module.__init_subclass__``. Without that, its own parameters
would be built by an unwrapped ``__init__`` after its base class's wrapped one had already returned,
and would stay whole on every rank. All of it is undone on exit.

``Module.apply`` is wrapped inside the context so initialization functions run on gathered parameters
(DeepSpeed's ``override_module_apply``), and ``Module.to_empty`` so that a module built on the ``meta``
device (``torch.nn.utils.skip_init``) is partitioned when ``to_empty()`` gives it storage. Code that changes parameters of already-built submodules in any
other way must do so inside ``GatheredParameters(params, modifier_rank=0)``.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, Callable, Mapping

import torch

from deepshard.comm.group import CommGroup
from deepshard.utils.rank_order import refuse_collectives_here
from deepshard.zero.stage3.param_status import ZeroParamStatus, set_status

_LOCAL = threading.local()


def is_init_partitioned(p: torch.Tensor) -> bool:
    """Whether ``p`` holds a ``zero.Init`` shard not yet adopted by ``initialize`` (whose parameters have a
    ``ds_tensor`` too: a view of the engine's shard)."""
    return getattr(p, "ds_comm", None) is not None and getattr(p, "ds_tensor", None) is not None


def full_value(p: torch.nn.Parameter, comm: CommGroup) -> torch.Tensor:
    """The full value of ``p``: its data, or gathered from its zero.Init shard (a collective then, over the
    group zero.Init partitioned it over: the world, where ``comm`` may be a hybrid-sharding shard group)."""
    if not is_init_partitioned(p):
        return p.detach()
    comm = getattr(p, "ds_comm")  # the group zero.Init partitioned it over (see the docstring)
    shard: torch.Tensor = getattr(p, "ds_tensor")
    out = torch.empty(shard.numel() * comm.size, dtype=shard.dtype, device=shard.device)
    comm.all_gather_into_tensor(out, shard)
    return out[:int(getattr(p, "ds_numel"))].view(getattr(p, "ds_shape"))


@torch.no_grad()
def partition_param(p: torch.nn.Parameter, comm: CommGroup, dtype: torch.dtype | None, ds_id: int = 0) -> bool:
    """Keep only this rank's chunk of ``p`` (after making rank 0's value everyone's); False when ``p`` was
    partitioned already. ``ds_id`` numbers it as DeepSpeed does (``initialize`` renumbers per model)."""
    if hasattr(p, "ds_tensor") or hasattr(p, "ds_shape"):
        return False
    value = p.detach()
    if dtype is not None:
        value = value.to(dtype)
    comm.broadcast(value, src=0)
    n = value.numel()
    chunk = max(-(-n // comm.size), 1)
    flat = torch.zeros(chunk * comm.size, dtype=value.dtype, device=value.device)
    flat[:n] = value.reshape(-1)
    # DeepSpeed's attribute names (its users read ds_shape / ds_numel ...); ds_comm: the group the shards live on
    for name, attr in (("ds_tensor", flat[comm.rank * chunk:(comm.rank + 1) * chunk].clone()),
                       ("ds_shape", value.shape), ("ds_numel", n), ("ds_comm", comm), ("ds_id", ds_id),
                       ("ds_persist", False), ("ds_active_sub_modules", set())):
        setattr(p, name, attr)
    p.data = torch.empty(0, dtype=value.dtype, device=value.device)
    set_status([p], ZeroParamStatus.NOT_AVAILABLE)
    return True


class _InitGather:
    """Gather zero.Init-partitioned parameters of one module in place, and re-partition on exit."""

    def __init__(self, params: list[torch.nn.Parameter], comm: CommGroup, modifier_rank: int | None) -> None:
        self.params = [p for p in params if is_init_partitioned(p)]
        self.comm, self.modifier_rank = comm, modifier_rank

    def __enter__(self) -> None:
        for p in self.params:
            p.data = full_value(p, self.comm).clone()
        set_status(self.params, ZeroParamStatus.AVAILABLE)

    @torch.no_grad()
    def __exit__(self, *exc: Any) -> None:
        for p in self.params:
            value = p.data
            if self.modifier_rank is not None:
                self.comm.broadcast(value, src=self.modifier_rank)
            shard: torch.Tensor = getattr(p, "ds_tensor")
            chunk = shard.numel()
            flat = torch.zeros(chunk * self.comm.size, dtype=value.dtype, device=value.device)
            flat[:value.numel()] = value.reshape(-1)
            shard.copy_(flat[self.comm.rank * chunk:(self.comm.rank + 1) * chunk])
            p.data = torch.empty(0, dtype=value.dtype, device=value.device)
        set_status(self.params, ZeroParamStatus.NOT_AVAILABLE)


def _all_subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    stack = [cls]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                stack.append(sub)
    return out


def single_rank_group_contradiction(dp_world_size: int, explicit_process_group: Any,
                                   env: Mapping[str, Any] | None = None) -> str | None:
    """Why ``zero.Init`` must stop, or None: the launcher started several processes (``WORLD_SIZE`` > 1) but
    the group it would partition over has one rank, and the caller did not choose that group. That happens
    when something set up a one-process group before (a ``from_pretrained`` ahead of ``init_distributed``);
    partitioning over it would keep every parameter whole on every rank, each holding the full model, which
    shows up later as an out-of-memory error with no hint at its cause. A group passed in is taken as meant,
    and a ``WORLD_SIZE`` that is not a number is left to the launcher."""
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    env = os.environ if env is None else env
    try:
        launched = int(env.get("WORLD_SIZE") or 0)
    except (TypeError, ValueError):
        return None
    if launched <= 1:
        return None
    return (f"zero.Init would partition over a process group of 1 rank, but the launcher started "
            f"WORLD_SIZE={launched} processes: a one-process group was set up before zero.Init (for example a "
            f"from_pretrained call ahead of deepspeed.init_distributed()), so every rank would hold the whole "
            f"model. Call init_distributed() before building the model under zero.Init, or pass "
            f"data_parallel_group= when a one-rank group is what you mean.")


class Init:
    """Context manager: modules built inside are partitioned as they are built (ZeRO stage 3)."""

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, **unsupported: Any) -> None:
        self.enabled = enabled
        self.dtype = dtype
        self.group = data_parallel_group
        self.mpu = mpu
        if remote_device not in (None, "cpu", "none", "nvme"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): use None, 'cpu' or 'nvme'")
        # remote_device='nvme': the shards built here are this rank's 1/N in host memory; deepshard.initialize
        # moves them to disk when zero_optimization.offload_param.device is 'nvme'
        self.remote_device = remote_device
        self._patched: dict[type, Callable[..., Any]] = {}
        self._orig_apply: Callable[..., Any] | None = None
        self._orig_init_subclass: Any = None  # nn.Module's own __init_subclass__ entry, if it had one
        self._orig_to_empty: Callable[..., Any] | None = None
        self.comm: CommGroup | None = None
        self._next_id = 0  # ds_id of the next parameter partitioned here
        if module is not None and enabled:  # DeepSpeed also accepts an already-built module
            self._setup()
            for m in module.modules():
                self._partition(m)

    def _setup(self) -> None:
        from deepshard.distributed import init_distributed

        init_distributed(verbose=False)
        if self.group is None and self.mpu is not None:  # Megatron-style: shard over its data-parallel group
            self.group = self.mpu.get_data_parallel_group()
        self.comm = CommGroup(self.group)
        refusal = single_rank_group_contradiction(self.comm.size, self.group)
        if refusal is not None:
            raise RuntimeError(refusal)

    def _partition(self, module: torch.nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if p.is_meta:  # no values yet: partitioned once to_empty() gives it storage (see _hook_to_empty)
                continue
            if partition_param(p, self.comm, self.dtype, self._next_id):  # type: ignore[arg-type]
                self._next_id += 1

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self._setup()
        if self.comm.size > 1:
            refuse_collectives_here("deepshard.zero.Init (it partitions each module's parameters as it is built)")
        depth: dict[int, int] = {}

        def wrap(init: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(init)
            def wrapped(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
                key = id(module)
                depth[key] = depth.get(key, 0) + 1
                try:
                    init(module, *args, **kwargs)
                finally:
                    depth[key] -= 1
                if depth[key] == 0:
                    del depth[key]
                    self._partition(module)
            return wrapped

        for cls in _all_subclasses(torch.nn.Module) | {torch.nn.Module}:
            self._wrap_class(cls, wrap)
        self._hook_new_classes(wrap)
        self._orig_apply = torch.nn.Module.apply
        comm, orig_apply = self.comm, self._orig_apply

        def apply(module: torch.nn.Module, fn: Callable[[torch.nn.Module], Any]) -> torch.nn.Module:
            for child in module.children():
                apply(child, fn)
            with _InitGather(list(module.parameters(recurse=False)), comm, modifier_rank=0):  # type: ignore[arg-type]
                fn(module)
            return module

        setattr(torch.nn.Module, "apply", apply)  # patched while the context is open
        del orig_apply
        self._hook_to_empty()
        return self

    def _hook_to_empty(self) -> None:
        """Partition what ``to_empty()`` materializes. A module built on the ``meta`` device
        (``torch.nn.utils.skip_init``, or ``device="meta"`` then ``to_empty``) has no values when its
        ``__init__`` returns, so it is left whole then; ``to_empty`` replaces its parameters with new ones
        holding storage, and those are partitioned as it returns (their values broadcast from rank 0, as
        every partitioned parameter's are, so the uninitialized memory is the same on every rank)."""
        self._orig_to_empty = torch.nn.Module.__dict__["to_empty"]
        orig, init_ctx = self._orig_to_empty, self

        @functools.wraps(orig)
        def to_empty(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
            out = orig(module, *args, **kwargs)
            for sub in module.modules():
                init_ctx._partition(sub)
            return out

        setattr(torch.nn.Module, "to_empty", to_empty)

    def _wrap_class(self, cls: type, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        if "__init__" in cls.__dict__ and cls not in self._patched:
            self._patched[cls] = cls.__dict__["__init__"]
            setattr(cls, "__init__", wrap(cls.__dict__["__init__"]))

    def _hook_new_classes(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Wrap the ``__init__`` of every ``nn.Module`` subclass created while the context is open."""
        module_cls = torch.nn.Module
        own = module_cls.__dict__.get("__init_subclass__")
        self._orig_init_subclass = own
        init_ctx = self

        def init_subclass(cls: type, **kwargs: Any) -> None:
            if own is not None:
                own.__get__(None, cls)(**kwargs)
            else:
                super(module_cls, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
            init_ctx._wrap_class(cls, wrap)

        setattr(module_cls, "__init_subclass__", classmethod(init_subclass))

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        if self._orig_init_subclass is not None:
            setattr(torch.nn.Module, "__init_subclass__", self._orig_init_subclass)
        elif "__init_subclass__" in torch.nn.Module.__dict__:
            del torch.nn.Module.__init_subclass__
        self._orig_init_subclass = None
        for cls, init in self._patched.items():
            setattr(cls, "__init__", init)
        self._patched.clear()
        if self._orig_apply is not None:
            setattr(torch.nn.Module, "apply", self._orig_apply)
            self._orig_apply = None
        if self._orig_to_empty is not None:
            setattr(torch.nn.Module, "to_empty", self._orig_to_empty)
            self._orig_to_empty = None
