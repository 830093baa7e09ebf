"""Which prior precision should `NTKPosterior` use when the user has no held-out data?

    python benchmarks/posterior_prior.py [--settings a,b] [--json out.json] [--curvature ekfac]
    python benchmarks/posterior_prior.py --smoke          # tiny data, two settings

The rule family: δ such that the damped Gauss–Newton system keeps a fixed effective number of
parameters γ(δ) = Σ_k e_k/(e_k + δ) (`attribution._damping`). For every γ of a log grid, every
setting's test NLL, ECE and OOD AUROC (pixel- or feature-permuted test inputs, by predictive
entropy) are computed from one eigendecomposition of the system. The default γ is chosen
leave-one-setting-out: each fold picks the γ with the smallest mean log(NLL / NLL of the MAP
softmax) over the other settings, and is scored on the setting it did not see. The last rows
put the fixed rule next to δ tuned on the validation split (the best grid point, as
`fit(validation=...)` would find it) and the MAP softmax.

Settings (seeded, trained with `ntk.demo.train`; data and architectures of
benchmarks/uncertainty.py): `digits_mlp`, `digits_cnn`, `breast_cancer` and `wine` trained to
convergence without weight decay (300 epochs); `digits_mlp_weight_decay` (Adam L2 1e-3);
`digits_mlp_20_epochs` (stopped early); `demo` (the CLI's demo network, 60 epochs, weight decay
1e-4; its test split halved into validation and test).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uncertainty

from attribution import NTKPosterior, _damping, calibration_metrics
from attribution._posterior import EFFECTIVE_PARAMETERS, entropy
from ntk import demo

SETTINGS = {  # name: (data and architecture of benchmarks/uncertainty.py, training recipe)
    "digits_mlp": ("digits_mlp", uncertainty.RECIPE),
    "digits_cnn": ("digits_cnn", uncertainty.RECIPE),
    "breast_cancer": ("breast_cancer", uncertainty.RECIPE),
    "wine": ("wine", uncertainty.RECIPE),
    "digits_mlp_weight_decay": ("digits_mlp", dict(uncertainty.RECIPE, weight_decay=1e-3)),
    "digits_mlp_20_epochs": ("digits_mlp", dict(uncertainty.RECIPE, epochs=20)),
    "demo": (None, None),
}
SMOKE = ("breast_cancer", "wine")
GAMMAS = 10.0 ** np.arange(-1.0, 1.5001, 0.125)


def case(name: str, smoke: bool) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The trained network and float32 splits train / val / test / ood (permuted test inputs)."""
    source, recipe = SETTINGS[name]
    if source is None:
        model, d = demo.demo_model()
        half = len(d.y_test) // 2
        rng = np.random.default_rng(0)
        test = d.x_test[half:]
        return model, dict(
            x_train=d.x_train,
            y_train=d.y_train,
            x_val=d.x_test[:half],
            y_val=d.y_test[:half],
            x_test=test,
            y_test=d.y_test[half:],
            ood=test[:, torch.from_numpy(rng.permutation(test.shape[1]))],
        )
    d = {k: torch.from_numpy(v) for k, v in uncertainty.data(source, smoke).items()}
    recipe = dict(recipe, epochs=20) if smoke else recipe
    model = demo.train(uncertainty.build(source), d["x_train"], d["y_train"], **recipe)
    return model, dict(d, ood=d["ood_permuted"])


def curves(model, d: dict[str, torch.Tensor], curvature: str = "exact") -> dict:
    """Test NLL / ECE / OOD AUROC at every γ of GAMMAS, the validation NLL, and the MAP's, for
    the posterior of NTKPosterior(curvature=curvature)."""
    post = NTKPosterior(model, curvature=curvature, prior_precision=1.0)
    post.fit(d["x_train"], d["y_train"])
    n, o = len(d["y_train"]), post.n_outputs_
    parts = ("x_val", "x_test", "ood")
    x = torch.cat([d[k] for k in parts])
    sizes = [len(d[k]) for k in parts]
    mean = post._mean(x)
    if curvature == "exact":
        eigenvalues, covariance = post._spectral_covariance(post._system(), x)
    else:  # the factored curvature's spectrum and δ ↦ Σ(x)
        eigenvalues = post.kronecker_.eigenvalues
        covariance = post.kronecker_.covariance_function(x)

    def scores(p: torch.Tensor) -> dict:
        val, test, ood = p.split(sizes)
        y_val, y_test = d["y_val"], d["y_test"]
        unsure = torch.cat([entropy(test), entropy(ood)]).numpy()
        return dict(
            val_nll=float(-val[torch.arange(len(y_val)), y_val].clamp_min(1e-300).log().mean()),
            nll=float(-test[torch.arange(len(y_test)), y_test].clamp_min(1e-300).log().mean()),
            ece=calibration_metrics(test.numpy(), y_test.numpy())["ece"],
            auroc=float(roc_auc_score([0] * sizes[1] + [1] * sizes[2], unsure)),
        )

    rows = []
    for gamma in GAMMAS:
        delta = _damping.damping_for(eigenvalues, float(gamma))
        rows.append(
            dict(gamma=float(gamma), delta=delta, **scores(post._proba(mean, covariance(delta))))
        )
    default = NTKPosterior(model, curvature=curvature)  # the library's own path
    default.fit(d["x_train"], d["y_train"])
    library = scores(torch.as_tensor(default.predict_proba(x)))
    return dict(n=n, o=o, map=scores(mean.softmax(-1)), rows=rows, library=library)


