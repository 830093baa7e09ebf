"""`ntk report`: the surrogate-model report (self-contained HTML plus JSON) of a classifier."""

from __future__ import annotations

from pathlib import Path

import click

from .._report import report as build_report
from ..surrogate import KINDS, MACHINES, KernelSurrogate
from .common import (
    UsageProblem,
    emit,
    interactive,
    model_options,
    resolve_model_and_data,
    resolve_test_data,
)


@click.command()
@model_options
@click.option(
    "--train",
    "train_file",
    default=None,
    help="training data (.npz/.pt with x and optionally y); default: --data",
)
@click.option(
    "--test",
    "test_file",
    default=None,
    help="test data (.npz/.pt with x and optionally y); default: the digits test split",
)
@click.option(
    "--test-samples", type=click.IntRange(min=1), default=None, help="use the first N test samples"
)
@click.option(
    "--out",
    default="ntk-report.html",
    show_default=True,
    help="the HTML file; the JSON file takes the same name with .json",
)
@click.option(
    "--image-shape",
    default=None,
    help="draw inputs as images of this shape, e.g. 8x8 or 3x32x32 (default: 8x8 for digits)",
)
@click.option(
    "--kind",
    type=click.Choice(KINDS),
    default=None,
    help="kernel of the surrogate (default: KernelSurrogate's)",
)
@click.option(
    "--machine",
    type=click.Choice(MACHINES),
    default=None,
    help="kernel machine of the surrogate (default: KernelSurrogate's)",
)
@click.option(
    "--alpha",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="surrogate regularisation (default: chosen by cross-validation)",
)
@click.option("--normalize", is_flag=True, help="cosine-normalise the kernel (trNTK)")
@click.option(
    "--examples",
    type=click.IntRange(min=1),
    default=6,
    show_default=True,
    help="test predictions explained",
)
@click.option(
    "--top",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="proponents and opponents shown per prediction",
)
def report(
    model_spec,
    weights,
    data,
    samples,
    device,
    batch_size,
    fmt,
    output,
    train_file,
    test_file,
    test_samples,
    out,
    image_shape,
    kind,
    machine,
    alpha,
    normalize,
    examples,
    top,
):
    """Build the surrogate-model report of a classifier (default: the built-in digits demo):
    faithfulness of the eNTK kernel surrogate, the kernel's spectrum, attributions to training
    examples and layer importance. Prints the headline numbers."""
    if Path(out).suffix.lower() not in (".html", ".htm"):
        raise UsageProblem(f"--out must name an .html file, got {out}")
    shape = _shape(image_shape)
    if train_file is not None:
        data = train_file
    if model_spec is None and data != "digits":
        raise UsageProblem("a training data file needs --model (the built-in demo uses digits)")
    model, x_train, y_train = resolve_model_and_data(
        model_spec, weights, data, samples, device, default_samples=None
    )
    x_test, y_test = resolve_test_data(test_file, data, test_samples)
    if shape is None and data == "digits":
        shape = (8, 8)
    chosen = {
        k: v for k, v in dict(kind=kind, machine=machine, alpha=alpha).items() if v is not None
    }
    surrogate = KernelSurrogate(
        model,
        **chosen,
        **({"normalize": True} if normalize else {}),
        batch_size=batch_size,
        device=device,
    )
    result = build_report(
        model,
        x_train,
        y_train,
        x_test,
        y_test,
        path=out,
        surrogate=surrogate,
        examples=examples,
        top=top,
        image_shape=shape,
        batch_size=batch_size,
        device=device,
        progress=interactive(),
        retrain=_demo_retrain if model_spec is None and data == "digits" else None,
        settings={
            "data": "digits (scikit-learn, built-in)" if data == "digits" else data,
            "test data": test_file or "digits test split",
            "model spec": model_spec or "built-in demo MLP",
        },
    )
    faith, kernel = result["faithfulness"], result["kernel"]
    rows = [
        {"measure": name, "value": value}
        for name, value in faith["surrogate"].items()
        if isinstance(value, (int, float))
    ]
    rows += [
        {"measure": name, "value": kernel[name]}
        for name in ("condition_number", "effective_rank", "label_alignment")
        if kernel[name] is not None
    ]
    rows += [
        {"measure": f"share of layer {row['layer']}", "value": row["share"]}
        for row in result["layers"]["rows"]
    ]
    emit(
        rows,
        fmt,
        output,
        title=f"surrogate report: {out} (+ .json)",
        meta={"html": out, "json": str(Path(out).with_suffix(".json"))},
    )


def _shape(text):
    if text is None:
        return None
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        raise UsageProblem(f"--image-shape must look like 8x8 or 3x32x32, got {text!r}") from None
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise UsageProblem(f"--image-shape must have 2 or 3 positive sizes, got {text!r}")
    return shape


def _demo_retrain(x, y):
    """The demo network's recipe (`ntk.demo.demo_model`) on other training data: each card's
    sanity strip compares the surrogate's counterfactual with this retraining."""
    import torch

    from ntk import demo

    torch.manual_seed(0)
    return demo.train(demo.mlp(), x, y)
