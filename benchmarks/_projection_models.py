"""Models and data shared by the projection benchmarks: the MLP 784-512-512-10 and a small CNN
on scikit-learn's digits upsampled to 28 × 28 (bundled, no download), fixed seeds."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ntk import demo


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    ).eval()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 10),
    ).eval()


MODELS = {"mlp": mlp, "cnn": cnn}


def images(n: int) -> torch.Tensor:
    """n digit images [n, 1, 28, 28] (the 1,797 digits repeated with a little noise beyond)."""
    d = demo.digits(n_train=1000)
    x = torch.cat([d.x_train, d.x_test]).reshape(-1, 1, 8, 8)
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    reps = -(-n // x.shape[0])
    g = torch.Generator().manual_seed(0)
    x = x.repeat(reps, 1, 1, 1)[:n]
    if reps > 1:
        x = x + 0.01 * torch.randn(x.shape, generator=g)
    return x.contiguous()
