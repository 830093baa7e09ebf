"""Ground truth for the NAS benchmark: validation accuracy of every architecture in `space.py`
after a fixed training budget, averaged over SEEDS; writes ground_truth.json next to this file.

Budget: 10 epochs of Adam (lr 1e-3, weight decay 1e-4, minibatches of 64) on the 1,000-sample
digits training split (`ntk.demo.digits(n_train=1000)`), accuracy on the other 797 samples.
How noisy one training run is: how well one seed's accuracies rank the architectures like
another seed's, the mean Kendall τ / Spearman ρ over pairs of seeds ("ceiling"). The truth, the
mean over SEEDS, is less noisy than one run, so a proxy can rank it better than that.

    python benchmarks/nas/ground_truth.py    # 632 s for 20 seeds on the 2-core machine (one thread)
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

# Training runs averaged per architecture, here and in ground_truth_spaces.py. 20, not 5: against
# 5-seed truths the τ of one proxy moved by up to 0.10 between disjoint blocks of 5 seeds (the
# `rank` default on the attention space: 0.709 / 0.612 / 0.667 / 0.646), more than the margins
# the defaults are chosen by (benchmarks/results/nas.md, "Twenty seeds").
SEEDS = tuple(range(20))
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
