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
