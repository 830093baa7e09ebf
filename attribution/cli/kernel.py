"""`ntk kernel`: compute a model's eNTK, summarise it and optionally save it as .npy."""

from __future__ import annotations

import time
from dataclasses import replace

import click

from .choices import KERNEL_KINDS, KERNEL_METHODS
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
    resolve_model_and_data,
    step,
    untrained_note,
    writing,
)

# The full and diagonal kernels are [N·O, N·O] matrices to eigendecompose: O((N·O)³).
DEFAULT_SAMPLES = 256
COLUMNS = ("kind", "shape", "lambda_1", "condition_number", "rank", "seconds")  # by default
EVERY_COLUMN = (
    "kind",
    "shape",
    "seconds",
    "lambda_1",
    "lambda_2",
    "lambda_3",
    "condition_number",
    "rank",
)
HEADERS = {"lambda_1": "λ1", "condition_number": "κ", "rank": "rank"}


@click.command()
@model_options(EVERY_COLUMN, headers=HEADERS)
@click.option(
    "--kind",
    "kinds",
    type=click.Choice(KERNEL_KINDS),
    multiple=True,
    help="kernel kind(s) to compute (default: all four)",
)
@click.option("--method", type=click.Choice(KERNEL_METHODS), default="auto", show_default=True)
@click.option(
    "--save",
    default=None,
    help="save the kernel as .npy (needs exactly one --kind); a line on stderr says where",
)
def kernel(
    model_spec, weights, data, samples, device, output_fn, batch_size, out, kinds, method, save
):
    """Compute the eNTK of a model (default: the built-in digits demo) on the first 256 samples
    (--samples) and summarise it: shapes, time, top eigenvalues, numerical rank, condition number
    κ and per-layer trace shares.

    \b
    rank: the eigenvalues above λ1 · n · ε(float32) (numpy's matrix_rank tolerance; n = N, or
          N·O for the full and diagonal kernels, which are computed in float32).
    κ:    λ1 / λn over the same eigenvalues: inf whenever the rank is below n (λn is then
          rounding noise), so a finite κ always comes with full rank.

    The table prints the summary, then the per-layer shares of the trace kernel; --format json
    holds them under "layers", --format csv as one more row per layer (columns layer, type,
    trace, share; kind "trace"). JSON also holds the notes under the table (why κ = inf),
    "untrained" (--model without --weights, the table's title says so) and the --save path."""
    import ntk
    from ntk.core import inputs

    from ..layers import layer_label

    kinds = tuple(dict.fromkeys(kinds)) or KERNEL_KINDS  # a kind given twice is computed once
    if save is not None and len(kinds) != 1:
        raise UsageProblem("--save needs exactly one --kind")
    check_paths(
        [("--output", out.path), ("--save", save)],
        model_files(model_spec, weights, data, output_fn=output_fn),
        renamed=["--save"],
    )
    model, x, _ = resolve_model_and_data(
        model_spec, weights, data, samples, device, default_samples=DEFAULT_SAMPLES, labels=False
    )
    untrained = untrained_note(model_spec, weights)
    n = inputs.count(x)
    output_fn = load_output_fn(output_fn)
    rows, notes = [], []
    saved = None
    for kind in kinds:
        start = time.perf_counter()
        with flag_names(x1="--data"):  # a model that fails on some of the data names the flag
            k = ntk.empirical_ntk(
                model,
                x,
                kind=kind,
                method=method,
                batch_size=batch_size,
                device=device,
                output_fn=output_fn,
                progress=interactive(),
            )
        seconds = time.perf_counter() - start
        with step(f"spectrum of the {kind} kernel"):
            ev = ntk.eigenvalues(k)
        size = len(ev)
        rank = numerical_rank(ev, size)
        kappa = condition_number(ev, rank)
        rows.append(
            {
                "kind": kind,
                "shape": "x".join(map(str, k.shape)),
                "seconds": round(seconds, 4),
                **{f"lambda_{i}": float(ev[i - 1]) if i <= len(ev) else None for i in (1, 2, 3)},
                "condition_number": kappa,
                "rank": rank,
            }
        )
        if kappa == float("inf"):
            notes.append(f"κ = inf for {kind}: {why_singular(kind, n, size, rank)}")
        saved = k
    with step("per-layer trace kernels"), flag_names(x1="--data"):
        layers = ntk.empirical_ntk(
            model,
            x,
            kind="trace",
            layers="all",
            method=method,
            batch_size=batch_size,
            device=device,
            output_fn=output_fn,
        )
    traces = {name: float(k.diagonal().sum()) for name, k in layers.items()}
    total = sum(traces.values())
    modules = dict(model.named_modules())
    shares = [
        {
            "layer": name,
            "type": type(modules[name]).__name__,
            "trace": t,
            "share": t / total if total > 0 else 0.0,  # a kernel that is zero everywhere
        }
        for name, t in traces.items()
    ]
    if save is not None:
        _save_npy(saved.cpu().numpy(), save)
        done(f"wrote the {kinds[0]} kernel ({'x'.join(map(str, saved.shape))}) to {save}")
    meta = {"samples": int(n), "saved": save}
    if out.fmt == "table":
        emit(
            rows,
            out,
            title=f"eNTK of {n} samples",
            untrained=untrained,
            columns=COLUMNS,
            headers=HEADERS,
            notes=notes,
        )
        every = replace(out, columns=(), all_columns=True)  # --columns choose the summary's
        emit(
            shares,
            every,
            title=f"per-layer trace shares ({n} samples)",
            display={"layer": layer_label},
            append=True,
        )
    elif out.fmt == "csv":
        emit([*rows, *({"kind": "trace", **share} for share in shares)], out)
    else:
        emit(rows, out, meta={**meta, "notes": notes, "layers": shares}, untrained=untrained)


def numerical_rank(eigenvalues, size: int) -> int:
    """Eigenvalues above numpy's matrix_rank tolerance, λmax · size · ε(float32)."""
    import numpy as np

    tolerance = float(eigenvalues[0]) * size * np.finfo(np.float32).eps
    return int((eigenvalues > tolerance).sum())


def condition_number(eigenvalues, rank: int) -> float:
    """κ = λmax / λmin over the eigenvalues `numerical_rank` counts: inf when the rank is below
    the size (λmin is then below the rounding tolerance, and a finite ratio of it would only
    measure the rounding of the float32 kernel)."""
    from ntk.spectrum import condition_from_eigenvalues

    return condition_from_eigenvalues(eigenvalues) if rank == len(eigenvalues) else float("inf")


def why_singular(kind: str, n: int, size: int, rank: int) -> str:
    """Why κ is infinite: the kernel's numerical rank is below its size."""
    if rank >= size:
        return f"λmin ≤ 0 by rounding although the rank is full ({rank})"
    rows = f"N·O = {n}·{size // n} = {size}" if size != n else f"N = {n}"
    return f"rank-deficient: {rows} > rank {rank}"


def _save_npy(array, path: str) -> None:
    """Write atomically: a partial file never carries the final name; a failure names --save."""
    import numpy as np

    from ntk.core.files import atomic_path

    with writing("--save", path), atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array)  # to an open file: np.save of a name would add .npy
