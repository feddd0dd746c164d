"""Communication: process groups as objects, counted collectives, the comms logger, and DeepSpeed's
module-level ``deepspeed.comm`` functions (``init_distributed``, ``get_rank``, ``all_reduce`` ...,
:mod:`deepshard.comm.api`)."""
from deepshard.comm import api
from deepshard.comm.api import *  # noqa: F401,F403 - DeepSpeed's module-level names
from deepshard.comm.group import CommGroup
from deepshard.comm.logger import CommsLogger, OpStats, log_summary

__all__ = ["CommGroup", "CommsLogger", "OpStats", "log_summary"] + list(api.__all__)
