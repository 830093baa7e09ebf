"""Engine leftovers of issue 13, measured in one process (medians, ratios within the run).

auto      the kernel time of `method="structured"` (what `auto` picked before the cost model),
          `method="jacobian"` and `method="auto"` on the benchmark CNN and MLP of
          benchmarks/entk_speed.py and the small ResNet of benchmarks/_resnet.py, full and trace
          kinds; which method auto picks (ntk.core.structured.prefers_autodiff).
overhead  the time of one `empirical_ntk` call at N = 16 (MLP and CNN of entk_speed.py) and on a
          2-sample linear model (the fixed cost of a call: checks, planning, tiling).

Run: python benchmarks/hf_engine.py [--repeats 5] [--sections auto,overhead]
                                    [--models cnn,mlp,resnet] [--device cuda]
     (--device: the models and inputs live there; the auto section then also prints the cost
     model's terms, to fit COPY_COST for that device type)
     python benchmarks/hf_engine.py --quick      # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

import ntk
from ntk.core import structured
from ntk.core.model import ModelView

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _resnet import resnet
from entk_speed import build, inputs

DEVICE = torch.device("cpu")


def timed(fn) -> float:
    """Seconds `fn` takes, waiting for the device's queued work before and after."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(timed(fn) for _ in range(repeats))


def kernel_time(model, x, repeats: int, **options) -> float:
    return median_time(lambda: ntk.empirical_ntk(model, x, **options), repeats)


METHODS = ("structured", "jacobian", "auto")


def interleaved_times(model, x, kind: str, repeats: int) -> dict[str, float]:
    """Median time of each method, the methods taking turns (one warm-up round first) so that
    load changes on a shared machine hit them alike."""
    times = {m: [] for m in METHODS}
    for r in range(repeats + 1):
        for m in METHODS:
            seconds = timed(partial(ntk.empirical_ntk, model, x, kind=kind, method=m))
            if r:
                times[m].append(seconds)
    return {m: statistics.median(t) for m, t in times.items()}


def auto(args) -> None:
    n = {"mlp": 16, "cnn": 8, "resnet": 8} if args.quick else {"mlp": 64, "cnn": 64, "resnet": 32}
    if DEVICE.type == "cuda" and not args.quick:
        n = {"mlp": 256, "cnn": 128, "resnet": 64}
    cases = {
        f"CNN (entk_speed), N = {n['cnn']}": lambda: (build("cnn"), inputs("cnn", n["cnn"])),
        f"MLP 784-512-512-10 (entk_speed), N = {n['mlp']}": lambda: (
            build("mlp"),
            inputs("mlp", n["mlp"]),
        ),
        f"ResNet (_resnet.py), N = {n['resnet']}": lambda: (
            resnet(),
            torch.randn(n["resnet"], 3, 32, 32, generator=torch.Generator().manual_seed(0)),
        ),
    }
    cases = {name: case for name, case in cases.items() if name.split()[0].lower() in args.models}
    print(f"\n## method='auto' from the cost model (median of {args.repeats}, methods in turn)\n")
    print(
        "| model | kind | structured s (auto before) | jacobian s | auto s (after) | auto picks | "
        "before/after | explicit | structured without copies | copied elements |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, case in cases.items():
        model, x = case()
        model, x = model.to(DEVICE), x.to(DEVICE)
        for kind in ("full", "trace"):
            t = interleaved_times(model, x, kind, args.repeats)
            plan = structured.plan(ModelView(model), x, kind, 10, len(x), len(x))
            autodiff = structured.prefers_autodiff(plan, kind, 10, len(x), DEVICE)
            picked = "jacobian" if autodiff else "structured"
            explicit, compute, copied = structured.cost_terms(plan, kind, 10, len(x))
            print(
                f"| {name} | {kind} | {t['structured']:.3f} | {t['jacobian']:.3f} | "
                f"{t['auto']:.3f} | {picked} | {t['structured'] / t['auto']:.2f} | "
                f"{explicit:.3g} | {compute:.3g} | {copied:.3g} |",
                flush=True,
            )


def overhead(args) -> None:
    tiny = nn.Linear(2, 2).eval()
    cases = {
        "Linear 2→2, N = 2 (fixed cost)": (tiny, torch.randn(2, 2)),
        "MLP 784-512-512-10, N = 16": (build("mlp"), inputs("mlp", 16)),
        "CNN (entk_speed), N = 16": (build("cnn"), inputs("cnn", 16)),
    }
    print(f"\n## per-call time at small N (median of {args.repeats}, after one warm-up call)\n")
    print("| case | full s | trace s |")
    print("|---|---|---|")
    for name, (model, x) in cases.items():
        model, x = model.to(DEVICE), x.to(DEVICE)
        full, trace = (kernel_time(model, x, args.repeats, kind=k) for k in ("full", "trace"))
        print(f"| {name} | {full:.4f} | {trace:.4f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sections", default="auto,overhead")
    parser.add_argument("--models", default="cnn,mlp,resnet", help="auto section: which models")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.quick:
        args.repeats = 1
    torch.set_num_threads(1)
    sections = set(args.sections.split(","))
    if sections - {"auto", "overhead"}:
        parser.error(f"unknown section(s) {sorted(sections - {'auto', 'overhead'})}")
    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "CPU, 1 thread"
    print(f"# engine leftovers — {where}, torch {torch.__version__}")
    if "auto" in sections:
        auto(args)
    if "overhead" in sections:
        overhead(args)


if __name__ == "__main__":
    main()
