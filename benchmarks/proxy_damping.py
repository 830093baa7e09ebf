"""A damping chosen per model for the Gauss–Newton influence, measured (not adopted by the library):
the λ whose scores best predict the kernel's own retraining on random halves of the training set.

    python benchmarks/proxy_damping.py [--cache-dir DIR] [--settings ...]
    python benchmarks/proxy_damping.py --smoke                          # seconds

The LDS judges attribution scores by how well they rank the test margins of networks retrained on
random halves. `influence`'s damping keeps one share of the curvature's directions for every model
(`damping.DOF_FRACTION`), and the best share belongs to the setting (0.015 on the digits networks,
0.08 on wine: `python benchmarks/damping.py`). The linearised network retrains for the price of a
kernel solve: the kernel gradient flow (`kernel_flow.flow_logits`, a batch of halves in lockstep)
on a half S, on k(S, S) from f = 0 until it has fitted a share of the kernel's directions or
reached the network's own training loss, gives test margins through k(Z, S). Over PROXY_HALVES
halves these margins are a proxy truth computed from the kernel alone (`proxy_truth`);
`proxy_choice` searches a logarithmic grid of λ around the fixed rule's λ₀ (COARSE, refined by
REFINEMENTS around the best) for the best LDS against it, λ_p; the rule damps with
λ₀ (λ_p/λ₀)^w.

For every setting: the LDS against the truth of the rule for each proxy share (PROXY_SHARES) and
weight w (PROXY_WEIGHTS; w = 0 is the fixed rule), and of the best λ of the search's grid (read
from the truth, for scale); each share's λ_p/λ₀; the pair chosen leave-one-setting-out on
settings.NAMES (held-out settings, when named: the pair chosen on all of NAMES). The library's
`influence(damping="auto")` is run once per setting as a check of the fixed rule's row.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import settings
from damping import system

from attribution import influence, lds, random_subsets
from attribution.damping import DOF_FRACTION, auto_damping
from attribution.kernel_flow import FITTED_FRACTION, flow_logits
from attribution.outputs import logits, margins

PROXY_HALVES = 32
# The proxy flows integrate with steps growing by this factor per step (`influence`'s own flow:
# 1.003), ten times fewer steps for an error far below the spread of the halves' margins
PROXY_STEP_GROWTH = 1.03
PROXY_SHARES = (0.1, 0.2, 0.3, 0.5, 0.8)
PROXY_WEIGHTS = (0.25, 0.5, 0.75, 1.0)
# The λ the search tries, as multiples of the fixed rule's: COARSE first, then each of
# REFINEMENTS in turn on both sides of the best so far (a grid of ratio 2^(1/2) near the best)
COARSE = (1 / 256, 1 / 64, 1 / 16, 1 / 4, 1.0, 4.0)
REFINEMENTS = (2.0, 2**0.5)
FIXED = f"fixed, dof fraction {DOF_FRACTION:g}"  # the row of `influence`'s damping="auto"


class ProxyTruth(NamedTuple):
    """The kernel flow's retrainings: which training examples each saw ([S, N] bool) and the test
    margins each reached ([S, M])."""

    subsets: torch.Tensor
    margins: torch.Tensor


def proxy_truth(
    kernel: torch.Tensor,
    cross: torch.Tensor,
    y: torch.Tensor,
    y_test: torch.Tensor,
    num_outputs: int,
    loss_floor: float,
    share: float,
    *,
    halves: int = PROXY_HALVES,
    seed: int = 0,
) -> ProxyTruth:
    """Test margins [halves, M] of the kernel flow retrained on `halves` random halves
    (`random_subsets(N, halves, seed=seed)`), each run from f = 0 on k(S, S) until it has fitted
    `share` of that kernel's directions or its training loss reaches `loss_floor`, the margins
    read at its test logits (`kernel_flow.flow_logits`, all halves in one batch). kernel: k(X, X)
    [N, N]; cross: k(Z, X) [M, N] (scalar kernels); y [N], y_test [M] labels."""
    subsets = random_subsets(kernel.shape[0], halves, seed=seed)
    rows = torch.stack([mask.nonzero()[:, 0] for mask in subsets])  # [S, N/2], one size
    state = flow_logits(
        kernel[rows[:, :, None], rows[:, None, :]],
        y[rows],
        num_outputs,
        share,
        loss_floor=loss_floor,
        cross=cross[:, rows].transpose(0, 1),
        step_growth=PROXY_STEP_GROWTH,
    )
    return ProxyTruth(subsets, margins(state.test, y_test))


def proxy_choice(
    scores_at: Callable[[float], torch.Tensor], anchor: float, truth: ProxyTruth
) -> float:
    """The λ with the best LDS against the proxy `truth` among anchor × COARSE and then, for each
    of REFINEMENTS, the best so far times and divided by it. scores_at(λ): the influence scores
    [M, N] at damping λ; anchor: the fixed rule's λ."""
    tried: dict[float, float] = {}

    def attempt(lam: float) -> None:
        if lam in tried:
            return
        with warnings.catch_warnings():  # test margins the flows leave constant are skipped
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                tried[lam] = lds(scores_at(lam), truth.subsets, truth.margins)
            except ValueError:  # every margin constant over the halves: nothing to rank by
                tried[lam] = float("-inf")

    for multiple in COARSE:
        attempt(anchor * multiple)
    for ratio in REFINEMENTS:
        best = max(tried, key=tried.__getitem__)
        attempt(best * ratio)
        attempt(best / ratio)
    best = max(tried, key=tried.__getitem__)
    if tried[best] == float("-inf"):
        raise ValueError(
            "the kernel flow's retrainings on random halves leave every test margin constant, "
            "so they cannot choose a damping"
        )
    return best


