"""Four small attribution settings with their LDS ground truth, shared by the attribution
benchmarks (benchmarks/attribution_settings.py and the surrogate benchmarks).

- `digits_mlp`: scikit-learn digits, MLP 64-64-10 (the demo network), 1000 train / 797 test;
- `digits_cnn`: the same images as 1×8×8, a small CNN (two 3×3 convolutions, max-pool, linear);
- `breast_cancer`: scikit-learn's breast_cancer (30 features standardised on the training split),
  MLP 30-32-2, 400 train / 169 test;
- `wine_mlp`: scikit-learn's wine (13 features standardised on the training split), MLP 13-32-3,
  120 train / 58 test (added after the damping and surrogate defaults were chosen on the first
  three, to check them on a setting they were not chosen on).

Two more, `HELD_OUT_NAMES`, added after every attribution default was chosen and never used to
choose one (no script loads them unless `--settings` names them):

- `synth_mlp`: generated tabular data (benchmarks/nas/spaces.py's `synth_task`: 20 features,
  5 classes, 3 % flipped labels), MLP 20-64-64-5 with LayerNorm and GELU, 600 train / 300 test;
- `seq_conv`: the generated majority task of the same file (16 one-hot tokens of 4), a residual
  1-D CNN with GroupNorm (16 channels, two convolutions of kernel 3, mean pooling), 800 train /
  300 test.

Each setting trains its network with one recipe (Adam, `attribution.train_on_subsets`, seed r for
model r), and its ground truth retrains the same recipe on random half-subsets
(`attribution.random_subsets`, vmapped) and records the test margins, averaged over seeds. The
truth is cached in `cache_dir` (keyed by every choice that changes it) when one is given.

Usage: `setting = load("digits_mlp", subsets=100, seeds=2, cache_dir=...)`, then
`setting.model`, `setting.models(10)`, `setting.subsets`, `setting.truth` and
`attribution.lds(scores, setting.subsets, setting.truth)`.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from attribution import random_subsets, train_on_subsets
from attribution.evaluation import SubsetModels
from benchmarks.nas.spaces import ConvNet1d, SynthMLP, majority_task, synth_task
from ntk import demo

NAMES = ("digits_mlp", "digits_cnn", "breast_cancer", "wine_mlp")
HELD_OUT_NAMES = ("synth_mlp", "seq_conv")
RECIPES = {
    "digits_mlp": dict(epochs=60, batch_size=64, lr=3e-3, weight_decay=1e-4),
    "digits_cnn": dict(epochs=40, batch_size=64, lr=3e-3, weight_decay=1e-4),
    "breast_cancer": dict(epochs=60, batch_size=32, lr=3e-3, weight_decay=1e-4),
    "wine_mlp": dict(epochs=100, batch_size=32, lr=3e-3, weight_decay=1e-4),
    "synth_mlp": dict(epochs=40, batch_size=64, lr=3e-3, weight_decay=1e-4),
    "seq_conv": dict(epochs=30, batch_size=64, lr=3e-3, weight_decay=1e-4),
}
SMOKE = dict(n_train=120, n_test=40, subsets=8, seeds=1, epochs=3)


def cnn(classes: int = 10) -> nn.Sequential:
    """A small CNN on 8×8 digits given as 64 features: conv 3×3 (8) → ReLU → conv 3×3 (16) → ReLU
    → max-pool 2 → linear (3,834 parameters)."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, classes),
    )


def _digits(n_train):
    d = demo.digits(n_train=n_train)
    return d.x_train, d.y_train, d.x_test, d.y_test


def _tabular(dataset: str):
    """A loader of scikit-learn's bundled `dataset` (shuffled with seed 0, features standardised
    on the training split)."""

    def load(n_train):
        import sklearn.datasets
        from sklearn.preprocessing import StandardScaler

        data = getattr(sklearn.datasets, f"load_{dataset}")()
        order = np.random.default_rng(0).permutation(len(data.target))
        x, y = data.data[order], data.target[order]
        scaler = StandardScaler().fit(x[:n_train])
        x = torch.tensor(scaler.transform(x), dtype=torch.float32)
        y = torch.tensor(y, dtype=torch.long)
        return x[:n_train], y[:n_train], x[n_train:], y[n_train:]

    return load


def _generated(task, test_from: int):
    """A loader of a generated task's (x, y): the first n_train samples to train, 300 from
    `test_from` to test."""

    def load(n_train):
        x, y = task()
        return (
            x[:n_train],
            y[:n_train],
            x[test_from : test_from + 300],
            y[test_from : test_from + 300],
        )

    return load


_SPECS = {
    # name: (data loader, training-set size, architecture factory)
    "digits_mlp": (_digits, 1000, demo.mlp),
    "digits_cnn": (_digits, 1000, cnn),
    "breast_cancer": (
        _tabular("breast_cancer"),
        400,
        lambda: demo.mlp(hidden=32, inputs=30, classes=2),
    ),
    "wine_mlp": (_tabular("wine"), 120, lambda: demo.mlp(hidden=32, inputs=13, classes=3)),
    "synth_mlp": (_generated(synth_task, 1000), 600, lambda: SynthMLP(64, 1, "ln", "gelu", False)),
    "seq_conv": (
        _generated(lambda: majority_task(3000, 0), 2000),
        800,
        lambda: ConvNet1d(16, 2, 3, True, "gn", "relu", "mean"),
    ),
}


