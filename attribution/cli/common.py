"""What every subcommand shares: loading models and data, output formats, progress, errors."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import io
import json
import operator
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch
from torch import nn

from ntk.core import inputs


class UsageProblem(click.ClickException):
    """A usage error (bad flag value, unreadable file, malformed spec): exit 2, one line."""

    exit_code = 2


FORMATS = ("table", "json", "csv")


def interactive() -> bool:
    return sys.stdout.isatty()


def load_object(spec: str, what: str = "model") -> Any:
    """Resolve `package.module:attr` or `path/to/file.py:attr`."""
    if ":" not in spec:
        raise UsageProblem(
            f"--{what} must look like package.module:attr or path/file.py:attr, got {spec!r}"
        )
    target, attr = spec.rsplit(":", 1)
    if not attr.isidentifier():
        raise UsageProblem(f"--{what}: {attr!r} is not a valid attribute name")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise UsageProblem(f"--{what}: file {target} does not exist")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except UsageProblem:
        raise
    except ImportError as exc:
        raise UsageProblem(f"--{what}: cannot import {target}: {exc}") from None
    if not hasattr(module, attr):
        raise UsageProblem(f"--{what}: {target} has no attribute {attr!r}")
    return getattr(module, attr)


def load_model(spec: str, weights: str | None = None, device: str | None = None) -> nn.Module:
    """Instantiate a model from a factory (or module instance) spec, load weights, eval mode."""
    obj = load_object(spec, "model")
    model = obj if isinstance(obj, nn.Module) else obj() if callable(obj) else None
    if not isinstance(model, nn.Module):
        raise UsageProblem(f"--model: {spec} is neither an nn.Module nor a factory returning one")
    if weights is not None:
        path = Path(weights)
        if not path.is_file():
            raise UsageProblem(f"--weights: file {weights} does not exist")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise UsageProblem(f"--weights: cannot read {weights}: {exc}") from None
        if (
            isinstance(state, dict)
            and "state_dict" in state
            and isinstance(state["state_dict"], dict)
        ):
            state = state["state_dict"]
        try:
            model.load_state_dict(state)
        except (RuntimeError, TypeError, AttributeError) as exc:
            first = str(exc).strip().splitlines()[0]
            raise UsageProblem(f"--weights: {weights} does not fit the model: {first}") from None
    if device is not None:
        model = model.to(device)
    return model.eval()


def load_output_fn(spec: str | None) -> Callable | None:
    """--output-fn: None, the name of an attribute of the model's output (`logits` for
    HuggingFace models), or package.module:function / path/file.py:function."""
    if spec is None:
        return None
    if ":" in spec:
        fn = load_object(spec, "output-fn")
        if not callable(fn):
            raise UsageProblem(f"--output-fn: {spec} is not callable")
        return fn
    if not spec.isidentifier():
        raise UsageProblem(
            f"--output-fn must be an attribute name (e.g. logits) or package.module:function, "
            f"got {spec!r}"
        )
    return operator.attrgetter(spec)


def load_arrays(path: str, option: str = "data") -> tuple[inputs.Inputs, torch.Tensor | None]:
    """Inputs `x` and optional labels `y` from an .npz or .pt file. `x` is one array, or several
    model inputs passed by keyword: arrays named x.<name> (e.g. x.input_ids and
    x.attention_mask), or in a .pt file a dict of tensors under x."""
    file = Path(path)
    if not file.is_file():
        raise UsageProblem(f"--{option}: file {path} does not exist")
    try:
        if file.suffix == ".npz":
            with np.load(file, allow_pickle=False) as z:
                content = {k: z[k] for k in z.files}
        elif file.suffix == ".pt":
            content = torch.load(file, map_location="cpu", weights_only=True)
            if isinstance(content, torch.Tensor):
                content = {"x": content}
        else:
            raise UsageProblem(f"--{option}: {path} must be an .npz or .pt file")
    except UsageProblem:
        raise
    except Exception as exc:
        raise UsageProblem(f"--{option}: cannot read {path}: {exc}") from None
    named = (
        {}
        if not isinstance(content, dict)
        else {k[2:]: v for k, v in content.items() if k.startswith("x.")}
    )
    if not isinstance(content, dict) or ("x" not in content and not named):
        raise UsageProblem(
            f"--{option}: {path} must hold an array named 'x' (or arrays x.<name>, one per "
            "keyword input) and optionally 'y'"
        )
    x = content["x"] if "x" in content else named

    def tensor(a) -> torch.Tensor:
        t = torch.as_tensor(a)
        return t.float() if t.is_floating_point() else t

    x = {k: tensor(v) for k, v in x.items()} if isinstance(x, dict) else tensor(x)
    try:
        n = inputs.validate(x, "x")
    except (TypeError, ValueError) as exc:
        raise UsageProblem(f"--{option}: {path}: {exc}") from None
    y = content.get("y")
    y = None if y is None else torch.as_tensor(y)
    if y is not None and len(y) != n:
        raise UsageProblem(f"--{option}: x has {n} samples but y has {len(y)}")
    return x, y


def emit(
    rows: Sequence[dict],
    fmt: str,
    output: str | None = None,
    *,
    title: str = "",
    meta: dict | None = None,
) -> None:
    """Write rows as a table (rich on a terminal, plain text otherwise), JSON or CSV."""
    if fmt == "json":
        text = json.dumps({**(meta or {}), "rows": list(rows)}, indent=2, default=_jsonable) + "\n"
    elif fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else [], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        text = buf.getvalue()
    else:
        text = None
    if text is not None:
        if output:
            Path(output).write_text(text)
        else:
            click.echo(text, nl=False)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None)
    for column in rows[0] if rows else {}:
        table.add_column(
            str(column), justify="right" if isinstance(rows[0][column], (int, float)) else "left"
        )
    for row in rows:
        table.add_row(*[_cell(v) for v in row.values()])
    if output:
        with open(output, "w") as f:
            Console(file=f, width=160, color_system=None).print(table)
    else:
        Console(
            color_system=None if not interactive() else "auto", width=None if interactive() else 160
        ).print(table)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _jsonable(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def model_options(f):
    """--model, --weights, --data, --samples, --device, --output-fn, --batch-size, --format,
    --output."""
    options = [
        click.option(
            "--model",
            "model_spec",
            default=None,
            help="package.module:factory or path/file.py:factory (default: the built-in digits demo)",
        ),
        click.option(
            "--weights", default=None, help="state_dict file (.pt), loaded with weights_only=True"
        ),
        click.option(
            "--data",
            default="digits",
            show_default=True,
            help="'digits' or an .npz/.pt file with arrays x (and optionally y)",
        ),
        click.option(
            "--samples", type=click.IntRange(min=1), default=None, help="use the first N samples"
        ),
        click.option("--device", default=None, help="torch device, e.g. cpu or cuda"),
        click.option(
            "--output-fn",
            default=None,
            help="map the model's output to [B, O]: an attribute name (e.g. logits for "
            "HuggingFace models) or package.module:function",
        ),
        click.option(
            "--batch-size",
            type=click.IntRange(min=1),
            default=None,
            help="samples per block (default: chosen from free memory)",
        ),
        click.option(
            "--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True
        ),
        click.option(
            "--output", default=None, help="write the result to this file instead of stdout"
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def resolve_model_and_data(model_spec, weights, data, samples, device, default_samples=256):
    """The model and (x, y) a subcommand works on; no --model means the trained demo network."""
    if model_spec is None:
        if weights is not None:
            raise UsageProblem("--weights needs --model")
        if data != "digits":
            raise UsageProblem(
                "--data with a file needs --model (the built-in demo runs on digits)"
            )
        from ntk import demo

        model, digits = demo.demo_model()
        model = model.to(device) if device else model
        x, y = digits.x_train, digits.y_train
    else:
        model = load_model(model_spec, weights, device)
        if data == "digits":
            from ntk import demo

            d = demo.digits()
            x, y = d.x_train, d.y_train
        else:
            x, y = load_arrays(data)
    n = samples or default_samples
    x, y = inputs.take(x, slice(0, n)), (None if y is None else y[:n])
    check_fits(model, x)
    return model, x, y


def resolve_test_data(test_file: str | None, data: str, test_samples: int | None):
    """Test inputs and labels: a --test file, or the digits test split when training on digits."""
    if test_file is not None:
        x_test, y_test = load_arrays(test_file, "test")
    elif data == "digits":
        from ntk import demo

        split = demo.digits()
        x_test, y_test = split.x_test, split.y_test
    else:
        raise UsageProblem("--test is needed with a training data file")
    x_test = inputs.take(x_test, slice(0, test_samples))
    return x_test, None if y_test is None else y_test[:test_samples]


def check_fits(model: nn.Module, x) -> None:
    """Run one sample through the model so that data of the wrong shape is a usage error."""
    try:
        with torch.no_grad():
            first = next(model.parameters(), None)
            one = inputs.take(x, slice(0, 1))
            one = one if first is None else inputs.convert(one, first.device, None)
            args, kwargs = inputs.as_call(one)
            model(*args, **kwargs)
    except (RuntimeError, IndexError, TypeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageProblem(
            f"--data: the model cannot take samples of shape {inputs.signature(x)}: {first}"
        ) from None
