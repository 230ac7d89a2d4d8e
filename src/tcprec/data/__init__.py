"""Small real data bundled with tcprec, so demos run offline and without optional packages.

``astronaut_crop.png`` is a 128x128 crop (rows 40:168, columns 170:298) of scikit-image's
``astronaut`` photograph (Eileen Collins, NASA; public domain).
"""

from __future__ import annotations

from importlib import resources

import torch

__all__ = ["astronaut", "bundled_astronaut"]


def bundled_astronaut() -> torch.Tensor:
    """The bundled 128x128 crop of the astronaut photo: float32 (128, 128, 3) in [0, 1]."""
    from matplotlib.image import imread  # PNG through Pillow, already a matplotlib dependency

    with resources.as_file(resources.files(__name__) / "astronaut_crop.png") as path:
        img = imread(path)  # (H, W, 3) float32 in [0, 1] for 8-bit PNGs
    return torch.from_numpy(img[..., :3].copy())


def astronaut() -> tuple[torch.Tensor, str]:
    """scikit-image's astronaut photo as float32 (512, 512, 3) in [0, 1], with a description of the
    source; the bundled crop when scikit-image is not installed.

    >>> img, source = astronaut()
    >>> img.dtype, img.shape[-1]
    (torch.float32, 3)
    """
    try:
        from skimage import data
    except ImportError:
        img = bundled_astronaut()
        return img, f"bundled {img.shape[0]}x{img.shape[1]} crop of astronaut (scikit-image not installed)"
    img = torch.from_numpy(data.astronaut()).to(torch.float32) / 255.0  # (512, 512, 3) uint8 -> [0, 1]
    return img, f"scikit-image astronaut {img.shape[0]}x{img.shape[1]}x{img.shape[2]}"
