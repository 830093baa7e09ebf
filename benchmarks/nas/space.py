"""The benchmark's search space: 112 MLPs and 8 small CNNs on scikit-learn digits (64 features).

MLPs vary depth (hidden layers), width, activation, normalisation and residual connections; the
112 are drawn with a fixed seed from the 6 × 6 × 5 × 3 × 2 grid below. CNNs read the 64 features
as one 8×8 image. `space()` maps each architecture's name to a factory.
"""

from __future__ import annotations

import itertools
from functools import partial

import numpy as np
from torch import nn

DEPTHS = (1, 2, 3, 4, 6, 8)
WIDTHS = (8, 16, 32, 64, 128, 256)
ACTIVATIONS = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "gelu": nn.GELU,
    "sigmoid": nn.Sigmoid,
    "leaky": nn.LeakyReLU,
}
NORMS = {"none": None, "bn": nn.BatchNorm1d, "ln": nn.LayerNorm}
CNNS = [  # (channels per conv layer, BatchNorm, 2×2 max-pool after the first conv)
    ((8,), False, False),
    ((16,), True, False),
    ((8, 16), False, True),
    ((16, 32), True, True),
    ((16, 16), False, False),
    ((32, 32), True, False),
    ((8, 8, 8), False, False),
    ((16, 32, 32), True, True),
]
NUM_MLPS = 112


class Block(nn.Module):
    """x → act(norm(W x)), plus x when `skip` (only where widths match)."""

    def __init__(self, width_in, width, activation, norm, skip):
        super().__init__()
        self.linear = nn.Linear(width_in, width)
        self.norm = NORMS[norm](width) if NORMS[norm] else nn.Identity()
        self.act = ACTIVATIONS[activation]()
        self.skip = skip and width_in == width

    def forward(self, x):
        h = self.act(self.norm(self.linear(x)))
        return x + h if self.skip else h


def mlp(depth, width, activation, norm, skip, inputs=64, classes=10) -> nn.Sequential:
    blocks = [
        Block(inputs if i == 0 else width, width, activation, norm, skip) for i in range(depth)
    ]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


def cnn(channels, batchnorm, pool, classes=10) -> nn.Sequential:
    layers, c_in, side = [nn.Unflatten(1, (1, 8, 8))], 1, 8
    for i, c in enumerate(channels):
        layers += [nn.Conv2d(c_in, c, 3, padding=1)] + ([nn.BatchNorm2d(c)] if batchnorm else [])
        layers.append(nn.ReLU())
        if pool and i == 0:
            layers.append(nn.MaxPool2d(2))
            side //= 2
        c_in = c
    layers += [nn.Flatten(), nn.Linear(c_in * side * side, classes)]
    return nn.Sequential(*layers)


def space() -> dict:
    """Name → factory for all 120 architectures (112 MLPs, 8 CNNs), in a fixed order."""
    grid = list(itertools.product(DEPTHS, WIDTHS, ACTIVATIONS, NORMS, (False, True)))
    chosen = np.random.default_rng(0).choice(len(grid), NUM_MLPS, replace=False)
    out = {}
    for i in sorted(chosen):
        depth, width, act, norm, skip = grid[i]
        name = f"mlp-d{depth}-w{width}-{act}-{norm}{'-skip' if skip else ''}"
        out[name] = partial(mlp, depth, width, act, norm, skip)
    for channels, bn, pool in CNNS:
        name = f"cnn-{'x'.join(map(str, channels))}{'-bn' if bn else ''}{'-pool' if pool else ''}"
        out[name] = partial(cnn, channels, bn, pool)
    return out
