"""Influence from checkpoints saved along one training run, against the final model alone, on the
LDS ground truth of benchmarks/settings.py (and Kronfluence EK-FAC given the same checkpoints).

    python benchmarks/checkpoints.py --cache-dir DIR [--peer-python PY] [--ensemble 10]
    python benchmarks/checkpoints.py --smoke --no-peers            # seconds

Each setting's network (seed 0) is retrained along the same trajectory and saved after a
quarter, half, three quarters and all of its epochs (the recipe draws its minibatch order epoch
by epoch from one seeded generator and keeps Adam's learning rate constant, so a run of E' < E
epochs is the first E' epochs of the full run). `attribution.influence(..., checkpoints=...)`
averages the scores of the checkpoints it is given, each with the kernel flow's training logits
on its own kernel (the default); every "gauss_newton" scheme below is such an average, and the
"network's logits" rows score each checkpoint at its own logits instead. A scheme is chosen
leave-one-setting-out (best mean LDS on the other settings) and scored on the
held-out one. --ensemble K repeats the chosen scheme on K independently seeded runs (the
ensemble of the issue's target) on digits MLP; --truth-seeds 2,4,8,16 scores those rows also
against truths that average more retrainings per subset (less training noise in the truth).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from attribution import influence, lds, train_on_subsets  # noqa: E402
from benchmarks import settings  # noqa: E402
from benchmarks.attribution_settings import run_peers  # noqa: E402

FRACTIONS = (0.25, 0.5, 0.75, 1.0)
SCHEMES = {
    "final model (one checkpoint)": (1.0,),
    "4 evenly spaced (1/4, 1/2, 3/4, 1)": (0.25, 0.5, 0.75, 1.0),
    "last half (1/2, 3/4, 1)": (0.5, 0.75, 1.0),
    "first half (1/4, 1/2)": (0.25, 0.5),
    "1/4 alone": (0.25,),
    "1/2 alone": (0.5,),
}
# row prefix -> influence options (the Kronecker-factored EK-FAC reads the network's logits)
METHODS = {
    "gauss_newton": {},
    "gauss_newton, network's logits": dict(training_logits="network"),
    "ekfac": dict(method="ekfac"),
}


def trajectory(
    setting: settings.Setting, runs: int = 1, fractions=FRACTIONS
) -> list[dict[float, torch.nn.Module]]:
    """For each of `runs` independently seeded runs (seeds 0..runs−1), its network after each
    fraction of the recipe's epochs in `fractions` (each trained from the start)."""
    everything = torch.ones(1, len(setting.x), dtype=torch.bool)
    out = [{} for _ in range(runs)]
    for f in fractions:
        recipe = dict(setting.recipe, epochs=max(1, round(setting.recipe["epochs"] * f)))
        stack = train_on_subsets(
            setting.factory, setting.x, setting.y, everything, seeds=runs, **recipe
        )
        for run, net in enumerate(stack.modules()):
            out[run][f] = net
    return out


def scores_along(setting, nets: dict, options: dict) -> dict[float, torch.Tensor]:
    """Scores of each checkpoint alone under `influence` options (a scheme's scores are their
    mean, which is what `influence(checkpoints=...)` computes)."""
    s = setting
    return {f: influence(m, s.x, s.y, s.xt, s.yt, **options) for f, m in nets.items()}


