"""The built-in demo: a small MLP trained in seconds on scikit-learn's bundled digits data."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm


@dataclass
class DigitsData:
    """Standardised 8×8 digit images (64 features) with labels, split into train and test."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def digits(n_train: int = 1000, seed: int = 0, dtype=torch.float32) -> DigitsData:
    """scikit-learn's digits (1,797 images, bundled, no download), shuffled with `seed`;
    the first `n_train` samples train, the rest test. Features scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    if not 0 < n_train < len(data.target):
        raise ValueError(f"n_train must be between 1 and {len(data.target) - 1}, got {n_train}")
    order = np.random.default_rng(seed).permutation(len(data.target))
    x = torch.tensor(data.data[order] / 16.0, dtype=dtype)
    y = torch.tensor(data.target[order], dtype=torch.long)
    return DigitsData(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def mlp(hidden: int = 64, depth: int = 1, inputs: int = 64, classes: int = 10) -> nn.Sequential:
    """A ReLU MLP inputs → hidden (× depth) → classes."""
    layers, width = [], inputs
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int = 60,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 1e-4,
    seed: int = 0,
    progress: bool = False,
) -> nn.Module:
    """Train a classifier with Adam and cross-entropy (fixed seed); returns it in eval mode.
    `progress`: a bar over the epochs."""
    for _ in _epochs(model, x, y, epochs, batch_size, lr, weight_decay, seed, progress):
        pass
    return model.eval()


def train_checkpoints(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    count: int = 4,
    epochs: int = 60,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 1e-4,
    seed: int = 0,
    progress: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Train exactly like `train` and return copies of the state dict after each `count`-th of the
    epochs (epochs ⌈k·epochs/count⌉, k = 1..count; the last is the trained model, left in eval
    mode). Pass them to `attribution.influence(..., checkpoints=...)`: averaged over checkpoints
    of one run, the influence predicts retraining better than from the final model alone
    (`python benchmarks/checkpoints.py`)."""
    if not 1 <= count <= epochs:
        raise ValueError(f"count must be between 1 and epochs ({epochs}), got {count}")
    marks = {-(-k * epochs // count) for k in range(1, count + 1)}
    states = []
    for done in _epochs(model, x, y, epochs, batch_size, lr, weight_decay, seed, progress):
        if done in marks:
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    model.eval()
    return states


def _epochs(model, x, y, epochs, batch_size, lr, weight_decay, seed, progress):
    """Train `model` in place epoch by epoch (Adam, cross-entropy, minibatch order from `seed`),
    yielding the number of epochs done after each."""
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    for epoch in tqdm(range(epochs), disable=not progress, desc="training the demo", unit="epoch"):
        for idx in torch.randperm(len(y), generator=generator).split(batch_size):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        yield epoch + 1


def demo_model(seed: int = 0, progress: bool = False) -> tuple[nn.Module, DigitsData]:
    """The demo network (MLP 64-64-10) trained on the digits training split, and the data."""
    data = digits(seed=seed)
    torch.manual_seed(seed)
    model = train(mlp(), data.x_train, data.y_train, seed=seed, progress=progress)
    return model, data


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())
