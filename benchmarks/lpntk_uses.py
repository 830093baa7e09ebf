"""The two uses of the lpNTK (`attribution.sample_interactions`): finding flipped labels and
pruning redundant training data, against the usual baselines on the same trained networks.

    python benchmarks/lpntk_uses.py [--seeds 3] [--sections mislabel,pruning]
    python benchmarks/lpntk_uses.py --smoke          # seconds

Settings: `digits` (scikit-learn digits, MLP 64-64-10, 1000 train / 797 test) and `breast_cancer`
(MLP 30-32-2 on standardised features, 400 train / 169 test), trained with `ntk.demo.train`.

Mislabel detection: 10 % of the training labels flipped (`attribution.flip_labels`), the network
trained on the noisy labels, every training example ranked by a score; ROC AUC of finding the
flipped ones, median over seeds (flip and training seed). Scores: the lpNTK's −agreement (with
the samples of the same label), −support and contradiction, the loss, −margin, EL2N
‖softmax − e_y‖ (Paul et al., NeurIPS 2021; at the trained network and early in training, after
EARLY_EPOCHS), and Gauss–Newton self-influence (`attribution.influence`, the default method).
Which lpNTK score to use is chosen leave-one-setting-out: for each setting, the lpNTK score with
the best median AUC on the other settings, and its AUC on the held-out one.

Pruning (lpNTK paper, Guo et al., ICLR 2024, §5): keep a fraction of the clean training set and
retrain (`attribution.train_on_subsets`, the demo recipe, --seeds seeds each); test accuracy per
fraction kept. lpNTK: remove the most redundant samples first (highest `redundancy`), one of each
pair (a sample whose most interchangeable partner was already removed is kept); EL2N: keep the
highest early-training EL2N (mean over seeds); random: a uniform subset.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attribution import (
    flip_labels,
    influence,
    mislabel_auc,
    sample_interactions,
    train_on_subsets,
)
from ntk import demo

SETTINGS = ("digits", "breast_cancer")
RECIPE = dict(epochs=60, batch_size=64, lr=3e-3, weight_decay=1e-4)  # ntk.demo.train's
EARLY_EPOCHS = 5  # EL2N "early in training"
FRACTIONS = (1.0, 0.8, 0.6, 0.4, 0.2)


def load(setting: str, smoke: bool):
    """(factory, x_train, y_train, x_test, y_test, classes)."""
    if setting == "digits":
        d = demo.digits(n_train=200 if smoke else 1000)
        x, y, xt, yt = d.x_train, d.y_train, d.x_test, d.y_test
        return (lambda: demo.mlp()), x, y, xt, yt, 10
    data = load_breast_cancer()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(data.target))
    x, y = data.data[order].astype(np.float32), data.target[order].astype(np.int64)
    n = 150 if smoke else 400
    mu, sd = x[:n].mean(0), x[:n].std(0) + 1e-6
    x = (x - mu) / sd
    tensors = [torch.from_numpy(a) for a in (x[:n], y[:n], x[n:], y[n:])]
    return (lambda: demo.mlp(hidden=32, inputs=30, classes=2)), *tensors, 2


def train(factory, x, y, seed: int, epochs: int):
    torch.manual_seed(seed)
    return demo.train(factory(), x, y, **dict(RECIPE, epochs=epochs), seed=seed)


def el2n(model, x, y, classes: int) -> np.ndarray:
    with torch.no_grad():
        p = model(x).double().softmax(-1)
    return (p - torch.nn.functional.one_hot(y, classes)).norm(dim=1).numpy()


def mislabel(setting: str, seeds: int, smoke: bool, epochs: int) -> dict[str, list[float]]:
    factory, x, y, _, _, classes = load(setting, smoke)
    aucs: dict[str, list[float]] = {}
    for seed in range(seeds):
        noisy, flipped = flip_labels(y, 0.1, classes, seed=seed)
        model = train(factory, x, noisy, seed, epochs)
        early = train(factory, x, noisy, seed, EARLY_EPOCHS)
        inter = sample_interactions(model, x, noisy)
        with torch.no_grad():
            g = model(x).double()
        loss = torch.nn.functional.cross_entropy(g, noisy, reduction="none").numpy()
        others = g.scatter(1, noisy[:, None], float("-inf")).logsumexp(1)
        margin = (g.gather(1, noisy[:, None])[:, 0] - others).numpy()
        self_influence = influence(model, x, noisy, x, noisy).diagonal().numpy()
        scores = {
            "lpNTK −agreement": -inter["agreement"],
            "lpNTK contradiction": inter["contradiction"],
            "lpNTK −support": -inter["support"],
            "loss": loss,
            "−margin": -margin,
            "EL2N (trained)": el2n(model, x, noisy, classes),
            f"EL2N (epoch {EARLY_EPOCHS})": el2n(early, x, noisy, classes),
            "self-influence (GN)": self_influence,
        }
        for name, s in scores.items():
            aucs.setdefault(name, []).append(mislabel_auc(s, flipped.numpy()))
    return aucs


def lpntk_keep(redundancy: np.ndarray, partner: np.ndarray, keep: int) -> np.ndarray:
    """A keep-mask of size `keep`: remove the most redundant samples first, never both of a
    pair (then, if still too many, by redundancy alone)."""
    n = len(redundancy)
    removed = np.zeros(n, dtype=bool)
    order = np.argsort(-redundancy, kind="stable")
    for i in order:
        if removed.sum() == n - keep:
            break
        if not removed[partner[i]]:
            removed[i] = True
    for i in order:
        if removed.sum() >= n - keep:
            break
        removed[i] = True
    return ~removed


def pruning(setting: str, seeds: int, smoke: bool, epochs: int) -> dict[str, list[float]]:
    factory, x, y, xt, yt, classes = load(setting, smoke)
    n = len(y)
    model = train(factory, x, y, 0, epochs)
    inter = sample_interactions(model, x, y)
    early = np.mean(
        [el2n(train(factory, x, y, s, EARLY_EPOCHS), x, y, classes) for s in range(seeds)], 0
    )
    rng = np.random.default_rng(0)
    names = ("lpNTK (drop redundant)", "EL2N (keep hard)", "random")
    curves: dict[str, list[float]] = {name: [] for name in names}
    for fraction in FRACTIONS:
        keep = int(round(fraction * n))
        masks = np.zeros((3, n), dtype=bool)
        masks[0] = lpntk_keep(inter["redundancy"], inter["partner"], keep)
        masks[1, np.argsort(-early, kind="stable")[:keep]] = True
        masks[2, rng.permutation(n)[:keep]] = True
        recipe = dict(RECIPE, epochs=epochs)
        stack = train_on_subsets(factory, x, y, torch.from_numpy(masks), seeds=seeds, **recipe)
        accuracy = (stack.outputs(xt).argmax(-1) == yt).double().mean((1, 2)).numpy()
        for name, a in zip(curves, accuracy):
            curves[name].append(float(a))
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--sections", default="mislabel,pruning")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="small data, few epochs, one seed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = 1 if args.smoke else args.seeds
    epochs = 5 if args.smoke else RECIPE["epochs"]
    medians: dict[str, dict[str, float]] = {}
    for setting in args.settings.split(","):
        if setting not in SETTINGS:
            parser.error(f"unknown setting {setting!r}; valid: {', '.join(SETTINGS)}")
        if "mislabel" in args.sections:
            aucs = mislabel(setting, seeds, args.smoke, epochs)
            medians[setting] = {name: float(np.median(v)) for name, v in aucs.items()}
            print(f"\n### {setting}: mislabel AUC, 10 % flipped (median over {seeds} seeds)\n")
            print("| score | median AUC | per seed |\n|---|---|---|")
            for name, values in sorted(aucs.items(), key=lambda kv: -np.median(kv[1])):
                cells = ", ".join(f"{v:.3f}" for v in values)
                print(f"| {name} | {np.median(values):.3f} | {cells} |")
        if "pruning" in args.sections:
            curves = pruning(setting, seeds, args.smoke, epochs)
            print(f"\n### {setting}: test accuracy vs fraction kept (mean over {seeds} seeds)\n")
            print("| method | " + " | ".join(f"{f:.0%}" for f in FRACTIONS) + " |")
            print("|---" * (len(FRACTIONS) + 1) + "|")
            for name, values in curves.items():
                print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
        sys.stdout.flush()
    if len(medians) > 1:
        print_held_out(medians)


def print_held_out(medians: dict[str, dict[str, float]]) -> None:
    """The lpNTK score chosen on the other settings, scored on the held-out one."""
    print("\n### lpNTK score for mislabel detection, chosen leave-one-setting-out\n")
    print("| held out | chosen on the others | held-out AUC | best lpNTK score in-sample | AUC |")
    print("|---|---|---|---|---|")
    for held, scores in medians.items():
        lpntk = [name for name in scores if name.startswith("lpNTK")]
        others = [medians[s] for s in medians if s != held]
        chosen = max(lpntk, key=lambda name: np.mean([o[name] for o in others]))
        best = max(lpntk, key=lambda name: scores[name])
        print(f"| {held} | {chosen} | {scores[chosen]:.3f} | {best} | {scores[best]:.3f} |")


if __name__ == "__main__":
    main()
