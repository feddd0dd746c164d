"""``deepshard.initialize`` (defined here, exported by the package): config -> process group -> grid ->
``deepshard.parallelize`` (the plan check, then every technique in a fixed order, then the engine)."""
from __future__ import annotations

import argparse
from typing import Any, Callable, Iterable

import torch

from deepshard.accelerator import get_accelerator
from deepshard.compile import adopt_compiled
from deepshard.config import load_config, resolve_config_source
from deepshard.config.agree import check_same_on_every_rank
from deepshard.config.inert import warn_unused_pipeline
from deepshard.config.loader import read_config_source
from deepshard.distributed import init_distributed
from deepshard.grid import build_topology
from deepshard.parallelize import parallelize
from deepshard.parts import OptimizerArg
from deepshard.utils.logging import set_log_level_from_string
from deepshard.utils.z3_leaf_module import apply_zero_leaf_module_config
from deepshard.utils.teardown import settle_backend_threads_at_exit


class MissingModelError(ValueError, AssertionError):
    """``initialize`` got no model (an AssertionError too: DeepSpeed asserts here, and code catches that)."""


def initialize(args: argparse.Namespace | None = None, model: torch.nn.Module | None = None,
               optimizer: OptimizerArg = None, model_parameters: Iterable[Any] | None = None,
               training_data: torch.utils.data.Dataset | None = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[..., Any] | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[Any, Any, Any, Any]:
    """Wrap ``model`` for distributed training; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``optimizer`` (an instance, or a callable taking the parameters) wins over the config's
    ``optimizer`` section; ``lr_scheduler`` (an instance, or a callable taking the optimizer) wins over
    ``scheduler``. ``config`` is a dict, a JSON path or base64 JSON; or pass ``args.deepspeed_config``.
    The dataloader is None unless ``training_data`` is given.
    """
    if model is None:
        raise MissingModelError("deepshard.initialize needs model=<torch.nn.Module> (a model passed first, "
                                "without model=, lands in args)")
    model = adopt_compiled(model)  # torch.compile(model): train the original, compiled in place
    if config is not None and config_params is not None:
        raise ValueError("pass the config once: config=... or config_params=... (an alias), not both")
    source = resolve_config_source(args, config if config is not None else config_params)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required, verbose=False)
    settle_backend_threads_at_exit()  # a group deepshard did not create: its threads still finish before exit
    raw, _ = read_config_source(source)
    topology = build_topology(raw, model=model, mpu=mpu, mesh_param=mesh_param)
    cfg = load_config(source, dp_world_size=topology.dp.size)
    if cfg.log_level is not None:
        set_log_level_from_string(cfg.log_level)  # the config's log_level sets deepshard's logger, as DeepSpeed's
    check_same_on_every_rank(cfg, topology.world)  # before the first collective that depends on it
    warn_unused_pipeline(cfg, model)
    apply_zero_leaf_module_config(model, cfg.zero_optimization.leaf_module)  # ZeRO-3 reads the marks
    engine = parallelize(model, cfg, get_accelerator(), topology, optimizer, model_parameters, lr_scheduler, mpu=mpu)
    if training_data is not None:
        engine.training_dataloader = engine.deepspeed_io(training_data, collate_fn=collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
