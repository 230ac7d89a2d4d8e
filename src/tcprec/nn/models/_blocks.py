"""Small building blocks shared by the model definitions."""

from __future__ import annotations

from torch import nn


def conv_bn_act(cin: int, cout: int, k: int, stride: int = 1, padding: int | None = None, *, act: str = "relu",
                pool: nn.Module | None = None) -> list[nn.Module]:
    """conv (no bias) -> BatchNorm -> ReLU / LeakyReLU(0.1) / nothing [-> pool], as a list of modules."""
    pad = k // 2 if padding is None else padding
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, pad, bias=False), nn.BatchNorm2d(cout)]
    if act == "relu":
        layers.append(nn.ReLU(inplace=False))
    elif act == "leaky":
        layers.append(nn.LeakyReLU(0.1))
    elif act != "none":
        raise ValueError(f"act must be 'relu', 'leaky' or 'none', got {act!r}")
    if pool is not None:
        layers.append(pool)
    return layers
