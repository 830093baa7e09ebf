"""Accuracy of projected kernels: relative Frobenius error ‖Φ Φᵀ − Θ‖_F / ‖Θ‖_F of the
projected `trace` and `sum_logits` kernels against the exact ones (ntk.empirical_ntk) for
k ∈ {256, 1024, 4096, 16384}, on the MLP 784-512-512-10 and a small CNN (digits upsampled to
28 × 28), median over seeds. Also the single Kronecker product R_out ⊗ R_in with
k_out = k_in = √k (the block size m = √k of `projections._sketch`) to show why the default uses
m = 1. Writes a table and a log-log plot with the 1/√k trend.

    python benchmarks/projection_accuracy.py [--n 128] [--seeds 3] [--png projection_accuracy.png]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, os.path.dirname(__file__))
from _projection_models import MODELS, images

import ntk
from ntk.core import kinds
from projections.projected import Featurizer

DIMS = (256, 1024, 4096, 16384)
KINDS = ("trace", "sum_logits")


def error(model, x, exact, kind, dim, seed, block=1):
    fz = Featurizer(model, dim=dim, kind=kind, seed=seed)
    fz.prepare(x)
    if block != 1:
        fz._sketcher.m, fz._sketcher.r = block, dim // (block * block)
    phi = torch.cat([fz.block(x[s : s + 64]) for s in range(0, x.shape[0], 64)]).double()
    return float((kinds.get(kind).contract_features(phi, phi) - exact).norm() / exact.norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument(
        "--png", default=os.path.join(os.path.dirname(__file__), "projection_accuracy.png")
    )
    args = ap.parse_args()
    x = images(args.n)
    print(
        f"# {os.cpu_count()} CPUs, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
        f"N={args.n}, median of {args.seeds} seeds, Rademacher"
    )
    print("| model | kind | projection | " + " | ".join(f"k={k}" for k in DIMS) + " | slope |")
    print("|---|---|---|" + "---|" * (len(DIMS) + 1))
    fig, axes = plt.subplots(1, len(MODELS), figsize=(10, 4), sharey=True)
    for ax, (name, build) in zip(axes, MODELS.items()):
        model, anchor = build(), None
        for kind in KINDS:
            exact = ntk.empirical_ntk(model, x, kind=kind).double()
            for label, blocks in (
                ("row-wise Kronecker (default)", [1] * len(DIMS)),
                ("single Kronecker √k×√k", [int(math.isqrt(k)) for k in DIMS]),
            ):
                errs = [
                    statistics.median(
                        error(model, x, exact, kind, k, s, m) for s in range(args.seeds)
                    )
                    for k, m in zip(DIMS, blocks)
                ]
                slope = (math.log(errs[-1]) - math.log(errs[0])) / (
                    math.log(DIMS[-1]) - math.log(DIMS[0])
                )
                print(
                    f"| {name} | {kind} | {label} | "
                    + " | ".join(f"{e:.4f}" for e in errs)
                    + f" | {slope:.2f} |",
                    flush=True,
                )
                ax.loglog(DIMS, errs, "o-" if blocks[0] == 1 else "s--", label=f"{kind}, {label}")
                anchor = errs[0] if (kind, blocks[0]) == ("sum_logits", 1) else anchor
        ref = anchor * (DIMS[0] / torch.tensor(DIMS, dtype=torch.float64)) ** 0.5
        ax.loglog(DIMS, ref.tolist(), ":", color="gray", label="∝ 1/√k")
        ax.set_title(name)
        ax.set_xlabel("k (projection dimension)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("relative Frobenius error")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"\nplot: {args.png}")


if __name__ == "__main__":
    main()
