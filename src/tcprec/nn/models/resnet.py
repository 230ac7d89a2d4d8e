"""ResNet-18 in TCBNN's layout (224x224x3): conv 7x7 3->64 s4 (56), four stages of two basic blocks
(64/128/256/512 channels, stride 2 entering stages 2-4), FC 25088 -> 512 -> 1000 (no global pooling)."""

from __future__ import annotations

import torch
from torch import nn

from ._blocks import conv_bn_act


class BasicBlock(nn.Module):
    """relu(bn2(conv2(relu(bn1(conv1 x)))) + shortcut(x)), shortcut = 1x1 s2 conv + BN when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.branch = nn.Sequential(*conv_bn_act(cin, cout, 3, stride), *conv_bn_act(cout, cout, 3, act="none"))
        self.shortcut = (nn.Sequential(*conv_bn_act(cin, cout, 1, stride, 0, act="none"))
                         if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.branch(x) + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(*conv_bn_act(3, 64, 7, 4, 3))  # 224 -> 56
        blocks, cin = [], 64
        for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.stages = nn.Sequential(*blocks)  # 56 -> 7
        self.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 512), nn.ReLU(), nn.Linear(512, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.stages(self.stem(x)), 1))
