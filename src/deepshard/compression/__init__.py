"""Compressed communication: 1-bit compression with error feedback and the optimizers that use it
(``OneBitAdam``). See docs/compression.md."""
from deepshard.compression.exchange import CompressedAverage, ExactAverage
from deepshard.compression.onebit import ExchangeLayout, compress, decompress, pack_signs, unpack_signs
from deepshard.compression.onebit_adam import CompressedCommOptimizer, OneBitAdam

__all__ = ["CompressedAverage", "CompressedCommOptimizer", "ExactAverage", "ExchangeLayout", "OneBitAdam",
           "compress", "decompress", "pack_signs", "unpack_signs"]
