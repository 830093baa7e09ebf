"""Projected features at k = 4096: ntk-toolkit's `projections.features` against TRAK's CPU path
(per-sample gradients with vmap(grad) as TRAK's FunctionalGradientComputer does, flattened, then
`trak.projectors.BasicProjector`, Rademacher, float32, batches of 512), on the MLP 784-512-512-10
and a small CNN, N = 1024. Kernel: sum-of-logits (one cotangent, like TRAK's one output per
sample). Each measurement runs in a fresh process: an untimed first call on 8 samples, an
untimed call for the peak resident set size above the resident size before it (sampled every
2 ms by a thread, which slows the calls it runs beside; earlier runs sampled during the timed
calls), then the median wall time of the repeats. (Before 2026-12-05 there was no untimed
call: TRAK's single default repeat then included its one-time costs, ~0.8 s on the CNN, and our
median of several did not.) Error:
relative Frobenius error of Φ Φᵀ against the exact kernel (ntk.empirical_ntk), TRAK's features
scaled by 1/√k; ours also as the mean over `--error-seeds` projection seeds (one seed's error
varies several-fold from seed to seed). One row per projector of ours (`--projectors`, the
library's default first), against the same TRAK run. Finally the time to featurise
`--store-samples` samples of the MLP into an on-disk store.

    python benchmarks/projection_speed.py [--n 1024] [--dim 4096] [--repeats 3] [--trak-repeats 1]
                                          [--store-samples 60000] [--models mlp,cnn]
                                          [--projectors rademacher,srht] [--error-seeds 4]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from functools import partial

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _projection_models import MODELS, images


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _ours(model, x, dim, projector=None, seed=0):
    import projections

    return projections.features(
        model,
        x,
        dim=dim,
        kind="sum_logits",
        batch_size=256,
        projector=projector or projections.DEFAULT_PROJECTOR,
        seed=seed,
    )


def _trak(model, x, dim, batch=512):
    from torch.func import functional_call, grad, vmap
    from trak.projectors import BasicProjector, ProjectionType
    from trak.utils import vectorize

    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    num_params = sum(p.numel() for p in params.values())

    def output(p, b, xi):  # sum of logits / √O: the pseudo-NTK's single output
        out = functional_call(model, (p, b), (xi.unsqueeze(0),))
        return out.sum() / math.sqrt(out.shape[-1])

    projector = BasicProjector(
        grad_dim=num_params,
        proj_dim=dim,
        seed=0,
        proj_type=ProjectionType.rademacher,
        device="cpu",
        dtype=torch.float32,
    )
    rows = []
    for start in range(0, x.shape[0], batch):
        g = vmap(grad(output), in_dims=(None, None, 0))(params, buffers, x[start : start + batch])
        rows.append(projector.project(vectorize(g, device="cpu"), model_id=0))
    return torch.cat(rows) / math.sqrt(dim)


class _PeakRSS:
    """Highest resident set size while the block runs, sampled every 2 ms (ru_maxrss would
    also count peaks from before the measurement)."""

    def __enter__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


WARM_UP = 8  # samples of the untimed first call in each worker


def _worker(method, model_name, n, dim, repeats, out_path, queue):
    model, x = MODELS[model_name](), images(n)
    method, _, projector = method.partition(":")
    fn = partial(_ours, projector=projector) if method == "ours" else _trak
    fn(model, x[:WARM_UP], dim)  # untimed: one-time costs (imports, first calls) of either
    base = _rss()
    with _PeakRSS() as rss:  # a run of its own: the sampling thread slows the timed runs
        fn(model, x, dim)
    peak = rss.peak - base
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        phi = fn(model, x, dim)
        times.append(time.perf_counter() - t)
    np.save(out_path, phi.numpy())
    queue.put((times, peak))


def measure(method, model_name, n, dim, repeats, tmp):
    """(median seconds, peak bytes, features) from a fresh process."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    path = os.path.join(tmp, f"{method.replace(':', '-')}-{model_name}.npy")
    proc = ctx.Process(target=_worker, args=(method, model_name, n, dim, repeats, path, queue))
    proc.start()
    times, peak = queue.get()
    proc.join()
    return statistics.median(times), peak, torch.from_numpy(np.load(path))


def rel_error(phi, exact):
    return float((phi.double() @ phi.double().T - exact).norm() / exact.norm())


def store_time(samples, dim, tmp):
    import projections

    model, x = MODELS["mlp"](), images(samples)
    t = time.perf_counter()
    projections.featurize(
        model,
        x,
        os.path.join(tmp, "store"),
        dim=dim,
        kind="sum_logits",
        block=4096,
        batch_size=256,
        progress=False,
    )
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trak-repeats", type=int, default=1)
    ap.add_argument("--store-samples", type=int, default=60000)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of mlp,cnn")
    ap.add_argument(
        "--projectors",
        default="rademacher,srht",
        help="our projectors, one row each (the first is the library's default)",
    )
    ap.add_argument("--error-seeds", type=int, default=4, help="seeds of our mean kernel error")
    args = ap.parse_args()
    import ntk

    print(
        f"# {platform.node()} {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}; N={args.n}, k={args.dim}, sum_logits kernel"
    )
    print(
        "| model | params | projector | ours (s) | TRAK CPU (s) | speed-up | ours peak MiB "
        f"| TRAK peak MiB | ours rel. err (seed 0; mean of {args.error_seeds} seeds) "
        "| TRAK rel. err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model, x = MODELS[name](), images(args.n)
            exact = ntk.empirical_ntk(model, x, kind="sum_logits").double()
            t_t, m_t, f_t = measure("trak", name, args.n, args.dim, args.trak_repeats, tmp)
            trak_error = rel_error(f_t, exact)
            params = sum(p.numel() for p in model.parameters())
            for projector in args.projectors.split(","):
                t_o, m_o, f_o = measure(
                    f"ours:{projector}", name, args.n, args.dim, args.repeats, tmp
                )
                errors = [rel_error(f_o, exact)] + [  # the timed run is seed 0
                    rel_error(_ours(model, x, args.dim, projector, seed), exact)
                    for seed in range(1, args.error_seeds)
                ]
                print(
                    f"| {name} | {params:,} | {projector} | {t_o:.2f} | {t_t:.2f} | "
                    f"{t_t / t_o:.1f}x | {m_o / 2**20:.0f} | {m_t / 2**20:.0f} | "
                    f"{errors[0]:.4f}; {np.mean(errors):.4f} | "
                    f"{trak_error:.4f} |",
                    flush=True,
                )
        if args.store_samples:
            t = store_time(args.store_samples, args.dim, tmp)
            print(
                f"\nfeaturize {args.store_samples:,} samples (MLP, sum_logits, k={args.dim}, "
                f"float32 store, blocks of 4096): {t:.1f} s "
                f"({args.store_samples / t:.0f} samples/s)"
            )


if __name__ == "__main__":
    main()
