"""`ntk layers`: rank a model's layers (or blocks) by importance, from their eNTK components."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import click

from .choices import DEFAULT_LAYER_SCORE, KERNEL_KINDS, LABEL_SCORES, LAYER_SCORES
from .common import (
    UsageProblem,
    check_paths,
    done,
    emit,
    flag_names,
    interactive,
    load_output_fn,
    model_files,
    model_options,
    output_path,
    resolve_model_and_data,
    untrained_note,
)

# The columns of `attribution.layer_importance`'s rows.
COLUMNS = ("layer", "type", "params", *LAYER_SCORES, "trace", "rank")


def _check_plot(path: str | None) -> None:
    """--plot: a name ending in a format matplotlib writes (it would add .png to one without),
    whose writer has the programs it runs on this machine (`_programs`): a missing one failed
    only once the work was done."""
    if path is None:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    fmt = Path(path).suffix[1:].lower()
    if fmt not in formats:
        raise UsageProblem(
            f"--plot: {path} must end in the suffix of a format matplotlib writes: "
            f"{', '.join(sorted(formats))}"
        )
    for program, why in _programs(fmt):
        if shutil.which(program) is None:
            raise UsageProblem(f"--plot: cannot write {path}: {why}, which is not on PATH")


def _programs(fmt: str) -> list[tuple[str, str]]:
    """The programs that matplotlib runs to write a figure in `fmt` with its settings (the
    user's matplotlibrc included), each with why, ending in its name: the pgf writer measures
    text with a TeX engine, and text.usetex has the other writers typeset text with latex (PS
    then runs dvips; Agg's formats dvipng, unless text.latex.engine reads the DVI itself). None
    otherwise: matplotlib draws and writes every other format itself (a missing Ghostscript,
    for ps.usedistiller, only skips the distilling, with a warning)."""
    import matplotlib as mpl
    from matplotlib.backend_bases import get_registered_canvas_class

    writer = get_registered_canvas_class(fmt).__module__.rsplit(".", 1)[-1]
    if writer == "backend_pgf":
        tex = mpl.rcParams["pgf.texsystem"]
        return [(tex, f"matplotlib writes pgf with rcParams['pgf.texsystem'], {tex}")]
    if not mpl.rcParams["text.usetex"]:
        return []
    why = "with rcParams['text.usetex'] matplotlib typesets text with"
    needed = [("latex", f"{why} latex")]
    if writer == "backend_ps":
        needed.append(("dvips", f"{why} latex and dvips"))
    elif writer == "backend_agg" and mpl.rcParams.get("text.latex.engine") in (
        None,  # before matplotlib 3.11, always
        "latex+dvipng",
    ):
        needed.append(("dvipng", f"{why} latex and dvipng"))
    return needed


def _plot(rows: list[dict], score: str, path: str) -> None:
    """Horizontal bar chart of `score`, most important at the top (rows where it is undefined
    are left out); a matplotlib `Figure`, no pyplot state. The title is centred on the figure,
    not over the axes that long layer names narrow, and the image grows to hold long names.
    Written through `output_path` (a temporary file renamed onto `path`), in the format that
    `path`'s suffix names (`_check_plot`), as an open file, so that no format records the
    temporary's name (ending in .part): PS and EPS have no %%Title, which matplotlib takes only
    from a path, and svgz is compressed here, its gzip header naming `path`."""
    from .._figures import bar_chart
    from ..layers import layer_label

    rows = [r for r in rows if r[score] is not None]
    fig = bar_chart(
        [f"{layer_label(r['layer'])}  [{r['type']}]" for r in rows],
        [r[score] for r in rows],
        score,
    )
    fig.suptitle(f"layer importance ({score})")
    fig.tight_layout()
    fmt = Path(path).suffix[1:].lower()
    with output_path("--plot", path) as where, open(where, "wb") as file:
        if fmt == "svgz":
            with gzip.GzipFile(Path(path).name, "wb", fileobj=file) as svgz:
                _save(fig, svgz, "svg")
        else:
            _save(fig, file, fmt)


def _save(fig, file, fmt: str) -> None:
    try:
        fig.savefig(file, format=fmt, dpi=120, bbox_inches="tight")
    except Exception as exc:  # matplotlib's PDF writer, closing its stream after a write
        failed = exc.__context__  # failed (a full disk), raises an AttributeError instead
        if isinstance(failed, OSError) and not isinstance(exc, OSError):
            raise failed from None
        raise


@click.command()
@model_options(COLUMNS)
@click.option(
    "--score",
    type=click.Choice(LAYER_SCORES),
    default=DEFAULT_LAYER_SCORE,
    show_default=True,
    help="score that ranks the rows (higher is more important; --all shows every score)",
)
@click.option(
    "--kind",
    type=click.Choice(KERNEL_KINDS),
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
    out,
    score,
    kind,
    projection_dim,
    group,
    depth,
    plot,
):
    """Rank the layers of a model (default: the built-in digits demo) by importance: each layer's
    share of the eNTK, its sensitivity, label alignment and top eigenvalue, with cheap baselines
    (all higher-is-more-important)."""
    from ntk.core import inputs

    from ..layers import layer_importance, layer_label

    if depth is not None and group != "blocks":
        raise UsageProblem("--depth needs --group blocks")
    if score == "block_influence" and group != "blocks":
        raise UsageProblem("--score block_influence compares blocks: it needs --group blocks")
    check_paths(
        [("--output", out.path), ("--plot", plot)],
        model_files(model_spec, weights, data, output_fn=output_fn),
    )
    _check_plot(plot)
    grouping: object | None = None if group == "layers" else (depth or "blocks")
    model, x, y = resolve_model_and_data(model_spec, weights, data, samples, device)
    if y is None and score in LABEL_SCORES:
        raise UsageProblem(f"--score {score} needs labels: --data must hold an array y")
    untrained = untrained_note(model_spec, weights)
    n = inputs.count(x)
    with flag_names(y="--data: y", x="--data", x1="--data"):
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
        done(f"wrote the bar chart of {score} to {plot}")
    frozen = [  # modules whose own parameters are all frozen: no share of the eNTK, no row
        name
        for name, module in model.named_modules()
        if (own := list(module.parameters(recurse=False))) and not any(p.requires_grad for p in own)
    ]
    notes = ["↑ ranks the rows, higher is more important; – where a score is undefined"]
    if frozen:
        notes.append(
            "not ranked, no trainable parameters (requires_grad=False): "
            + ", ".join(map(layer_label, frozen))
        )
    meta = {
        "model": model_spec or "demo",
        "samples": n,
        "score": score,
        "kind": kind,
        "group": group if depth is None else f"depth {depth}",
        "projection_dim": projection_dim,
        "frozen": frozen,
    }
    columns = ["layer", "type", "params", score, "share", "rank"]
    emit(
        rows,
        out,
        title=f"layer importance by {score} ({n} samples, {kind} eNTK)",
        meta=meta,
        untrained=untrained,
        columns=list(dict.fromkeys(columns)),
        headers={score: f"{score} ↑"},
        display={"layer": layer_label},
        notes=notes,
    )
