"""Which noise and prior precision should `NTKPosterior(likelihood="regression")` use when the
user has no held-out data?

    python benchmarks/posterior_regression.py [--settings a,b] [--json out.json]
    python benchmarks/posterior_regression.py --smoke     # the two quickest settings
    python benchmarks/posterior_regression.py --checks    # networks never used to choose it
    python benchmarks/posterior_regression.py --splits 5  # each setting on 5 random splits

Seven regression networks (MLPs trained with Adam on the mean squared error, fixed seeds;
inputs and targets standardised; 60 / 20 / 20 % train / validation / test splits) on data
bundled with scikit-learn or generated: `diabetes` (300 epochs, no weight decay: it
interpolates), `diabetes_wd` (weight decay 1e-3), `diabetes_30ep` (stopped early),
`digits_value` (the digit's value from its pixels), `cancer_area` (log mean area of a
breast_cancer tumour from the other features but radius, perimeter and their worst values),
`wine_two` (alcohol and colour intensity from the other wine features: two outputs) and
`sine_gap` (sin 2x + noise, with no training data in |x| < 0.5).

Rules without held-out data, test NLL per output (Gaussian predictive N(f(x), Σ(x) + σ²)):
- `MAP`: σ² the mean squared training residual, no weight uncertainty;
- `previous default`: σ² the residual, δ keeping 2.37 effective parameters
  (the classification default's rule);
- `evidence δ`: σ² the residual, δ maximising the evidence;
- `default`: σ² and δ maximising the evidence together (`noise="auto"`,
  `prior_precision="auto"`).
For reference, with the validation split: `validation` (σ² and δ minimising its NLL together,
as `fit(validation=...)` does with noise="auto") and `validation δ` (σ² the residual, δ
minimising it: `noise=` the residual), and `oracle Gaussian` (N(f(x), test MSE): the best a
constant variance can do). The default is chosen leave-one-setting-out among the three rules:
each fold picks the rule with the smallest mean test NLL over the other six. With --splits K
each setting runs on K random splits (the train / validation / test split, generated data,
initialisation and minibatch order seeded 0 … K − 1; split 0 is the single run) and every
figure is the mean over its splits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from sklearn import datasets
from sklearn.model_selection import train_test_split
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attribution import NTKPosterior, damping

RECIPES = {
    "diabetes": dict(),
    "diabetes_wd": dict(weight_decay=1e-3),
    "diabetes_30ep": dict(epochs=30),
    "digits_value": dict(epochs=100),
    "cancer_area": dict(),
    "wine_two": dict(),
    "sine_gap": dict(epochs=500),
}
# Networks never used to choose the default, measured after it was chosen (`--checks`):
# scikit-learn's generated Friedman #1 (10 inputs, 5 informative, noise 1) trained 200 and 1,500
# epochs, Friedman #3 (noise 0.1), a noisy linear problem (10 inputs, noise 20) and the count of
# bright pixels in a digit's lower 24 pixels from its upper 40.
CHECKS = {
    "friedman1": dict(epochs=200),
    "friedman1_long": dict(epochs=1500),
    "friedman3": dict(),
    "linear_noisy": dict(epochs=200),
    "digits_ink": dict(epochs=150),
}
RULES = ("previous default", "evidence δ", "default")
PREVIOUS_EFFECTIVE_PARAMETERS = 10**0.375  # the classification rule's γ when regression used it
SMOKE = ("diabetes_30ep", "sine_gap")


def mlp(d_in: int, d_out: int, width: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, d_out),
    )


def train(model, x, y, epochs=300, lr=3e-3, weight_decay=0.0, batch=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for start in range(0, len(x), batch):
            rows = order[start : start + batch]
            opt.zero_grad()
            ((model(x[rows]) - y[rows]) ** 2).mean().backward()
            opt.step()
    return model.eval()


def splits(x, y, seed: int = 0) -> dict:
    x = (x - x.mean(0)) / (x.std(0) + 1e-8)
    y = y.reshape(len(y), -1)
    y = (y - y.mean(0)) / y.std(0)
    x_tr, x_rest, y_tr, y_rest = train_test_split(x, y, test_size=0.4, random_state=seed)
    x_va, x_te, y_va, y_te = train_test_split(x_rest, y_rest, test_size=0.5, random_state=seed)
    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return {"train": (t(x_tr), t(y_tr)), "val": (t(x_va), t(y_va)), "test": (t(x_te), t(y_te))}


def data(name: str, split: int = 0) -> dict:
    """The setting's standardised train / val / test tensors; `split` seeds the split and the
    generated data."""
    if name.startswith("diabetes"):
        d = datasets.load_diabetes()
        return splits(d.data, d.target, split)
    if name == "digits_value":
        d = datasets.load_digits()
        return splits(d.data, d.target.astype(float), split)
    if name == "cancer_area":
        x = datasets.load_breast_cancer().data
        return splits(np.delete(x, [0, 2, 3, 20, 22, 23], 1), np.log(x[:, 3]), split)
    if name == "wine_two":
        x = datasets.load_wine().data
        return splits(np.delete(x, [0, 9], 1), x[:, [0, 9]], split)
    if name.startswith("friedman1"):
        return splits(*datasets.make_friedman1(600, noise=1.0, random_state=split), split)
    if name == "friedman3":
        return splits(*datasets.make_friedman3(600, noise=0.1, random_state=split), split)
    if name == "linear_noisy":
        return splits(*datasets.make_regression(500, 10, noise=20.0, random_state=split), split)
    if name == "digits_ink":
        x = datasets.load_digits().data
        return splits(x[:, :40], (x[:, 40:] > 4).sum(1).astype(float), split)
    rng = np.random.default_rng(split)
    xs = np.concatenate([rng.uniform(-3, -0.5, 200), rng.uniform(0.5, 3, 200)])
    return splits(xs[:, None], np.sin(2 * xs) + 0.2 * rng.standard_normal(400), split)


def measure(name: str, split: int = 0) -> dict[str, float]:
    """Every rule's test NLL per output (and the MSEs, the default's σ²) on random split `split`."""
    d = data(name, split)
    (x, y), (xv, yv), (xt, yt) = d["train"], d["val"], d["test"]
    recipe = {**RECIPES, **CHECKS}[name]
    model = train(mlp(x.shape[1], y.shape[1], seed=split), x, y, **recipe, seed=split)
    o = y.shape[1]
    with torch.no_grad():
        residual = float(((model(x) - y) ** 2).mean())
        test_mse = float(((model(xt) - yt) ** 2).mean())

    def nll(post) -> float:
        return -post.score(xt, yt) / o

    fixed = NTKPosterior(model, likelihood="regression", noise=residual, prior_precision=1.0)
    eigenvalues = fixed.fit(x, y).kronecker_.eigenvalues
    previous = damping.damping_for(eigenvalues, PREVIOUS_EFFECTIVE_PARAMETERS)
    rows = {
        "MAP": 0.5 * math.log(2 * math.pi * residual) + 0.5 * test_mse / residual,
        "previous default": nll(
            NTKPosterior(
                model, likelihood="regression", noise=residual, prior_precision=previous
            ).fit(x, y)
        ),
        "evidence δ": nll(
            NTKPosterior(
                model, likelihood="regression", noise=residual, prior_precision="evidence"
            ).fit(x, y)
        ),
    }
    default = NTKPosterior(model, likelihood="regression").fit(x, y)
    rows["default"] = nll(default)
    rows["validation"] = nll(
        NTKPosterior(model, likelihood="regression").fit(x, y, validation=(xv, yv))
    )
    rows["validation δ"] = nll(
        NTKPosterior(model, likelihood="regression", noise=residual).fit(x, y, validation=(xv, yv))
    )
    rows["oracle Gaussian"] = 0.5 * math.log(2 * math.pi * test_mse) + 0.5
    rows["train MSE"], rows["test MSE"], rows["default σ²"] = residual, test_mse, default.noise_
    return rows


def held_out(results: dict[str, dict]) -> dict[str, str]:
    """Each setting's fold: the rule with the smallest mean test NLL on the other settings."""
    picks = {}
    for name in results:
        others = [r for n, r in results.items() if n != name]
        picks[name] = min(RULES, key=lambda rule: np.mean([r[rule] for r in others]))
    return picks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--settings", default=",".join(RECIPES))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="only " + ", ".join(SMOKE))
    ap.add_argument(
        "--checks",
        action="store_true",
        help="measure the networks never used to choose the default: " + ", ".join(CHECKS),
    )
    ap.add_argument("--splits", type=int, default=1, help="random splits per setting (means)")
    args = ap.parse_args()
    if args.splits < 1:
        ap.error(f"--splits must be at least 1, got {args.splits}")

    def averaged(name: str) -> dict[str, float]:
        runs = [measure(name, split) for split in range(args.splits)]
        return {key: float(np.mean([r[key] for r in runs])) for key in runs[0]}

    if args.checks:
        print("networks never used to choose the default: test NLL per output")
        print("| setting | train / test MSE | MAP | evidence δ | default | oracle Gaussian |")
        print("|---|---|---|---|---|---|")
        for name in CHECKS:
            r = averaged(name)
            print(
                f"| {name} | {r['train MSE']:.3g} / {r['test MSE']:.3g} | {r['MAP']:.4g} "
                f"| {r['evidence δ']:.4g} | {r['default']:.4g} | {r['oracle Gaussian']:.4g} |",
                flush=True,
            )
        return
    names = SMOKE if args.smoke else args.settings.split(",")
    results = {name: averaged(name) for name in names}
    picks = held_out(results)
    columns = ["MAP", *RULES, "validation", "validation δ", "oracle Gaussian"]
    print("test NLL per output (lower is better); held out: the rule picked without the setting")
    print(
        "| setting | train / test MSE | default σ² | "
        + " | ".join(columns)
        + " | held-out pick (NLL) |"
    )
    print("|---" * (len(columns) + 4) + "|")
    for name, r in results.items():
        cells = " | ".join(f"{r[c]:.4g}" for c in columns)
        pick = picks[name]
        print(
            f"| {name} | {r['train MSE']:.3g} / {r['test MSE']:.3g} | {r['default σ²']:.3g} "
            f"| {cells} | {pick} ({r[pick]:.4g}) |"
        )
    in_sample = min(RULES, key=lambda rule: np.mean([r[rule] for r in results.values()]))
    print(
        f"in sample: {in_sample}; mean NLL "
        + ", ".join(f"{rule} {np.mean([r[rule] for r in results.values()]):.4g}" for rule in RULES)
    )
    if args.json:
        args.json.write_text(json.dumps({"results": results, "held_out": picks}, indent=1))


if __name__ == "__main__":
    main()
