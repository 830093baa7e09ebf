"""Does a layer's eNTK score predict what happens when the layer is ablated?

Trains small models on offline data (digits MLPs with 2, 3 and 4 hidden layers, a CNN on the 8×8
digit images, a 3-block transformer on a synthetic pointer task, scored per layer and per block),
scores every layer with `attribution.layer_importance` (eNTK scores and cheap baselines) on 256
held-out samples, and measures two ground truths on the rest of the held-out data:
re-initialising the layer (loss increase, accuracy drop; mean of 3 seeds) and fine-tuning the
layer alone vs leaving it frozen on a shifted task (inputs translated by one pixel / one
position). Prints Spearman ρ of each score against each ground truth, per model and averaged.

    python benchmarks/layer_importance.py
"""

from __future__ import annotations

import platform
import sys
import time

import numpy as np
import torch
from torch import nn

from attribution import layer_importance
from attribution.layer_validation import TRUTHS, agreement, finetune_gain, reinit_damage
from attribution.layers import SCORES
from ntk import demo

N_SCORE = 256


class DigitsCNN(nn.Module):
    """Three 3×3 convolutions and two dense layers on the 8×8 digit images (flat 64 inputs)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.conv3 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.conv1(x.view(-1, 1, 8, 8)))
        h = torch.relu(self.conv2(h))
        h = nn.functional.max_pool2d(torch.relu(self.conv3(h)), 2)
        return self.fc2(torch.relu(self.fc1(h.flatten(1))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, width: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        )
        weights = torch.softmax(q @ k.transpose(-1, -2) / (w // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((weights @ v).transpose(1, 2).reshape(b, t, w))
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    """Token + position embeddings, three blocks, final norm, classifier on the first position."""

    def __init__(self, vocab: int = 16, length: int = 8, width: int = 32, classes: int = 10):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(3)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, ids):
        # Positions get the batch axis too: the engine's structured Embedding path needs it.
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device).expand_as(ids))
        return self.head(self.ln(self.blocks(h))[:, 0])


def pointer_task(n: int, seed: int, length: int = 8):
    """Sequences [p, c_1, …, c_7]: p ∈ 1..7 points at a content token c ∈ 0..9 (tokens 10..15 are
    unused); the label is c_p."""
    g = torch.Generator().manual_seed(seed)
    content = torch.randint(0, 10, (n, length - 1), generator=g)
    pointer = torch.randint(1, length, (n,), generator=g)
    y = content.gather(1, (pointer - 1).unsqueeze(1)).squeeze(1)
    return torch.cat([pointer.unsqueeze(1), content], 1), y


def translated(x: torch.Tensor) -> torch.Tensor:
    """8×8 digit images moved one pixel to the right (the fine-tuning task of the image models)."""
    img = x.view(-1, 8, 8)
    return torch.cat([torch.zeros_like(img[:, :, :1]), img[:, :, :-1]], 2).reshape(len(x), 64)


def rotated(ids: torch.Tensor) -> torch.Tensor:
    """Content tokens rotated by one position (the fine-tuning task of the transformer)."""
    return torch.cat([ids[:, :1], ids[:, 1:].roll(1, dims=1)], 1)


def setups():
    """(name, model factory, training epochs, group, data) for each benchmark model."""
    d = demo.digits()
    digits_data = (d.x_train, d.y_train, d.x_test, d.y_test, translated)
    for depth in (2, 3, 4):
        yield f"mlp-{depth}", lambda depth=depth: demo.mlp(depth=depth), 60, None, digits_data
    yield "cnn", DigitsCNN, 30, None, digits_data
    x_tr, y_tr = pointer_task(2000, 0)
    x_te, y_te = pointer_task(1000, 1)
    seq_data = (x_tr, y_tr, x_te, y_te, rotated)
    yield "transformer", Transformer, 8, None, seq_data
    yield "transformer-blocks", Transformer, 8, "blocks", seq_data


def run():
    """Spearman tables {model: {score: {measure: ρ}}} and the rows and truths behind them."""
    trained = {}
    results, rows_by_model = {}, {}
    for name, factory, epochs, group, (x_tr, y_tr, x_te, y_te, shift) in setups():
        start = time.perf_counter()
        if factory not in trained:
            torch.manual_seed(0)
            trained[factory] = demo.train(factory(), x_tr, y_tr, epochs=epochs)
        model = trained[factory]
        acc = demo.accuracy(model, x_te, y_te)
        x_score, y_score = x_te[:N_SCORE], y_te[:N_SCORE]
        x_eval, y_eval = x_te[N_SCORE:], y_te[N_SCORE:]
        rows = layer_importance(model, x_score, y_score, group=group)
        truths = reinit_damage(model, x_eval, y_eval, group=group)
        n_ft = len(x_tr) // 2
        gains = finetune_gain(
            model, shift(x_tr[:n_ft]), y_tr[:n_ft], shift(x_eval), y_eval, group=group
        )
        for row in truths:
            truths[row].update(gains[row])
        results[name] = agreement(rows, truths)
        rows_by_model[name] = (rows, truths)
        print(
            f"# {name}: {len(rows)} rows, test accuracy {acc:.3f}, "
            f"{time.perf_counter() - start:.1f} s",
            file=sys.stderr,
        )
    return results, rows_by_model


def _fmt(value, width: int, spec: str = ".2f") -> str:
    return f"{'–':>{width}}" if value is None else f"{value:{width}{spec}}"


def print_tables(results, rows_by_model):
    print(
        f"# layer importance vs ablation — {platform.node()}, {time.strftime('%Y-%m-%d')}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    )
    models = list(results)
    for measure in TRUTHS:
        print(
            f"\nSpearman ρ: score vs {measure} (block_influence: only where defined, "
            "the 3 blocks and the final LayerNorm)"
        )
        print(f"{'score':<16}" + "".join(f"{m:>19}" for m in models) + f"{'mean':>7}")
        for score in SCORES:
            vals = [results[m][score][measure] for m in models]
            got = [v for v in vals if v is not None]
            print(
                f"{score:<16}"
                + "".join(_fmt(v, 19) for v in vals)
                + _fmt(float(np.mean(got)) if got else None, 7)
            )
    for name, (rows, truths) in rows_by_model.items():
        print(f"\n{name}: scores (rank by sensitivity) and ground truth")
        print(
            f"{'layer':<14}{'sensitivity':>12}{'share':>7}{'align':>7}{'λmax':>9}{'fisher':>9}"
            f"{'blockinf':>9}{'Δloss':>8}{'Δacc':>7}{'ft gain':>8}"
        )
        for r in rows:
            t = truths[r["layer"]]
            print(
                f"{r['layer']:<14}{r['sensitivity']:12.3g}{r['share']:7.3f}{r['alignment']:7.3f}"
                f"{r['top_eigenvalue']:9.3g}{r['fisher']:9.3g}"
                f"{_fmt(r['block_influence'], 9, '.3f')}"
                f"{t['loss_increase']:8.3f}{t['accuracy_drop']:7.3f}{t['finetune_gain']:8.3f}"
            )


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared machine
    start = time.perf_counter()
    print_tables(*run())
    print(f"\n# total {time.perf_counter() - start:.0f} s")
