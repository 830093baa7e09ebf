"""What computing kernels and features in the model's dtype (float32) instead of float64 costs
in accuracy and saves in time, in one run.

1. digits (the demo MLP 64-64-10 and the LDS harness of benchmarks/attribution_digits.py: 1000
   training / 500 test images, `--subsets` random half-subsets × `--seeds` retrainings, margin
   target): the LDS of `influence` methods with dtype=None (float32 kernels and features,
   float64 solves) and dtype=torch.float64, their difference, the largest relative score change
   and the time of each;
2. a small CIFAR-shaped ResNet (benchmarks/_resnet.py, BatchNorm in eval mode): the median time of
   the trace eNTK of the train+test samples and of `influence` (auto: Gauss–Newton on the trace
   kernel) in float32 and float64, the ratios, and influence / float32 trace eNTK.

Run: python benchmarks/precision.py [--subsets 100] [--seeds 2] [--repeats 3]
     python benchmarks/precision.py --quick      # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import ntk
from attribution import influence, lds, random_subsets, train_on_subsets
from ntk import demo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _resnet import resnet

RECIPE = dict(epochs=60, batch_size=64, lr=3e-3, weight_decay=1e-4)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def digits(args) -> None:
    n_train, n_test = (200, 100) if args.quick else (1000, 500)
    data = demo.digits(n_train=n_train)
    x, y, xt, yt = data.x_train, data.y_train, data.x_test[:n_test], data.y_test[:n_test]
    recipe = dict(RECIPE, epochs=5) if args.quick else RECIPE
    torch.manual_seed(0)
    everything = torch.ones(1, n_train, dtype=torch.bool)
    model = _first(train_on_subsets(demo.mlp, x, y, everything, seeds=1, **recipe))
    subsets = random_subsets(n_train, args.subsets, 0.5, seed=0)
    stack, t_h = timed(
        lambda: train_on_subsets(demo.mlp, x, y, subsets, seeds=args.seeds, **recipe)
    )
    target = stack.margins(xt, yt)
    print(
        f"\n## digits: LDS in float32 vs float64 ({n_train} train, {n_test} test, "
        f"{args.subsets} subsets × {args.seeds} seeds retrained in {t_h:.0f} s)\n"
    )
    print(
        "| method | LDS float32 | LDS float64 | Δ LDS | max rel. score change | "
        "time float32 s | time float64 s | float64/float32 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    dims = {"full": 1024 if args.quick else 4096}
    methods = [
        ("gauss_newton, trace, exact (auto)", {}),
        ("gauss_newton, full, exact", {"kind": "full"}),
        (f"gauss_newton, full, k={dims['full']}", {"kind": "full", "dim": dims["full"]}),
        ("grad_dot, full, exact", {"method": "grad_dot"}),
        ("trak, k=512", {"method": "trak", "dim": 512}),
    ]
    for name, opts in methods:
        s32, t32 = timed(lambda opts=opts: influence(model, x, y, xt, yt, **opts))
        s64, t64 = timed(
            lambda opts=opts: influence(model, x, y, xt, yt, dtype=torch.float64, **opts)
        )
        l32, l64 = lds(s32, subsets, target), lds(s64, subsets, target)
        rel = float((s32 - s64).abs().max() / s64.abs().max())
        print(
            f"| {name} | {l32:.4f} | {l64:.4f} | {l32 - l64:+.4f} | {rel:.1e} | {t32:.2f} | "
            f"{t64:.2f} | {t64 / t32:.2f} |",
            flush=True,
        )


def _first(stack):
    import copy

    model = copy.deepcopy(stack.base)
    model.load_state_dict({k: v[0] for k, v in stack.params.items()})
    return model.eval()


def resnet_times(args) -> None:
    n_train, n_test = (8, 4) if args.quick else (48, 16)
    model = resnet(blocks=1 if args.quick else 2)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_train, 3, 32, 32, generator=g)
    xt = torch.randn(n_test, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n_train,), generator=g)
    both = torch.cat([x, xt])
    print(
        f"\n## ResNet ({params:,} parameters, BatchNorm eval): {n_train} train × {n_test} test, "
        f"median of {args.repeats} after a warm-up, computations in turn\n"
    )
    print("| computation | float32 s | float64 s | float64/float32 |")
    print("|---|---|---|---|")
    computations = {
        f"trace eNTK of the {n_train + n_test} samples": lambda dt: ntk.empirical_ntk(
            model, both, kind="trace", dtype=dt
        ),
        "influence (auto)": lambda dt: influence(model, x, y, xt, dtype=dt),
    }
    dtypes = (None,) if args.float32_only else (None, torch.float64)
    runs = {(name, dt): [] for name in computations for dt in dtypes}
    for r in range(args.repeats + 1):  # a warm-up round, then in turn, so that load changes
        for (name, dt), times in runs.items():  # hit every computation alike
            t = timed(lambda name=name, dt=dt: computations[name](dt))[1]
            if r:
                times.append(t)
    med = {key: statistics.median(t) for key, t in runs.items()}
    for name in computations:
        t32, t64 = med[name, None], med.get((name, torch.float64))
        t64s = "— | —" if t64 is None else f"{t64:.2f} | {t64 / t32:.2f}"
        print(f"| {name} | {t32:.2f} | {t64s} |", flush=True)
    times = {name: med[name, None] for name in computations}
    kernel_time = next(t for n, t in times.items() if n.startswith("trace"))
    print(f"\ninfluence / float32 trace eNTK: {times['influence (auto)'] / kernel_time:.2f}")
    if not args.float32_only:
        s32 = influence(model, x, y, xt)
        s64 = influence(model, x, y, xt, dtype=torch.float64)
        rel = float((s32 - s64).abs().max() / s64.abs().max())
        print(f"largest relative change of the ResNet's scores, float32 vs float64: {rel:.1e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subsets", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", default="digits,resnet")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument(
        "--float32-only", action="store_true", help="ResNet section: time float32 only"
    )
    args = parser.parse_args()
    if args.quick:
        args.subsets, args.seeds, args.repeats = 8, 1, 1
    torch.set_num_threads(1)
    print(
        f"# float32 vs float64 — {platform.machine()}, {torch.get_num_threads()} thread, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    sections = set(args.sections.split(","))
    if "digits" in sections:
        digits(args)
    if "resnet" in sections:
        resnet_times(args)


if __name__ == "__main__":
    main()
