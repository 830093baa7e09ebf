"""Which training logits the Gauss–Newton influence reads its residuals and curvature from: the
network's own, or the kernel's gradient flow stopped once it has fitted a share D of the kernel's
directions (`attribution.kernel_flow`), on the LDS ground truth of benchmarks/settings.py.

    python benchmarks/training_logits.py [--cache-dir DIR] [--settings a,b] [--fractions .04,.05]
        [--ensemble 10 [--peer-python PY]] [--checkpoints]
    python benchmarks/training_logits.py --smoke        # seconds

Every row is `attribution.influence(model, ..., training_logits=...)` with the other defaults;
the share D is chosen leave-one-setting-out (best mean LDS on the other settings) and scored on
the held-out one. --ensemble K also scores, on every setting, the mean over K networks with the
network's logits and with the flow at the chosen share: K independently seeded networks on the
whole training set, and K networks each trained on its own random half of it (`Setting.halves`),
with --peer-python also Kronfluence EK-FAC's scores of the same networks, averaged alike;
--checkpoints the checkpoints after 1/4 and 1/2 of the epochs of one run of the first setting
(benchmarks/checkpoints.py) both ways.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attribution import influence, lds
from attribution.kernel_flow import FITTED_FRACTION
from benchmarks import settings
from benchmarks.attribution_settings import run_peers

FRACTIONS = (0.02, 0.025, 0.03, 0.035, 0.04, 0.045, 0.05, 0.055, 0.06, 0.07)
NETWORK = "network's logits"


def row_name(fraction: float) -> str:
    return f"flow to {fraction:g} of the directions"


def scores(setting, model, training_logits, checkpoints=None) -> torch.Tensor:
    s = setting
    return influence(
        model, s.x, s.y, s.xt, s.yt, training_logits=training_logits, checkpoints=checkpoints
    )


def kronfluence(setting, model, python: str) -> torch.Tensor:
    """Kronfluence EK-FAC's scores of one network, run in the peer's interpreter `python`."""
    s = setting
    out = run_peers(model, [model], s.x, s.y, s.xt, s.yt, python, "kronfluence_ekfac")
    return torch.as_tensor(out["kronfluence_ekfac"][0]).double()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(settings.NAMES))
    parser.add_argument("--cache-dir", default=None, help="where the ground truth is cached")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--ensemble", type=int, default=0, help="networks for the ensemble rows")
    parser.add_argument("--checkpoints", action="store_true", help="also one run's checkpoints")
    parser.add_argument("--fractions", default=",".join(f"{d:g}" for d in FRACTIONS))
    parser.add_argument(
        "--peer-python",
        default=os.environ.get("NTK_PEER_PYTHON"),
        help="an interpreter with kronfluence: also Kronfluence EK-FAC on the ensembles' networks",
    )
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    names = args.settings.split(",")
    fractions = [float(d) for d in args.fractions.split(",")]
    rows: dict[str, dict[str, float]] = {}
    loaded = {}
    for name in names:
        s = loaded[name] = settings.load(name, cache_dir=args.cache_dir, smoke=args.smoke)
        model = s.model
        rows[name] = {NETWORK: lds(scores(s, model, "network"), s.subsets, s.truth)}
        for d in fractions:
            rows[name][row_name(d)] = lds(scores(s, model, d), s.subsets, s.truth)
        print(name, {k: round(v, 3) for k, v in rows[name].items()}, flush=True)
    print("\n" + settings.lds_table(rows, "training logits"))
    chosen = FITTED_FRACTION
    if len(names) > 1:
        print("\nleave-one-setting-out choice of the share (best mean LDS on the others)\n")
        print("| held out | share chosen | held-out LDS | in-sample best | network's logits |")
        print("|---|---|---|---|---|")
        candidates = {row_name(d): d for d in fractions}
        for held, pick in settings.leave_one_out(rows, list(candidates)).items():
            best = max(rows[held][r] for r in candidates)
            print(
                f"| {held} | {candidates[pick]:g} | {rows[held][pick]:.3f} | {best:.3f} "
                f"| {rows[held][NETWORK]:.3f} |"
            )
        chosen = candidates[max(candidates, key=lambda r: sum(rows[n][r] for n in names))]
        print(f"\nbest mean over all settings: share {chosen:g}")
    s = loaded[names[0]]
    variants = {NETWORK: "network", row_name(chosen): chosen}
    if args.checkpoints:
        from benchmarks.checkpoints import trajectory

        nets = trajectory(s)[0]
        early = [nets[0.25], nets[0.5]]
        print(f"\n{names[0]}, one run's checkpoints after 1/4 and 1/2 of the epochs")
        for label, value in variants.items():
            v = lds(scores(s, s.model, value, checkpoints=early), s.subsets, s.truth)
            print(f"  {label}: {v:.3f}")
    if args.ensemble:
        k = args.ensemble
        table = {}
        for name in names:
            s = loaded[name]
            table[name] = {}
            for kind, nets in (
                (f"{k} seeds on all the data", s.models(k)),
                (f"{k} on random halves", s.halves(k)),
            ):
                for label, value in variants.items():
                    mean = torch.stack([scores(s, m, value) for m in nets]).mean(0)
                    table[name][f"{kind}, {label}"] = lds(mean, s.subsets, s.truth)
                if args.peer_python:  # the peer's scores of the same networks, averaged alike
                    mean = torch.stack([kronfluence(s, m, args.peer_python) for m in nets]).mean(0)
                    table[name][f"{kind}, Kronfluence EK-FAC"] = lds(mean, s.subsets, s.truth)
            print(name, {r: round(v, 3) for r, v in table[name].items()}, flush=True)
        print(f"\nmean of the scores of {k} networks\n")
        print(settings.lds_table(table, "ensemble members, training logits"))


if __name__ == "__main__":
    main()
