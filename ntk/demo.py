"""The built-in demo: a small MLP trained in seconds on scikit-learn's bundled digits data."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .core.checks import check_amount, check_integer
from .core.inputs import targets
from .core.kinds import class_labels


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

    n_train = check_integer(n_train, "n_train")
    seed = check_integer(seed, "seed", least=0)  # numpy's generators take no negative seed
    data = load_digits()
    if not n_train < len(data.target):
        raise ValueError(f"n_train must be between 1 and {len(data.target) - 1}, got {n_train}")
    order = np.random.default_rng(seed).permutation(len(data.target))
    x = torch.tensor(data.data[order] / 16.0, dtype=dtype)
    y = torch.tensor(data.target[order], dtype=torch.long)
    return DigitsData(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def mlp(hidden: int = 64, depth: int = 1, inputs: int = 64, classes: int = 10) -> nn.Sequential:
    """A ReLU MLP inputs → hidden (× depth) → classes."""
    for name, value in (
        ("hidden", hidden),
        ("depth", depth),
        ("inputs", inputs),
        ("classes", classes),
    ):
        check_integer(value, name)
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
    `progress`: a bar over the epochs. x [N, ...] and class labels y [N] in 0..O−1 of the model's
    O outputs; bad arguments are refused before training, and a failure during it leaves the model
    in the mode it came in."""
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
    epochs = check_integer(epochs, "epochs", least=0)
    if not 1 <= check_integer(count, "count", least=None) <= epochs:
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
    yielding the number of epochs done after each; its train/eval mode is restored afterwards."""
    epochs = check_integer(epochs, "epochs", least=0)
    batch_size = check_integer(batch_size, "batch_size")
    generator = torch.Generator().manual_seed(check_integer(seed, "seed", least=None))
    opt = adam(model.parameters(), lr, weight_decay)
    training = model.training
    try:
        model.eval()
        y = _labels(model, x, y)
        model.train()
        bar = tqdm(range(epochs), disable=not progress, desc="training the demo", unit="epoch")
        for epoch in bar:
            for idx in torch.randperm(len(y), generator=generator).split(batch_size):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
            yield epoch + 1
    finally:
        model.train(training)


def _labels(model: nn.Module, x: torch.Tensor, y) -> torch.Tensor:
    """y as class labels of x's samples in 0..O−1, O the outputs of `model` on one sample
    (without gradients; the caller sets the mode), refused naming x and y otherwise."""
    y = targets(y)
    if len(x) != len(y):
        raise ValueError(f"x holds {len(x)} samples but y holds {len(y)} labels")
    with torch.no_grad():
        out = model(x[:1])
    return class_labels(y, len(y), out.shape[-1], "y")


def adam(parameters, lr: float, weight_decay: float) -> torch.optim.Adam:
    """The recipe's optimizer (`train`, `attribution.train_on_subsets`): Adam over those of
    `parameters` that require gradients (frozen ones stay as they are); lr > 0 and
    weight_decay ≥ 0, finite, refused naming them otherwise."""
    check_amount(lr, "lr")
    check_amount(weight_decay, "weight_decay", zero=True)
    trainable = [p for p in parameters if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters (requires_grad=True) to train")
    return torch.optim.Adam(trainable, lr=lr, weight_decay=weight_decay)


def demo_model(seed: int = 0, progress: bool = False) -> tuple[nn.Module, DigitsData]:
    """The demo network (MLP 64-64-10) trained on the digits training split, and the data."""
    data = digits(seed=seed)
    torch.manual_seed(seed)
    model = train(mlp(), data.x_train, data.y_train, seed=seed, progress=progress)
    return model, data


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())
