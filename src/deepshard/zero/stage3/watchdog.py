"""The collective watchdog (moved to :mod:`deepshard.comm.watchdog`, where every group has one)."""
from deepshard.comm.watchdog import DEFAULT_TIMEOUT_S, GRACE_S, CollectiveTimeout, Watchdog

__all__ = ["CollectiveTimeout", "Watchdog", "DEFAULT_TIMEOUT_S", "GRACE_S"]