def proxy_grid(anchor: float) -> list[float]:
    """Every λ the search of `proxy_choice` can reach from `anchor`."""
    grid = [anchor * c for c in COARSE]
    for ratio in REFINEMENTS:
        grid = sorted({lam * f for lam in grid for f in (1 / ratio, 1.0, ratio)})
    return grid


def rule(share: float, weight: float) -> str:
    return f"proxy, share {share:g}, weight {weight:g}"


def sweep(setting) -> tuple[dict[str, float], dict[str, float]]:
    """(LDS rows, λ_p/λ₀ per share) of one setting's network (module docstring)."""
    model = setting.model
    scores_at, e, n, o, trace = system(setting, model, FITTED_FRACTION)
    anchor = auto_damping(e, n, o)
    floor = torch.nn.functional.cross_entropy(logits(model, setting.x).double(), setting.y).item()

    def truth_lds(lam: float) -> float:
        return lds(scores_at(lam), setting.subsets, setting.truth)

    out, ratios = {FIXED: truth_lds(anchor)}, {}
    for share in PROXY_SHARES:
        truth = proxy_truth(trace[:n, :n], trace[n:, :n], setting.y, setting.yt, o, floor, share)
        ratio = proxy_choice(scores_at, anchor, truth) / anchor
        for weight in PROXY_WEIGHTS:
            out[rule(share, weight)] = truth_lds(anchor * ratio**weight)
        ratios[f"share {share:g}: λ_p / λ₀"] = ratio
    out["best λ of the search's grid (truth)"] = max(map(truth_lds, proxy_grid(anchor)))
    s = setting
    library = influence(model, s.x, s.y, s.xt, s.yt)
    out["library, influence(damping='auto')"] = lds(library, s.subsets, s.truth)
    return out, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(settings.NAMES))
    parser.add_argument("--cache-dir", default=None, help="where the ground truth is cached")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.settings.split(",")
    rows, ratios = {}, {}
    for name in names:
        setting = settings.load(name, cache_dir=args.cache_dir, smoke=args.smoke)
        rows[name], ratios[name] = sweep(setting)
        print(name, flush=True)
    print(settings.lds_table(rows, "rule"))
    print("\n| proxy's choice | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for key in ratios[names[0]]:
        print(f"| {key} | " + " | ".join(f"{ratios[n][key]:.3g}" for n in names) + " |")
    chosen_on = {name: row for name, row in rows.items() if name in settings.NAMES}
    if len(chosen_on) > 1:
        candidates = [rule(p, w) for p in PROXY_SHARES for w in PROXY_WEIGHTS]
        folds = settings.leave_one_out(chosen_on, candidates)
        overall = max(candidates, key=lambda c: sum(row[c] for row in chosen_on.values()))
        folds.update({name: overall for name in rows if name not in chosen_on})
        print("\nshare and weight chosen leave-one-setting-out (best mean LDS on the other")
        print(f"settings of {', '.join(chosen_on)}; the others: chosen on all of them)\n")
        print("| held out | rule chosen | held-out LDS | fixed rule |")
        print("|---|---|---|---|")
        for held, chosen in folds.items():
            lds_held, lds_fixed = rows[held][chosen], rows[held][FIXED]
            print(f"| {held} | {chosen[7:]} | {lds_held:.3f} | {lds_fixed:.3f} |")


if __name__ == "__main__":
    main()