def scheme_lds(setting, per_checkpoint: dict) -> dict[str, float]:
    return {
        name: lds(
            torch.stack([per_checkpoint[f] for f in fracs]).mean(0), setting.subsets, setting.truth
        )
        for name, fracs in SCHEMES.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(settings.NAMES))
    parser.add_argument("--cache-dir", default=None, help="where the ground truth is cached")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--peer-python", default=os.environ.get("NTK_PEER_PYTHON"))
    parser.add_argument("--ensemble", type=int, default=0, help="runs for the ensemble rows")
    parser.add_argument(
        "--truth-seeds",
        default="",
        help="comma-separated seed counts: the ensemble rows also against truths averaging that "
        "many retrainings per subset (the settings' truth averages 2)",
    )
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not args.no_peers and not args.peer_python:
        parser.error("give --peer-python (or $NTK_PEER_PYTHON), or --no-peers")
    rows: dict[str, dict[str, float]] = {}
    chosen_fracs = {}
    names = args.settings.split(",")
    for name in names:
        s = settings.load(name, cache_dir=args.cache_dir, smoke=args.smoke)
        nets = trajectory(s)[0]
        rows[name] = {}
        for prefix, options in METHODS.items():
            start = time.perf_counter()
            per = scores_along(s, nets, options)
            seconds = (time.perf_counter() - start) / len(per)
            for scheme, value in scheme_lds(s, per).items():
                rows[name][f"{prefix}: {scheme}"] = value
            print(f"{name} {prefix}: {seconds:.1f} s per checkpoint", flush=True)
        # the library averages exactly these scores
        fracs = SCHEMES["4 evenly spaced (1/4, 1/2, 3/4, 1)"]
        lib = influence(s.model, s.x, s.y, s.xt, s.yt, checkpoints=[nets[f] for f in fracs])
        rows[name]["library: influence(checkpoints=4 evenly spaced)"] = lds(lib, s.subsets, s.truth)
        if not args.no_peers:
            per = {}
            for f, m in nets.items():
                out = run_peers(m, [m], s.x, s.y, s.xt, s.yt, args.peer_python, "kronfluence_ekfac")
                per[f] = torch.as_tensor(out["kronfluence_ekfac"][0]).double()
            for scheme, value in scheme_lds(s, per).items():
                rows[name][f"Kronfluence EK-FAC: {scheme}"] = value
        print({k: round(v, 3) for k, v in rows[name].items()}, flush=True)
    print("\n" + settings.lds_table(rows, "scheme"))
    if len(names) > 1:
        print("\nleave-one-setting-out choice of the scheme (gauss_newton, best mean elsewhere)\n")
        print("| held out | scheme chosen | held-out LDS | in-sample best | final model |")
        print("|---|---|---|---|---|")
        candidates = [f"gauss_newton: {k}" for k in SCHEMES]
        for held, pick in settings.leave_one_out(rows, candidates).items():
            chosen_fracs[held] = SCHEMES[pick.split(": ", 1)[1]]
            best = max(rows[held][r] for r in candidates)
            final = rows[held]["gauss_newton: final model (one checkpoint)"]
            print(
                f"| {held} | {pick.split(': ', 1)[1]} | {rows[held][pick]:.3f} | {best:.3f} "
                f"| {final:.3f} |"
            )
    if args.ensemble:
        name = "digits_mlp" if "digits_mlp" in names else names[0]
        s = settings.load(name, cache_dir=args.cache_dir, smoke=args.smoke)
        fracs = chosen_fracs.get(name, SCHEMES["4 evenly spaced (1/4, 1/2, 3/4, 1)"])
        finals, schemes = [], []
        for nets in trajectory(s, args.ensemble):
            per = scores_along(s, {f: nets[f] for f in set(fracs) | {1.0}}, {})
            finals.append(per[1.0])
            schemes.append(torch.stack([per[f] for f in fracs]).mean(0))
        print(
            f"\n{name}, ensemble of {args.ensemble} runs: final models "
            f"{lds(torch.stack(finals).mean(0), s.subsets, s.truth):.3f}, checkpoints "
            f"{fracs} {lds(torch.stack(schemes).mean(0), s.subsets, s.truth):.3f}"
        )
        if args.truth_seeds:
            print(f"\n{name} against truths of more retrainings per subset (checkpoints {fracs})")
            print(
                "| truth seeds | final model | one run's checkpoints | ensemble final models "
                "| ensemble checkpoints |"
            )
            print("|---|---|---|---|---|")
        for seeds in [int(v) for v in args.truth_seeds.split(",") if v]:
            t = settings.load(name, seeds=seeds, cache_dir=args.cache_dir, smoke=args.smoke)
            ensembles = [torch.stack(finals).mean(0), torch.stack(schemes).mean(0)]
            cells = [finals[0], schemes[0], *ensembles]
            values = " | ".join(f"{lds(c, t.subsets, t.truth):.3f}" for c in cells)
            print(f"| {seeds} | {values} |")


if __name__ == "__main__":
    main()
