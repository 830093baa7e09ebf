"""Surrogate variants on the four attribution settings (benchmarks/settings.py): is the
decomposition faithful and coherent at once, and do the counterfactual scores predict retraining?

Per setting and variant, fitted to the network's outputs: Kendall τ of the predicted-class
probability (`faithfulness`), median cancellation Σ|c_i|/|Σc_i| and the share of the top-5
proponents whose training label is the predicted class (`coherence`); fitted to the labels:
τ again ("label-fitted faithfulness"); LDS of the contributions and, where the machine has them,
of the closed-form counterfactual scores (`influence`), both projected on the margin gradient.
The default is chosen leave-one-setting-out (the variant meeting most targets, then the highest
τ, on the other settings; ties: the first listed) and its held-out row is printed next to the
in-sample best. Variants: machines, kernels and fixed α with the dual decomposition
(K(x, x_i) − κ(x)) A_i; the smoother decomposition s_i(x) (t_i − ℓ) at fixed α; and α chosen by
readability (alpha=None) with each budget b of median cancellation on the training samples
(`attribution.surrogate.READABLE_CANCELLATION`, set per variant), for either decomposition.

--fractions f1,f2,… instead measures the Gauss–Newton machine (trace kernel, fitted to the labels)
with its damping keeping each fraction f of the rank N·(O − 1) as effective parameters
(`KernelSurrogate(effective_parameters=f)`): label-fitted τ and counterfactual LDS, the issue's
two targets (τ ≥ 0.85, LDS ≥ 0.60), and two leave-one-setting-out choices: the faithful f
(`attribution.surrogate.GAUSS_NEWTON_DOF_FRACTION`, the machine's default: the best worst τ on
the other settings) and the counterfactual f (best mean LDS on the others; what
`influence(method="surrogate")` uses, `attribution.damping.DOF_FRACTION`), over the settings of
settings.NAMES; those of settings.HELD_OUT_NAMES are printed at the fractions chosen on all four.
f ≥ 0.5 is the damping's cap, half the curvature's numerical rank (`damping.damping_for`).

Run:   python benchmarks/surrogate_settings.py --cache-dir /tmp/ntk-attr-cache
       python benchmarks/surrogate_settings.py --cache-dir … --fractions 0.015,0.025,0.05
Smoke: python benchmarks/surrogate_settings.py --smoke [--fractions 0.015,0.025]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attribution.surrogate
from attribution import KernelSurrogate, lds
from attribution.outputs import logits, margin_gradient
from benchmarks import settings

DEFAULT_BUDGET = attribution.surrogate.READABLE_CANCELLATION
BUDGETS = (5, 6, 7, 8, 9, 10)
DUAL = dict(center=True, decomposition="dual")  # contributions (K(x, x_i) − κ(x)) A_i
VARIANTS = {
    "ridge, α by CV (old default)": dict(center=False, alpha="cv"),
    "ridge, α 0.05": dict(center=False, alpha=0.05),
    "centred, α by CV, q 0.25": dict(DUAL, alpha="cv"),
    "centred, α 0.02, q 0.25": dict(DUAL, alpha=0.02),
    "centred, α 0.05, q 0.25": dict(DUAL, alpha=0.05),
    "centred, α 0.1, q 0.25 (default until 2026-12-06)": dict(DUAL, alpha=0.1),
    "centred, α 1, q 0.25": dict(DUAL, alpha=1.0),
    "centred, α 10, q 0.25": dict(DUAL, alpha=10.0),
    "centred, α 0.05, q 0": dict(DUAL, alpha=0.05, reference=0.0),
    "centred, α 0.05, q 0.5": dict(DUAL, alpha=0.05, reference=0.5),
    "representer (loss residuals)": dict(machine="representer"),
    # the pseudo-NTK (sum of logits) as the kernel, added with the fourth setting (wine)
    **{
        f"centred sum_logits, α {a:g}": dict(DUAL, alpha=a, kind="sum_logits")
        for a in (0.02, 0.05, 0.1, 0.2)
    },
    # the cosine-normalised trace kernel (trNTK, Engel et al.), added in the fifth session
    **{
        f"centred trNTK, α {a:g}": dict(DUAL, alpha=a, normalize=True)
        for a in (0.01, 0.02, 0.05, 0.1)
    },
    # the Gauss–Newton model of kernel logistic regression at the network's logits
    "Gauss–Newton machine, λ auto": dict(machine="gauss_newton"),
    "Gauss–Newton machine, sum_logits, λ auto": dict(machine="gauss_newton", kind="sum_logits"),
    # α chosen by readability (alpha=None): the smallest α whose training decomposition has
    # median cancellation ≤ b (attribution.surrogate.READABLE_CANCELLATION, set per variant)
    **{f"centred, readable α, b {b}": dict(DUAL, readable_cancellation=b) for b in BUDGETS},
    # the smoother decomposition s_i(x) (t_i − ℓ), at fixed α and with α chosen by readability
    **{f"centred smoother, α {a:g}": dict(alpha=a) for a in (0.001, 0.003, 0.01, 0.03, 0.1)},
    **{
        f"centred smoother, readable α, b {b}" + (" (default)" if b == DEFAULT_BUDGET else ""): (
            dict(readable_cancellation=b)
        )
        for b in BUDGETS
    },
}
TARGETS = dict(tau=0.98, cancellation=10.0, share=0.90)


def measure(s, options: dict) -> dict:
    options = dict(options)
    budget = options.pop("readable_cancellation", DEFAULT_BUDGET)
    attribution.surrogate.READABLE_CANCELLATION = budget
    try:
        return _measure(s, options)
    finally:
        attribution.surrogate.READABLE_CANCELLATION = DEFAULT_BUDGET


def _measure(s, options: dict) -> dict:
    model = s.model
    sur = KernelSurrogate(model, **options).fit(s.x)
    faith = sur.faithfulness(s.xt, s.yt)
    coh = sur.coherence(s.xt, s.y)
    g = logits(model, s.xt)
    u = margin_gradient(g, s.yt).numpy()
    row = dict(
        alpha="–" if sur.alpha_ is None else f"{sur.alpha_:.2g}",
        tau=faith["tau_prob"],
        cancellation=coh["median_cancellation"],
        share=coh["mean_label_share"],
        lds_contribution=lds(np.einsum("mio,mo->mi", sur.attribute(s.xt), u), s.subsets, s.truth),
        lds_counterfactual=float("nan"),
    )
    if sur.removable_:
        row["lds_counterfactual"] = lds(
            np.einsum("mio,mo->mi", sur.influence(s.xt, output="all"), u), s.subsets, s.truth
        )
    labelled = KernelSurrogate(model, **options).fit(s.x, s.y)
    row["tau_labels"] = labelled.faithfulness(s.xt)["tau_prob"]
    row["lds_counterfactual_labels"] = float("nan")
    if labelled.removable_:
        row["lds_counterfactual_labels"] = lds(
            np.einsum("mio,mo->mi", labelled.influence(s.xt, output="all"), u), s.subsets, s.truth
        )
    return row


def met(row: dict) -> int:
    return sum(
        [
            row["tau"] >= TARGETS["tau"],
            row["cancellation"] <= TARGETS["cancellation"],
            row["share"] >= TARGETS["share"],
        ]
    )


def faithful_fraction(tau: dict, among: list[str], values: list[float]) -> float:
    """The fraction with the best worst label-fitted τ over the settings `among` (tau: {(setting,
    f): τ}); ties go to the smallest fraction, the stronger damping."""
    return max(sorted(values), key=lambda f: min(tau[n, f] for n in among))


def fractions(names: list[str], values: list[float], cache_dir, smoke: bool) -> None:
    """The Gauss–Newton machine's damping fraction (module docstring, --fractions): per fraction
    and setting the label-fitted τ and counterfactual LDS; leave-one-setting-out over the
    settings of settings.NAMES among `names`, the faithful fraction (`faithful_fraction`) and the
    counterfactual one (the best mean LDS on the others); the settings never chosen on
    (settings.HELD_OUT_NAMES) at the fractions chosen on all of those."""
    tau, score = {}, {}
    print("| setting | f | λ | τ (labels) | counterfactual LDS (labels) |")
    print("|---|---|---|---|---|")
    for name in names:
        s = settings.load(name, cache_dir=cache_dir, smoke=smoke)
        u = margin_gradient(logits(s.model, s.xt), s.yt).numpy()
        for f in values:
            sur = KernelSurrogate(s.model, machine="gauss_newton", effective_parameters=f)
            sur.fit(s.x, s.y)
            tau[name, f] = sur.faithfulness(s.xt)["tau_prob"]
            score[name, f] = lds(
                np.einsum("mio,mo->mi", sur.influence(s.xt, output="all"), u), s.subsets, s.truth
            )
            print(
                f"| {name} | {f:g} | {sur.alpha_:.3g} | {tau[name, f]:.3f} | {score[name, f]:.3f} |"
            )

    def counterfactual(among):
        return max(values, key=lambda f: np.mean([score[n, f] for n in among]))

    chosen_on = [n for n in names if n in settings.NAMES]
    print("\n| held out | faithful f | held-out τ (labels) | counterfactual f | held-out LDS |")
    print("|---|---|---|---|---|")
    for out in chosen_on:
        rest = [n for n in chosen_on if n != out]
        f_tau, f_lds = faithful_fraction(tau, rest, values), counterfactual(rest)
        print(
            f"| {out} | {f_tau:g} | {tau[out, f_tau]:.3f} | {f_lds:g} | {score[out, f_lds]:.3f} |"
        )
    f_tau, f_lds = faithful_fraction(tau, chosen_on, values), counterfactual(chosen_on)
    for name in names:
        if name not in chosen_on:
            print(
                f"| {name} (never chosen on) | {f_tau:g} | {tau[name, f_tau]:.3f} | {f_lds:g} "
                f"| {score[name, f_lds]:.3f} |"
            )
    print(f"\nin sample: faithful f = {f_tau:g}, counterfactual f = {f_lds:g}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(settings.NAMES))
    parser.add_argument("--cache-dir", default=None, help="where the ground truth is cached")
    parser.add_argument("--smoke", action="store_true", help="seconds-long miniature settings")
    parser.add_argument("--variants", default=None, help="comma-separated substrings to run")
    parser.add_argument("--fractions", default=None, help="the Gauss–Newton damping fractions")
    args = parser.parse_args()
    chosen = [
        v
        for v in VARIANTS
        if args.variants is None or any(part in v for part in args.variants.split(","))
    ]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.fractions:
        values = [float(v) for v in args.fractions.split(",")]
        fractions(args.settings.split(","), values, args.cache_dir, args.smoke)
        return
    results = {}
    head = "| variant | α | τ (outputs) | median cancellation | top-5 class share | τ (labels) "
    head += "| LDS contribution | LDS counterfactual | LDS counterfactual (label-fitted) |\n"
    head += "|---|---|---|---|---|---|---|---|---|"
    for name in args.settings.split(","):
        s = settings.load(name, cache_dir=args.cache_dir, smoke=args.smoke)
        print(f"\n## {name}: N_train {len(s.x)}, N_test {len(s.xt)}\n\n{head}", flush=True)
        results[name] = {}
        for variant in chosen:
            r = results[name][variant] = measure(s, VARIANTS[variant])
            print(
                f"| {variant} | {r['alpha']} | {r['tau']:.3f} | {r['cancellation']:.1f} "
                f"| {r['share']:.2f} | {r['tau_labels']:.3f} | {r['lds_contribution']:.3f} "
                f"| {r['lds_counterfactual']:.3f} | {r['lds_counterfactual_labels']:.3f} |",
                flush=True,
            )
    names = list(results)
    if len(names) > 1:
        print("\n## Leave-one-setting-out choice\n")
        print("| held out | chosen on the others | held-out targets met (of 3) | in-sample best |")
        print("|---|---|---|---|")

        def rank(v, among):
            rows = [results[n][v] for n in among]
            return (sum(met(r) for r in rows), float(np.mean([r["tau"] for r in rows])))

        for out in names:
            rest = [n for n in names if n != out]
            pick = max(chosen, key=lambda v: rank(v, rest))
            best = max(chosen, key=lambda v: rank(v, [out]))
            print(f"| {out} | {pick} | {met(results[out][pick])} | {best} |")
        every = max(chosen, key=lambda v: rank(v, names))
        print(f"\nchosen on all settings: {every} ({rank(every, names)[0]} targets met)")


if __name__ == "__main__":
    main()
