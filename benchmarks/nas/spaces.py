"""Three more NAS search spaces, independent of `space.py`, each with its own data and budget.

- `digits_cnn`  30 CNNs on the 8×8 digit images: 1–3 convolutions of 4–32 channels, kernel 3 or
  5, with or without BatchNorm, max-pool and a hidden dense layer.
- `cancer_mlp`  30 MLPs on scikit-learn's breast_cancer (30 standardised features, 2 classes):
  depth 1–6, width 4–128, ReLU / tanh / sigmoid, with or without LayerNorm.
- `seq_attention`  30 small attention networks on a generated pointer task: a sequence of 8
  one-hot tokens (vocabulary 8) whose first token p names a position; the label is the token
  at position p. Embedding width 8–32, 1–3 blocks, 1–4 heads, with or without the attention
  (MLP-only blocks), mean- or first-token pooling.

Two held-out spaces, `HELD_OUT_SPACES`, never used to choose a default (holdout.py only checks
the defaults as coded on them; compare.py and repeats.py do not read them):

- `seq_conv`  30 one-dimensional CNNs on a generated majority task: 16 one-hot tokens
  (vocabulary 4), the label is the most frequent token (the smallest on a tie). Width 4–32,
  1–4 convolutions of kernel 1, 3 or 5, plain or residual, BatchNorm / GroupNorm / none, ReLU /
  GELU / tanh, mean or max pooling over positions.
- `synth_mlp`  30 MLPs on a generated tabular task (scikit-learn's `make_classification`: 20
  features, 10 informative, 5 classes, 3 % flipped labels): width 8–128, 1–6 hidden layers,
  plain or pre-norm residual blocks, BatchNorm / LayerNorm / none, ReLU / SiLU / GELU / tanh.

`SPACES[name]()` (or `HELD_OUT_SPACES[name]()`) gives a `Space`: the candidates (name →
factory), the data split and the training budget that `ground_truth_spaces.py` uses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torch import nn

from ntk import demo


@dataclass
class Space:
    candidates: dict
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    budget: dict = field(default_factory=dict)


def _pick(grid, n, seed):
    chosen = np.random.default_rng(seed).choice(len(grid), n, replace=False)
    return [grid[i] for i in sorted(chosen)]


# ----------------------------------------------------------------------------- digits CNNs


def digits_cnn_model(channels, kernel, batchnorm, pool, hidden, classes=10) -> nn.Sequential:
    layers, c_in, side = [nn.Unflatten(1, (1, 8, 8))], 1, 8
    for i, c in enumerate(channels):
        layers.append(nn.Conv2d(c_in, c, kernel, padding=kernel // 2))
        layers += [nn.BatchNorm2d(c)] if batchnorm else []
        layers.append(nn.ReLU())
        if pool and i == 0:
            layers.append(nn.MaxPool2d(2))
            side //= 2
        c_in = c
    layers.append(nn.Flatten())
    width = c_in * side * side
    if hidden:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def digits_cnn(n=30) -> Space:
    chans = [(4,), (16,), (4, 8), (8, 16), (16, 32), (4, 4, 4), (8, 16, 32), (32, 32, 32)]
    grid = list(itertools.product(chans, (3, 5), (False, True), (False, True), (0, 32)))
    out = {}
    for channels, kernel, bn, pool, hidden in _pick(grid, n, 1):
        name = (
            f"cnn-{'x'.join(map(str, channels))}-k{kernel}{'-bn' if bn else ''}"
            f"{'-pool' if pool else ''}{f'-h{hidden}' if hidden else ''}"
        )
        out[name] = partial(digits_cnn_model, channels, kernel, bn, pool, hidden)
    data = demo.digits(n_train=1000, seed=1)
    budget = {"epochs": 3, "lr": 1e-3, "batch_size": 64, "weight_decay": 1e-4}
    return Space(out, data.x_train, data.y_train, data.x_test, data.y_test, budget)


# ------------------------------------------------------------------------ tabular MLPs


class TabularMLP(nn.Sequential):
    def __init__(self, depth, width, activation, norm, inputs=30, classes=2):
        act = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}[activation]
        layers, w = [], inputs
        for _ in range(depth):
            layers += [nn.Linear(w, width)] + ([nn.LayerNorm(width)] if norm else []) + [act()]
            w = width
        super().__init__(*layers, nn.Linear(w, classes))


def cancer_mlp(n=30) -> Space:
    from sklearn.datasets import load_breast_cancer
    from sklearn.preprocessing import StandardScaler

    grid = list(
        itertools.product(
            (1, 2, 3, 4, 6), (4, 8, 16, 32, 128), ("relu", "tanh", "sigmoid"), (False, True)
        )
    )
    out = {}
    for depth, width, act, norm in _pick(grid, n, 2):
        out[f"mlp-d{depth}-w{width}-{act}{'-ln' if norm else ''}"] = partial(
            TabularMLP, depth, width, act, norm
        )
    data = load_breast_cancer()
    order = np.random.default_rng(0).permutation(len(data.target))
    x, y = data.data[order], data.target[order]
    n_train = 300
    x = StandardScaler().fit(x[:n_train]).transform(x)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    budget = {"epochs": 2, "lr": 1e-3, "batch_size": 32, "weight_decay": 1e-4}
    return Space(out, x[:n_train], y[:n_train], x[n_train:], y[n_train:], budget)


# -------------------------------------------------------------------- attention networks

SEQ_LEN, VOCAB = 8, 8


class Block(nn.Module):
    """x + attention(LN x) (skipped when heads == 0), then x + MLP(LN x) with a ReLU."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        if heads:
            self.norm1 = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width)
        )

    def forward(self, x):
        if self.heads:
            b, t, w = x.shape
            q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, -1).unbind(2)
            att = torch.softmax(torch.einsum("bihd,bjhd->bhij", q, k) / q.shape[-1] ** 0.5, -1)
            x = x + self.proj(torch.einsum("bhij,bjhd->bihd", att, v).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


class AttentionNet(nn.Module):
    """One-hot tokens [B, T, V] → linear embedding + learned positions → blocks → pooled → V."""

    def __init__(self, width, depth, heads, pool):
        super().__init__()
        self.embed = nn.Linear(VOCAB, width)
        self.pos = nn.Parameter(0.1 * torch.randn(SEQ_LEN, width))
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.pool = pool

    def forward(self, x):
        h = self.norm(self.blocks(self.embed(x) + self.pos))
        return self.head(h.mean(1) if self.pool == "mean" else h[:, 0])


def pointer_task(n, seed):
    """n sequences of SEQ_LEN one-hot tokens; token 0 is a position p ≥ 1, the label x[p]."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=g)
    tokens[:, 0] = torch.randint(1, SEQ_LEN, (n,), generator=g)
    y = tokens[torch.arange(n), tokens[:, 0]]
    return nn.functional.one_hot(tokens, VOCAB).float(), y


def seq_attention(n=30) -> Space:
    grid = list(itertools.product((8, 16, 32), (1, 2, 3), (0, 1, 2, 4), ("mean", "first")))
    out = {}
    for width, depth, heads, pool in _pick(grid, n, 3):
        name = f"att-w{width}-d{depth}-h{heads}-{pool}"
        out[name] = partial(AttentionNet, width, depth, heads, pool)
    x, y = pointer_task(3000, 0)
    budget = {"epochs": 4, "lr": 3e-3, "batch_size": 64, "weight_decay": 1e-4}
    return Space(out, x[:2000], y[:2000], x[2000:], y[2000:], budget)


SPACES = {"digits_cnn": digits_cnn, "cancer_mlp": cancer_mlp, "seq_attention": seq_attention}


# ---------------------------------------------------------- held out: 1-D CNNs on sequences

MAJORITY_LEN, MAJORITY_VOCAB = 16, 4
_ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh}


def majority_task(n, seed):
    """n sequences of one-hot tokens [n, vocabulary, length]; the label is the most frequent
    token (argmax takes the smallest on a tie)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MAJORITY_VOCAB, (n, MAJORITY_LEN), generator=g)
    one_hot = nn.functional.one_hot(tokens, MAJORITY_VOCAB)
    return one_hot.float().transpose(1, 2).contiguous(), one_hot.sum(1).argmax(1)


