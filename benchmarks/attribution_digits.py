"""Data attribution and kernel surrogates on scikit-learn's digits, in one run.

Network: the demo MLP 64-64-10 (Adam, 60 epochs), 1000 training / 500 test images. Printed:
1. faithfulness of `KernelSurrogate` (Kendall τ on the network's predicted-class probability,
   τ on all logits, label agreement) per kernel kind, exact and projected (k = 1024), fitted to the
   network's outputs (our default) and to the labels (the protocol of Engel et al., ICLR 2024);
2. LDS (100 random half-subsets × SEEDS retrainings with the same recipe, margin target) of every
   `influence` method with 1 and 10 models, of TRAK as published (ours) and of the `traker`
   package's TRAKer on the same models (1, 10, 20), plus the harness's trust check: multinomial
   logistic regression with its exact influence function (Gauss–Newton = Hessian for a linear
   model; damping = n · weight decay); and the peers kronfluence (EK-FAC, K-FAC) and dattri
   (explicit IF, TRAK with 1 and 10 models, Grad-Dot) on the same models and subsets, run by
   benchmarks/peers/attr_peers.py in their own interpreter (--peer-python or $NTK_PEER_PYTHON);
3. mislabel-detection ROC AUC (10 % of labels flipped, self-influence of a model trained on them);
4. the time of each (one run each on the shared machine).

Run: python benchmarks/attribution_digits.py [--seeds 2] [--quick] [--peer-python PY].
traker (a peer, `peers` extra).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attribution import (
    KernelSurrogate,
    flip_labels,
    influence,
    lds,
    mislabel_auc,
    random_subsets,
    train_on_subsets,
    trak,
)
from attribution.evaluation import SubsetModels
from attribution.outputs import margins
from benchmarks.attribution_settings import run_peers
from ntk import demo

N_TRAIN, N_TEST, CLASSES = 1000, 500, 10
FULL_ALPHA = 1e-6
RECIPE = dict(epochs=60, batch_size=64, lr=3e-3, weight_decay=1e-4)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def models_of(stack: SubsetModels, count: int) -> list[torch.nn.Module]:
    """The first `count` models of a stack as ordinary modules (eval mode)."""
    out = []
    for j in range(count):
        m = copy.deepcopy(stack.base)
        m.load_state_dict({k: v[j] for k, v in stack.params.items()})
        out.append(m.eval())
    return out


def traker_scores(models, x, y, xt, yt, *, proj_dim):
    """The traker package's TRAKer (CPU, BasicProjector, float32), scores [N_test, N_train]."""
    from trak import TRAKer
    from trak.projectors import BasicProjector, ProjectionType

    net = copy.deepcopy(models[0])
    grad_dim = sum(p.numel() for p in net.parameters())
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        projector = BasicProjector(
            grad_dim=grad_dim,
            proj_dim=proj_dim,
            seed=0,
            proj_type=ProjectionType.rademacher,
            device="cpu",
        )
        tr = TRAKer(
            model=net,
            task="image_classification",
            train_set_size=len(x),
            save_dir=tmp,
            device="cpu",
            projector=projector,
            proj_dim=proj_dim,
            use_half_precision=False,
            logging_level=40,
        )
        for i, m in enumerate(models):
            tr.load_checkpoint(m.state_dict(), model_id=i)
            for s in range(0, len(x), 250):
                tr.featurize(
                    batch=(x[s : s + 250], y[s : s + 250]), num_samples=len(x[s : s + 250])
                )
        tr.finalize_features()
        for i, m in enumerate(models):
            tr.start_scoring_checkpoint(
                exp_name="bench", checkpoint=m.state_dict(), model_id=i, num_targets=len(xt)
            )
            for s in range(0, len(xt), 250):
                tr.score(batch=(xt[s : s + 250], yt[s : s + 250]), num_samples=len(xt[s : s + 250]))
        scores = tr.finalize_scores(exp_name="bench")
    return torch.as_tensor(np.asarray(scores)).T.double()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2, help="retraining seeds per subset")
    parser.add_argument("--subsets", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="skip the full-kernel surrogates")
    parser.add_argument(
        "--sections",
        default="faithfulness,lds,mislabel",
        help="comma-separated subset of faithfulness,lds,mislabel",
    )
    parser.add_argument(
        "--peer-python",
        default=os.environ.get("NTK_PEER_PYTHON"),
        help="interpreter with kronfluence and dattri (peers skipped when not given)",
    )
    parser.add_argument("--peer-methods", default=None, help="comma-separated subset")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = demo.digits(n_train=N_TRAIN)
    x, y, xt, yt = data.x_train, data.y_train, data.x_test[:N_TEST], data.y_test[:N_TEST]
    print(
        f"# attribution on digits — {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )

    # -- models: the network, 20 independently seeded copies, and the retraining harness -------
    everything = torch.ones(1, N_TRAIN, dtype=torch.bool)
    (copies, t_copies) = timed(train_on_subsets, demo.mlp, x, y, everything, seeds=20, **RECIPE)
    nets = models_of(copies, 20)
    model = nets[0]
    print(
        f"network: MLP 64-64-10, test accuracy {demo.accuracy(model, xt, yt):.3f} "
        f"(20 seeds trained in {t_copies:.0f} s, vmapped)"
    )
    subsets = random_subsets(N_TRAIN, args.subsets, 0.5, seed=0)
    stack, t_h = timed(train_on_subsets, demo.mlp, x, y, subsets, seeds=args.seeds, **RECIPE)
    target = stack.margins(xt, yt)
    print(
        f"harness: {args.subsets} half-subsets × {args.seeds} seeds retrained in {t_h:.0f} s; "
        f"subset-model test accuracy {(stack.outputs(xt).argmax(-1) == yt).float().mean():.3f}"
    )
    if args.seeds >= 2:
        a, b = (margins(stack.outputs(xt)[:, r].double(), yt) for r in (0, 1))
        noise = np.mean([spearmanr(a[:, z], b[:, z]).statistic for z in range(N_TEST)])
        print(
            f"training noise: Spearman between two seeds' margins over subsets {noise:.3f} "
            f"(an LDS against the {args.seeds}-seed mean can exceed it)"
        )

    sections = set(args.sections.split(","))
    # -- 1. faithfulness -------------------------------------------------------------------------
    if "faithfulness" in sections:
        faithfulness(args, model, x, y, xt, yt)
    if "lds" in sections:
        attribution_lds(args, model, nets, x, y, xt, yt, subsets, target, everything)
    if "mislabel" in sections:
        mislabel(x, y)


def faithfulness(args, model, x, y, xt, yt):
    print("\n## Surrogate faithfulness (500 test images)\n")
    print(
        f"{'protocol':<8} {'kind':<16} {'machine':<9} {'k':>5} {'τ prob':>7} {'τ logits':>8} "
        f"{'R² logits':>9} {'agree':>6} {'acc gap':>8} {'α (CV)':>8} {'time s':>7}"
    )
    configs = [
        ("outputs", kind, False, "ridge", dim)
        for kind in ("trace", "sum_logits", "full")
        for dim in (None, 1024)
    ]
    configs += [("outputs", "trace", True, "ridge", None)]
    configs += [
        ("labels", "trace", norm, machine, None)
        for machine in ("ridge", "logistic", "svm")
        for norm in (False, True)
    ]
    for protocol, kind, norm, machine, dim in configs:
        if args.quick and kind == "full":
            continue
        # the full kernel's [10⁴, 10⁴] CV takes ~5 min here: fixed at the scalar kinds' CV choice
        s = KernelSurrogate(
            model,
            kind=kind,
            machine=machine,
            normalize=norm,
            projection_dim=dim,
            alpha=FULL_ALPHA if kind == "full" else None,
        )
        _, t = timed(s.fit, x, None if protocol == "outputs" else y)
        f = s.faithfulness(xt, yt)
        print(
            f"{protocol:<8} {kind + (' (cos)' if norm else ''):<16} {machine:<9} "
            f"{dim or '-':>5} {f.get('tau_prob', float('nan')):7.3f} "
            f"{f.get('tau_logits', float('nan')):8.3f} {f.get('r2_logits', float('nan')):9.3f} "
            f"{f['label_agreement']:6.3f} {f['accuracy_gap']:+8.3f} {s.alpha_:8.0e} {t:7.1f}",
            flush=True,
        )


def attribution_lds(args, model, nets, x, y, xt, yt, subsets, target, everything):
    print(f"\n## LDS ({args.subsets} half-subsets × {args.seeds} seeds, margin target) and time\n")
    print(f"{'method':<44} {'models':>6} {'LDS':>6} {'time s':>7}")
    ten, twenty = nets[:10], nets[:20]
    rows = [
        ("gauss_newton, full, exact", 1, lambda: influence(model, x, y, xt, yt, kind="full")),
        ("influence auto = gauss_newton, trace, exact", 1, lambda: influence(model, x, y, xt, yt)),
        (
            "gauss_newton, full, projected k=1024",
            1,
            lambda: influence(model, x, y, xt, yt, kind="full", dim=1024),
        ),
        (
            "gauss_newton, full, projected k=2048",
            1,
            lambda: influence(model, x, y, xt, yt, kind="full", dim=2048),
        ),
        (
            "gauss_newton, full, projected k=4096",
            1,
            lambda: influence(model, x, y, xt, yt, kind="full", dim=4096),
        ),
        (
            "gauss_newton, full, projected k=4096",
            10,
            lambda: influence(model, x, y, xt, yt, kind="full", dim=4096, checkpoints=ten),
        ),
        ("grad_dot, full, exact", 1, lambda: influence(model, x, y, xt, yt, method="grad_dot")),
        (
            "surrogate (ridge on outputs), trace",
            1,
            lambda: influence(model, x, y, xt, yt, method="surrogate", kind="trace"),
        ),
        (
            "surrogate (ridge on outputs), sum_logits",
            1,
            lambda: influence(model, x, y, xt, yt, method="surrogate", kind="sum_logits"),
        ),
        ("trak (ours), k=512", 1, lambda: trak(model, x, y, xt, yt, dim=512)),
        ("trak (ours), k=2048", 1, lambda: trak(model, x, y, xt, yt, dim=2048)),
        ("trak (ours), k=512", 10, lambda: trak(model, x, y, xt, yt, dim=512, checkpoints=ten)),
        ("trak (ours), k=2048", 10, lambda: trak(model, x, y, xt, yt, dim=2048, checkpoints=ten)),
        ("trak (ours), k=512", 20, lambda: trak(model, x, y, xt, yt, dim=512, checkpoints=twenty)),
        ("traker TRAKer, k=512", 1, lambda: traker_scores([model], x, y, xt, yt, proj_dim=512)),
        ("traker TRAKer, k=512", 10, lambda: traker_scores(ten, x, y, xt, yt, proj_dim=512)),
        ("traker TRAKer, k=512", 20, lambda: traker_scores(twenty, x, y, xt, yt, proj_dim=512)),
    ]
    for name, count, run in rows:
        scores, t = timed(run)
        print(f"{name:<44} {count:>6} {lds(scores, subsets, target):6.3f} {t:7.1f}", flush=True)
    if args.peer_python:
        auto = lds(influence(model, x, y, xt, yt), subsets, target)
        found = run_peers(model, ten, x, y, xt, yt, args.peer_python, args.peer_methods)
        for name, (scores, t) in found.items():
            count = 10 if name.endswith("_10") else 1
            value = lds(scores, subsets, target)
            print(f"{name + ' (peer)':<44} {count:>6} {value:6.3f} {t:7.1f}", flush=True)
            if name.startswith("kronfluence"):
                print(f"{'  ratio LDS influence auto / ' + name:<44} {'':>6} {auto / value:6.2f}")

    # trust check: logistic regression, whose exact influence is the Gauss–Newton one
    wd = 1e-3
    linear = dict(epochs=300, batch_size=N_TRAIN, lr=0.05, weight_decay=wd)
    lin_full = models_of(
        train_on_subsets(lambda: torch.nn.Linear(64, CLASSES), x, y, everything, **linear), 1
    )[0]
    lin_stack, t_lin = timed(
        train_on_subsets, lambda: torch.nn.Linear(64, CLASSES), x, y, subsets, **linear
    )
    scores, t = timed(influence, lin_full, x, y, xt, yt, damping=N_TRAIN * wd)
    print(
        f"{'trust check: logistic regression, exact IF':<44} {1:>6} "
        f"{lds(scores, subsets, lin_stack.margins(xt, yt)):6.3f} {t:7.1f}   "
        f"(retrained in {t_lin:.0f} s)"
    )


def mislabel(x, y):
    noisy, flipped = flip_labels(y, 0.1, CLASSES, seed=0)
    torch.manual_seed(0)
    noisy_model = demo.train(demo.mlp(), x, noisy)
    print("\n## Mislabel detection (10 % flipped, self-influence), ROC AUC\n")
    print(f"{'method':<44} {'AUC':>6} {'time s':>7}")
    detectors = [
        (
            "gauss_newton, full, exact",
            lambda: influence(noisy_model, x, noisy, x, noisy, kind="full"),
        ),
        (
            "gauss_newton, full, projected k=4096",
            lambda: influence(noisy_model, x, noisy, x, noisy, kind="full", dim=4096),
        ),
        (
            "grad_dot, full, exact",
            lambda: influence(noisy_model, x, noisy, x, noisy, method="grad_dot"),
        ),
        (
            "surrogate (ridge on outputs), trace",
            lambda: influence(noisy_model, x, noisy, x, noisy, method="surrogate"),
        ),
        ("trak (ours), k=2048", lambda: trak(noisy_model, x, noisy, x, noisy)),
        (
            "traker TRAKer, k=512",
            lambda: traker_scores([noisy_model], x, noisy, x, noisy, proj_dim=512),
        ),
    ]
    for name, run in detectors:
        scores, t = timed(run)
        print(f"{name:<44} {mislabel_auc(scores.diagonal(), flipped):6.3f} {t:7.1f}", flush=True)


if __name__ == "__main__":
    main()
