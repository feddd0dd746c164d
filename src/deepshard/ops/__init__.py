"""DeepSpeed's optimizer classes by their ``deepspeed.ops`` names, as plain PyTorch optimizers.

DeepSpeed builds these as C++/CUDA extensions; deepshard needs none (PRODUCT.md: no JIT-built ops): each
class is torch's implementation under DeepSpeed's name and constructor signature, so code that names
them (Accelerate swaps a torch optimizer for ``DeepSpeedCPUAdam`` under optimizer offload) runs
unchanged. Modules: :mod:`deepshard.ops.adam`, :mod:`deepshard.ops.adagrad`, :mod:`deepshard.ops.lion`.
"""
from deepshard.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
