"""Communication: process groups as objects, counted collectives, the comms logger, and DeepSpeed's
module-level ``deepspeed.comm`` functions (``init_distributed``, ``get_rank``, ``all_reduce`` ...,
:mod:`deepshard.comm.api`; the object, coalesced and batched collectives, :mod:`deepshard.comm.batched`;
launcher-environment helpers, :mod:`deepshard.comm.launcher_env`; the logging helpers,
:mod:`deepshard.comm.op_logging`; the backend object, :mod:`deepshard.comm.backend`)."""
from deepshard.accelerator import get_accelerator
from deepshard.comm import api, backend, batched, launcher_env, op_logging
from deepshard.comm.api import *  # noqa: F401,F403 - DeepSpeed's module-level names
from deepshard.comm.backend import *  # noqa: F401,F403
from deepshard.comm.batched import *  # noqa: F401,F403
from deepshard.comm.group import CommGroup
from deepshard.comm.launcher_env import *  # noqa: F401,F403
from deepshard.comm.logger import CommsLogger, OpStats, log_summary
from deepshard.comm.op_logging import *  # noqa: F401,F403

__all__ = (["CommGroup", "CommsLogger", "OpStats", "get_accelerator", "log_summary"] + list(api.__all__)
           + list(backend.__all__) + list(batched.__all__) + list(launcher_env.__all__) + list(op_logging.__all__))
