"""CS492's YOLOv2-tiny (416x416x3 -> 13x13x125): conv3x3-BN-LeakyReLU(0.1) 3->16->32->64->128->256, each
followed by a 2x2/2 max-pool; 256->512 + 2x2 max-pool with stride 1 (darknet pads right/bottom by one, so
13x13 stays 13x13); 512->1024; 1024->1024; conv 1x1 1024->125 with bias (5 anchors x (20 classes + 5))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._blocks import conv_bn_act


class MaxPoolSame(nn.Module):
    """2x2 max-pool, stride 1, right/bottom padding of one (darknet's 'same' pool), H x W -> H x W."""

    tcprec_pool = ("max", 2, 1)  # quantize_model fuses it into the conv epilogue (tcprec.ops.qconv pools)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.pad(x, (0, 1, 0, 1), mode="replicate"), 2, 1)


class YOLOv2Tiny(nn.Module):
    def __init__(self, num_classes: int = 20, anchors: int = 5):
        super().__init__()
        layers: list[nn.Module] = []
        for cin, cout in [(3, 16), (16, 32), (32, 64), (64, 128), (128, 256)]:
            layers += conv_bn_act(cin, cout, 3, act="leaky", pool=nn.MaxPool2d(2, 2))  # 416 -> 13
        layers += conv_bn_act(256, 512, 3, act="leaky", pool=MaxPoolSame())
        layers += conv_bn_act(512, 1024, 3, act="leaky")
        layers += conv_bn_act(1024, 1024, 3, act="leaky")
        layers.append(nn.Conv2d(1024, anchors * (num_classes + 5), 1, bias=True))
        self.features = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)
