"""Ground truth for the spaces of `spaces.py`, the held-out ones too: validation accuracy of
every architecture after its space's training budget (Adam, `demo.train`), averaged over
ground_truth.SEEDS (20); writes truth_<space>.json next to this file, with the seed-to-seed
ceiling (mean Kendall τ / Spearman ρ over pairs of seeds: how noisy one run is; the mean over
the seeds is less noisy).

    python benchmarks/nas/ground_truth_spaces.py [digits_cnn ... synth_mlp]   # default: all five
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from ground_truth import SEEDS
from scipy.stats import kendalltau, spearmanr
from spaces import ALL_SPACES

from ntk import demo


def truth_path(name: str) -> Path:
    return Path(__file__).with_name(f"truth_{name}.json")


def ground_truth(name: str, seeds=SEEDS, n=None) -> dict:
    space = ALL_SPACES[name]() if n is None else ALL_SPACES[name](n)
    start = time.perf_counter()
    archs = {}
    for arch, factory in space.candidates.items():
        accs = []
        for seed in seeds:
            torch.manual_seed(seed)
            model = demo.train(factory(), space.x_train, space.y_train, seed=seed, **space.budget)
            accs.append(round(demo.accuracy(model, space.x_val, space.y_val), 4))
        params = sum(p.numel() for p in model.parameters())
        archs[arch] = {"params": params, "accuracy": accs, "mean": round(float(np.mean(accs)), 4)}
        print(f"{name} {arch:36s} {np.mean(accs):.3f} ± {np.std(accs):.3f}", flush=True)
    table = np.array([a["accuracy"] for a in archs.values()])
    pairs = list(itertools.combinations(range(len(seeds)), 2))
    ceiling = {
        "kendall_tau": float(np.mean([kendalltau(table[:, i], table[:, j])[0] for i, j in pairs])),
        "spearman_rho": float(np.mean([spearmanr(table[:, i], table[:, j])[0] for i, j in pairs])),
    }
    return {
        "budget": {**space.budget, "n_train": len(space.y_train), "n_val": len(space.y_val)},
        "seeds": list(seeds),
        "ceiling": ceiling,
        "seconds": round(time.perf_counter() - start, 1),
        "torch": torch.__version__,
        "architectures": archs,
    }


def main() -> None:
    torch.set_num_threads(1)
    for name in sys.argv[1:] or ALL_SPACES:
        truth = ground_truth(name)
        truth_path(name).write_text(json.dumps(truth, indent=1) + "\n")
        c = truth["ceiling"]
        print(
            f"{name}: ceiling τ {c['kendall_tau']:.3f} ρ {c['spearman_rho']:.3f}; "
            f"{truth['seconds']:.0f} s; wrote {truth_path(name)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
