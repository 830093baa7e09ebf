"""Layer importance across model families, and the default score chosen leave-one-family-out.

Trains 13 models on offline data — MLPs of depth 2–8 and width 16–256, CNNs with BatchNorm,
residual MLPs, small transformers (the pointer task of benchmarks/layer_importance.py) — scores
every layer with `attribution.layer_importance` on 256 held-out samples, and measures two truths
on the rest of the held-out data:

- `loss_increase`: the loss increase when the layer is re-initialised (mean of `TRUTH_SEEDS`
  redraws, `attribution.layer_validation.reinit_damage`); its reliability is the Spearman ρ
  between the means of the first and the second half of the redraws (a ceiling for the scores);
- `prune_finetune`: the loss increase that remains when the layer's parameters are zeroed and
  frozen and every other parameter is fine-tuned for `FT_STEPS` Adam steps (lr 1e-3) on the
  training data, against the model fine-tuned the same way with nothing pruned.

Prints each score's Spearman ρ per model and truth, its mean and worst model, and the
leave-one-family-out choice for each truth (and for both averaged): for each family, the score
with the best worst-family mean ρ on the other families, and its ρ on the held-out family. The
per-model ρ are saved to results/layer_families.json; `--cached` re-prints the tables from it.

`--held-out` runs instead eight models of two families that no choice reads (added after the
default was fixed): one-dimensional CNNs on the generated majority task and MLPs with GELU / SiLU
on generated tabular data (the data of benchmarks/nas/spaces.py's held-out spaces), and prints
the same tables without a choice, the code default's figures beside every other score's
(results/layer_families_held_out.json).

    python benchmarks/layer_families.py            # ≈ 10 min on the shared 2-core machine
    python benchmarks/layer_families.py --cached   # the tables of the last full run
    python benchmarks/layer_families.py --held-out [--cached]   # ≈ 3 min
    python benchmarks/layer_families.py --smoke    # two tiny models, seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from layer_importance import DigitsCNN, Transformer, pointer_task
from nas.spaces import HELD_OUT_SPACES, ConvNet1d, SynthMLP
from scipy.stats import spearmanr
from torch import nn

from attribution import layer_importance
from attribution.layer_validation import reinit_damage
from attribution.layers import DEFAULT_SCORE, SCORES, layer_groups
from ntk import demo

N_SCORE = 256
FT_STEPS = 50
# Redraws per layer for the re-initialisation truth. With 3 (the first run) the two halves of a
# 6-redraw truth agreed only at ρ 0.79 on the MLPs (hidden layers sit near chance-level loss
# after any redraw, so their order is seed noise), 0.97–0.99 on the other families; with 10 the
# MLPs' split-half reliability was 0.90, with 20 it is 0.94 (results/nas.md).
TRUTH_SEEDS = 20
TRUTH_NAMES = ("loss_increase", "prune_finetune")
CRITERIA = (("loss_increase",), ("prune_finetune",), TRUTH_NAMES)
CACHE = Path(__file__).parent / "results" / "layer_families.json"
HELD_OUT_CACHE = CACHE.with_name("layer_families_held_out.json")
RELIABILITY = "truth reliability"  # a row of each model's table: the truth's split-half ρ


class CNNBN(nn.Sequential):
    def __init__(self, channels):
        layers, c_in = [nn.Unflatten(1, (1, 8, 8))], 1
        for c in channels:
            layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()]
            c_in = c
        super().__init__(*layers, nn.Flatten(), nn.Linear(c_in * 64, 10))


class ResBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm, self.fc1, self.fc2 = (
            nn.LayerNorm(width),
            nn.Linear(width, width),
            nn.Linear(width, width),
        )

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class ResMLP(nn.Sequential):
    def __init__(self, width, blocks):
        super().__init__(
            nn.Linear(64, width), *[ResBlock(width) for _ in range(blocks)], nn.Linear(width, 10)
        )


def setups(smoke=False):
    """(family, name, factory, epochs, data)."""
    d = demo.digits()
    digits = (d.x_train, d.y_train, d.x_test, d.y_test)
    if smoke:
        yield "mlp", "mlp-d2-w16", lambda: demo.mlp(16, 2), 2, digits
        yield "resnet", "res-w16-b1", lambda: ResMLP(16, 1), 2, digits
        return
    for depth, width in ((2, 16), (3, 256), (4, 64), (6, 128), (8, 32)):
        yield "mlp", f"mlp-d{depth}-w{width}", lambda d=depth, w=width: demo.mlp(w, d), 30, digits
    for ch in ((8, 16), (16, 32, 32), (4, 8, 8, 8)):
        yield "cnn-bn", f"cnn-bn-{'x'.join(map(str, ch))}", lambda c=ch: CNNBN(c), 10, digits
    yield "cnn-bn", "cnn-pool", DigitsCNN, 20, digits
    for width, blocks in ((32, 2), (64, 4), (128, 3)):
        yield (
            "resnet",
            f"res-w{width}-b{blocks}",
            lambda w=width, b=blocks: ResMLP(w, b),
            20,
            digits,
        )
    x_tr, y_tr = pointer_task(2000, 0)
    x_te, y_te = pointer_task(1000, 1)
    seq = (x_tr, y_tr, x_te, y_te)
    yield "transformer", "transformer-w32", Transformer, 8, seq
    yield "transformer", "transformer-w16", lambda: Transformer(width=16), 10, seq


def held_out_setups():
    """(family, name, factory, epochs, data) of the families no choice reads."""
    for family, space, models, epochs in (
        (
            "conv1d",
            "seq_conv",
            {
                "conv1d-w32-d3-res-bn": lambda: ConvNet1d(32, 3, 3, True, "bn", "relu", "mean"),
                "conv1d-w16-d4-gn-max": lambda: ConvNet1d(16, 4, 5, False, "gn", "gelu", "max"),
                "conv1d-w8-d2-tanh": lambda: ConvNet1d(8, 2, 3, False, "none", "tanh", "mean"),
                "conv1d-w32-d2-res-gn-max": lambda: ConvNet1d(32, 2, 5, True, "gn", "relu", "max"),
            },
            10,
        ),
        (
            "synth-mlp",
            "synth_mlp",
            {
                "synth-w64-d4-ln-gelu": lambda: SynthMLP(64, 4, "ln", "gelu", False),
                "synth-w128-d3-bn-silu-res": lambda: SynthMLP(128, 3, "bn", "silu", True),
                "synth-w32-d6-relu-res": lambda: SynthMLP(32, 6, "none", "relu", True),
                "synth-w128-d2-ln-tanh": lambda: SynthMLP(128, 2, "ln", "tanh", False),
            },
            30,
        ),
    ):
        data = HELD_OUT_SPACES[space]()
        split = (data.x_train, data.y_train, data.x_val, data.y_val)
        for name, factory in models.items():
            yield family, name, factory, epochs, split


def prune_finetune(model, x_tr, y_tr, x_ev, y_ev, steps=FT_STEPS):
    """{row: loss increase on (x_ev, y_ev) after zeroing and freezing the row and fine-tuning
    the rest for `steps`, against fine-tuning with nothing pruned}."""

    def finetune(layer):
        net = copy.deepcopy(model).train()
        if layer is not None:
            with torch.no_grad():
                for p in net.get_submodule(layer).parameters(recurse=False):
                    p.zero_()
                    p.requires_grad_(False)
        opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-3)
        g = torch.Generator().manual_seed(0)
        for _ in range(steps):
            idx = torch.randint(0, len(y_tr), (64,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(net(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
        with torch.no_grad():
            return float(nn.functional.cross_entropy(net.eval()(x_ev), y_ev))

    base = finetune(None)
    return {
        row: {"prune_finetune": float(np.mean([finetune(layer) for layer in layers])) - base}
        for row, layers in layer_groups(model).items()
    }


def run(smoke=False, held_out=False):
    """{model: (family, {score: {truth: ρ}})}."""
    out = {}
    models = held_out_setups() if held_out else setups(smoke)
    for family, name, factory, epochs, (x_tr, y_tr, x_te, y_te) in models:
        start = time.perf_counter()
        torch.manual_seed(0)
        model = demo.train(factory(), x_tr, y_tr, epochs=epochs)
        x_s, y_s, x_ev, y_ev = x_te[:N_SCORE], y_te[:N_SCORE], x_te[N_SCORE:], y_te[N_SCORE:]
        rows = layer_importance(model, x_s, y_s)
        seeds = list(range(100, 100 + TRUTH_SEEDS))
        halves = [
            reinit_damage(model, x_ev, y_ev, seeds=part)
            for part in (seeds[: TRUTH_SEEDS // 2], seeds[TRUTH_SEEDS // 2 :])
        ]
        truths = {
            row: {"loss_increase": (a["loss_increase"] + b["loss_increase"]) / 2}
            for (row, a), b in zip(halves[0].items(), halves[1].values())
        }
        reliability = float(
            spearmanr(
                [halves[0][r]["loss_increase"] for r in truths],
                [halves[1][r]["loss_increase"] for r in truths],
            )[0]
        )
        for row, v in prune_finetune(
            model, x_tr, y_tr, x_ev, y_ev, 5 if smoke else FT_STEPS
        ).items():
            truths[row].update(v)
        table = {}
        for score in SCORES:
            table[score] = {}
            for t in TRUTH_NAMES:
                pairs = [(r[score], truths[r["layer"]][t]) for r in rows if r[score] is not None]
                ok = len(pairs) >= 3 and len({a for a, _ in pairs}) > 1
                table[score][t] = float(spearmanr(*zip(*pairs))[0]) if ok else None
        table[RELIABILITY] = {"loss_increase": reliability, "prune_finetune": None}
        out[name] = (family, table)
        print(
            f"# {name}: {len(rows)} layers, truth reliability {reliability:.2f}, "
            f"accuracy {demo.accuracy(model, x_te, y_te):.3f}, "
            f"{time.perf_counter() - start:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return out


def value(table, score, truths):
    """Mean ρ over `truths` (None if any is undefined)."""
    v = [table[score][t] for t in truths]
    return None if None in v else float(np.mean(v))


def family_means(results, score, families, truths):
    """{family: mean over its models of ρ on `truths`} (None if undefined anywhere)."""
    out = {}
    for f in families:
        vals = [value(t, score, truths) for fam, t in results.values() if fam == f]
        out[f] = None if None in vals or not vals else float(np.mean(vals))
    return out


def choose(results, families, truths):
    """The score with the best worst-family mean ρ over `families` (ties: best mean)."""
    ok = {}
    for s in SCORES:
        m = family_means(results, s, families, truths)
        if None not in m.values():
            ok[s] = (min(m.values()), float(np.mean(list(m.values()))))
    return max(ok, key=ok.get)


def report(results, choose_default=True):
    models = list(results)
    families = list(dict.fromkeys(f for f, _ in results.values()))
    rows = [
        *SCORES,
        *([RELIABILITY] if all(RELIABILITY in t for _, t in results.values()) else []),
    ]
    for t in TRUTH_NAMES:
        print(f"\nSpearman ρ: score vs {t}")
        print("| score | " + " | ".join(models) + " | mean | worst |")
        print("|---|" + "---|" * (len(models) + 2))
        for s in rows:
            v = [results[m][1][s][t] for m in models]
            got = [x for x in v if x is not None]
            cells = " | ".join("–" if x is None else f"{x:+.2f}" for x in v)
            tail = f"{np.mean(got):+.2f} | {min(got):+.2f}" if got else "– | –"
            print(f"| {s} | {cells} | {tail} |")
    for truths in CRITERIA:
        label = " and ".join(truths)
        print(f"\nPer family, mean over models of ρ on {label}")
        print("| score | " + " | ".join(families) + " | mean | worst family |")
        print("|---|" + "---|" * (len(families) + 2))
        for s in rows:
            m = family_means(results, s, families, truths)
            if None not in m.values():
                print(
                    f"| {s} | "
                    + " | ".join(f"{m[f]:+.2f}" for f in families)
                    + f" | {np.mean(list(m.values())):+.2f} | {min(m.values()):+.2f} |"
                )
        if not choose_default:
            m = family_means(results, DEFAULT_SCORE, families, truths)
            best = choose(results, families, truths)
            print(
                f"{label}: code default {DEFAULT_SCORE} mean ρ {np.mean(list(m.values())):+.3f}, "
                f"worst family {min(m.values()):+.3f}; best here (not a choice): {best}"
            )
            continue
        if len(families) < 2:
            continue
        print(f"\nLeave-one-family-out on {label} (chosen by best worst-family mean ρ)")
        print("| held-out family | chosen | ρ held-out |")
        print("|---|---|---|")
        held = []
        for f in families:
            pick = choose(results, [g for g in families if g != f], truths)
            held.append(family_means(results, pick, [f], truths)[f])
            print(f"| {f} | {pick} | {held[-1]:+.2f} |")
        print(
            f"{label}: held-out mean ρ {np.mean(held):+.3f}, worst family {min(held):+.3f}; "
            f"chosen on all families: {choose(results, families, truths)}; "
            f"code default: {DEFAULT_SCORE}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--cached", action="store_true", help="re-print the last full run")
    parser.add_argument("--held-out", action="store_true", help="the families no choice reads")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    cache = HELD_OUT_CACHE if args.held_out else CACHE
    if args.cached:
        results = json.loads(cache.read_text())
    else:
        results = run(args.smoke, args.held_out)
        if not args.smoke:
            cache.write_text(json.dumps(results, indent=1) + "\n")
    report(results, choose_default=not args.held_out)
    print(f"\n# total {time.perf_counter() - start:.0f} s")
