"""Communication: process groups as objects, counted collectives, and the comms logger."""
from deepshard.comm.group import CommGroup
from deepshard.comm.logger import CommsLogger, OpStats, log_summary

__all__ = ["CommGroup", "CommsLogger", "OpStats", "log_summary"]
