"""Score every architecture of `space.py` with every proxy of `ntk.proxies` and compare the
rankings with the ground truth in ground_truth.json (made by ground_truth.py).

Each proxy sees only the digits training split, `--repeats` random batches (of
`proxies.DEFAULT_BATCH_SIZE` samples, `proxies.score`'s default) and fresh initialisations
(seeds 0, 1, 2, ...), and reports the mean; by default as many repeats as `proxies.score`
averages (`proxies.DEFAULT_REPEATS`). Columns: Kendall τ and Spearman ρ with the mean
validation accuracy, the median time per architecture (all repeats), and how many of the 10
best architectures by accuracy are among the proxy's 10 best. "vote" rows order the
architectures by their mean rank under two proxies (`proxies.mean_rank`); the held-out lines
check that choosing a metric or a pair on half of the architectures carries over to the other
half.

    python benchmarks/nas/score.py [--repeats N] [--only lga,params]  # 6–10 min (3 × 64, 12-02)
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import kendalltau, spearmanr
from space import space

from ntk import demo, proxies

WARMUP = 16  # ≈ one epoch of minibatches of 64 on 1,000 samples: Mok et al.'s "minimal training"
PROXIES = {m: {"metric": m} for m in proxies.METRICS}
PROXIES["lga (trace kernel)"] = {"metric": "lga", "kind": "trace"}
PROXIES["condition_number (trace kernel)"] = {"metric": "condition_number", "kind": "trace"}
PROXIES[f"lga after {WARMUP} steps"] = {"metric": "lga", "warmup_steps": WARMUP}
PROXIES[f"condition_number after {WARMUP} steps"] = {
    "metric": "condition_number",
    "warmup_steps": WARMUP,
}
VOTES = [("lga", "naswot"), ("lga", "jacob_cov"), ("naswot", "jacob_cov")]  # proxies.mean_rank


def accuracy_after_one_epoch(factory, data, repeats):
    """Reference, not a proxy: validation accuracy after one epoch of the ground truth's recipe
    (different seeds from the ground truth)."""
    accs = []
    for r in range(repeats):
        torch.manual_seed(100 + r)
        model = demo.train(factory(), data.x_train, data.y_train, epochs=1, lr=1e-3, seed=100 + r)
        accs.append(demo.accuracy(model, data.x_test, data.y_test))
    return float(np.mean(accs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=proxies.DEFAULT_REPEATS,
        help="repeats averaged (default: %(default)s, proxies.DEFAULT_REPEATS)",
    )
    parser.add_argument("--only", default=None, help="comma-separated proxy names")
    args = parser.parse_args()
    torch.set_num_threads(1)
    truth = json.loads(Path(__file__).with_name("ground_truth.json").read_text())
    archs = truth["architectures"]
    data = demo.digits(n_train=truth["budget"]["n_train"])
    candidates = space()
    names = list(candidates)
    accuracy = np.array([archs[n]["mean"] for n in names])
    selected = PROXIES if args.only is None else {k: PROXIES[k] for k in args.only.split(",")}

    rows, measured = [], {}
    for label, options in {**selected, "accuracy after 1 epoch": None}.items():
        if options is None and args.only is not None:
            continue
        values, seconds = [], []
        for name in names:
            start = time.perf_counter()
            if options is None:
                values.append(accuracy_after_one_epoch(candidates[name], data, args.repeats))
            else:
                values.append(
                    proxies.score(
                        candidates[name],
                        data.x_train,
                        data.y_train,
                        repeats=args.repeats,
                        **options,
                    )
                )
            seconds.append(time.perf_counter() - start)
        measured[label] = (np.array(values), np.array(seconds))
        rows.append(row(label, *measured[label], accuracy))
        print(f"  {label}: τ {rows[-1][1]:+.3f}", flush=True)
    for pair in VOTES:
        if all(m in measured for m in pair):
            votes = proxies.mean_rank([measured[m][0] for m in pair])
            rows.append(
                row(f"vote: {' + '.join(pair)}", votes, sum(measured[m][1] for m in pair), accuracy)
            )

    ceiling = truth["ceiling"]
    print(
        f"\n{len(names)} architectures, {args.repeats} repeats × {proxies.DEFAULT_BATCH_SIZE} "
        "samples; ground truth: mean "
        f"validation accuracy over {len(truth['seeds'])} seeds "
        f"({truth['budget']['epochs']} epochs of Adam)"
    )
    print(f"| {'proxy':38s} | Kendall τ | Spearman ρ | ms / arch | top-10 overlap |")
    print(f"|{'-' * 40}|-----------|------------|-----------|----------------|")
    for label, tau, rho, ms, top in rows:
        print(f"| {label:38s} | {tau:+9.3f} | {rho:+10.3f} | {ms:9.1f} | {top:>11d}/10 |")
    print(
        f"| {'seed-to-seed ceiling (one run vs one)':38s} | {ceiling['kendall_tau']:+9.3f} | "
        f"{ceiling['spearman_rho']:+10.3f} |           |                |"
    )
    singles = {m: measured[m][0] for m in proxies.METRICS if m in measured}
    if len(singles) > 2:
        held_out(singles, accuracy)


def row(label, values, seconds, accuracy):
    """(label, Kendall τ, Spearman ρ, median ms per architecture, top-10 overlap); an
    undefined (NaN) score ranks last."""
    values = np.nan_to_num(np.asarray(values, dtype=float), nan=-np.inf)
    best = set(np.argsort(-accuracy)[:10])
    top = set(np.argsort(-values, kind="stable")[:10])
    return (
        label,
        kendalltau(values, accuracy)[0],
        spearmanr(values, accuracy)[0],
        1000 * float(np.median(seconds)),
        len(best & top),
    )


def held_out(singles, accuracy, splits=200):
    """Is a vote better than one metric, or just picked after the fact? On random halves of the
    architectures choose the best single metric and the best pair by τ; report τ on the other
    half (median over splits)."""
    rng = np.random.default_rng(0)
    pairs = list(itertools.combinations(singles, 2))
    tau = lambda v, i: kendalltau(np.nan_to_num(v[i], nan=-np.inf), accuracy[i])[0]  # noqa: E731
    chosen_single, chosen_pair = [], []
    for _ in range(splits):
        perm = rng.permutation(len(accuracy))
        a, b = perm[: len(perm) // 2], perm[len(perm) // 2 :]
        single = max(singles, key=lambda m: tau(singles[m], a))
        votes = {p: proxies.mean_rank([singles[m] for m in p]) for p in pairs}
        pair = max(pairs, key=lambda p: tau(votes[p], a))
        chosen_single.append((single, tau(singles[single], b)))
        chosen_pair.append((" + ".join(pair), tau(votes[pair], b)))
    for what, picks in (("single metric", chosen_single), ("pair vote", chosen_pair)):
        names, taus = zip(*picks)
        common = max(set(names), key=names.count)
        print(
            f"held-out: best {what} chosen on half the architectures scores τ "
            f"{np.median(taus):+.3f} (median; IQR {np.percentile(taus, 25):+.3f} … "
            f"{np.percentile(taus, 75):+.3f}) on the other half; most often {common} "
            f"({names.count(common)}/{splits})"
        )


if __name__ == "__main__":
    main()