class ConvNet1d(nn.Module):
    """Pointwise stem → `depth` blocks conv → norm → activation (added to their input when
    residual) → mean or max over positions → linear."""

    def __init__(self, width, depth, kernel, residual, norm, act, pool):
        super().__init__()
        norms = {"bn": lambda: [nn.BatchNorm1d(width)], "gn": lambda: [nn.GroupNorm(2, width)]}
        self.stem = nn.Conv1d(MAJORITY_VOCAB, width, 1)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv1d(width, width, kernel, padding=kernel // 2),
                *norms.get(norm, list)(),
                _ACTS[act](),
            )
            for _ in range(depth)
        )
        self.residual, self.pool = residual, pool
        self.head = nn.Linear(width, MAJORITY_VOCAB)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h) if self.residual else block(h)
        return self.head(h.mean(2) if self.pool == "mean" else h.amax(2))


def seq_conv(n=30) -> Space:
    grid = list(
        itertools.product(
            (4, 8, 16, 32),
            (1, 2, 4),
            (1, 3, 5),
            (False, True),
            ("none", "bn", "gn"),
            ("relu", "gelu", "tanh"),
            ("mean", "max"),
        )
    )
    out = {}
    for width, depth, kernel, residual, norm, act, pool in _pick(grid, n, 4):
        name = f"conv-w{width}-d{depth}-k{kernel}{'-res' if residual else ''}-{norm}-{act}-{pool}"
        out[name] = partial(ConvNet1d, width, depth, kernel, residual, norm, act, pool)
    x, y = majority_task(3000, 0)
    budget = {"epochs": 3, "lr": 3e-3, "batch_size": 64, "weight_decay": 1e-4}
    return Space(out, x[:2000], y[:2000], x[2000:], y[2000:], budget)


