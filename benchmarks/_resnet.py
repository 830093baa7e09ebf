"""A small CIFAR-shaped ResNet (He et al., CVPR 2016) with BatchNorm, defined here so that no
benchmark needs torchvision: a 3×3 stem, `blocks` BasicBlocks per stage at widths
`widths` (stride 2 between stages), global average pooling and a linear classifier."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths=(16, 32, 64), blocks: int = 1, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        layers, c_in = [], widths[0]
        for i, width in enumerate(widths):
            for b in range(blocks):
                layers.append(BasicBlock(c_in, width, 2 if i > 0 and b == 0 else 1))
                c_in = width
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


def resnet(seed: int = 0, **kwargs) -> ResNet:
    """A ResNet in eval mode whose BatchNorm layers hold non-trivial running statistics (one
    training-mode pass over random images), as a trained network's would."""
    torch.manual_seed(seed)
    model = ResNet(**kwargs)
    with torch.no_grad():
        model.train()(torch.randn(64, 3, 32, 32))
    return model.eval()
