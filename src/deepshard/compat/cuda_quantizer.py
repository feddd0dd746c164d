"""``CUDAQuantizer`` of ``deepspeed.runtime.zero.partition_parameters``: the 8-bit weight quantizer of
ZeRO++'s quantized weight all-gather (qwZ), as one object that code written for DeepSpeed calls directly.

DeepSpeed's class wraps a compiled kernel (``quantizer_cuda_module``, its ``QuantizerBuilder`` op). Here the
kernel is :class:`BlockQuantizerKernel`: the same calls (``quantize(values, groups, bits, kind)`` /
``dequantize(q, scales, groups, bits, kind)``), computed by deepshard's block quantizer
(:class:`deepshard.comm.quantize.BlockCodec`, the one deepshard's qwZ sends) in PyTorch on the tensor's own
device. Like DeepSpeed's kernel it reads fp16 and writes fp16, so the wrapper casts a parameter to fp16 on
the way in and hands it back in the dtype asked for on the way out (a bf16 parameter stays bf16). As in
DeepSpeed, the kernel is a class attribute that can be replaced (tests swap in a stand-in).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional

import torch

from deepshard.comm.quantize import BlockCodec


class BlockQuantizerKernel:
    """DeepSpeed's quantizer-kernel interface over :class:`BlockCodec`: ``groups`` equal blocks of
    ``num_bits``-bit integers (8: one int8 per value; 4: two per byte) with one fp32 scale each."""

    Symmetric = 0
    Asymmetric = 1

    def quantize(self, values: torch.Tensor, groups: int, num_bits: int,
                 quant_type: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(integers, scales)`` of ``values`` cut into ``groups`` equal blocks (symmetric only)."""
        codec = _codec(values.numel(), groups, num_bits, quant_type)
        payload = codec.encode(values.reshape(-1))
        return (payload[:codec.data_bytes].view(torch.int8).clone(),
                payload[codec.data_bytes:].view(torch.float32).clone())

    def dequantize(self, quantized: torch.Tensor, scales: torch.Tensor, num_groups: int, num_bits: int,
                   quant_type: int) -> torch.Tensor:
        """The fp16 values that :meth:`quantize`'s ``(integers, scales)`` encode."""
        codec = _codec(quantized.numel() * (8 // num_bits), num_groups, num_bits, quant_type)
        if scales.numel() != codec.blocks:
            raise ValueError(f"dequantize got {scales.numel()} scales for {num_groups} groups; pass the scales "
                             "quantize returned with the integers")
        payload = torch.cat([quantized.reshape(-1).view(torch.uint8),
                             scales.reshape(-1).to(torch.float32).view(torch.uint8)])
        return codec.decode(payload).to(torch.half)


def _codec(numel: int, groups: int, num_bits: int, quant_type: int) -> BlockCodec:
    if quant_type != BlockQuantizerKernel.Symmetric:
        raise NotImplementedError(f"quantization kind {quant_type} is not implemented: deepshard quantizes "
                                  f"symmetrically only; pass BlockQuantizerKernel.Symmetric "
                                  f"({BlockQuantizerKernel.Symmetric})")
    if groups < 1 or numel % groups:
        raise ValueError(f"cannot cut {numel} values into {groups} equal quantization groups; pass a group count "
                         "that divides the number of values (CUDAQuantizer.quantize chooses one when given none)")
    return BlockCodec(numel, numel // groups, num_bits)


@lru_cache(maxsize=256)
def quantization_groups(numel: int, target_group_size: int) -> int:
    """The group count DeepSpeed's quantizer picks for ``numel`` values: the fewest groups of at most
    ``target_group_size`` values whose size is a multiple of 8."""
    if numel < 8 or numel % 8:
        raise ValueError(f"8-bit weight quantization needs a multiple of 8 values, got {numel}; leave this "
                         "parameter out of quantization (or pad it to a multiple of 8)")
    eights = numel // 8
    groups = max(-(-numel // target_group_size), 1)
    while eights % groups:
        groups += 1
    return groups


class CUDAQuantizer:
    """DeepSpeed's ZeRO++ weight quantizer (8 bits, symmetric, groups of at most ``target_group_size``
    values), on any device: :class:`BlockQuantizerKernel` unless ``quantizer_cuda_module`` is set."""

    target_group_size = 8000
    quantizer_cuda_module: Any = None

    def __init__(self) -> None:
        if CUDAQuantizer.quantizer_cuda_module is None:
            CUDAQuantizer.quantizer_cuda_module = BlockQuantizerKernel()

    def quantize(self, param: torch.Tensor, groups: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(int8 values, scales)`` of ``param``, read as fp16 (as DeepSpeed's kernel reads it)."""
        if groups is None:
            groups = quantization_groups(param.numel(), self.target_group_size)
        kernel = self.quantizer_cuda_module
        return kernel.quantize(param.to(dtype=torch.half), groups, 8, kernel.Symmetric)

    def dequantize(self, quantized_param: torch.Tensor, scale: torch.Tensor,
                   dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The values back (fp16, or ``dtype`` when given: a parameter's own dtype)."""
        kernel = self.quantizer_cuda_module
        values = kernel.dequantize(quantized_param, scale, scale.numel(), 8, kernel.Symmetric)
        return values if dtype is None or values.dtype == dtype else values.to(dtype)
