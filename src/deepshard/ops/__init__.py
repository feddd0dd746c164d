"""DeepSpeed's optimizer classes by their ``deepspeed.ops`` names, as plain PyTorch optimizers.

DeepSpeed builds these as C++/CUDA extensions; deepshard needs none (PRODUCT.md: no JIT-built ops): each
class is torch's implementation under DeepSpeed's name and constructor signature, so code that names
them (Accelerate swaps a torch optimizer for ``DeepSpeedCPUAdam`` under optimizer offload) runs
unchanged. Modules: :mod:`deepshard.ops.adam`, :mod:`deepshard.ops.adagrad`, :mod:`deepshard.ops.lion`; the
op builders code asks before using an op: :mod:`deepshard.ops.op_builder`.
"""
from deepshard.ops import adagrad, adam, aio, lion, op_builder

__compatible_ops__ = op_builder.compatible_ops()
"""Op name -> whether deepshard provides it (DeepSpeed's ``deepspeed.ops.__compatible_ops__``; see
:mod:`deepshard.ops.op_builder`)."""

__all__ = ["__compatible_ops__", "adagrad", "adam", "aio", "lion", "op_builder"]
