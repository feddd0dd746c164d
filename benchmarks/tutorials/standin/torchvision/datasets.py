"""A synthetic ``CIFAR10``: 32x32x3 uint8 images in 10 classes, learnable and the same for every run.

Each class has a fixed smooth colour pattern (a random 4x4x3 grid scaled up bilinearly); an image is
its class's pattern, shifted by up to 3 pixels, dimmed or brightened, plus per-pixel noise, quantized
to uint8. A small CNN learns it gradually (the loss falls from ln 10 over a few hundred steps), so
round-off differences between runs have room to show. Generated from a private ``torch.Generator``
(the data does not depend on, or disturb, any other random stream); sizes and seed: see the package
docstring.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

CLASSES = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
SIDE = 32
MAX_SHIFT = 3


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; unset it or give a whole number") from None
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return value


def _patterns(gen: torch.Generator) -> torch.Tensor:
    """One smooth pattern per class, values in about [-1, 1], shape (10, 3, 32 + 2*shift, 32 + 2*shift)."""
    coarse = torch.rand(len(CLASSES), 3, 4, 4, generator=gen) * 2 - 1
    side = SIDE + 2 * MAX_SHIFT
    return F.interpolate(coarse, size=(side, side), mode="bilinear", align_corners=True)


def make_images(count: int, seed: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` images (N, 32, 32, 3) uint8 and their labels (N,) int64, for data seed ``seed`` and
    split 0 (train) or 1 (test): the patterns are shared, the samples differ."""
    patterns = _patterns(torch.Generator().manual_seed(1000 + seed))
    gen = torch.Generator().manual_seed(2000 + 2 * seed + split)
    labels = torch.randint(0, len(CLASSES), (count,), generator=gen)
    shifts = torch.randint(0, 2 * MAX_SHIFT + 1, (count, 2), generator=gen)
    gains = 0.15 + 0.2 * torch.rand(count, generator=gen)
    noise = torch.randn(count, 3, SIDE, SIDE, generator=gen)
    images = torch.empty(count, 3, SIDE, SIDE)
    for i in range(count):
        dy, dx = int(shifts[i, 0]), int(shifts[i, 1])
        crop = patterns[labels[i], :, dy:dy + SIDE, dx:dx + SIDE]
        images[i] = 0.5 + gains[i] * crop + 0.22 * noise[i]
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    return pixels, labels


class CIFAR10(Dataset):
    """torchvision's signature; ``root`` and ``download`` are accepted and ignored (nothing is read or
    written). Items are ``(transform(image), label)`` with the image an HxWxC uint8 tensor."""

    classes = list(CLASSES)

    def __init__(self, root: str = "./data", train: bool = True, transform: Optional[Callable[[Any], Any]] = None,
                 target_transform: Optional[Callable[[Any], Any]] = None, download: bool = False) -> None:
        seed = _env_int("CIFAR_STANDIN_SEED", 0)
        count = _env_int("CIFAR_STANDIN_TRAIN_SIZE", 8000) if train else _env_int("CIFAR_STANDIN_TEST_SIZE", 1000)
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform
        self.data, labels = make_images(count, seed, 0 if train else 1)
        self.targets = labels.tolist()
        # the tutorial seeds nothing: its network is built right after this, then its loader shuffles
        torch.manual_seed(_env_int("CIFAR_STANDIN_TORCH_SEED", seed))

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image, target = self.data[index], self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
