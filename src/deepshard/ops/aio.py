"""``deepspeed.ops.aio``: the async-I/O op's builder (not available in deepshard: it compiles no ops; its NVMe
offload does its own file I/O)."""
from deepshard.ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
