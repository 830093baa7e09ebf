"""How many repeats `proxies.score` and `proxies.rank` average by default.

Every default candidate of compare.py (the metrics defined for every model input, on 64 and 256
samples) is scored with REPEATS fresh initialisations and random batches on the five NAS spaces
(compare.py's four and NAS-Bench-201 as nb201.py builds it), keeping each repeat's value (cached
in repeats_<space>.json, a label as it goes, candidate by candidate under "partial", by name, so
that a run cut short resumes where it stopped). The score of a candidate over r repeats is the
mean of its first r values, which is what `proxies.score(..., repeats=r)` returns (repeat i uses
seed i).

Printed: Kendall τ of the defaults as coded (`proxies.DEFAULT` on DEFAULT_BATCH_SIZE samples for
`score`, the vote `proxies.DEFAULT_RANKING` on RANKING_BATCH_SIZE for `rank`) per space for
r = 1 … REPEATS; the leave-one-space-out choice of r for each (compare.py's rule: best
worst-space τ on the other spaces, ties by the mean); and the same rule over (candidate, r)
jointly, to see whether the metric chosen at compare.py's 2 repeats still wins; and that joint
rule's held-out τ from the pool without and with compare.JUDGED's metrics, which keeps them
out of the pool (compare.OUTSIDE_POOL) when they lower the held-out worst. `--rescore-batchnorm`
recomputes the cached values of the architectures holding a BatchNorm.

    python benchmarks/nas/repeats.py [--cached] [--rescore-batchnorm] [--spaces digits_mlp,...]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial

import numpy as np
import torch
from compare import (
    HERE,
    JUDGED,
    LARGE,
    OUTSIDE_POOL,
    SMALL,
    SPACE_NAMES,
    batch_sizes,
    choose,
    leave_one_out,
    load,
    proxy_label,
    rescore_batchnorm,
)
from nb201 import CELLS, CHANNELS, NB201Net, digits32, ops_of

from ntk import proxies

REPEATS = 4
SPACES = (*SPACE_NAMES, "nb201")
METRICS = [m for m in proxies.METRICS if m not in proxies.FLOAT_INPUT_METRICS]
LABELS = {  # label → recipe
    proxy_label(m, b): (m, b) for b in (SMALL, LARGE) for m in METRICS if b in batch_sizes(m)
}


def load_space(name: str):
    """(candidates, x, y, accuracies) of one space; NAS-Bench-201 as nb201.py scores it."""
    if name != "nb201":
        cands, x, y, acc, _ = load(name)
        return cands, x, y, np.asarray(acc, dtype=float)
    truth = json.loads((HERE / "truth_nb201.json").read_text())
    keys = list(truth["architectures"])
    cands = {k: partial(NB201Net, ops_of(k), CHANNELS, CELLS) for k in keys}
    acc = np.array([truth["architectures"][k]["mean"] for k in keys])
    return (cands, *digits32(), acc)


def score_repeats(cands, x, y, metric: str, batch: int, done=None, save=None) -> list:
    """Each candidate's REPEATS per-repeat values (NaN where the metric fails), in the order of
    `cands`. done: {candidate: values} of those already scored (by a run cut short; only the
    others are scored); save(done) is called after each candidate, with every value so far."""
    done = dict(done or {})
    for name, factory in cands.items():
        if name in done:
            continue
        try:
            details = proxies.score(
                factory,
                x,
                y,
                metric=metric,
                batch_size=batch,
                repeats=REPEATS,
                return_details=True,
            )
            done[name] = [float(v) for v in details.values]
        except (ValueError, RuntimeError):  # e.g. a singular kernel: ranks last
            done[name] = [float("nan")] * REPEATS
        if save is not None:
            save(done)
    return [done[name] for name in cands]


def rescore(cands, x, y, labels) -> dict:
    """{label: [[value per repeat] per candidate]} of the labels of LABELS among `labels`."""
    return {
        label: score_repeats(cands, x, y, *LABELS[label]) for label in labels if label in LABELS
    }


def scored(name: str, cached_only: bool, batchnorm=False) -> tuple[dict, np.ndarray]:
    """{label: [[value per repeat] per architecture]} for every candidate, and the accuracies
    (batchnorm: first recompute the cached values of the architectures holding a BatchNorm). A
    label being scored is cached after each candidate (under "partial"), so that a run cut
    short resumes at the next one."""
    cands, x, y, acc = load_space(name)
    path = HERE / f"repeats_{name}.json"
    cache = json.loads(path.read_text()) if path.exists() else {}
    if cache.get("architectures") != list(cands) or cache.get("repeats") != REPEATS:
        cache = {"repeats": REPEATS, "architectures": list(cands), "scores": {}}
    unfinished = cache.pop("partial", {})  # label → {candidate: values} of those scored so far

    def write():
        path.write_text(
            json.dumps({**cache, "partial": unfinished} if unfinished else cache) + "\n"
        )

    def save(label, values):
        unfinished[label] = values
        write()

    if batchnorm and cache["scores"]:
        start = time.perf_counter()
        names = rescore_batchnorm(cache["scores"], cands, x, y, rescore)
        if names:
            write()
        print(
            f"  {name}: rescored {len(names)} architectures holding a BatchNorm in "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        )
    for label, (metric, batch) in LABELS.items():
        if label in cache["scores"] or cached_only:
            continue
        start = time.perf_counter()
        done = unfinished.get(label, {})
        cache["scores"][label] = score_repeats(
            cands, x, y, metric, batch, done, partial(save, label)
        )
        unfinished.pop(label, None)
        write()
        print(
            f"  {name}: {label} in {time.perf_counter() - start:.0f} s"
            + (f" (resumed after {len(done)} candidates)" if done else ""),
            flush=True,
        )
    return cache["scores"], acc


def means(per_repeat: dict, r: int) -> dict:
    """{label: mean of the first r repeats per architecture}."""
    return {label: np.asarray(v, dtype=float)[:, :r].mean(1) for label, v in per_repeat.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spaces", default=",".join(SPACES), help="comma-separated")
    parser.add_argument("--cached", action="store_true", help="report the caches, score nothing")
    parser.add_argument(
        "--rescore-batchnorm",
        action="store_true",
        help="recompute the cached values of the architectures holding a BatchNorm",
    )
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data, accs = {}, {}
    for name in args.spaces.split(","):
        data[name], accs[name] = scored(name, args.cached, args.rescore_batchnorm)
    spaces = list(data)
    # τ of every candidate (single metrics and votes) per number of repeats and space, by the
    # metrics left out of the pool: as coded (OUTSIDE_POOL), without compare.JUDGED's metrics and
    # with them (the dict computes each distinct pool once; the coded one is one of the others)
    by_pool: dict[tuple, dict] = {OUTSIDE_POOL: {}, JUDGED: {}, (): {}}
    for r in range(1, REPEATS + 1):
        scores = {s: means(data[s], r) for s in spaces}
        for what, votes in (("score", False), ("rank", True)):
            for outside, table in by_pool.items():
                t = leave_one_out(scores, accs, votes, outside=outside)[2]
                table.update({(what, c, r): t[c] for c in t})
    taus, narrow, wider = by_pool[OUTSIDE_POOL], by_pool[JUDGED], by_pool[()]
    code = {
        "score": proxy_label(proxies.DEFAULT, proxies.DEFAULT_BATCH_SIZE),
        "rank": proxy_label(" + ".join(proxies.DEFAULT_RANKING), proxies.RANKING_BATCH_SIZE),
    }
    coded_repeats = {"score": proxies.DEFAULT_REPEATS, "rank": proxies.RANKING_REPEATS}
    for what, label in code.items():
        print(f"\n{what} default as coded: {label}, {coded_repeats[what]} repeats")
        print(f"| repeats | {' | '.join(spaces)} | worst | mean |")
        print("|---|" + "---|" * (len(spaces) + 2))
        by_r = {r: taus[what, label, r] for r in range(1, REPEATS + 1)}
        for r, t in by_r.items():
            row = [t[s] for s in spaces]
            print(
                f"| {r} | "
                + " | ".join(f"{v:+.3f}" for v in row)
                + f" | {min(row):+.3f} | {np.mean(row):+.3f} |"
            )
        if len(spaces) < 2:
            continue
        print(f"\nLeave-one-space-out over the repeats ({label}) and over (candidate, repeats)")
        print(
            "| held-out space | repeats chosen | τ held-out "
            "| (candidate, repeats) chosen | τ held-out |"
        )
        print("|---|---|---|---|---|")
        joint = jointly(taus, what)
        repeats_picks, picks = held_out(by_r, spaces), held_out(joint, spaces)
        for held in spaces:
            r, pick = repeats_picks[held], picks[held]
            print(
                f"| {held} | {r} | {by_r[r][held]:+.3f} | {pick[0]}, {pick[1]} | "
                f"{joint[pick][held]:+.3f} |"
            )
        r_all, pick_all = choose(by_r, spaces), choose(joint, spaces)
        print(
            f"chosen on all spaces: {r_all} repeats (worst τ {min(by_r[r_all].values()):+.3f}); "
            f"jointly {pick_all[0]} with {pick_all[1]} repeats "
            f"(worst τ {min(joint[pick_all].values()):+.3f})"
        )
    if len(spaces) > 1:
        pools(narrow, wider, spaces)
        for metric in JUDGED:  # a label missing on one space is no candidate of either pool
            unscored = [s for s in spaces if proxy_label(metric, SMALL) not in data[s]]
            if unscored:
                print(
                    f"{metric} is not scored on {', '.join(unscored)}: no candidate of either "
                    "pool, so not judged yet"
                )


def jointly(taus: dict, what: str) -> dict:
    """{(candidate, repeats): τ per space} of one default ("score" or "rank")."""
    return {(c, r): t for (w, c, r), t in taus.items() if w == what}


def held_out(table: dict, spaces: list) -> dict:
    """{space: the key of `table` the rule chooses on the other spaces}."""
    return {held: choose(table, [s for s in spaces if s != held]) for held in spaces}


def pools(narrow: dict, wider: dict, spaces: list) -> None:
    """The joint rule's held-out τ per space from the pool without and with compare.JUDGED."""
    print(f"\nThe pool: the joint rule without and with {', '.join(JUDGED)} as candidates")
    print("| held-out space | what | pool | (candidate, repeats) chosen | τ held-out |")
    print("|---|---|---|---|---|")
    for what in ("score", "rank"):
        worst = {}
        for pool, table in (("without", narrow), ("with", wider)):
            joint = jointly(table, what)
            held = {}
            for space, pick in held_out(joint, spaces).items():
                held[space] = joint[pick][space]
                print(f"| {space} | {what} | {pool} | {pick[0]}, {pick[1]} | {held[space]:+.3f} |")
            worst[pool] = min(held.values())
        print(
            f"pool for {what}: held-out worst τ {worst['without']:+.3f} without, "
            f"{worst['with']:+.3f} with"
        )


if __name__ == "__main__":
    main()
