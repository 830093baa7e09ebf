"""`ntk kernel`: compute a model's eNTK, summarise it and optionally save it as .npy."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import click
import numpy as np

import ntk
from ntk.core import inputs

from .common import (
    UsageProblem,
    emit,
    interactive,
    load_output_fn,
    model_options,
    resolve_model_and_data,
)


@click.command()
@model_options
@click.option(
    "--kind",
    "kinds",
    type=click.Choice(ntk.KINDS),
    multiple=True,
    help="kernel kind(s) to compute (default: all four)",
)
@click.option("--method", type=click.Choice(ntk.METHODS), default="auto", show_default=True)
@click.option("--save", default=None, help="save the kernel as .npy (needs exactly one --kind)")
def kernel(
    model_spec,
    weights,
    data,
    samples,
    device,
    output_fn,
    batch_size,
    fmt,
    output,
    kinds,
    method,
    save,
):
    """Compute the eNTK of a model (default: the built-in digits demo) and summarise it:
    shapes, time, top eigenvalues, condition number and per-layer trace shares."""
    kinds = kinds or ntk.KINDS
    if save is not None and len(kinds) != 1:
        raise UsageProblem("--save needs exactly one --kind")
    model, x, _ = resolve_model_and_data(model_spec, weights, data, samples, device)
    output_fn = load_output_fn(output_fn)
    rows = []
    saved = None
    for kind in kinds:
        start = time.perf_counter()
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
        ev = ntk.eigenvalues(k)
        rows.append(
            {
                "kind": kind,
                "shape": "x".join(map(str, k.shape)),
                "seconds": round(seconds, 4),
                "lambda_1": float(ev[0]),
                "lambda_2": float(ev[1]),
                "lambda_3": float(ev[2]),
                "condition_number": ntk.condition_number(k),
            }
        )
        saved = k
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
    shares = [
        {
            "layer": name,
            "type": type(dict(model.named_modules())[name]).__name__,
            "trace": t,
            "share": t / total,
        }
        for name, t in traces.items()
    ]
    if save is not None:
        _save_npy(saved.cpu().numpy(), save)
    if fmt == "table" and output is None:
        emit(rows, fmt, title=f"eNTK of {inputs.count(x)} samples")
        emit(shares, fmt, title="per-layer trace shares")
    else:
        emit(rows, fmt, output, meta={"samples": inputs.count(x), "layers": shares})


def _save_npy(array: np.ndarray, path: str) -> None:
    """Write atomically: a partial file never carries the final name."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent or ".", suffix=".npy.part")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
