"""The library's logger: one named logger, rank-aware formatting, no global process-group state."""
from __future__ import annotations

import logging
import os
import sys

_FORMAT = "[%(asctime)s] [deepshard] [%(levelname)s] %(message)s"


def _make_logger() -> logging.Logger:
    log = logging.getLogger("deepshard")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(os.environ.get("DEEPSHARD_LOG_LEVEL", "INFO").upper())
        log.propagate = False
    return log


logger: logging.Logger = _make_logger()


def log_rank0(msg: str, rank: int, level: int = logging.INFO) -> None:
    """Log ``msg`` only on global rank 0 (the rank is passed in, never looked up globally)."""
    if rank == 0:
        logger.log(level, msg)


LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}


def get_log_level_from_string(log_level_str: str) -> int:
    """``"warning"`` (any case) -> ``logging.WARNING``; an unknown name is a ValueError listing the names."""
    key = str(log_level_str).lower()
    if key not in LOG_LEVELS:
        raise ValueError(f"log level {log_level_str!r} is not one of {', '.join(LOG_LEVELS)}")
    return LOG_LEVELS[key]


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the level of deepshard's logger (or ``custom_logger``) and of its handlers (config ``log_level``)."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    """The effective level of deepshard's logger."""
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the logger's level is at most ``max_log_level_str`` (messages of that level get through)."""
    return get_current_level() <= get_log_level_from_string(max_log_level_str)


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed global ranks (every rank for None or ``[-1]``)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)
