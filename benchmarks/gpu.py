"""The GPU checks in one run (on a CUDA machine): eNTK speed against the torch.func tutorial's
recipe, and `influence` at 20,000–50,000 training points, on the same models and data as the CPU
benchmarks.

    python benchmarks/gpu.py [--repeats 5] [--sizes 20000,50000] [--json out.json]

eNTK: benchmarks/entk_speed.py's cases (MLP 784-512-512-10 and the 3×32×32 CNN, float32, full
kernel [N, N, O, O]) at its sizes and at 4× them; ours (`ntk.empirical_ntk(method=...)`: structured,
auto and jacobian; ntk_vp, the slowest on CPU by 5–40×, is left out to keep the run short) and the
tutorial's vmap(jacrev) Jacobian contraction, each the median of --repeats calls after one
warm-up, timed between `torch.cuda.synchronize()`; peak memory is the call's
`torch.cuda.max_memory_allocated` above what was allocated before it; error is relative to
ours (structured). TF32 stays at PyTorch's defaults (off for matrix products).

influence: benchmarks/attribution_scale.py's networks (MLP 64-256-256-10; CNN with BatchNorm)
trained on the GPU for 2 epochs on its augmented digits, then `influence(method="ekfac")` and
`influence(method="auto")` (the projected Gauss–Newton path at this N) with `device="cuda"`
against its 500 test points: one timed call after a warm-up on 2,000 points.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import attribution_scale as scale
import entk_speed as speed

import ntk
from attribution import influence

DEVICE = torch.device("cuda")


def timed(fn, repeats: int, warmup: bool = True) -> tuple[float, float, torch.Tensor]:
    """(median seconds, peak GiB above the start, result) of `repeats` calls (after a warm-up
    call). Off CUDA (--device cpu, to check this script) the peak is 0."""
    cuda = DEVICE.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    if warmup:
        fn()
    sync()
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        sync()
        seconds.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0
    return statistics.median(seconds), peak, out


def entk_rows(repeats: int, scale_up: int, base: tuple[int, int] = (256, 128)) -> list[dict]:
    rows = []
    mlp, cnn = base
    cases = [("mlp", mlp), ("mlp", mlp * scale_up), ("cnn", cnn), ("cnn", cnn * scale_up)]
    for arch, n in dict.fromkeys(cases):
        model = speed.build(arch).to(DEVICE)
        x = speed.inputs(arch, n).to(DEVICE)
        methods = {f"ours:{m}": m for m in ("structured", "auto", "jacobian")}
        results = {}
        for name, method in methods.items():
            call = functools.partial(ntk.empirical_ntk, model, x, method=method)
            results[name] = timed(call, repeats)
        results["torch.func tutorial"] = timed(
            functools.partial(speed.tutorial_ntk, model, x, x), repeats
        )
        reference = results["ours:structured"][2]
        tutorial = results["torch.func tutorial"][0]
        for name, (seconds, peak, k) in results.items():
            error = float(torch.linalg.norm(k - reference) / torch.linalg.norm(reference))
            rows.append(
                dict(
                    case=f"{arch} N={n}",
                    method=name,
                    seconds=seconds,
                    peak_gib=peak,
                    speedup_vs_tutorial=tutorial / seconds,
                    rel_error=error,
                )
            )
            print(
                f"| {arch} N={n} | {name} | {seconds:.4f} | {tutorial / seconds:.2f}× | "
                f"{peak:.2f} | {error:.1e} |",
                flush=True,
            )
        del results, reference
        torch.cuda.empty_cache()  # a no-op where CUDA was never initialised
    return rows


def influence_rows(sizes: list[int]) -> list[dict]:
    rows = []
    for arch in ("mlp", "cnn"):
        for n in sizes:
            x, y, x_test = scale.augmented_digits(n)
            x, y, x_test = x.to(DEVICE), y.to(DEVICE), x_test.to(DEVICE)
            model = scale.train(scale.architecture(arch).to(DEVICE), x, y)
            for method in ("ekfac", "auto"):
                influence(model, x[:2000], y[:2000], x_test[:50], method=method, device=DEVICE)
                call = functools.partial(
                    influence, model, x, y, x_test, method=method, device=DEVICE
                )
                seconds, peak, scores = timed(call, 1, warmup=False)
                finite = bool(torch.isfinite(scores).all())
                rows.append(
                    dict(case=arch, n=n, method=method, seconds=seconds, peak_gib=peak, ok=finite)
                )
                print(
                    f"| {arch} | {n} | {method} | {seconds:.2f} | {peak:.2f} | {finite} |",
                    flush=True,
                )
                del scores
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="20000,50000")
    parser.add_argument("--sections", default="entk,influence")
    parser.add_argument("--scale-up", type=int, default=4, help="the larger eNTK cases' N factor")
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of this script")
    parser.add_argument("--quick", action="store_true", help="eNTK N = 16 / 8: seconds on a CPU")
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device")
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}")
    report = {}
    sections = args.sections.split(",")
    if "entk" in sections:
        print("\n| case | method | seconds | × tutorial | peak GiB | rel. error |")
        print("|---|---|---|---|---|---|")
        report["entk"] = entk_rows(
            args.repeats, args.scale_up, (16, 8) if args.quick else (256, 128)
        )
    if "influence" in sections:
        print("\n| network | N | method | seconds | peak GiB | finite |\n|---|---|---|---|---|---|")
        report["influence"] = influence_rows([int(s) for s in args.sizes.split(",")])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
