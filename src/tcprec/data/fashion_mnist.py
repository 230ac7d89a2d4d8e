"""Fashion-MNIST from its idx files (Debian package ``dataset-fashion-mnist``; nothing is downloaded).

>>> # x, y = load_fashion_mnist(split="test")      # (10000, 28, 28) uint8, (10000,) int64
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import torch

__all__ = ["DEFAULT_PATH", "load_fashion_mnist", "fashion_mnist_available", "CLASSES"]

DEFAULT_PATH = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def _find(folder: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def fashion_mnist_available(path=None) -> tuple[bool, str]:
    """(available, reason): whether the four idx files are in ``path`` (default: the Debian folder)."""
    folder = Path(path or os.environ.get("TCPREC_FASHION_MNIST", DEFAULT_PATH))
    missing = [s for pair in _FILES.values() for s in pair if _find(folder, s) is None]
    if missing:
        return False, (f"Fashion-MNIST not found in {folder} (missing {missing[0]}[.gz]); install the Debian "
                       "package dataset-fashion-mnist or pass the folder holding the idx files")
    return True, str(folder)


def _read_idx(p: Path) -> torch.Tensor:
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = data[0] << 8 | data[1], data[2], data[3]
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{p} is not an idx file of unsigned bytes (header {data[:4].hex()})")
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    body = data[4 + 4 * ndim:]
    n = 1
    for d in dims:
        n *= d
    if len(body) != n:
        raise ValueError(f"{p}: header says {dims} ({n} bytes), file holds {len(body)}")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(dims)


def load_fashion_mnist(path=None, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """(images (N, 28, 28) uint8, labels (N,) int64) of ``split`` ("train": 60,000, "test": 10,000)."""
    if split not in _FILES:
        raise ValueError(f"split must be one of {tuple(_FILES)}, got split={split!r}")
    ok, where = fashion_mnist_available(path)
    if not ok:
        raise FileNotFoundError(where)
    folder = Path(where)
    images = _read_idx(_find(folder, _FILES[split][0]))
    labels = _read_idx(_find(folder, _FILES[split][1])).long()
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{split}: {images.shape[0]} images but {labels.shape[0]} labels")
    return images, labels
