"""`ntk attribute`: the training examples that most raise (proponents) and lower (opponents) the
margin of each test prediction, by `attribution.influence`."""

from __future__ import annotations

import click

from .choices import INFLUENCE_METHODS
from .common import (
    UsageProblem,
    binary_logit,
    check_paths,
    class_labels,
    emit,
    flag_names,
    load_output_fn,
    load_weights,
    model_files,
    model_options,
    resolve_model_and_data,
    resolve_test_data,
    step,
    untrained_note,
)

COLUMNS = ("test", "label", "predicted", "role", "rank", "train", "train_label", "score")


@click.command()
@model_options(COLUMNS)
@click.option(
    "--test",
    "test_file",
    default=None,
    help="test data (.npz/.pt with x, optionally y); default: the digits test split",
)
@click.option(
    "--test-samples",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="explain the first N test samples",
)
@click.option(
    "--method",
    type=click.Choice(INFLUENCE_METHODS),
    default="auto",
    show_default=True,
    help="auto: the method the attribution benchmark chose; the title and json give the method "
    "that ran (json: method, and method_requested as given)",
)
@click.option(
    "--top",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="proponents and opponents listed per test sample",
)
@click.option(
    "--dim",
    type=click.IntRange(min=1),
    default=None,
    help="random-projection dimension of the gradients (trak: default 2048, keep it well below "
    "the number of training examples; the kernel methods: default exact kernels where they fit "
    "in memory, else a projection)",
)
@click.option(
    "--checkpoint",
    "checkpoint_files",
    multiple=True,
    help="a state_dict of the model saved along its training (repeat the option for several): "
    "the scores are averaged over them; the weights after a quarter and a half of the epochs "
    "predict retraining better than the final weights alone (benchmarks/checkpoints.py)",
)
@click.option(
    "--train-features",
    default=None,
    help="a feature store of the training data written by `ntk featurize --kind full` from the "
    "same model and data: the projected Gauss–Newton influence in parameter space reads it "
    "instead of featurising the training data. Another estimator than the default's: the "
    "network's own logits (the default's kernel-flow logits need the N × N kernel), lower LDS "
    "on the benchmarks (README)",
)
def attribute(
    model_spec,
    weights,
    data,
    samples,
    device,
    output_fn,
    batch_size,
    out,
    test_file,
    test_samples,
    method,
    top,
    dim,
    checkpoint_files,
    train_features,
):
    """Top proponents and opponents among the training data (--data, labels y required) of each
    test prediction (default: the built-in digits demo). The score is the influence of a
    training example on the test margin: higher raises it. With --checkpoint files the scores
    are averaged over those weights (--weights, or the demo, still gives the predictions)."""
    import torch

    import projections
    from ntk.core import inputs
    from ntk.core.model import copy_module

    from .._influence import influence, resolve_method
    from ..outputs import logits

    check_paths(
        [("--output", out.path)],
        [
            *model_files(model_spec, weights, data, output_fn=output_fn),
            ("--test", test_file),
            *(("--checkpoint", path) for path in checkpoint_files),
            ("--train-features", train_features),
        ],
    )
    model, x_train, y_train = resolve_model_and_data(model_spec, weights, data, samples, device)
    if y_train is None:
        raise UsageProblem("--data must hold training labels y for attribution")
    x_test, y_test = resolve_test_data(test_file, data, test_samples, model, x_train)
    output_fn = binary_logit(model, x_train, y_train, "data", load_output_fn(output_fn))
    y_train = class_labels(model, x_train, y_train, "data", output_fn)
    y_test = class_labels(model, x_test, y_test, "test", output_fn)
    n_train, n_test = inputs.count(x_train), inputs.count(x_test)
    if 2 * top > n_train:
        raise UsageProblem(
            f"--top {top} with {n_train} training samples: the proponents and opponents would "
            f"share examples; at most {n_train // 2}"
        )
    if train_features is not None:
        try:
            projections.store_info(train_features)
        except ValueError as exc:
            raise UsageProblem(f"--train-features: {exc}") from None
    checkpoints = []
    for path in checkpoint_files:  # before the kept warnings are printed: a file's own joins them
        checkpoints.append(copy_module(model))
        load_weights(checkpoints[-1], path, "--checkpoint")
    untrained = untrained_note(model_spec, weights)
    requested, method = method, resolve_method(method)
    shown = f"{requested}: {method}" if requested != method else method
    if train_features is not None:  # the parameter-space path, on the network's own logits
        shown += ", projected from --train-features, network logits"
    with (
        step(f"influence ({shown}) of {n_train} training examples on {n_test} predictions"),
        flag_names(train_features="--train-features", x_train="--data", x_test="--test"),
    ):
        scores = influence(
            model,
            x_train,
            y_train,
            x_test,
            method=method,
            dim=dim,
            checkpoints=checkpoints or None,
            train_features=train_features,
            batch_size=batch_size,
            device=device,
            output_fn=output_fn,
        )
    predicted = logits(model, x_test, output_fn=output_fn, name="--test: x").argmax(1).tolist()
    rows = []
    for t in range(n_test):
        order = torch.argsort(scores[t], descending=True)
        highest, lowest = order[:top], order.flip(0)[:top]
        proponents = highest[scores[t, highest] > 0]  # of fewer, only those of its sign
        opponents = lowest[scores[t, lowest] < 0]
        for role, picks in (("proponent", proponents), ("opponent", opponents)):
            for rank, i in enumerate(picks.tolist(), start=1):
                rows.append(
                    {
                        "test": t,
                        "label": None if y_test is None else int(y_test[t]),
                        "predicted": predicted[t],
                        "role": role,
                        "rank": rank,
                        "train": i,
                        "train_label": int(y_train[i]),
                        "score": float(scores[t, i]),
                    }
                )
    emit(
        rows,
        out,
        title=(f"influence ({shown}) of {n_train} training examples on {n_test} test predictions"),
        untrained=untrained,
        meta={
            "method": method,
            "method_requested": requested,
            "train_samples": n_train,
            "test_samples": n_test,
            "dim": dim,
            "checkpoints": list(checkpoint_files),
            "train_features": train_features,
            "training_logits": "network" if train_features is not None else "auto",
        },
        headers={"score": "score ↑"},
        notes=["score ↑: how much the training example raises the test margin"],
    )
