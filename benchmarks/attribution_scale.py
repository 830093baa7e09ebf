"""Attribution at 20,000–50,000 training points: `influence(method="ekfac")` and the projected
Gauss–Newton path that `influence(method="auto")` takes there (`--methods projected2048`)
against Kronfluence's EK-FAC on the same models, data and test points, in one run.

Data: scikit-learn's digits (8×8), the first 1,297 images (shuffled, seed 0) augmented to N
training points (random shifts of up to one pixel, Gaussian pixel noise σ = 0.1); 500 test points
from the other 500 images, labelled with the network's predictions (`y_test=None`). Networks:
`mlp`, a ReLU MLP 64-256-256-10, and `cnn`, conv 1→16 (3×3) + BatchNorm + ReLU, conv 16→32 (3×3)
+ BatchNorm + ReLU, 2×2 max-pool, linear 512→10, each trained for 2 epochs on the largest N
(Adam) and used in eval mode. Every measurement is a fresh process with the same thread count
(default 1): wall time of the whole attribution (factors and scores, for ours the network's
logits too), the peak resident-memory increase during it and the process's peak resident memory
(benchmarks/peers/measure.py); medians of --repeats runs. Agreement: the mean over test points of
Spearman's ρ between two methods' scores over the training points, at the full N (ours vs
Kronfluence) and on the first --exact-n training points, where the exact kernel-form
Gauss–Newton influence (`influence`'s default, trace kernel, and kind="full") fits.

    python benchmarks/attribution_scale.py --kronfluence-python PATH   # or KRONFLUENCE_PYTHON
    python benchmarks/attribution_scale.py --quick --no-peers           # N = 2,000, one repeat
    python benchmarks/attribution_scale.py --smoke --no-peers           # seconds-long smoke run
    python benchmarks/attribution_scale.py --digits [--seeds 2] [--kronfluence-python PATH]

--digits: the LDS of the scalable path on the digits benchmark's model and retraining truth
(benchmarks/attribution_digits.py: MLP 64-64-10, 1,000 train / 500 test, 100 half-subsets ×
--seeds retrainings, margin target), next to the exact path and Kronfluence on the same model.

Without a Kronfluence interpreter (flag, env var) its rows are skipped. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # attribution_digits (the --digits harness)
N_TEST = 500


def architecture(name: str) -> nn.Sequential:
    if name == "mlp":
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, 256),
            nn.ReLU(),
            nn.Linear(256, 256),
            nn.ReLU(),
            nn.Linear(256, 10),
        )
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(512, 10),
        )
    raise ValueError(f"unknown case {name!r}; valid cases are mlp, cnn")


def augmented_digits(n: int, seed: int = 0):
    """n augmented training images [n, 1, 8, 8] with labels, and N_TEST held-out test images."""
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.target))
    x = torch.tensor(data.data[order] / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(data.target[order], dtype=torch.long)
    pool_x, pool_y, x_test = x[:-N_TEST], y[:-N_TEST], x[-N_TEST:]
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(pool_y), (n,), generator=g)
    pick[: len(pool_y)] = torch.arange(min(n, len(pool_y)))  # every original image once
    out = pool_x[pick]
    shifts = torch.randint(-1, 2, (n, 2), generator=g)
    padded = nn.functional.pad(out, (1, 1, 1, 1))
    rows = (torch.arange(8)[None, :] + 1 - shifts[:, :1]).clamp(0, 9)  # [n, 8]
    cols = (torch.arange(8)[None, :] + 1 - shifts[:, 1:]).clamp(0, 9)
    out = padded[torch.arange(n)[:, None, None], 0, rows[:, :, None], cols[:, None, :]]
    out = (out + 0.1 * torch.randn(out.shape, generator=g)).unsqueeze(1)
    return out, pool_y[pick], x_test


def train(model: nn.Module, x, y, epochs: int = 2, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(y)).split(128):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


# -- workers (fresh processes) ------------------------------------------------------------------


def worker(case_path: str, out_path: str, method: str, kind: str | None, threads: int) -> None:
    """Our `influence` on CASE.pt; prints the JSON of benchmarks/peers/kronfluence_scores.py."""
    sys.path.insert(0, str(HERE / "peers"))
    from measure import PeakRSS

    from attribution import influence

    torch.set_num_threads(threads)
    case = torch.load(case_path, weights_only=False)
    args = (case["model"], case["x_train"], case["y_train"], case["x_test"], case["y_test"])
    with PeakRSS() as mem:
        start = time.perf_counter()
        if method.startswith("projected"):  # the projected Gauss–Newton path at dim k
            options = dict(method="gauss_newton", kind="full", dim=int(method[len("projected") :]))
        else:
            options = dict(method=method, **({} if kind is None else {"kind": kind}))
        scores = influence(*args, **options)
        seconds = time.perf_counter() - start
    np.save(out_path, scores.numpy())
    print(
        json.dumps(
            {
                "seconds": seconds,
                "memory_increase": mem.increase,
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    )


def run(command: list[str]) -> dict:
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(command: list[str], repeats: int) -> dict:
    runs = [run(command) for _ in range(repeats)]
    return {
        "seconds": statistics.median(r["seconds"] for r in runs),
        "memory_increase": max(r["memory_increase"] for r in runs),
        "peak_rss": max(r["peak_rss"] for r in runs),
        "runs": len(runs),
    }


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([spearmanr(a[z], b[z]).statistic for z in range(len(a))]))


def digits_lds(args, peer) -> None:
    """LDS of ours (exact kernel form, projected, EK-FAC, K-FAC, each damping) and Kronfluence on
    the digits benchmark's network and truth."""
    import attribution_digits as bench

    from attribution import influence, lds, random_subsets, train_on_subsets
    from ntk import demo

    torch.manual_seed(0)
    data = demo.digits(n_train=bench.N_TRAIN)
    x, y = data.x_train, data.y_train
    xt, yt = data.x_test[: bench.N_TEST], data.y_test[: bench.N_TEST]
    everything = torch.ones(1, bench.N_TRAIN, dtype=torch.bool)
    model = bench.models_of(
        train_on_subsets(demo.mlp, x, y, everything, seeds=1, **bench.RECIPE), 1
    )[0]
    subsets = random_subsets(bench.N_TRAIN, args.subsets, 0.5, seed=0)
    target = train_on_subsets(demo.mlp, x, y, subsets, seeds=args.seeds, **bench.RECIPE).margins(
        xt, yt
    )
    print(f"\n## LDS on digits ({args.subsets} half-subsets × {args.seeds} seeds)\n")
    print("| method | damping | LDS | seconds |\n|---|---|---|---|")
    rows = [
        ("ours, exact gauss_newton (trace) = influence default", "auto", dict(method="auto")),
        ("ours, exact gauss_newton (full)", "auto", dict(method="gauss_newton", kind="full")),
        *(
            (
                f"ours, projected gauss_newton (full, k={k})",
                "auto",
                dict(method="gauss_newton", kind="full", dim=k),
            )
            for k in (1024, 2048, 4096)
        ),
    ]
    rows += [
        (f"ours, {m}", d, dict(method=m, damping=d))
        for m in ("ekfac", "kfac")
        for d in ("auto", *args.digits_damping)
    ]
    for name, damping, kwargs in rows:
        start = time.perf_counter()
        scores = influence(model, x, y, xt, yt, **kwargs)
        seconds = time.perf_counter() - start
        print(f"| {name} | {damping} | {lds(scores, subsets, target):.3f} | {seconds:.1f} |")
    if peer:
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/digits.pt"
            torch.save(dict(model=model, x_train=x, y_train=y, x_test=xt, y_test=yt), path)
            for damping in ("heuristic", "default"):
                command = [
                    peer,
                    str(HERE / "peers" / "kronfluence_scores.py"),
                    path,
                    f"{tmp}/k.npy",
                ]
                stats = run([*command, "--damping", damping, "--threads", str(args.threads)])
                score = lds(np.load(f"{tmp}/k.npy"), subsets, target)
                print(f"| Kronfluence, ekfac | {damping} | {score:.3f} | {stats['seconds']:.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--method", default="ekfac", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cases", default="mlp,cnn")
    parser.add_argument("--sizes", default="20000,50000")
    parser.add_argument("--exact-n", type=int, default=1000, help="training points for exact")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--methods",
        default="ekfac,kfac",
        help="our methods at full N (projectedK: the projected Gauss–Newton path at dim K)",
    )
    parser.add_argument(
        "--kronfluence-python",
        default=os.environ.get("KRONFLUENCE_PYTHON"),
        help="interpreter of a venv with kronfluence (default: $KRONFLUENCE_PYTHON)",
    )
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--digits", action="store_true", help="LDS on the digits benchmark")
    parser.add_argument("--seeds", type=int, default=2, help="--digits: retraining seeds")
    parser.add_argument("--subsets", type=int, default=100, help="--digits: half-subsets")
    parser.add_argument(
        "--digits-damping",
        type=lambda s: [float(v) for v in s.split(",")] if s else [],
        default=[],
        help="--digits: extra damping values λ for ekfac/kfac (comma-separated)",
    )
    parser.add_argument("--quick", action="store_true", help="N=2000, 1 repeat, mlp only")
    parser.add_argument("--smoke", action="store_true", help="N=400, 1 repeat, mlp, ekfac only")
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker, args.method, args.kind, args.threads)
    if args.quick:
        args.cases, args.sizes, args.repeats, args.exact_n = "mlp", "2000", 1, 200
    if args.smoke:
        args.cases, args.sizes, args.repeats, args.exact_n = "mlp", "400", 1, 100
        args.methods = "ekfac"
    peer = None if args.no_peers else args.kronfluence_python
    if args.digits:
        torch.set_num_threads(args.threads)
        return digits_lds(args, peer)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"# attribution at scale — {platform.processor() or platform.machine()}, "
        f"{args.threads} thread(s) per worker, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}; medians of {args.repeats} fresh processes\n"
    )
    print(
        "| case | N | method | median s | peak RSS GiB | RSS increase GiB | ρ vs Kronfluence "
        "| ρ vs exact (trace) | ρ vs exact (full) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    peer_script = str(HERE / "peers" / "kronfluence_scores.py")
    threads = ["--threads", str(args.threads)]

    def ours(path, out, *extra):
        return [sys.executable, __file__, "--worker", path, out, *threads, *extra]

    def kronfluence(path, out):
        return [peer, peer_script, path, out, *threads]

    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            x, y, xt = augmented_digits(max(sizes))
            model = train(architecture(case), x, y)
            with torch.no_grad():
                yt = model(xt).argmax(1)
            for n in [args.exact_n, *sizes]:
                path = f"{tmp}/{case}-{n}.pt"
                case_data = dict(model=model, x_train=x[:n], y_train=y[:n], x_test=xt, y_test=yt)
                torch.save(case_data, path)
                rows = {}
                if n == args.exact_n:
                    rows["exact (trace)"] = (ours, "--method", "gauss_newton")
                    rows["exact (full)"] = (ours, "--method", "gauss_newton", "--kind", "full")
                for m in args.methods.split(","):
                    rows[f"ours, {m}"] = (ours, "--method", m)
                if peer:
                    rows["Kronfluence, ekfac"] = (kronfluence,)
                scores, stats = {}, {}
                for i, (name, (command, *extra)) in enumerate(rows.items()):
                    out = f"{tmp}/{case}-{n}-{i}.npy"
                    stats[name] = measure(command(path, out, *extra), args.repeats)
                    scores[name] = np.load(out)
                refs = ("Kronfluence, ekfac", "exact (trace)", "exact (full)")
                for name, st in stats.items():
                    cells = [
                        f"{agreement(scores[name], scores[r]):.3f}"
                        if r in scores and r != name
                        else "-"
                        for r in refs
                    ]
                    print(
                        f"| {case} | {n:,} | {name} | {st['seconds']:.2f} | "
                        f"{st['peak_rss'] / 2**30:.2f} | {st['memory_increase'] / 2**30:.2f} | "
                        + " | ".join(cells)
                        + " |",
                        flush=True,
                    )
                if peer:
                    for m in args.methods.split(","):
                        ratio = stats[f"ours, {m}"]["seconds"] / stats[refs[0]]["seconds"]
                        print(f"| {case} | {n:,} | time ours {m} / Kronfluence: {ratio:.2f} |")


if __name__ == "__main__":
    main()