@dataclass
class Setting:
    """A trained network, its data and the LDS ground truth on random half-subsets."""

    name: str
    factory: object  # () -> nn.Module, the architecture
    recipe: dict
    x: torch.Tensor
    y: torch.Tensor
    xt: torch.Tensor
    yt: torch.Tensor
    subsets: torch.Tensor  # bool [S, N_train]
    truth: torch.Tensor  # margins [S, N_test], averaged over seeds
    noise: float  # Spearman between two seeds' margins over subsets (nan with one seed)
    seconds: float  # time to retrain the truth (0 when read from the cache)
    _copies: SubsetModels | None = field(default=None, repr=False)

    @property
    def model(self) -> nn.Module:
        """The network: the recipe on the whole training set, seed 0."""
        return self.models(1)[0]

    def models(self, count: int) -> list[nn.Module]:
        """`count` independently seeded networks on the whole training set (seeds 0..count−1)."""
        if self._copies is None or self._copies.seeds < count:
            everything = torch.ones(1, len(self.x), dtype=torch.bool)
            self._copies = train_on_subsets(
                self.factory, self.x, self.y, everything, seeds=count, **self.recipe
            )
        return self._copies.modules()[:count]

    def halves(self, count: int) -> list[nn.Module]:
        """`count` networks, each trained by the recipe on its own random half of the training set
        (`random_subsets` drawn with seed 1, not the truth's subsets; initialisation seed 0)."""
        mask = random_subsets(len(self.x), count, 0.5, seed=1)
        return train_on_subsets(self.factory, self.x, self.y, mask, **self.recipe).modules()

    def accuracy(self, model: nn.Module) -> float:
        return demo.accuracy(model, self.xt, self.yt)


def load(
    name: str,
    *,
    subsets: int = 100,
    seeds: int = 2,
    cache_dir: str | Path | None = None,
    smoke: bool = False,
) -> Setting:
    """The setting `name` (one of NAMES or HELD_OUT_NAMES) with its ground truth over `subsets`
    half-subsets × `seeds` retrainings. smoke: a seconds-long miniature (SMOKE sizes) for tests."""
    if name not in _SPECS:
        raise ValueError(f"unknown setting {name!r}; valid settings are {', '.join(_SPECS)}")
    loader, n_train, factory = _SPECS[name]
    recipe = dict(RECIPES[name])
    if smoke:
        n_train, subsets, seeds = SMOKE["n_train"], SMOKE["subsets"], SMOKE["seeds"]
        recipe["epochs"] = SMOKE["epochs"]
    x, y, xt, yt = loader(n_train)
    if smoke:
        xt, yt = xt[: SMOKE["n_test"]], yt[: SMOKE["n_test"]]
    mask = random_subsets(len(x), subsets, 0.5, seed=0)
    key = dict(name=name, n_train=len(x), n_test=len(xt), subsets=subsets, seeds=seeds, **recipe)
    path = None
    if cache_dir is not None:
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
        path = Path(cache_dir) / f"truth_{name}_{digest}.pt"
        if path.exists():
            cached = torch.load(path)
            if bool((cached["subsets"] == mask).all()):
                return Setting(
                    name, factory, recipe, x, y, xt, yt, mask, cached["truth"], cached["noise"], 0.0
                )
    start = time.perf_counter()
    stack = train_on_subsets(factory, x, y, mask, seeds=seeds, **recipe)
    seconds = time.perf_counter() - start
    truth = stack.margins(xt, yt)
    noise = _seed_noise(stack, xt, yt) if seeds >= 2 else float("nan")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dict(key=key, subsets=mask, truth=truth, noise=noise), path)
    return Setting(name, factory, recipe, x, y, xt, yt, mask, truth, noise, seconds)


def _seed_noise(stack: SubsetModels, xt, yt) -> float:
    """Mean over test examples of the Spearman correlation, over subsets, of two seeds' margins
    (the training noise an LDS against the seed mean is measured through)."""
    from scipy.stats import spearmanr

    from attribution.outputs import margins

    out = stack.outputs(xt).double()
    a, b = (margins(out[:, r], yt) for r in (0, 1))
    rhos = [spearmanr(a[:, z], b[:, z]).statistic for z in range(len(yt))]
    return float(np.nanmean(rhos))


def lds_table(rows: dict[str, dict[str, float]], first: str) -> str:
    """Markdown table of rows[setting][rule] with a rule per line, a setting per column and
    the mean over settings; `first` heads the rule column."""
    names = list(rows)
    lines = ["| " + " | ".join([first, *names, "mean"]) + " |", "|---" * (len(names) + 2) + "|"]
    for rule in rows[names[0]]:
        values = [rows[s][rule] for s in names]
        cells = " | ".join(f"{v:.3f}" for v in values)
        lines.append(f"| {rule} | {cells} | {np.mean(values):.3f} |")
    return "\n".join(lines)


def leave_one_out(rows: dict[str, dict[str, float]], candidates: list[str]) -> dict[str, str]:
    """For each setting, the candidate rule with the best mean over the other settings."""
    return {
        held: max(candidates, key=lambda r: np.mean([rows[s][r] for s in rows if s != held]))
        for held in rows
    }
