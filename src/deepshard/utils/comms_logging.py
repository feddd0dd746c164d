"""``deepspeed.utils.comms_logging``: DeepSpeed's per-message-size communication log (latency and bandwidth
of each recorded collective) and its helpers.

:class:`CommsLogger` keeps, per operation name and message size, ``[count, latencies_ms, algbw_gbps,
busbw_gbps]`` (the i-th entries of the three lists belong to the i-th recorded call) and summarises them with
10%-trimmed means. The bandwidths follow nccl-tests' definitions: the algorithm bandwidth is the data a
rank's call moves over its duration, the bus bandwidth that times the fraction of it that crosses links
(``2(n-1)/n`` for an all-reduce, ``(n-1)/n`` for all-gather, reduce-scatter and all-to-all).

deepshard's own engines count their collectives in :class:`deepshard.comm.logger.CommsLogger`; this class is
for code that records timings itself in DeepSpeed's format.
"""
from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from deepshard.utils.timer import trim_mean

__all__ = ["CommsLogger", "calc_bw_log", "convert_size", "get_caller_func"]

_SIZE_NAMES = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
_GATHER_LIKE = {"all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"}
_ALL_TO_ALL = {"all_to_all", "all_to_all_single"}
_ALL_REDUCE = {"all_reduce", "all_reduce_coalesced", "inference_all_reduce"}
_POINT = {"send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast", "broadcast_object_list", "reduce",
          "gather", "scatter", "barrier"}


def get_caller_func(frame: int = 3) -> str:
    """The name of the function ``frame`` levels up the call stack."""
    import sys

    return sys._getframe(frame).f_code.co_name


def convert_size(size_bytes: int) -> str:
    """``1536`` -> ``"1.5 KB"`` (powers of 1024, two decimals)."""
    if size_bytes == 0:
        return "0B"
    power = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, power), 2)} {_SIZE_NAMES[power]}"


def calc_bw_log(comm_op: str, size: int, duration: float, world_size: int | None = None) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in Gbps of one ``comm_op`` call of ``size`` bytes that took
    ``duration`` (milliseconds), over ``world_size`` ranks (the initialized world when None)."""
    if world_size is None:
        from deepshard.comm.api import get_world_size

        world_size = get_world_size()
    n = world_size
    if comm_op in _ALL_TO_ALL:
        tput, busbw = size / duration, (size / duration) * ((n - 1) / n)
    elif comm_op in _GATHER_LIKE:
        size *= n
        tput, busbw = size / duration, (size / duration) * ((n - 1) / n)
    elif comm_op in _ALL_REDUCE:
        tput, busbw = size * 2 / duration, (size / duration) * (2 * (n - 1) / n)
    elif comm_op in _POINT:
        tput = busbw = size / duration
    else:
        raise ValueError(f"calc_bw_log: unknown communication op {comm_op!r}; one of "
                         f"{sorted(_ALL_TO_ALL | _GATHER_LIKE | _ALL_REDUCE | _POINT)}")
    return tput * 8 / 1e6, busbw * 8 / 1e6  # bytes per ms -> Gbps


class CommsLogger:
    """Per operation and message size: call count, latencies, algorithm and bus bandwidths (module doc)."""

    def __init__(self) -> None:
        self.comms_dict: dict[str, dict[int, list[Any]]] = {}
        self.verbose = False
        self.debug = False
        self.prof_ops: list[str] = []
        self.prof_all = True
        self.enabled = False

    def configure(self, comms_config: Any) -> None:
        """Take ``enabled``, ``verbose``, ``debug``, ``prof_ops``, ``prof_all`` from a ``comms_logger``
        config section (or an object with a ``comms_logger`` section)."""
        section = getattr(comms_config, "comms_logger", comms_config)
        self.enabled = bool(getattr(section, "enabled", False))
        if self.enabled:
            self.verbose = bool(getattr(section, "verbose", False))
            self.debug = bool(getattr(section, "debug", False))
            self.prof_ops = list(getattr(section, "prof_ops", []))
            self.prof_all = bool(getattr(section, "prof_all", True))

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int) -> None:
        """Record one call of ``raw_name`` (logged as ``record_name``) that took ``latency`` ms."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency)
        entry = self.comms_dict.setdefault(record_name, {}).setdefault(msg_size, [0, [], [], []])
        entry[0] += 1
        entry[1].append(latency)
        entry[2].append(algbw)
        entry[3].append(busbw)
        if self.verbose:
            from deepshard.utils.logging import logger

            logger.info("comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                        record_name, latency, convert_size(msg_size), algbw, busbw)

    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        return self.comms_dict.copy()

    def has_data(self) -> bool:
        return bool(self.comms_dict)

    def reset_data(self) -> None:
        self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(entry[0] for sizes in self.comms_dict.values() for entry in sizes.values())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        """Per message size: count, total and trimmed-mean latency, trimmed-mean bandwidths (None when the
        operation was never recorded). The recorded lists are not reordered."""
        if operation_name not in self.comms_dict:
            return None
        return {size: {"count": vals[0], "total_latency_ms": sum(vals[1]),
                       "avg_latency_ms": trim_mean(vals[1], 0.1), "tput_avg_gbps": trim_mean(vals[2], 0.1),
                       "busbw_avg_gbps": trim_mean(vals[3], 0.1), "msg_size_bytes": size,
                       "msg_size_str": convert_size(size)}
                for size, vals in self.comms_dict[operation_name].items()}

    def log_all(self, print_log: bool = True, show_straggler: bool = False,
                return_dict: bool = False) -> dict[str, Any] | None:
        """Print (and/or return) every operation's summary. ``show_straggler`` is accepted; the straggler
        analysis (a collective across ranks) is not computed here."""
        from deepshard.comm.api import get_rank, get_world_size

        summary = {name: self.get_operation_summary(name) for name in list(self.comms_dict)}
        if print_log:
            columns = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
                       "tput_avg (Gbps)", "busbw_avg (Gbps)")
            print("".join(f"{c: <20}" for c in columns))
            for name, sizes in summary.items():
                print(name)
                for size, s in sorted((sizes or {}).items()):
                    print(f"{' ': <20}{s['msg_size_str']: <20}{s['count']: <20}{s['total_latency_ms']: <20.2f}"
                          f"{s['avg_latency_ms']: <20.2f}{s['tput_avg_gbps']: <20.2f}{s['busbw_avg_gbps']: <20.2f}")
        if not return_dict:
            return None
        return {"summary": summary, "straggler_analysis": None,
                "metadata": {"world_size": get_world_size(), "rank": get_rank(),
                             "timestamp": datetime.now().isoformat()}}
