"""APNN-TC's AlexNet (224x224x3): five convs (11x11 s4, 5x5, three 3x3) with three 2x2 max-pools,
then FC 12544 -> 4096 -> 4096 -> 1000."""

from __future__ import annotations

import torch
from torch import nn

from ._blocks import conv_bn_act


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        pool = lambda: nn.MaxPool2d(2, 2)  # noqa: E731
        self.features = nn.Sequential(
            *conv_bn_act(3, 64, 11, 4, 5, pool=pool()),     # 224 -> 56 -> 28
            *conv_bn_act(64, 192, 5, pool=pool()),          # 28 -> 14
            *conv_bn_act(192, 384, 3),
            *conv_bn_act(384, 256, 3),
            *conv_bn_act(256, 256, 3, pool=pool()),         # 14 -> 7
        )
        self.classifier = nn.Sequential(
            nn.Linear(256 * 7 * 7, 4096), nn.ReLU(),
            nn.Linear(4096, 4096), nn.ReLU(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))
