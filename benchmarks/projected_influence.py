"""Memory and time of the projected Gauss–Newton influence (`influence(..., kind="full",
dim=k)`): the training features streamed batch by batch, or read from a feature store, against
holding all of them ([N, O, k]) as the path did before.

    python benchmarks/projected_influence.py [--sizes 2000,8000] [--dim 4096]
    python benchmarks/projected_influence.py --smoke

Each measurement runs in a fresh process (peak resident memory from getrusage); data are
synthetic (64 features, 10 classes), the model an MLP 64-256-10 at its initial weights (the
cost does not depend on training). "all features in memory" computes `projections.features` of
x_train and x_test and the same formula (H = Σ Φᵀ Λ Φ, one Cholesky), as the path did before;
"store" reads a store written beforehand by `projections.featurize` (its writing time is listed
separately). The scores of the three ways are compared in the last column.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N_TEST = 100


def problem(n: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    x = torch.randn(n + N_TEST, 64)
    y = torch.randint(0, 10, (n + N_TEST,))
    return model.eval(), x[:n], y[:n], x[n:], y[n:]


def worker(way: str, n: int, dim: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    import projections
    from attribution import influence
    from attribution.outputs import margin_gradient, softmax_curvature

    model, x, y, xt, yt = problem(n)
    start = time.perf_counter()
    if way == "all features in memory":
        f, ft = (projections.features(model, v, dim=dim, kind="full").double() for v in (x, xt))
        with torch.no_grad():
            g, gt = model(x).double(), model(xt).double()
        h = torch.einsum("iok,iop,ipl->kl", f, softmax_curvature(g), f)
        h.diagonal().add_(1.0)
        r = torch.nn.functional.one_hot(y, 10).double() - g.softmax(1)
        left = torch.einsum("mo,mok->mk", margin_gradient(gt, yt), ft)
        scores = (
            torch.cholesky_solve(left.T, torch.linalg.cholesky(h)).T
            @ torch.einsum("io,iok->ik", r, f).T
        )
    elif way == "streamed":
        scores = influence(model, x, y, xt, yt, kind="full", dim=dim, damping=1.0)
    else:
        scores = influence(model, x, y, xt, yt, train_features=store, damping=1.0)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.save(dict(scores=scores, seconds=seconds, peak=peak), out)


def run(way: str, n: int, dim: int, store: str, tmp: str) -> dict:
    out = str(Path(tmp) / "result.pt")
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        way,
        "--n",
        str(n),
        "--dim",
        str(dim),
        "--store",
        store,
        "--out",
        out,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return torch.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2000,8000")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", default=None)
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--store", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.n, args.dim, args.store, args.out)
        return
    sizes, dim = ([200], 64) if args.smoke else ([int(s) for s in args.sizes.split(",")], args.dim)
    print("| N | way | time s | peak memory GiB | max |Δ score| / max |score| |")
    print("|---|---|---|---|---|")
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            import projections

            torch.set_num_threads(1)
            model, x, *_ = problem(n)
            store = str(Path(tmp) / "features")
            start = time.perf_counter()
            projections.featurize(model, x, store, dim=dim, kind="full", progress=False)
            written = time.perf_counter() - start
            rows = {
                w: run(w, n, dim, store, tmp)
                for w in ("all features in memory", "streamed", "from a store")
            }
            ref = rows["all features in memory"]["scores"]
            for way, r in rows.items():
                err = float((r["scores"] - ref).abs().max() / ref.abs().max())
                print(
                    f"| {n} | {way} | {r['seconds']:.1f} | {r['peak'] / 2**30:.2f} | {err:.1e} |",
                    flush=True,
                )
            print(f"| {n} | (writing the store, once) | {written:.1f} | – | – |")
    print(json.dumps({"dim": dim, "n_test": N_TEST}))


if __name__ == "__main__":
    main()
