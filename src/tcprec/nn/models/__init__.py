"""The networks of APNN-TC and CS492 (seeded weights; no pretrained weights for these exist offline).

``build(name, seed=0)`` returns a float ``nn.Module`` in eval mode whose batch-norm statistics are set
from seeded random batches (so activations keep a sane scale through depth, as trained networks do),
and ``INPUT_SHAPES[name]`` is its (C, H, W) input.

>>> import tcprec.nn.models as M
>>> sorted(M.MODELS)
['alexnet', 'resnet18', 'vgg', 'yolov2-tiny']
"""

from __future__ import annotations

import torch
from torch import nn

from .alexnet import AlexNet
from .resnet import ResNet18
from .vgg import VGGVariant
from .yolo import YOLOv2Tiny

__all__ = ["MODELS", "INPUT_SHAPES", "build", "AlexNet", "VGGVariant", "ResNet18", "YOLOv2Tiny", "recalibrate_bn"]

MODELS = {"alexnet": AlexNet, "vgg": VGGVariant, "resnet18": ResNet18, "yolov2-tiny": YOLOv2Tiny}
INPUT_SHAPES = {"alexnet": (3, 224, 224), "vgg": (3, 224, 224), "resnet18": (3, 224, 224), "yolov2-tiny": (3, 416, 416)}


@torch.no_grad()
def recalibrate_bn(model: nn.Module, input_shape, *, batches: int = 2, batch: int = 4, seed: int = 0,
                   device=None) -> nn.Module:
    """Set every BatchNorm's running statistics from seeded N(0, 1) batches (cumulative average),
    then return the model in eval mode."""
    g = torch.Generator().manual_seed(seed + 1)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average over the calibration batches
    model.train()
    for _ in range(batches):
        x = torch.randn((batch, *input_shape), generator=g)
        model(x.to(device) if device is not None else x)
    return model.eval()


def build(name: str, *, seed: int = 0, num_classes: int | None = None, device=None) -> nn.Module:
    """A seeded float model by name (``alexnet``, ``vgg``, ``resnet18``, ``yolov2-tiny``), in eval mode."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    torch.manual_seed(seed)
    kwargs = {} if num_classes is None else {"num_classes": num_classes}
    model = MODELS[name](**kwargs)
    if device is not None:
        model = model.to(device)
    return recalibrate_bn(model, INPUT_SHAPES[name], seed=seed, device=device)
