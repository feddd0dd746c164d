"""``Compose``, ``ToTensor`` and ``Normalize`` with torchvision's semantics, for tensors and arrays."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


class Compose:
    """Apply ``transforms`` in order."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    """An HxWxC uint8 image (tensor or array) to a CxHxW float32 tensor in [0, 1], as torchvision's
    ``ToTensor`` turns a PIL image."""

    def __call__(self, image: Any) -> torch.Tensor:
        t = image if isinstance(image, torch.Tensor) else torch.as_tensor(image)
        if t.dim() != 3:
            raise ValueError(f"ToTensor expects an HxWxC image, got shape {tuple(t.shape)}")
        t = t.permute(2, 0, 1).contiguous()
        if t.dtype == torch.uint8:
            return t.to(torch.float32).div(255)
        return t.to(torch.float32)


class Normalize:
    """``(x - mean) / std`` per channel of a CxHxW tensor."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(list(mean), dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(list(std), dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.dtype)) / self.std.to(x.dtype)
