"""The damping rule of `attribution.influence` (Gauss–Newton), chosen leave-one-setting-out on
the LDS ground truth of benchmarks/settings.py.

    python benchmarks/damping.py [--cache-dir DIR] [--training-logits network]  # 100 × 2 truth
    python benchmarks/damping.py --smoke                # seconds

For each setting the damped system SΘS + λI of the default path (trace kernel) is
eigendecomposed once, so the scores for every λ cost one product: τ = (BS) U diag(1/(e + λ))
Uᵀ (Sw). Rules compared: λ = c × the mean eigenvalue (the previous default, c = 3) and the
effective-parameter rule of `auto_damping`, Σ_k e_k/(e_k + λ) = f · N·(O − 1), over a grid of f.
The rule's constant is chosen leave-one-setting-out (best mean LDS on the others); the
library (`influence(...)` with damping="auto" and the same training logits) is run once per
setting as a check that it reproduces the table's row for DOF_FRACTION, and method="ekfac" (3 ×
the mean eigenvalue of its factored curvature) is compared with the effective-parameter rule on
that spectrum. Residuals and curvature are taken at the training logits of --training-logits:
the kernel flow's at the library's FITTED_FRACTION (default; the test margins' gradients then at
the flow's test logits, as in the library), another share of the kernel's directions, or
"network".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import settings

import ntk
from attribution import influence, lds
from attribution.curvature import KroneckerCurvature
from attribution.damping import DOF_FRACTION, auto_damping
from attribution.kernel_flow import FITTED_FRACTION, influence_state
from attribution.outputs import (
    labels,
    logits,
    margin_gradient,
    psd_root,
    softmax_curvature,
)

FRACTIONS = (0.003, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.03, 0.05)
MEAN_MULTIPLES = (0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


def sweep(setting, share: float | None) -> dict[str, float]:
    """LDS of the Gauss–Newton scores (trace kernel) for every candidate rule, with residuals and
    curvature at the kernel flow's logits stopped once it has fitted `share` of the kernel's
    directions (the library's default at FITTED_FRACTION), or at the network's logits (None)."""
    model = setting.model
    g, gt = logits(model, setting.x), logits(model, setting.xt)
    n, o = g.shape
    y = labels(setting.y, n, o, "y")
    yt = labels(setting.yt, gt.shape[0], o, "y_test")
    u = margin_gradient(gt, yt)
    # Θ ≈ (trace / O) ⊗ I_O, the Gauss–Newton default's stand-in for the full kernel
    trace = ntk.empirical_ntk(model, torch.cat([setting.x, setting.xt]), kind="trace").double()
    joint = trace[:, :, None, None] / o * torch.eye(o, dtype=torch.float64)
    theta, cross = joint[:n, :n], joint[n:, :n]
    fit = g  # where residuals and curvature are taken (and the test margins' gradients)
    if share is not None:
        fit, u = influence_state(trace[:n, :n], trace[n:, :n], g, y, yt, share)
    s = psd_root(softmax_curvature(fit))
    p = fit.softmax(1)
    v = s[torch.arange(n), :, y] / p[torch.arange(n), y][:, None]
    a = torch.einsum("iop,ijpr,jrq->iojq", s, theta, s).reshape(n * o, n * o)
    e, vecs = torch.linalg.eigh(a)
    e = e.clamp_min(0)
    left = torch.einsum("mo,mioq->miq", u, cross)
    bs = torch.einsum("miq,iqo->mio", left, s).reshape(left.shape[0], n * o) @ vecs
    uv = (vecs.reshape(n, o, -1) * v[:, :, None]).sum(1)  # [N, N·O]

    def score(lam: float) -> float:
        return lds((bs / (e + lam)) @ uv.T, setting.subsets, setting.truth)

    mean = float(e.sum()) / (n * o)
    out = {f"{c:g} × mean eigenvalue": score(c * mean) for c in MEAN_MULTIPLES}
    for f in FRACTIONS:
        out[f"dof fraction {f:g}"] = score(auto_damping(e, n, o, fraction=f))
    library = {
        "gauss_newton": dict(training_logits="network" if share is None else share),
        "ekfac": {},
    }
    for method, options in library.items():
        scores = influence(
            model, setting.x, setting.y, setting.xt, setting.yt, method=method, **options
        )
        out[f"library, influence(method={method!r})"] = lds(scores, setting.subsets, setting.truth)
    # the effective-parameter rule on EK-FAC's factored spectrum (its default keeps 3 × mean)
    curv = KroneckerCurvature(model, strategy="ekfac").fit(setting.x, g)
    factored = torch.cat([block.eigenvalues.flatten() for block in curv.blocks.values()])
    scores = influence(
        model,
        setting.x,
        setting.y,
        setting.xt,
        setting.yt,
        method="ekfac",
        damping=auto_damping(factored, n, o),
    )
    out[f"ekfac, dof fraction {DOF_FRACTION:g}"] = lds(scores, setting.subsets, setting.truth)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(settings.NAMES))
    parser.add_argument("--cache-dir", default=None, help="where the ground truth is cached")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--training-logits",
        default=f"{FITTED_FRACTION:g}",
        help="'network', or the share of the kernel's directions the flow fits (default: the "
        "library's FITTED_FRACTION)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    share = None if args.training_logits == "network" else float(args.training_logits)
    rows = {}
    for name in args.settings.split(","):
        setting = settings.load(name, cache_dir=args.cache_dir, smoke=args.smoke)
        rows[name] = sweep(setting, share)
    names = list(rows)
    print(settings.lds_table(rows, "rule"))
    if len(names) > 1:
        print("\nleave-one-setting-out choice of the dof fraction (best mean LDS on the others)\n")
        print("| held out | fraction chosen | held-out LDS | in-sample best | 3 × mean eig. |")
        print("|---|---|---|---|---|")
        candidates = [f"dof fraction {f:g}" for f in FRACTIONS]
        for held, chosen in settings.leave_one_out(rows, candidates).items():
            best = max(rows[held][r] for r in candidates)
            old = rows[held]["3 × mean eigenvalue"]
            print(f"| {held} | {chosen[13:]} | {rows[held][chosen]:.3f} | {best:.3f} | {old:.3f} |")
    logits_used = "the network's" if share is None else f"the kernel flow's at the share {share:g}"
    print(f"\n(library DOF_FRACTION = {DOF_FRACTION}; training logits: {logits_used})")


if __name__ == "__main__":
    main()
