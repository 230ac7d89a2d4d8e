"""Small models for the training experiments (no torchvision needed): ResNet-18 adapted to 28x28
single-channel images (3x3 stem, no max-pool), and a tiny CNN for smoke tests."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["resnet18", "vgg", "tiny_cnn", "MODELS"]


class _Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet18(nn.Module):
    def __init__(self, in_channels=1, num_classes=10, width=64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, mult in enumerate((1, 2, 4, 8)):
            cout = width * mult
            layers += [_Block(cin, cout, 1 if i == 0 else 2), _Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet18(num_classes=10, in_channels=1, width=64) -> nn.Module:
    """ResNet-18 (11.2M parameters at width 64) for 28x28 inputs."""
    return ResNet18(in_channels, num_classes, width)


class VGG28(nn.Module):
    """APNN-TC's VGG-variant (the BNN papers' CIFAR VGG: 2x128C3-MP2-2x256C3-MP2-2x512C3-MP2-2x1024FC) for 28x28
    inputs: the maps go 28 -> 14 -> 7 -> 3, the classifier reads 512 * 3 * 3 = 4608 features."""

    def __init__(self, in_channels=1, num_classes=10, width=128):
        super().__init__()
        layers, cin = [], in_channels
        for i, cout in enumerate((width, width, 2 * width, 2 * width, 4 * width, 4 * width)):
            layers += [nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
            if i % 2:
                layers.append(nn.MaxPool2d(2, 2))
            cin = cout
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(cin * 3 * 3, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                        nn.Linear(1024, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def vgg(num_classes=10, in_channels=1, width=128) -> nn.Module:
    """APNN-TC's VGG-variant for 28x28 inputs (VGG28)."""
    return VGG28(in_channels, num_classes, width)


def tiny_cnn(num_classes=10, in_channels=1) -> nn.Module:
    """Conv (stride 2) + Linear on the 14x14 feature map: trains in seconds on a CPU (smoke tests)."""
    return nn.Sequential(nn.Conv2d(in_channels, 4, 3, 2, 1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 14 * 14, num_classes))


MODELS = {"resnet18": resnet18, "vgg": vgg, "tiny_cnn": tiny_cnn}