def held_out(results: dict[str, dict]) -> dict[str, dict]:
    """Leave-one-setting-out: each fold's γ minimises the mean log(NLL / MAP NLL) over the other
    settings; returns, per held-out setting, the fold's γ and that setting's scores at it."""

    def loss(name: str, i: int) -> float:
        r = results[name]
        return math.log(r["rows"][i]["nll"] / r["map"]["nll"])

    out = {}
    names = list(results)
    for name in names + ["(all settings)"]:
        others = [m for m in names if m != name]
        best = min(range(len(GAMMAS)), key=lambda i: np.mean([loss(m, i) for m in others]))
        out[name] = dict(index=best, gamma=float(GAMMAS[best]))
    return out


def table(results: dict[str, dict], folds: dict[str, dict]) -> str:
    lines = [
        "| setting | held-out γ | NLL rule / validation / MAP | ECE rule / validation / MAP "
        "| OOD AUROC rule / validation / MAP | rule beats MAP on all three |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rule = r["rows"][folds[name]["index"]]
        val = min(r["rows"], key=lambda row: row["val_nll"])
        if r["map"]["val_nll"] <= val["val_nll"]:
            val = r["map"]
        m = r["map"]
        wins = rule["nll"] < m["nll"] and rule["ece"] <= m["ece"] and rule["auroc"] >= m["auroc"]
        lines.append(
            f"| {name} | {folds[name]['gamma']:.3g} | {rule['nll']:.4f} / {val['nll']:.4f} / "
            f"{m['nll']:.4f} | {rule['ece']:.4f} / {val['ece']:.4f} / {m['ece']:.4f} | "
            f"{rule['auroc']:.4f} / {val['auroc']:.4f} / {m['auroc']:.4f} | "
            f"{'yes' if wins else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=None, help="comma-separated; default: all")
    parser.add_argument("--smoke", action="store_true", help="tiny data, two settings")
    parser.add_argument("--json", help="also write every number to this file")
    parser.add_argument(
        "--curvature", default="exact", help="NTKPosterior's curvature: exact, ekfac or kfac"
    )
    args = parser.parse_args()
    names = args.settings.split(",") if args.settings else list(SMOKE if args.smoke else SETTINGS)
    for name in names:
        if name not in SETTINGS:
            parser.error(f"unknown setting {name!r}; valid: {', '.join(SETTINGS)}")
    results = {}
    for name in names:
        torch.manual_seed(0)
        results[name] = curves(*case(name, args.smoke), curvature=args.curvature)
        print(f"{name}: done", flush=True)
    folds = held_out(results)
    print()
    print(table(results, folds))
    chosen = folds["(all settings)"]["gamma"]
    print(f"\nin-sample choice over all settings: γ = {chosen:.3g}")
    print(f"library EFFECTIVE_PARAMETERS = {EFFECTIVE_PARAMETERS:g}")
    row = int(np.argmin(np.abs(GAMMAS - EFFECTIVE_PARAMETERS)))
    for name, r in results.items():
        print(
            f"  {name}: NTKPosterior(model).fit test NLL {r['library']['nll']:.6f}, "
            f"grid row γ = {GAMMAS[row]:.4g}: {r['rows'][row]['nll']:.6f}"
        )
    print("\nmean log(NLL / MAP NLL) per γ (in-sample):")
    for i, gamma in enumerate(GAMMAS):
        values = [math.log(r["rows"][i]["nll"] / r["map"]["nll"]) for r in results.values()]
        print(f"  γ = {gamma:7.3g}: mean {np.mean(values):+.4f}, worst {max(values):+.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(results=results, folds=folds), indent=1))


if __name__ == "__main__":
    main()