# ----------------------------------------------- held out: MLPs on generated tabular data


class Residual(nn.Module):
    """h + linear(activation(linear(norm h)))."""

    def __init__(self, width, norm, act):
        super().__init__()
        self.body = nn.Sequential(
            _norm1d(norm, width), nn.Linear(width, width), _ACTS[act](), nn.Linear(width, width)
        )

    def forward(self, h):
        return h + self.body(h)


def _norm1d(norm, width) -> nn.Module:
    return {"bn": nn.BatchNorm1d, "ln": nn.LayerNorm}.get(norm, lambda _: nn.Identity())(width)


class SynthMLP(nn.Sequential):
    def __init__(self, width, depth, norm, act, residual, inputs=20, classes=5):
        if residual:
            body = [Residual(width, norm, act) for _ in range(depth)]
        else:
            body = [
                m
                for _ in range(depth)
                for m in (nn.Linear(width, width), _norm1d(norm, width), _ACTS[act]())
            ]
        super().__init__(nn.Linear(inputs, width), _ACTS[act](), *body, nn.Linear(width, classes))


def synth_task():
    """2,000 samples of `make_classification` (20 features, 10 informative, 5 classes, 3 %
    flipped labels), standardised on the first 1,000."""
    from sklearn.datasets import make_classification
    from sklearn.preprocessing import StandardScaler

    x, y = make_classification(
        n_samples=2000,
        n_features=20,
        n_informative=10,
        n_redundant=4,
        n_classes=5,
        class_sep=0.8,
        flip_y=0.03,
        random_state=0,
    )
    x = StandardScaler().fit(x[:1000]).transform(x)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def synth_mlp(n=30) -> Space:
    grid = list(
        itertools.product(
            (8, 16, 32, 64, 128),
            (1, 2, 4, 6),
            ("none", "bn", "ln"),
            ("relu", "silu", "gelu", "tanh"),
            (False, True),
        )
    )
    out = {}
    for width, depth, norm, act, residual in _pick(grid, n, 5):
        name = f"mlp-w{width}-d{depth}-{norm}-{act}{'-res' if residual else ''}"
        out[name] = partial(SynthMLP, width, depth, norm, act, residual)
    x, y = synth_task()
    budget = {"epochs": 8, "lr": 1e-3, "batch_size": 64, "weight_decay": 1e-4}
    return Space(out, x[:1000], y[:1000], x[1000:], y[1000:], budget)


HELD_OUT_SPACES = {"seq_conv": seq_conv, "synth_mlp": synth_mlp}
ALL_SPACES = {**SPACES, **HELD_OUT_SPACES}  # for the truths and loading; no rule reads the held out
