"""`ntk report`: the surrogate-model report (self-contained HTML plus JSON) of a classifier."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import click

from .choices import POSTERIOR_AUTO_MAX, SURROGATE_KINDS, SURROGATE_MACHINES
from .common import (
    DEMO_SAMPLES,
    UNTRAINED,
    UsageProblem,
    binary_logit,
    cannot_write,
    check_paths,
    class_labels,
    emit,
    flag_names,
    interactive,
    load_output_fn,
    model_files,
    model_options,
    more_than_held,
    resolve_model_and_data,
    resolve_test_data,
    untrained_note,
)


def _finite(ctx, param, value: float | None) -> float | None:
    """--alpha: a finite number (FloatRange lets nan, which no comparison refuses, and inf by)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


@click.command()
@model_options(("measure", "value", "samples"))
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
    "--test-samples",
    type=click.IntRange(min=2),
    default=None,
    help="use the first N test samples (at least 2: faithfulness compares their rankings)",
)
@click.option(
    "--out",
    "report_path",
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
    type=click.Choice(SURROGATE_KINDS),
    default=None,
    help="kernel of the surrogate (default: KernelSurrogate's)",
)
@click.option(
    "--machine",
    type=click.Choice(SURROGATE_MACHINES),
    default=None,
    help="kernel machine of the surrogate (default: KernelSurrogate's)",
)
@click.option(
    "--alpha",
    type=click.FloatRange(min=0, min_open=True),
    callback=_finite,
    default=None,
    help="surrogate regularisation (default: KernelSurrogate's)",
)
@click.option("--normalize", is_flag=True, help="cosine-normalise the kernel (trNTK)")
@click.option(
    "--kernel-samples",
    type=click.IntRange(min=1),
    default=None,
    help=f"training samples of the spectrum and layer sections (default: all, at most "
    f"{DEMO_SAMPLES}; an eigendecomposition costs O(N³))",
)
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
@click.option(
    "--posterior/--no-posterior",
    default=None,
    help="calibration section: an NTKPosterior fitted on the kernel samples, its reliability "
    "diagram, NLL/ECE against the network's, and the least sure test examples (default: on when "
    "the model fits the Kronecker-factored curvature, whose cost is linear in the kernel samples, "
    f"or kernel samples × classes ≤ {POSTERIOR_AUTO_MAX}: the exact posterior's cost grows as "
    "the cube of that)",
)
def report(
    model_spec,
    weights,
    data,
    samples,
    device,
    output_fn,
    batch_size,
    out,
    train_file,
    test_file,
    test_samples,
    report_path,
    image_shape,
    kind,
    machine,
    alpha,
    normalize,
    kernel_samples,
    examples,
    top,
    posterior,
):
    """Build the surrogate-model report of a classifier (default: the built-in digits demo):
    faithfulness of the eNTK kernel surrogate, the kernel's spectrum, attributions to training
    examples, layer importance and calibration. Prints the headline numbers, each with the samples
    it used."""
    from ntk.core import inputs

    from .._report import SINGULAR_KERNEL
    from .._report import report as build_report
    from ..layers import layer_label
    from ..surrogate import KernelSurrogate

    html = report_path
    if Path(html).suffix.lower() not in (".html", ".htm"):
        raise UsageProblem(f"--out must name an .html file, got {html}")
    default_machine = KernelSurrogate(None).get_params()["machine"]
    if kind == "full" and ((machine or default_machine) != "ridge" or normalize):
        raise UsageProblem(
            "--kind full (a multi-output kernel) works with --machine ridge only, without "
            "--normalize"
        )
    json_path = str(Path(html).with_suffix(".json"))
    shape = _shape(image_shape)
    if train_file is not None:
        from click.core import ParameterSource

        if click.get_current_context().get_parameter_source("data") is ParameterSource.COMMANDLINE:
            raise UsageProblem(
                f"--train {train_file} and --data {data} both name the training data; give one"
            )
        data = train_file
    if model_spec is None and data != "digits":
        raise UsageProblem("a training data file needs --model (the built-in demo uses digits)")
    option = "data" if train_file is None else "train"
    check_paths(
        [("--out", html), ("--out (its .json)", json_path), ("--output", out.path)],
        [
            *model_files(model_spec, weights, data, f"--{option}", output_fn=output_fn),
            ("--test", test_file),
        ],
        renamed=["--out", "--out (its .json)"],
    )
    model, x_train, y_train = resolve_model_and_data(
        model_spec,
        weights,
        data,
        samples,
        device,
        default_samples=None,
        option=option,
    )
    n_train = inputs.count(x_train)
    kernel_samples = kernel_samples or min(n_train, DEMO_SAMPLES)
    x_test, y_test = resolve_test_data(test_file, data, test_samples, model, x_train)
    if inputs.count(x_test) < 2:
        raise UsageProblem(
            f"--test: {test_file} holds 1 sample; the report needs at least 2 (faithfulness "
            "compares their rankings)"
        )
    more_than_held("kernel_samples", n_train, option)
    more_than_held("examples", inputs.count(x_test), "test")
    output_fn = binary_logit(model, x_train, y_train, option, load_output_fn(output_fn))
    y_train = class_labels(model, x_train, y_train, option, output_fn)
    y_test = class_labels(model, x_test, y_test, "test", output_fn)
    untrained = untrained_note(model_spec, weights)
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
        output_fn=output_fn,
    )
    with (
        flag_names(image_shape="--image-shape", x_train=f"--{option}", x_test="--test"),
        outputs_named(html, json_path),
    ):
        result = build_report(
            model,
            x_train,
            y_train,
            x_test,
            y_test,
            path=html,
            surrogate=surrogate,
            examples=examples,
            top=top,
            kernel_samples=kernel_samples,
            image_shape=shape,
            batch_size=batch_size,
            device=device,
            output_fn=output_fn,
            progress=interactive(),
            retrain=_demo_retrain if model_spec is None and data == "digits" else None,
            posterior=posterior,
            settings={
                "data": "digits (scikit-learn, built-in)" if data == "digits" else data,
                "test data": test_file or "digits test split",
                "model spec": model_spec or "built-in demo MLP",
                "output fn": str(output_fn or "none (the model's output)"),
                "weights": (
                    weights
                    or (
                        "the demo's, trained"
                        if model_spec is None
                        else f"the factory's ({UNTRAINED})"
                    )
                ),
            },
        )
    faith, kernel, layers = result["faithfulness"], result["kernel"], result["layers"]
    n_test, n_kernel = inputs.count(x_test), kernel["samples"]
    rows = [
        {"measure": name, "value": value, "samples": f"{n_test} test"}
        for name, value in faith["surrogate"].items()
        if isinstance(value, (int, float))
    ]
    rows += [
        {"measure": name, "value": kernel[name], "samples": f"{n_kernel} train"}
        for name in ("condition_number", "effective_rank", "label_alignment")
        if kernel[name] is not None
    ]
    rows += [
        {
            "measure": f"share of layer {layer_label(row['layer'])}",
            "value": row["share"],
            "samples": f"{layers['samples']} train",
        }
        for row in layers["rows"]
    ]
    calibration = result["calibration"]
    for name, value in (calibration.get("metrics") or {}).get("posterior", {}).items():
        network = calibration["metrics"]["network"][name]
        rows.append(
            {
                "measure": f"posterior {name} (network {network:.3g})",
                "value": value,
                "samples": f"{calibration['metrics_samples']} {calibration['metrics_split']}",
            }
        )
    notes = [f"written: {html} and {json_path}"]
    if not calibration["enabled"]:
        notes.append(f"calibration section {calibration['note']}")
    if kernel["condition_number"] == float("inf"):
        notes.append(f"condition_number = inf: {SINGULAR_KERNEL}; `ntk kernel` gives its rank")
    emit(
        rows,
        out,
        title=f"surrogate report of {n_train} training and {n_test} test samples",
        meta={"html": html, "json": json_path, "train_samples": n_train},
        untrained=untrained,
        notes=notes,
    )


@contextlib.contextmanager
def outputs_named(html: str, json_path: str):
    """The library's failure to write the report (an OSError naming the file, e.g. a full disk)
    names --out as `common.writing` does; any other OSError is left as it is."""
    try:
        yield
    except OSError as exc:
        outputs = {Path(html): ("--out", html), Path(json_path): ("--out (its .json)", json_path)}
        output = outputs.get(Path(exc.filename)) if isinstance(exc.filename, str) else None
        if output is None:
            raise
        raise cannot_write(*output, exc) from None


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
