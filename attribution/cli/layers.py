"""`ntk layers`: rank a model's layers (or blocks) by importance, from their eNTK components."""

from __future__ import annotations

import click

import ntk
from ntk.core import inputs

from ..layers import DEFAULT_SCORE, SCORES, layer_importance
from .common import (
    UsageProblem,
    emit,
    interactive,
    load_output_fn,
    model_options,
    resolve_model_and_data,
)


def _plot(rows: list[dict], score: str, path: str) -> None:
    """Horizontal bar chart of `score`, most important at the top (rows where it is undefined
    are left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r[score] is not None]
    labels = [f"{r['layer'] or '(root)'}  [{r['type']}]" for r in rows]
    values = [r[score] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.35 * len(rows)))
    ax.barh(range(len(rows)), values, color="tab:blue")
    ax.set_yticks(range(len(rows)), labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel(score)
    ax.set_title(f"layer importance ({score})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@click.command()
@model_options
@click.option(
    "--score",
    type=click.Choice(SCORES),
    default=DEFAULT_SCORE,
    show_default=True,
    help="score that ranks the rows (every score is reported)",
)
@click.option(
    "--kind",
    type=click.Choice(ntk.KINDS),
    default="trace",
    show_default=True,
    help="kernel kind of the layerwise eNTKs",
)
@click.option(
    "--projection-dim",
    type=click.IntRange(min=1),
    default=None,
    help="estimate the layer kernels from random projections of this dimension",
)
@click.option(
    "--group",
    type=click.Choice(("layers", "blocks")),
    default="layers",
    show_default=True,
    help="one row per layer, or per block (name up to its first number, e.g. blocks.3)",
)
@click.option(
    "--depth",
    type=click.IntRange(min=1),
    default=None,
    help="with --group blocks: group by the first N components of the layer names",
)
@click.option("--plot", default=None, help="also draw a bar chart of the score (e.g. layers.png)")
def layers(
    model_spec,
    weights,
    data,
    samples,
    device,
    output_fn,
    batch_size,
    fmt,
    output,
    score,
    kind,
    projection_dim,
    group,
    depth,
    plot,
):
    """Rank the layers of a model (default: the built-in digits demo) by importance: each layer's
    share of the eNTK, its sensitivity, label alignment and top eigenvalue, with cheap baselines."""
    if depth is not None and group != "blocks":
        raise UsageProblem("--depth needs --group blocks")
    grouping: object | None = None if group == "layers" else (depth or "blocks")
    model, x, y = resolve_model_and_data(model_spec, weights, data, samples, device)
    rows = layer_importance(
        model,
        x,
        y,
        score=score,
        kind=kind,
        group=grouping,
        projection_dim=projection_dim,
        batch_size=batch_size,
        device=device,
        output_fn=load_output_fn(output_fn),
        progress=interactive(),
    )
    if plot is not None:
        _plot(rows, score, plot)
    meta = {
        "model": model_spec or "demo",
        "samples": inputs.count(x),
        "score": score,
        "kind": kind,
        "group": group if depth is None else f"depth {depth}",
        "projection_dim": projection_dim,
    }
    if fmt == "table":
        rows = [{k: ("–" if v is None else v) for k, v in r.items()} for r in rows]
    emit(
        rows,
        fmt,
        output,
        title=f"layer importance by {score} ({inputs.count(x)} samples, {kind} eNTK)",
        meta=meta,
    )
