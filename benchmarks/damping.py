"""The damping rule of `attribution.influence` (Gauss–Newton), chosen leave-one-setting-out on
the LDS ground truth of benchmarks/settings.py.

    python benchmarks/damping.py [--cache-dir DIR] [--training-logits network]  # 100 × 2 truth
    python benchmarks/damping.py --smoke                # seconds
    python benchmarks/damping.py [--cache-dir DIR] --ensemble 10   # the rule for averaged models

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

--ensemble K: the rule for `influence(checkpoints=...)`, which averages several models' scores,
each model's λ keeping the same fraction of its own curvature: the LDS of the mean over K
networks each trained on its own random half (`Setting.halves`) and over one run's checkpoints
after 1/4 and 1/2 of the epochs, for every fraction, with the library's row as a check; the
fraction is chosen leave-one-setting-out over both kinds together (exploration: the library
keeps DOF_FRACTION for each averaged model, results/training_logits.md says why).
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
from benchmarks.checkpoints import trajectory

FRACTIONS = (0.003, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.03, 0.05)
ENSEMBLE_FRACTIONS = tuple(sorted({*FRACTIONS, 0.04, 0.065, 0.08, 0.1, 0.12}))  # averaged models
MEAN_MULTIPLES = (0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


def system(setting, model, share: float | None):
    """One model's damped Gauss–Newton system (trace kernel) in its eigenbasis: (scores(λ) [M, N]
    for any λ, its eigenvalues e, N, O, the trace kernel of train + test), with residuals and
    curvature at the kernel flow's logits stopped once it has fitted `share` of the kernel's
    directions (the library's default at FITTED_FRACTION; the test margins' gradients at the
    flow's test logits), or at the network's logits (None)."""
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

    def scores(lam: float) -> torch.Tensor:
        return (bs / (e + lam)) @ uv.T

    return scores, e, n, o, trace


def sweep(setting, share: float | None) -> dict[str, float]:
    """LDS of the Gauss–Newton scores (trace kernel) for every candidate rule, at the training
    logits of `system`, and of the library's damping="auto" (and EK-FAC's rules)."""
    model = setting.model
    scores_at, e, n, o, _ = system(setting, model, share)

    def score(lam: float) -> float:
        return lds(scores_at(lam), setting.subsets, setting.truth)

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
    curv = KroneckerCurvature(model, strategy="ekfac").fit(setting.x, logits(model, setting.x))
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


def members(setting, count: int) -> dict[str, list]:
    """The models an ensemble averages: `count` networks each trained on its own random half
    (`Setting.halves`), and one run's checkpoints after 1/4 and 1/2 of the epochs."""
    run = trajectory(setting, fractions=(0.25, 0.5))[0]
    return {
        f"{count} on random halves": setting.halves(count),
        "one run's checkpoints 1/4, 1/2": [run[0.25], run[0.5]],
    }


def ensemble_sweep(setting, nets: list, share: float) -> dict[str, float]:
    """LDS of the mean of the models' Gauss–Newton scores, each model's λ keeping the same dof
    fraction of its own curvature (as `influence(checkpoints=...)` averages them), for every
    fraction in ENSEMBLE_FRACTIONS; and the library's `influence(checkpoints=nets)` with
    damping="auto"."""
    total = {f: 0.0 for f in ENSEMBLE_FRACTIONS}
    for model in nets:
        scores_at, e, n, o, _ = system(setting, model, share)
        for f in ENSEMBLE_FRACTIONS:
            total[f] = total[f] + scores_at(auto_damping(e, n, o, fraction=f)) / len(nets)
    out = {f"dof fraction {f:g}": lds(v, setting.subsets, setting.truth) for f, v in total.items()}
    s = setting
    logits_at = "network" if share is None else share
    library = influence(nets[0], s.x, s.y, s.xt, s.yt, checkpoints=nets, training_logits=logits_at)
    out["library, influence(checkpoints=...)"] = lds(library, s.subsets, s.truth)
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
    parser.add_argument(
        "--ensemble",
        type=int,
        default=0,
        help="instead: the rule for averaged models, K networks on random halves and one run's "
        "checkpoints (after 1/4 and 1/2 of the epochs)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    share = None if args.training_logits == "network" else float(args.training_logits)
    if args.ensemble:
        return averaged(args.settings.split(","), args.ensemble, args.cache_dir, args.smoke, share)
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


def averaged(names: list[str], count: int, cache_dir, smoke: bool, share: float | None) -> None:
    """The dof fraction for the mean of several models' scores, chosen leave-one-setting-out
    over both kinds of averaged models together (the library cannot tell them apart)."""
    tables: dict[str, dict[str, dict[str, float]]] = {}
    for name in names:
        setting = settings.load(name, cache_dir=cache_dir, smoke=smoke)
        for kind, nets in members(setting, count).items():
            tables.setdefault(kind, {})[name] = ensemble_sweep(setting, nets, share)
            print(name, kind, flush=True)
    for kind, rows in tables.items():
        print(f"\n{kind}\n\n" + settings.lds_table(rows, "rule"))
    pooled = {
        f"{name} ({kind})": row for kind, rows in tables.items() for name, row in rows.items()
    }
    if len(names) > 1:
        candidates = [f"dof fraction {f:g}" for f in ENSEMBLE_FRACTIONS]
        print("\nleave-one-setting-out choice of the dof fraction for averaged models (best mean")
        print("LDS over both kinds on the other settings)\n")
        print(
            "| held out | kind | fraction chosen | held-out LDS | in-sample best | DOF_FRACTION |"
        )
        print("|---|---|---|---|---|---|")
        for held in names:
            others = [key for key in pooled if not key.startswith(f"{held} (")]
            chosen = max(candidates, key=lambda c: sum(pooled[key][c] for key in others))
            for kind, rows in tables.items():
                best = max(rows[held][c] for c in candidates)
                default = rows[held][f"dof fraction {DOF_FRACTION:g}"]
                print(
                    f"| {held} | {kind} | {chosen[13:]} | {rows[held][chosen]:.3f} | {best:.3f} "
                    f"| {default:.3f} |"
                )
    print(f"\n(library DOF_FRACTION = {DOF_FRACTION}, for one model and for each of several)")


if __name__ == "__main__":
    main()
