"""Does the report's "largest self-influence (likely mislabelled or atypical)" find mislabelled
training examples? Mislabel AUC (`attribution.mislabel_auc`) of two self-influence scores on
networks trained with 10 % of their labels flipped:

- "own contribution": c_i(x_i)[y_i], the training example's contribution to its own label's
  output in `KernelSurrogate(model)`'s decomposition (the report's score before the
  twenty-eighth session);
- "removal": d(x_i) − d_{−i}(x_i)[y_i], how much the Gauss–Newton kernel machine fitted to the
  labels (the report's counterfactual machine, `influence(method="surrogate")`'s damping) drops
  for the example's own label when the example alone is removed (exact refit; the report's
  score now).

Settings: a generated 3-class task (120 samples, MLP 5-16-3 with tanh, Adam for 100 and 1,500
steps) and scikit-learn's digits, breast_cancer and wine (standardised, at most 600 samples, MLP
with 64 ReLU units, `ntk.demo.train` for 20 and 200 epochs); two seeds each (the flipped
examples and the initialisation).

    python benchmarks/self_influence.py            # about a minute on one core
    python benchmarks/self_influence.py --smoke    # seconds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits, load_wine
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attribution import KernelSurrogate, mislabel_auc
from attribution.damping import DOF_FRACTION
from ntk import demo

DATASETS = {"digits": load_digits, "breast_cancer": load_breast_cancer, "wine": load_wine}


def scores(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, np.ndarray]:
    """The two self-influence scores of every training example."""
    n, rows = len(y), np.arange(len(y))
    surrogate = KernelSurrogate(model).fit(x)
    own = np.asarray(surrogate.attribute(x))[rows, rows, y.numpy()]
    machine = KernelSurrogate(
        model, kind=surrogate.kind, machine="gauss_newton", effective_parameters=DOF_FRACTION
    ).fit(x, y)
    removal = machine.self_influence()  # the drop of each example's own label
    assert own.shape == removal.shape == (n,)
    return {"own contribution": own, "removal": removal}


def flip(y: torch.Tensor, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y with 10 % of its labels moved to another class, and the mask of those."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(len(y), generator=g)[: len(y) // 10]
    flipped = y.clone()
    shift = 1 + torch.randint(0, classes - 1, (len(chosen),), generator=g)
    flipped[chosen] = (y[chosen] + shift) % classes
    mask = torch.zeros(len(y), dtype=torch.bool)
    mask[chosen] = True
    return flipped, mask


def generated(seed: int, steps: int, n: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y, mask = flip((x @ torch.randn(5, 3, generator=g)).argmax(1), 3, seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval(), x, y, mask


def tabular(name: str, seed: int, epochs: int, n: int):
    data = DATASETS[name]()
    x = torch.tensor(data.data, dtype=torch.float32)[:n]
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    classes = int(data.target.max()) + 1
    y, mask = flip(torch.tensor(data.target)[:n], classes, seed)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(x.shape[1], 64), nn.ReLU(), nn.Linear(64, classes))
    return demo.train(net, x, y, epochs=epochs, lr=1e-3, seed=seed).eval(), x, y, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one small network per kind")
    args = parser.parse_args()
    runs = [("generated", s, t) for s in (0, 1) for t in (100, 1500)]
    runs += [(name, s, e) for name in DATASETS for s in (0, 1) for e in (20, 200)]
    if args.smoke:
        runs = [("generated", 0, 30), ("wine", 0, 5)]
    print(f"{'setting':<16}{'seed':>5}{'train':>7}{'acc':>6}  own contribution   removal")
    table = {"own contribution": [], "removal": []}
    for name, seed, length in runs:
        if name == "generated":
            model, x, y, mask = generated(seed, length, 60 if args.smoke else 120)
        else:
            model, x, y, mask = tabular(name, seed, length, 90 if args.smoke else 600)
        with torch.no_grad():
            accuracy = float((model(x).argmax(1) == y).float().mean())
        aucs = {k: mislabel_auc(v, mask) for k, v in scores(model, x, y).items()}
        for k, v in aucs.items():
            table[k].append(v)
        print(
            f"{name:<16}{seed:>5}{length:>7}{accuracy:>6.2f}  "
            f"{aucs['own contribution']:>16.3f}{aucs['removal']:>10.3f}"
        )
    for k, v in table.items():
        print(f"{k}: mislabel AUC min {min(v):.3f}, median {np.median(v):.3f}, max {max(v):.3f}")


if __name__ == "__main__":
    main()
