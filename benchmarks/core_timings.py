"""Timings of the core renovation, in one run: TRAK's featurisation with one per-sample cotangent
(the margin gradient, `ntk.core.kinds.Weighted`) against the O-cotangent route it replaced (the
`full` features contracted with the margin gradient afterwards), the scores of both, and the
import time of `ntk` alone (fresh processes; optionally against an older source tree).

    python benchmarks/core_timings.py                     # digits MLP and CNN, k = 2048
    python benchmarks/core_timings.py --base /tmp/old     # also `import ntk` from an old tree
    python benchmarks/core_timings.py --quick             # seconds-long smoke run

Medians of --repeats runs; the two featurisations alternate within each repeat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import projections
from attribution.outputs import labels, logits, margin_gradient
from ntk import demo
from ntk.core import kinds

ROOT = Path(__file__).resolve().parents[1]


def digits_cnn(classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 64, classes),
    )


def featurise_both(model, x, y, dim, repeats):
    """Median seconds of the two TRAK featurisations of x, and their features."""
    u = margin_gradient(logits(model, x), labels(y, len(y), 10))
    times = {"O cotangents, then contract": [], "one per-sample cotangent": []}
    for r in range(repeats + 1):  # the first round warms up and is not counted
        start = time.perf_counter()
        full = projections.features(model, x, dim=dim, kind="full", seed=0)
        before = torch.einsum("io,iok->ik", u, full.double())
        middle = time.perf_counter()
        after = projections.features(model, x, dim=dim, kind=kinds.Weighted(), labels=u, seed=0)
        end = time.perf_counter()
        if r:
            times["O cotangents, then contract"].append(middle - start)
            times["one per-sample cotangent"].append(end - middle)
    return {k: statistics.median(v) for k, v in times.items()}, before, after.double()


def trak_scores(phi_train, phi_test, q):
    return phi_test @ torch.linalg.pinv(phi_train) * q


IMPORT = (
    "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
    "import ntk; t2 = time.perf_counter(); print(t2 - t0, t2 - t1)"
)


def import_times(trees: dict, repeats: int) -> dict:
    """Medians over fresh processes of (seconds to import torch and ntk, seconds for ntk once
    torch is loaded) per source tree, the trees alternating within each repeat."""
    out = {label: [] for label in trees}
    for _ in range(repeats):
        for label, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=str(tree))
            run = subprocess.run(  # in the tree: `python -c` puts the working directory first
                [sys.executable, "-c", IMPORT],
                env=env,
                cwd=tree,
                check=True,
                capture_output=True,
                text=True,
            )
            out[label].append([float(v) for v in run.stdout.split()])
    return {
        label: tuple(statistics.median(v[i] for v in values) for i in range(2))
        for label, values in out.items()
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-train", type=int, default=1000)
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--base", type=Path, help="an older source tree to time `import ntk` from")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.n_train, args.n_test, args.dim, args.repeats = 64, 16, 256, 1
    torch.set_num_threads(1)
    data = demo.digits(n_train=args.n_train)
    x, y = data.x_train, data.y_train
    xt, yt = data.x_test[: args.n_test], data.y_test[: args.n_test]

    print(
        f"TRAK featurisation, digits, N = {args.n_train} (+{args.n_test} test), k = {args.dim}, "
        f"float32, 1 thread; medians of {args.repeats} (seconds)\n"
    )
    print(
        "| model | O cotangents, then contract | one per-sample cotangent | speed-up "
        "| max rel. score difference |"
    )
    print("|---|---|---|---|---|")
    for name, make in (("MLP 64-256-256-10", lambda: demo.mlp(256, 2)), ("CNN", digits_cnn)):
        torch.manual_seed(0)
        model = make().eval()
        t, before, after = featurise_both(model, x, y, args.dim, args.repeats)
        _, before_t, after_t = featurise_both(model, xt, yt, args.dim, 1)
        q = 1 - logits(model, x).softmax(1)[torch.arange(len(y)), y]
        s_before = trak_scores(before, before_t, q)
        s_after = trak_scores(after, after_t, q)
        diff = float((s_after - s_before).abs().max() / s_before.abs().max())
        a, b = t["O cotangents, then contract"], t["one per-sample cotangent"]
        print(f"| {name} | {a:.3f} | {b:.3f} | {a / b:.1f}× | {diff:.1e} |")

    trees = {"this tree": ROOT, **({"--base": args.base} if args.base else {})}
    count = 3 if args.quick else 9
    print(f"\n`import ntk` in fresh processes, medians of {count} (seconds)\n")
    print("| source | import torch + ntk | ntk once torch is loaded |\n|---|---|---|")
    for label, (total, own) in import_times(trees, count).items():
        print(f"| {label} | {total:.3f} | {own:.3f} |")


if __name__ == "__main__":
    main()
