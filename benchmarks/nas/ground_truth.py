"""Ground truth for the NAS benchmark: validation accuracy of every architecture in `space.py`
after a fixed training budget, for several seeds; writes ground_truth.json next to this file.

Budget: 10 epochs of Adam (lr 1e-3, weight decay 1e-4, minibatches of 64) on the 1,000-sample
digits training split (`ntk.demo.digits(n_train=1000)`), accuracy on the other 797 samples.
The ceiling any proxy can hope for is how well one seed's accuracies rank the architectures
like another seed's: the mean Kendall τ / Spearman ρ over pairs of seeds.

    python benchmarks/nas/ground_truth.py    # 667 s on the shared 2-core machine (one thread)
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import kendalltau, spearmanr
from space import space

from ntk import demo

SEEDS = (0, 1, 2, 3, 4)
BUDGET = {
    "epochs": 10,
    "optimizer": "Adam",
    "lr": 1e-3,
    "weight_decay": 1e-4,
    "batch_size": 64,
    "n_train": 1000,
    "n_val": 797,
}
OUT = Path(__file__).with_name("ground_truth.json")


def main() -> None:
    torch.set_num_threads(1)
    data = demo.digits(n_train=BUDGET["n_train"])
    start = time.perf_counter()
    archs = {}
    for name, factory in space().items():
        accs = []
        for seed in SEEDS:
            torch.manual_seed(seed)
            model = demo.train(
                factory(),
                data.x_train,
                data.y_train,
                epochs=BUDGET["epochs"],
                batch_size=BUDGET["batch_size"],
                lr=BUDGET["lr"],
                weight_decay=BUDGET["weight_decay"],
                seed=seed,
            )
            accs.append(round(demo.accuracy(model, data.x_test, data.y_test), 4))
        params = sum(p.numel() for p in model.parameters())
        archs[name] = {"params": params, "accuracy": accs, "mean": round(float(np.mean(accs)), 4)}
        print(f"{name:32s} {np.mean(accs):.3f} ± {np.std(accs):.3f}", flush=True)
    table = np.array([a["accuracy"] for a in archs.values()])
    pairs = list(itertools.combinations(range(len(SEEDS)), 2))
    ceiling = {
        "kendall_tau": float(np.mean([kendalltau(table[:, i], table[:, j])[0] for i, j in pairs])),
        "spearman_rho": float(np.mean([spearmanr(table[:, i], table[:, j])[0] for i, j in pairs])),
    }
    seconds = time.perf_counter() - start
    OUT.write_text(
        json.dumps(
            {
                "budget": BUDGET,
                "seeds": list(SEEDS),
                "ceiling": ceiling,
                "seconds": round(seconds, 1),
                "torch": torch.__version__,
                "architectures": archs,
            },
            indent=1,
        )
        + "\n"
    )
    print(
        f"seed-to-seed ceiling: Kendall τ {ceiling['kendall_tau']:.3f}, Spearman ρ "
        f"{ceiling['spearman_rho']:.3f}; {seconds:.0f} s; wrote {OUT}"
    )


if __name__ == "__main__":
    main()
