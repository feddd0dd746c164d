"""An offline text corpus: the bytes of the Python standard library's own ``.py`` source files.

Every Python installation carries a few megabytes of real, varied text, so the demo needs no
download. The files are read in sorted path order, so the corpus is the same on every run and every
rank of the same interpreter. ``site-packages`` (third-party code that differs between machines) and
test directories (large generated data files) are skipped.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The ``.py`` files under the standard library directory, sorted, minus the skipped folders."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(
            f"standard library directory {str(root)!r} (sysconfig.get_paths()['stdlib']) does not exist; "
            "pass another root to load_stdlib_corpus")
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if not parts & _SKIP_DIRS:
            files.append(path)
    return files


def load_stdlib_corpus(max_bytes: int = 8_000_000, root: Path | None = None) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the concatenated stdlib sources, as a 1-D ``torch.uint8`` tensor.

    Files are joined with a newline; unreadable files are skipped. Raises ``RuntimeError`` when
    nothing could be read (for example an interpreter without its ``.py`` sources).
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_source_files(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data + b"\n")
        total += len(data) + 1
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(
            f"no readable .py files under {root or sysconfig.get_paths()['stdlib']!r}; "
            "this interpreter ships without its standard-library sources")
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class ByteWindowDataset(Dataset):
    """Fixed-length training windows over a byte tensor.

    Item ``i`` is ``(x, y)``: ``x`` is the ``block_size`` bytes starting at offset ``i * stride`` and
    ``y`` the same window shifted one byte to the right (the next-byte targets), both ``torch.long``.
    Offsets are a pure function of ``i``; shuffling is the sampler's job.
    """

    def __init__(self, data: torch.Tensor, block_size: int, stride: int | None = None) -> None:
        if data.dim() != 1:
            raise ValueError(f"data must be a 1-D byte tensor, got shape {tuple(data.shape)}")
        if data.numel() < block_size + 1:
            raise ValueError(
                f"data has {data.numel()} bytes but one window needs block_size + 1 = {block_size + 1}; "
                "load more bytes or use a smaller block_size")
        self.data = data
        self.block_size = block_size
        self.stride = stride or block_size
        self.length = (data.numel() - block_size - 1) // self.stride + 1

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"window index {index} out of range [0, {self.length})")
        start = index * self.stride
        chunk = self.data[start:start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def train_val_split(data: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a byte tensor into a leading training part and a trailing validation part."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(data.numel() * (1.0 - val_fraction))
    return data[:cut], data[cut:]
