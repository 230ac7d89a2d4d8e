"""APNN-TC's VGG variant (224x224x3, all 3x3): 3->96 s2 + pool (56); 96->256, 256->256, 256->256 + pool
(28); 256->512, 512->512, 512->512 + pool (14); three 512->512, the last + pool (7);
FC 25088 -> 4096 -> 4096 -> 1000."""

from __future__ import annotations

import torch
from torch import nn

from ._blocks import conv_bn_act


class VGGVariant(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        pool = lambda: nn.MaxPool2d(2, 2)  # noqa: E731
        plan = [  # (cin, cout, stride, pool after)
            (3, 96, 2, True),
            (96, 256, 1, False), (256, 256, 1, False), (256, 256, 1, True),
            (256, 512, 1, False), (512, 512, 1, False), (512, 512, 1, True),
            (512, 512, 1, False), (512, 512, 1, False), (512, 512, 1, True),
        ]
        layers: list[nn.Module] = []
        for cin, cout, s, p in plan:
            layers += conv_bn_act(cin, cout, 3, s, 1, pool=pool() if p else None)
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(),
            nn.Linear(4096, 4096), nn.ReLU(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))
