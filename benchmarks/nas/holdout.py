"""The NAS defaults as coded in `ntk.proxies`, checked on spaces never used to choose them.

compare.py, nb201.py and repeats.py choose `score`'s and `rank`'s defaults by leave-one-space-out
over five spaces; a held-out fold there still saw the other four spaces while the rules and the
pool were being drawn up. The spaces of `spaces.HELD_OUT_SPACES` (a 1-D CNN space on a generated
sequence task, an MLP space on generated tabular data; truths by ground_truth_spaces.py) were
added after the defaults were fixed and are read by nothing that chooses. Per space, Kendall τ,
Spearman ρ and the top-k overlap (k = max(3, n/10)) of

- `score`'s default: `proxies.score(factory, x, y)` with every default;
- `rank`'s default: `proxies.rank(candidates, x, y)` with every default;
- every metric of `proxies.METRICS` on 64 and 256 samples with 2 repeats (compare.SMALL_ONLY's
  on 64 only), as compare.py scores the five spaces (the zero-cost baselines among them).

Scores are cached in scores_<space>.json; the defaults' labels carry their settings, so a
changed default is scored afresh. `--rescore-batchnorm` recomputes the entries of the architectures
holding a BatchNorm (and `rank`'s whole column: its mean ranks are relative to every candidate).

    python benchmarks/nas/holdout.py [--rescore | --rescore-batchnorm]  # 10–15 min, then seconds
    python benchmarks/nas/holdout.py --smoke       # 6 architectures, 1 repeat, no cache
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from compare import (
    PROXIES,
    SMALL,
    batch_sizes,
    load,
    metrics,
    proxy_label,
    rescore_batchnorm,
    score_space,
)
from spaces import HELD_OUT_SPACES

from ntk import proxies

HERE = Path(__file__).parent
REPEATS = 2  # as compare.py scores every metric
SCORE_DEFAULT = (
    f"score default: {proxies.DEFAULT} ({proxies.DEFAULT_KIND}, {proxies.DEFAULT_BATCH_SIZE} "
    f"samples, {proxies.DEFAULT_REPEATS} repeats)"
)
RANK_DEFAULT = (
    f"rank default: {' + '.join(proxies.DEFAULT_RANKING)} ({proxies.RANKING_BATCH_SIZE} samples, "
    f"{proxies.RANKING_REPEATS} repeats)"
)
SINGLES = [label for label, options in PROXIES.items() if set(options) == {"metric", "batch_size"}]
SMOKE = [proxy_label(m, SMALL) for m in ("naswot", "params")]


def score_defaults(cands, x, y, repeats=None, only=(SCORE_DEFAULT, RANK_DEFAULT)) -> dict:
    """The two defaults' scores per candidate (repeats: override both defaults' repeats; only:
    the defaults' labels to score)."""
    more = {} if repeats is None else {"repeats": repeats}
    out = {}
    if SCORE_DEFAULT in only:
        out[SCORE_DEFAULT] = [proxies.score(f, x, y, **more) for f in cands.values()]
    if RANK_DEFAULT in only:
        ranked = dict(proxies.rank(cands, x, y, **more))
        out[RANK_DEFAULT] = [ranked[n] for n in cands]
    return out


def rescore(cands, x, y, labels) -> dict:
    """The scores of `labels` per candidate by the recipe of the cache (rank's default apart:
    its ranks are relative to the candidates given)."""
    return {
        **score_defaults(cands, x, y, only=[SCORE_DEFAULT] if SCORE_DEFAULT in labels else []),
        **score_space(cands, x, y, [p for p in labels if p in SINGLES], REPEATS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rescore", action="store_true")
    parser.add_argument(
        "--rescore-batchnorm",
        action="store_true",
        help="recompute the cached entries of the architectures holding a BatchNorm",
    )
    parser.add_argument("--smoke", action="store_true", help="6 architectures, 1 repeat, no cache")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tables = {}
    for name in HELD_OUT_SPACES:
        cands, x, y, acc, ceiling = load(name)
        if args.smoke:
            keep = list(cands)[:: max(1, len(cands) // 6)][:6]
            acc = acc[[list(cands).index(n) for n in keep]]
            cands = {n: cands[n] for n in keep}
            scores = {**score_defaults(cands, x, y, 1), **score_space(cands, x, y, SMOKE, 1)}
        else:
            cache = HERE / f"scores_{name}.json"
            cached = {} if args.rescore or not cache.exists() else json.loads(cache.read_text())
            scores = cached.get("scores", {})
            if args.rescore_batchnorm and scores:
                if cached["architectures"] != list(cands):
                    raise SystemExit(f"{cache.name} holds other architectures; use --rescore")
                kept = (SCORE_DEFAULT, RANK_DEFAULT, *SINGLES)
                scores = {p: v for p, v in scores.items() if p in kept}
                names = rescore_batchnorm(scores, cands, x, y, rescore)
                if names:  # rank's mean ranks are relative to every candidate: all of them
                    scores.update(score_defaults(cands, x, y, only=[RANK_DEFAULT]))
                print(f"{name}: rescored {len(names)} architectures holding a BatchNorm")
            if any(d not in scores for d in (SCORE_DEFAULT, RANK_DEFAULT)):
                scores.update(score_defaults(cands, x, y))
            missing = [p for p in SINGLES if p not in scores]
            if missing:
                scores.update(score_space(cands, x, y, missing, REPEATS))
            cache.write_text(
                json.dumps({"repeats": REPEATS, "architectures": list(cands), "scores": scores})
                + "\n"
            )
        tables[name] = {label: metrics(v, acc) for label, v in scores.items()}
        print(f"\n{name}: {len(acc)} architectures, seed-to-seed ceiling τ {ceiling:.3f}")
        print("| proxy | Kendall τ | Spearman ρ | top-k overlap |")
        print("|---|---|---|---|")
        for label, (tau, rho, top, k) in sorted(tables[name].items(), key=lambda t: -t[1][0]):
            print(f"| {label} | {tau:+.3f} | {rho:+.3f} | {top}/{k} |")
    baselines = [
        proxy_label(m, b)
        for m in (*proxies.BASELINE_METRICS, *proxies.TRAINING_METRICS)
        for b in batch_sizes(m)
    ]
    print("\nWorst held-out space (Kendall τ)")
    for label in (SCORE_DEFAULT, RANK_DEFAULT, *[b for b in baselines if b in SINGLES]):
        if all(label in t for t in tables.values()):
            taus = {s: t[label][0] for s, t in tables.items()}
            worst = min(taus, key=taus.get)
            per = ", ".join(f"{s} {v:+.3f}" for s, v in taus.items())
            print(f"{label}: worst {worst} {taus[worst]:+.3f} ({per})")


if __name__ == "__main__":
    main()
