"""Ground truth for layer importance, and how well each score predicts it.

Two ablations per layer (or group of layers, as in `layer_importance`):

- re-initialisation (Zhang, Bengio & Singer 2019, "Are all layers created equal?"): redraw the
  layer's parameters with its own initialiser (`layers.redraw`), keep every other parameter, and
  record the increase in loss and the drop in accuracy on held-out data, averaged over seeds
  (by default seeds other than the ones the `sensitivity` score draws with);
- fine-tuning alone vs frozen: train only that layer (all others frozen) for a fixed budget on a
  new task and record the held-out loss it gains over leaving the layer frozen.

`agreement` gives the Spearman correlation between every score and every ground truth.
Everything runs functionally on copies of the parameters: the model itself is never modified.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from scipy.stats import spearmanr
from torch import nn

from ntk.core import inputs
from ntk.core.model import ModelView, check_eval_mode

from .layers import SCORES, Group, check_labels, layer_groups, redraw, sample_losses

TRUTHS = ("loss_increase", "accuracy_drop", "finetune_gain")


def _evaluate(
    view: ModelView, params: dict, x, y: torch.Tensor, block: int = 1024
) -> tuple[float, float | None]:
    """Mean loss and accuracy (None for real-valued targets) on (x, y)."""
    loss, correct, n = 0.0, 0, inputs.count(x)
    with torch.no_grad():
        for start in range(0, n, block):
            rows = slice(start, start + block)
            out = view.forward(params, inputs.take(x, rows))
            loss += float(sample_losses(out, y[rows]).sum())
            if not y.is_floating_point():
                correct += int((out.argmax(1) == y[rows]).sum())
    return loss / n, None if y.is_floating_point() else correct / n


def _data(model: nn.Module, x, y, names: tuple[str, str], device: torch.device):
    """(x, y) checked as `layer_importance` checks them (numpy arrays of floats in the model's
    dtype; labels or targets, one per sample), on `device`."""
    x = inputs.from_numpy(x, names[0], inputs.param_dtype(model))
    y = check_labels(y, inputs.validate(x, names[0]), names[1])
    return inputs.convert(x, device, None), y.to(device)


def reinit_damage(
    model: nn.Module,
    x,
    y,
    *,
    group: Group = None,
    seeds: Iterable[int] = (100, 101, 102),
    output_fn: Callable | None = None,
) -> dict[str, dict]:
    """{row: {"loss_increase", "accuracy_drop"}}: mean over `seeds` of the change in loss and
    accuracy on (x, y) when the row's parameters alone are redrawn by their modules'
    initialisers (parameters of other layers keep their values; frozen ones are not redrawn).
    The model must be in eval mode (no active Dropout, BatchNorm on its running statistics)."""
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds is empty: name at least one seed to redraw with")
    check_eval_mode(model)
    view = ModelView(model, output_fn=output_fn)
    x, y = _data(model, x, y, ("x", "y"), view.device)
    base_loss, base_acc = _evaluate(view, view.params, x, y)
    result = {}
    for row, layers in layer_groups(model, group).items():
        losses, accs = [], []
        for seed in seeds:
            params = dict(view.params)
            for layer in layers:
                params.update({p: t.to(view.device) for p, t in redraw(model, layer, seed).items()})
            loss, acc = _evaluate(view, params, x, y)
            losses.append(loss - base_loss)
            accs.append(None if acc is None else base_acc - acc)
        result[row] = {
            "loss_increase": sum(losses) / len(losses),
            "accuracy_drop": None if base_acc is None else sum(accs) / len(accs),
        }
    return result


def finetune_gain(
    model: nn.Module,
    x_train,
    y_train,
    x_test,
    y_test,
    *,
    group: Group = None,
    steps: int = 100,
    lr: float = 1e-3,
    batch_size: int = 64,
    seed: int = 0,
    output_fn: Callable | None = None,
) -> dict[str, dict]:
    """{row: {"finetune_gain"}}: held-out loss with every parameter frozen minus held-out loss
    after `steps` Adam steps on (x_train, y_train) that update the row's parameters only. The
    model must be in eval mode (no active Dropout, BatchNorm on its running statistics)."""
    check_eval_mode(model)
    view = ModelView(model, output_fn=output_fn)
    x_train, y_train = _data(model, x_train, y_train, ("x_train", "y_train"), view.device)
    x_test, y_test = _data(model, x_test, y_test, ("x_test", "y_test"), view.device)
    frozen_loss, _ = _evaluate(view, view.params, x_test, y_test)
    n = inputs.count(x_train)
    result = {}
    for row, layers in layer_groups(model, group).items():
        names = [p for layer in layers for p in view.layers[layer]]
        trained = {p: view.params[p].clone().requires_grad_(True) for p in names}
        opt = torch.optim.Adam(trained.values(), lr=lr)
        generator = torch.Generator().manual_seed(seed)
        order = torch.cat(
            [torch.randperm(n, generator=generator) for _ in range(steps * batch_size // n + 1)]
        )
        for step in range(steps):
            idx = order[step * batch_size : (step + 1) * batch_size].to(view.device)
            out = view.forward({**view.params, **trained}, inputs.take(x_train, idx))
            opt.zero_grad()
            sample_losses(out, y_train[idx]).mean().backward()
            opt.step()
        params = {**view.params, **{p: t.detach() for p, t in trained.items()}}
        result[row] = {"finetune_gain": frozen_loss - _evaluate(view, params, x_test, y_test)[0]}
    return result


def agreement(
    rows: Sequence[dict],
    truths: dict[str, dict],
    *,
    scores: Sequence[str] = SCORES,
    measures: Sequence[str] = TRUTHS,
) -> dict[str, dict[str, float | None]]:
    """{score: {measure: Spearman ρ}} between the rows' scores (from `layer_importance`) and the
    ground truths (merged dicts from `reinit_damage` / `finetune_gain`), over the rows where both
    are defined (block influence: residual blocks only); None with fewer than 3 such rows or a
    constant column."""
    table = {}
    for score in scores:
        table[score] = {}
        for measure in measures:
            pairs = [(r.get(score), truths.get(r["layer"], {}).get(measure)) for r in rows]
            pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
            if len(pairs) < 3:
                table[score][measure] = None
                continue
            a, b = zip(*pairs)
            rho = spearmanr(a, b).statistic
            table[score][measure] = None if rho != rho else float(rho)
    return table
