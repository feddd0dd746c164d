"""The logging side of DeepSpeed's ``deepspeed.comm``: the ``timed_op`` decorator and the helpers it uses to
size a call's message from its arguments, and the questions asked of the module's logger between
intervals (``reset_log``, ``has_comm_data``, ``get_comm_operation_count``, ``get_logged_comm_ops``).

The logger is :data:`deepshard.comm.api.COMMS_LOGGER`, which counts every call made through
``deepspeed.comm`` (DeepSpeed's counts only while its ``comms_logger`` section is enabled)."""
from __future__ import annotations

import functools
import inspect
import sys
import time
from typing import Any, Callable

from deepshard.comm.api import COMMS_LOGGER

__all__ = ["get_caller_func", "get_comm_operation_count", "get_debug_log_name", "get_default_args",
           "get_logged_comm_ops", "get_msg_size_from_args", "get_tensor_kwarg", "get_tensor_position",
           "has_comm_data", "reset_log", "timed_op"]

# the argument that carries the data, by the names torch and DeepSpeed give it, in the order they are tried
_TENSOR_ARGS = ("tensor", "tensors", "input_list", "input_tensor_list", "p2p_op_list")


def get_caller_func(frame: int = 3) -> str:
    """The name of the function ``frame`` levels up the call stack (DeepSpeed's debug log names use it)."""
    return sys._getframe(frame).f_code.co_name


def get_default_args(func: Callable[..., Any]) -> dict[str, Any]:
    """``func``'s parameters that have defaults, with them."""
    return {name: p.default for name, p in inspect.signature(func).parameters.items()
            if p.default is not inspect.Parameter.empty}


def get_tensor_position(func: Callable[..., Any]) -> int:
    """The position of ``func``'s data argument (``tensor``, ``tensors``, ``input_list``, ...), or -1."""
    names = list(inspect.signature(func).parameters)
    for arg in _TENSOR_ARGS:
        if arg in names:
            return names.index(arg)
    return -1


def get_tensor_kwarg(func: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """The data argument of a call of ``func`` made with ``kwargs`` (defaults filled in), or None."""
    merged = {**get_default_args(func), **kwargs}
    return next((merged[arg] for arg in _TENSOR_ARGS if arg in merged), None)


def get_msg_size_from_args(func: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Bytes the call ``func(*args, **kwargs)`` hands over: its data tensor's size, the sum over a list of
    tensors (or of ``P2POp`` objects' tensors), 0 when it has none (``barrier``)."""
    data = None
    position = get_tensor_position(func) if args else -1
    if -1 < position < len(args):
        data = args[position]
    if data is None and kwargs:
        data = get_tensor_kwarg(func, kwargs)
    if data is None:
        return 0
    if isinstance(data, list):
        tensors = [getattr(item, "tensor", item) for item in data]
        return sum(t.element_size() * t.nelement() for t in tensors)
    return data.element_size() * data.nelement()


def get_debug_log_name(func_args: dict[str, Any], debug: bool) -> str:
    """The name a call is logged under: its ``log_name``, with the calling function when ``debug``."""
    if debug:
        return f"{func_args['log_name']} | [Caller Func: {get_caller_func()}]"
    return func_args["log_name"]


def timed_op(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a communication function so each call is counted in the ``deepspeed.comm`` logger under
    its ``log_name`` (default: the function's name) with the bytes it hands over, and timed at debug level."""
    default_name = get_default_args(func).get("log_name", func.__name__)

    @functools.wraps(func)
    def logged(*args: Any, **kwargs: Any) -> Any:
        name = kwargs.get("log_name", default_name)
        size = get_msg_size_from_args(func, *args, **kwargs)
        start = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            COMMS_LOGGER.record(name, size, 1)
            from deepshard.utils.logging import logger

            logger.debug("%s: %d bytes in %.3f ms", name, size, 1e3 * (time.perf_counter() - start))

    return logged


def reset_log() -> None:
    """Forget what the ``deepspeed.comm`` logger has counted (per-epoch or per-interval figures)."""
    COMMS_LOGGER.reset()


def has_comm_data() -> bool:
    """Whether any call has been counted since the start or the last :func:`reset_log`."""
    return bool(COMMS_LOGGER.ops)


def get_comm_operation_count() -> int:
    """Calls counted, over every operation."""
    return sum(stats.calls for stats in COMMS_LOGGER.ops.values())


def get_logged_comm_ops() -> list[str]:
    """The operations counted (``["all_reduce", "broadcast"]``)."""
    return list(COMMS_LOGGER.ops)
