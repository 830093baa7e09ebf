"""`report`: one self-contained HTML page (plots embedded as PNG, no scripts, no fonts, no network)
plus a JSON file with every number in it, telling whether the eNTK kernel surrogate of a
classifier can be trusted and what it says.

Sections: faithfulness of the surrogate (network vs surrogate probability of the network's class;
Kendall τ, Spearman ρ, R², accuracies and agreement from `KernelSurrogate.faithfulness`; the
confusion of the disagreements); the
kernel (eigenvalue spectrum, condition number λ₁/λ_N, effective rank exp(H(λ/Σλ)) of Roy &
Vetterli 2007, label alignment, per-layer trace shares); attribution (top proponents and opponents
of a few correct, wrong and uncertain test predictions, the training examples with the largest
total influence |c| over the test set and the largest self-influence, i.e. contribution to their
own label, likely mislabelled or atypical), and how much the contributions cancel, the median
over test examples of Σ_i |c_i(x)| / |Σ_i c_i(x)| (1: none; large: single examples say little);
layer importance (`layer_importance`); calibration (`NTKPosterior`, the linearised-Laplace GP
with the eNTK covariance, fitted on the kernel samples: a reliability diagram and accuracy / NLL /
ECE / Brier of the network's softmax and of the posterior, and the test examples the posterior is
least sure about); settings (model, data, surrogate, versions, time taken).

Contributions are the surrogate's exact decomposition: surrogate output for class o at x is
Σ_i c_i(x)[o] + `baseline_`[o], c = `KernelSurrogate.attribute(x)`; examples are explained for the
network's predicted class.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

import ntk
from ntk.core import inputs
from ntk.core.checks import check_integer
from ntk.core.files import atomic_path, check_replaceable
from ntk.core.kinds import ONE_LOGIT
from ntk.core.model import ModelView
from ntk.spectrum import condition_from_eigenvalues

from . import _figures
from .curvature import UnfactorableModelError
from .damping import DOF_FRACTION
from .evaluation import calibration_metrics, reliability
from .layers import DEFAULT_SCORE, layer_importance, layer_label
from .outputs import labels, logits
from .posterior import (
    EFFECTIVE_PARAMETERS,
    SHAPE_EFFECTIVE_PARAMETERS,
    TRAINING_VARIANCE_RATIO,
    NTKPosterior,
    entropy,
)
from .surrogate import KernelSurrogate, cancellation

STAGES = (
    "network outputs",
    "kernel spectrum",
    "layer importance",
    "surrogate fit",
    "faithfulness",
    "attribution",
    "self-influence",
    "calibration",
    "figures",
)
# The calibration section is on by default when the posterior's (N·O)² system is this small
# (N kernel samples, O classes: one Cholesky of 4096² takes about a second on one core), and
# beyond it when the model fits the Kronecker-factored curvature (cost linear in N).
POSTERIOR_AUTO_MAX = 4096
VALIDATION_MIN = 20  # labelled test samples needed to tune the posterior's prior precision
# Why the kernel's condition number is inf, on the page and in `ntk report`'s notes.
SINGULAR_KERNEL = "the kernel is singular (numerical rank below its size)"
# Readable names of `KernelSurrogate.faithfulness` entries (others are shown as they are named).
MEASURES = {
    "label_agreement": "agreement of predicted classes",
    "tau_prob": "Kendall τ, probability of the network's class",
    "spearman_prob": "Spearman ρ, probability of the network's class",
    "tau_logits": "Kendall τ, centred logits",
    "spearman_logits": "Spearman ρ, centred logits",
    "r2_logits": "R², centred logits",
    "accuracy_net": "network accuracy",
    "accuracy_surrogate": "surrogate accuracy",
    "accuracy_gap": "accuracy gap (network − surrogate)",
    "misclassified_jaccard": "Jaccard overlap of the misclassified sets",
}


def report(
    model: nn.Module,
    x_train,
    y_train=None,
    x_test=None,
    y_test=None,
    *,
    path: str | Path = "ntk-report.html",
    surrogate=None,
    examples: int = 6,
    top: int = 5,
    kernel_samples: int = 500,
    image_shape: Sequence[int] | None = None,
    title: str = "eNTK surrogate report",
    settings: dict | None = None,
    batch_size: int | None = None,
    device=None,
    output_fn: Callable | None = None,
    progress: bool = False,
    retrain=None,
    posterior: bool | None = None,
) -> dict:
    """Build the report of a classifier `model` (O ≥ 2 outputs) on training data (x_train,
    y_train) and test data (x_test, y_test); labels are optional (without them the network's
    predictions stand in and accuracies are left out). Writes `path` (HTML, named .html or
    .htm) and the same name with `.json`; returns the JSON content as a dict.

    surrogate: an unfitted `KernelSurrogate` of `model` to use (default: `KernelSurrogate(model)`
    with the toolkit's default kernel and machine); it is fitted to the network's outputs on
    x_train. examples: number of test predictions explained; top: proponents/opponents shown per
    example. kernel_samples: training samples for the spectrum and layer importance (an
    eigendecomposition is O(N³)). image_shape: per-sample shape to draw inputs as images
    (e.g. (8, 8)); by default inputs shaped [N, H, W] or [N, C, H, W] (C = 1 or 3) are drawn and
    others are shown as tables. settings: extra rows for the settings table (e.g. data files).
    output_fn: maps the model's output to the logits [B, O] (e.g. `lambda out: out.logits` for a
    HuggingFace model, whose inputs can be dicts of tensors); the default surrogate uses it too (a
    surrogate passed in keeps its own).
    retrain: optional callable (x, y) -> trained network, for each card's sanity strip (`_sanity`):
    the network is retrained once on all of x_train and once per card without its top
    proponents (cheap only on small demos). posterior: include the calibration section (an
    `NTKPosterior` fitted on the kernel samples and their training labels); None: when the model
    fits its default Kronecker-factored curvature or its exact (N·O)² system has
    N·O ≤ POSTERIOR_AUTO_MAX (otherwise the page says how to turn it on).
    The model is never modified.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if x_test is None:
        raise ValueError("report needs test data x_test (faithfulness is measured on it)")
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(
            f"path must name an .html file (the JSON is written beside it, as "
            f"{path.with_suffix('.json').name}), got {str(path)!r}"
        )
    json_path = path.with_suffix(".json")  # both files checked before any work, or either written
    if not path.parent.is_dir():
        raise ValueError(f"path: directory {path.parent} does not exist (for {str(path)!r})")
    for target in (path, json_path):
        if target.is_dir():
            raise ValueError(f"path: {target} is a directory, not a file the report can write")
        check_replaceable(target, "path")
    if surrogate is not None and not isinstance(surrogate, KernelSurrogate):
        raise TypeError(
            f"surrogate must be a KernelSurrogate of model or None, got {type(surrogate).__name__}"
        )
    if retrain is not None and not callable(retrain):
        raise TypeError(
            "retrain must be a callable (x, y) -> trained network or None, got "
            f"{type(retrain).__name__}"
        )
    if settings is not None and not isinstance(settings, Mapping):
        raise TypeError(
            f"settings must be a dict of extra settings rows or None, got {type(settings).__name__}"
        )
    if image_shape is not None:
        if isinstance(image_shape, str) or not isinstance(image_shape, (Sequence, np.ndarray)):
            raise TypeError(f"image_shape must be (H, W), (C, H, W) or None, got {image_shape!r}")
        image_shape = tuple(check_integer(s, "image_shape's sizes") for s in image_shape)
    if surrogate is not None and surrogate.model is not model:
        raise ValueError(
            "surrogate is a KernelSurrogate of another model (surrogate.model is not model); "
            "pass KernelSurrogate(model, ...) or None"
        )
    cast = inputs.param_dtype(model)  # numpy arrays of floats
    x_train, x_test = (
        inputs.from_numpy(x_train, "x_train", cast),
        inputs.from_numpy(x_test, "x_test", cast),
    )
    for name, value in (("examples", examples), ("top", top), ("kernel_samples", kernel_samples)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    n_train, n_test = inputs.validate(x_train, "x_train"), inputs.validate(x_test, "x_test")
    images = _image_view(x_train, image_shape), _image_view(x_test, image_shape)
    clock = _Clock(progress)

    with clock("network outputs"):
        g_train = logits(model, x_train, output_fn=output_fn, name="x_train")
        g_test = logits(model, x_test, output_fn=output_fn, name="x_test")
        classes = g_train.shape[1]
        if classes < 2:
            raise ValueError(
                f"report needs a classifier with at least two outputs, the model has {classes} "
                f"output ({ONE_LOGIT}; a regression model has no report)"
            )
        y_train = None if y_train is None else labels(y_train, n_train, classes, "y_train")
        y_test = None if y_test is None else labels(y_test, n_test, classes, "y_test")
        p_test = g_test.softmax(1)
        net_test = p_test.argmax(1)
        net_train = g_train.argmax(1)
        own = y_train if y_train is not None else net_train  # training labels, or predictions

    surrogate = (
        KernelSurrogate(model, batch_size=batch_size, device=device, output_fn=output_fn)
        if surrogate is None
        else surrogate
    )
    kind = surrogate.kind
    n_kernel = min(kernel_samples, n_train)
    x_kernel = inputs.take(x_train, slice(0, n_kernel))
    y_kernel = own[:n_kernel]
    with clock("kernel spectrum"):
        k = ntk.empirical_ntk(
            model,
            x_kernel,
            kind=kind,
            batch_size=batch_size,
            device=device,
            output_fn=output_fn,
        ).cpu()
        eigenvalues = ntk.eigenvalues(k).numpy()
        kernel = {
            "kind": kind,
            "samples": n_kernel,
            "eigenvalues": eigenvalues,
            "condition_number": condition_from_eigenvalues(eigenvalues),
            "effective_rank": effective_rank(eigenvalues),
            "trace": float(eigenvalues.sum()),
            "label_alignment": ntk.kernel_alignment(k, y_kernel) if k.dim() == 2 else None,
        }
    with clock("layer importance"):
        layer_rows = layer_importance(
            model,
            x_kernel,
            y_kernel,
            kind=kind,
            batch_size=batch_size,
            device=device,
            output_fn=output_fn,
        )

    with clock("surrogate fit"):
        surrogate.fit(x_train)
    with clock("faithfulness"):
        faith = surrogate.faithfulness(x_test, y_test)
        q_test = torch.as_tensor(surrogate.decision_function(x_test), dtype=torch.float64).softmax(
            1
        )
        sur_test = torch.as_tensor(surrogate.predict(x_test))
        rows = torch.arange(n_test)
        faithfulness = {
            "surrogate": faith,
            "network_probability": p_test[rows, net_test].numpy(),
            "surrogate_probability": q_test[rows, net_test].numpy(),
            "network_prediction": net_test.numpy(),
            "surrogate_prediction": sur_test.numpy(),
            "disagreements": disagreements(net_test, sur_test, classes),
        }

    with clock("attribution"):
        c_test = _predicted_class_contributions(surrogate, x_test, net_test)  # [M, N]
        explained = []
        baseline = None if retrain is None else retrain(x_train, own)
        machine, counterfactual = _counterfactual_machine(
            model,
            surrogate,
            x_train,
            own,
            batch_size=batch_size,
            device=device,
            output_fn=output_fn,
        )
        for i, category in choose_examples(p_test, y_test, examples):
            cls = int(net_test[i])
            one = inputs.take(x_test, slice(i, i + 1))
            sides = _neighbours(surrogate, one, cls, min(top, n_train), own)
            explained.append(
                {
                    "index": i,
                    "category": category,
                    "label": None if y_test is None else int(y_test[i]),
                    "network_prediction": cls,
                    "network_probability": float(p_test[i, cls]),
                    "surrogate_prediction": int(sur_test[i]),
                    "surrogate_probability": float(q_test[i, cls]),
                    "sum_of_contributions": float(c_test[i].sum()),
                    "baseline": float(np.asarray(surrogate.baseline_)[cls]),
                    **sides,
                    "sanity": _sanity(
                        machine, x_train, own, one, cls, c_test[i], sides, retrain, baseline
                    ),
                }
            )
        total_influence = c_test.abs().sum(0).numpy()
        cancellation = float(np.median((c_test.abs().sum(1) / c_test.sum(1).abs()).numpy()))
    with clock("self-influence"):
        self_influence = _self_influence(machine, own)
    with clock("calibration"):
        y_fit = None if y_train is None else y_train[:n_kernel]
        calibration = _calibration(
            model,
            (x_kernel, y_fit),
            (x_test, y_test, p_test),
            posterior,
            top,
            dict(batch_size=batch_size, device=device, output_fn=output_fn),
        )

    result = {
        "title": title,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "settings": _settings(
            model, surrogate, x_train, n_train, n_test, classes, y_train, y_test, settings
        ),
        "versions": versions(),
        "faithfulness": faithfulness,
        "kernel": kernel,
        "attribution": {
            "contribution": "surrogate contribution c_i(x) to the network's predicted class",
            "counterfactual": counterfactual,
            "examples": explained,
            "cancellation": cancellation,
            "total_influence": total_influence,
            "self_influence": self_influence,
            "self_influence_label": "training label"
            if y_train is not None
            else "network prediction",
            "top_total_influence": _ranked(total_influence, 2 * top, own, net_train),
            "top_self_influence": []
            if self_influence is None
            else _ranked(self_influence, 2 * top, own, net_train),
        },
        "layers": {"score": DEFAULT_SCORE, "samples": n_kernel, "rows": layer_rows},
        "calibration": calibration,
    }
    with clock("figures"):
        figures = _figures_for(result, images, top)
    result["seconds"] = {**clock.seconds, "total": sum(clock.seconds.values())}
    clock.close()
    html = _render(result, figures)
    plain = _plain(result)
    text = json.dumps(plain, indent=1, allow_nan=False) + "\n"
    for target, content in ((path, html), (json_path, text)):
        with atomic_path(target) as tmp:  # a failed write names `target`
            tmp.write_bytes(content.encode("utf-8"))
    return plain


# -- numbers -------------------------------------------------------------------------------------


def effective_rank(eigenvalues: np.ndarray) -> float:
    """exp of the Shannon entropy of the normalised positive eigenvalues (Roy & Vetterli, 2007):
    between 1 (one direction) and N (a flat spectrum)."""
    lam = np.clip(np.asarray(eigenvalues, dtype=np.float64), 0, None)
    if lam.sum() <= 0:
        return 0.0
    p = lam[lam > 0] / lam.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


def disagreements(network: torch.Tensor, surrogate: torch.Tensor, classes: int) -> dict:
    """Counts of (network class, surrogate class) over the test examples where they differ."""
    from sklearn.metrics import confusion_matrix

    differ = network != surrogate
    if not bool(differ.any()):
        return {"count": 0, "classes": [], "matrix": []}
    matrix = confusion_matrix(
        network[differ].numpy(), surrogate[differ].numpy(), labels=list(range(classes))
    )
    used = sorted(set(np.nonzero(matrix.any(1))[0]) | set(np.nonzero(matrix.any(0))[0]))
    return {
        "count": int(differ.sum()),
        "classes": [int(c) for c in used],
        "matrix": matrix[np.ix_(used, used)].tolist(),
    }


def choose_examples(p: torch.Tensor, y: torch.Tensor | None, n: int) -> list[tuple[int, str]]:
    """About n test examples spread over categories: `correct` (the most confident correct
    predictions), `wrong` (the most confident mistakes) and `uncertain` (the smallest gap between
    the two most probable classes); without labels, `confident` and `uncertain`. A category short
    of its share leaves its places to the others: n examples whenever p has n rows."""
    confidence, predicted = p.max(1)
    top2 = p.topk(2, dim=1).values
    gap = top2[:, 0] - top2[:, 1]
    if y is None:
        pools = {"confident": torch.argsort(-confidence), "uncertain": torch.argsort(gap)}
    else:
        right = predicted == y
        by_confidence = torch.argsort(-confidence)
        pools = {
            "correct": by_confidence[right[by_confidence]],
            "wrong": by_confidence[~right[by_confidence]],
            "uncertain": torch.argsort(gap),
        }
    chosen: dict[int, str] = {}
    quota = math.ceil(n / len(pools))
    for category, order in pools.items():
        fresh = [int(i) for i in order if int(i) not in chosen][:quota]
        chosen.update((i, category) for i in fresh)
    # the places of a category short of its quota (no mistakes: no `wrong`) go to the others
    for category, order in pools.items():
        for i in order.tolist():
            if len(chosen) >= n:
                break
            chosen.setdefault(i, category)
    rank = {category: j for j, category in enumerate(pools)}
    return sorted(list(chosen.items())[:n], key=lambda item: rank[item[1]])


def _predicted_class_contributions(surrogate, x, classes: torch.Tensor) -> torch.Tensor:
    """c_i(x)[class of x] for every test x and training point i: [M, N]."""
    c = torch.as_tensor(surrogate.attribute(x), dtype=torch.float64)
    return c[torch.arange(c.shape[0]), :, classes]


def _self_influence(machine, own: torch.Tensor) -> np.ndarray | None:
    """d(x_i) − d_{−i}(x_i) for the label of i: how much the counterfactual `machine`'s output
    for a training point's own label drops when that point alone is removed (exact refit,
    `KernelSurrogate.self_influence`). A point that only it supports (mislabelled, atypical)
    drops most; its own contribution c_i(x_i), shown before, ranked flipped labels last
    (mislabel AUC 0.00–0.35 on 16 networks with 10 % flipped labels, 0.77–0.99 for this). None
    without one."""
    if machine is None:
        return None
    drop = machine.self_influence(output="all")  # the machine may be fitted to other columns
    return drop[np.arange(len(drop)), own.numpy()]


def _neighbours(surrogate, x_one, cls: int, top: int, own: torch.Tensor) -> dict:
    """The `top` proponents and opponents of one test example's output `cls`."""
    sides = {}
    for side, sign in (("proponents", 1.0), ("opponents", -1.0)):
        idx, values = getattr(surrogate, side)(x_one, k=top, output=cls)
        sides[side] = [  # of fewer than `top` contributions of the side's sign, only those
            {"index": int(j), "label": int(own[j]), "contribution": float(v)}
            for j, v in zip(idx[0], values[0])
            if v * sign > 0
        ]
    return sides


def _counterfactual_machine(model, surrogate, x_train, own, **opts) -> tuple:
    """The kernel machine whose removal effects the sanity strips show, and its description: the
    Gauss–Newton machine fitted to the training labels (`own`: the labels, or the network's
    predictions) at `influence`'s damping, `influence(method="surrogate")`'s machine, whose removal
    effects predict retraining (results/surrogate.md); when its (N·O)² system does not fit in
    memory, the surrogate itself if it has a removal formula (else None)."""
    try:
        machine = KernelSurrogate(
            model,
            kind=surrogate.kind,
            machine="gauss_newton",
            effective_parameters=DOF_FRACTION,
            **opts,
        ).fit(x_train, own)
        return machine, "Gauss–Newton kernel machine fitted to the training labels (exact refit)"
    except MemoryError:
        if surrogate.removable_:
            return (
                surrogate,
                "the surrogate itself (exact refit; the Gauss–Newton machine did not fit)",
            )
        return (
            None,
            "none (the Gauss–Newton machine did not fit; the surrogate has no refit formula)",
        )


def _sanity(machine, x_train, own, x_one, cls, c_row, sides, retrain, baseline) -> dict:
    """A card's sanity strip: cancellation Σ|c_i|/|Σc_i| of its contributions, the share of its
    proponents whose label is the predicted class, and the counterfactual of removing those
    proponents: the change of the counterfactual `machine`'s output for the class, centred over
    its outputs (`KernelSurrogate.influence`, exact refit; None without a machine) next to the
    change of the network's per-sample centred logit after `retrain` without them (None without
    `retrain`)."""
    gone = np.array([p["index"] for p in sides["proponents"]], dtype=int)
    card = {
        "cancellation": float(cancellation(c_row.numpy()[None])[0]),
        "proponent_label_share": float(np.mean([p["label"] == cls for p in sides["proponents"]]))
        if len(gone)
        else None,
        "removed": len(gone),
        "counterfactual_change": None,
        "network_change": None,
    }
    if len(gone) == 0:  # no training example raises this output
        return card
    if machine is not None and len(gone) < len(own):
        drop = machine.influence(x_one, gone, output="all")[0]
        card["counterfactual_change"] = -float(drop[cls] - drop.mean())
    if retrain is not None:
        keep = torch.ones(len(own), dtype=torch.bool)
        keep[torch.as_tensor(gone)] = False
        without = retrain(inputs.take(x_train, keep.nonzero().squeeze(1)), own[keep])

        def centred(net):
            g = logits(net, x_one)[0]
            return float(g[cls] - g.mean())

        card["network_change"] = centred(without) - centred(baseline)
    return card


def _calibration(model, fit, test, enabled: bool | None, top: int, opts: dict) -> dict:
    """The calibration section: `NTKPosterior` fitted on fit = (x, labels), compared with the
    network's softmax on test = (x_test, y_test or None, network probabilities)."""
    x_fit, y_fit = fit
    x_test, y_test, p_test = test
    n, classes = inputs.count(x_fit), p_test.shape[1]
    size = n * classes
    if y_fit is None:
        return {"enabled": False, "note": "needs training labels (y_train)"}
    if enabled is False:
        return {"enabled": False, "note": "turned off (posterior=False)"}
    factored_only = enabled is None and size > POSTERIOR_AUTO_MAX
    if factored_only:  # large: only the factored curvature, whose cost is linear in N
        opts = dict(opts, curvature="ekfac")
    # with enough labelled test samples δ minimises the NLL of the even-numbered ones and the
    # metrics are measured on the odd-numbered ones (`NTKPosterior.fit(validation=...)`);
    # otherwise δ and the temperature are NTKPosterior's default (the shape of
    # SHAPE_EFFECTIVE_PARAMETERS effective parameters, the size of EFFECTIVE_PARAMETERS capped by
    # TRAINING_VARIANCE_RATIO)
    tuned = y_test is not None and len(y_test) >= VALIDATION_MIN
    tune, held = slice(0, None, 2), slice(1, None, 2)
    validation = (inputs.take(x_test, tune), y_test[tune]) if tuned else None
    try:
        post = NTKPosterior(model, **opts).fit(x_fit, y_fit, validation=validation)
    except UnfactorableModelError as err:
        if not factored_only:
            raise
        return {
            "enabled": False,
            "note": (
                f"off by default: the model does not fit the factored curvature ({err}), and "
                f"the exact posterior solves an (N·O)² system with N·O = {size:,} > "
                f"{POSTERIOR_AUTO_MAX:,}; turn it on with posterior=True (ntk report "
                "--posterior) or lower the kernel samples"
            ),
        }
    q_test = torch.as_tensor(post.predict_proba(x_test))
    uncertainty = entropy(q_test)
    net_pred, post_pred = p_test.argmax(1), q_test.argmax(1)
    least_sure = [
        {
            "index": i,
            "label": None if y_test is None else int(y_test[i]),
            "entropy": float(uncertainty[i]),
            "network_prediction": int(net_pred[i]),
            "network_probability": float(p_test[i, net_pred[i]]),
            "posterior_prediction": int(post_pred[i]),
            "posterior_probability": float(q_test[i, post_pred[i]]),
        }
        for i in uncertainty.argsort(descending=True)[: 2 * top].tolist()
    ]
    out = {
        "enabled": True,
        "note": None,
        "samples": n,
        "kind": post.kind,
        "curvature": post.curvature_,
        "prior_precision": post.prior_precision_,
        "prior_precision_by": (
            "validation NLL on the even-numbered test samples"
            if tuned
            else f"rule keeping {SHAPE_EFFECTIVE_PARAMETERS:.3g} effective parameters, scaled "
            f"to the logit variance on the training inputs of {EFFECTIVE_PARAMETERS:.3g} "
            f"effective parameters, at most {TRAINING_VARIANCE_RATIO:g} of their spread "
            f"(temperature {post.temperature_:.3g}; the default)"
        ),
        "least_sure": least_sure,
        "largest_probability_change": float((q_test - p_test).abs().max()),
        "metrics_samples": None,
        "metrics_split": None,
        "metrics": None,
        "reliability": None,
    }
    if y_test is not None:
        y = y_test.numpy()
        rows = held if tuned else slice(None)
        p, q, y = p_test.numpy()[rows], q_test.numpy()[rows], y[rows]
        out["metrics_samples"] = len(y)
        out["metrics_split"] = "odd-numbered test" if tuned else "test"
        out["metrics"] = {
            "network": calibration_metrics(p, y),
            "posterior": calibration_metrics(q, y),
        }
        out["reliability"] = {"network": reliability(p, y), "posterior": reliability(q, y)}
    return out


def _ranked(values: np.ndarray, n: int, own: torch.Tensor, net_train: torch.Tensor) -> list[dict]:
    """The n training examples with the largest values, with their labels and predictions."""
    order = np.argsort(-values)[:n]
    return [
        {
            "index": int(i),
            "label": int(own[i]),
            "network_prediction": int(net_train[i]),
            "value": float(values[i]),
        }
        for i in order
    ]


# -- settings -------------------------------------------------------------------------------------


def versions() -> dict:
    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "ntk-toolkit": version("ntk-toolkit"),
        "python": platform.python_version(),
        **{
            name: version(name)
            for name in ("torch", "numpy", "scipy", "scikit-learn", "matplotlib")
        },
        "platform": platform.platform(),
    }


def _settings(model, surrogate, x_train, n_train, n_test, classes, y_train, y_test, extra) -> dict:
    trainable = ModelView(model).num_params
    shape = inputs.signature(x_train)
    options = {
        k: v
        for k, v in surrogate.get_params(deep=False).items()
        if isinstance(v, (str, int, float, bool, type(None)))
    }
    options["chosen alpha"] = getattr(surrogate, "alpha_", None)
    return {
        "model": type(model).__name__,
        "trainable_parameters": trainable,
        "architecture": str(model),
        "train_samples": n_train,
        "test_samples": n_test,
        "input_shape": shape,
        "outputs": classes,
        "train_labels": y_train is not None,
        "test_labels": y_test is not None,
        "surrogate": {"class": type(surrogate).__name__, **options},
        **(extra or {}),
    }


# -- figures and HTML ------------------------------------------------------------------------------


def _image_view(x, image_shape) -> np.ndarray | None:
    """The inputs as images [N, H, W] or [N, C, H, W] when they are (or `image_shape` says so)."""
    if not isinstance(x, torch.Tensor):
        if image_shape is not None:
            raise ValueError("image_shape needs tensor inputs, not a tuple or dict of tensors")
        return None
    if image_shape is not None:  # a tuple of positive ints (checked by `report`)
        if math.prod(image_shape) != x[0].numel() or len(image_shape) not in (2, 3):
            raise ValueError(
                f"image_shape {image_shape} does not fit samples of shape {tuple(x.shape[1:])} "
                "(give (H, W) or (C, H, W))"
            )
        return x.detach().cpu().float().reshape(-1, *image_shape).numpy()
    if x.dim() == 3 or (x.dim() == 4 and x.shape[1] in (1, 3)):
        return x.detach().cpu().float().numpy()
    return None


def _figures_for(result: dict, images, top: int) -> dict:
    faith, kernel, attr = result["faithfulness"], result["kernel"], result["attribution"]
    agree = faith["network_prediction"] == faith["surrogate_prediction"]
    layer_rows = result["layers"]["rows"]
    figures = {
        "scatter": _figures.faithfulness_scatter(
            faith["network_probability"], faith["surrogate_probability"], agree
        ),
        "spectrum": _figures.spectrum(kernel["eigenvalues"]),
        "layers": _figures.bars(
            [f"{layer_label(r['layer'])} ({r['type']})" for r in layer_rows],
            [r[DEFAULT_SCORE] or 0.0 for r in layer_rows],
            DEFAULT_SCORE,
        ),
        "examples": [],
        "total_influence": None,
        "self_influence": None,
        "reliability": None,
        "least_sure": None,
    }
    calibration = result["calibration"]
    if calibration.get("reliability"):
        curves = calibration["reliability"]
        figures["reliability"] = _figures.reliability_diagram(
            {"network softmax": curves["network"], "NTK posterior": curves["posterior"]}
        )
    train_images, test_images = images
    if calibration["enabled"] and test_images is not None:
        rows = calibration["least_sure"]
        figures["least_sure"] = _figures.image_row(
            [test_images[r["index"]] for r in rows],
            [
                f"#{r['index']} y={r['label']}\nNTK {r['posterior_prediction']} "
                f"{r['posterior_probability']:.2f}"
                for r in rows
            ],
        )
    if train_images is None or test_images is None:
        return figures
    for e in attr["examples"]:
        pictures = [test_images[e["index"]]] + [
            train_images[p["index"]] for p in e["proponents"] + e["opponents"]
        ]
        captions = [f"test #{e['index']}\npred {e['network_prediction']}"] + [
            f"#{p['index']} y={p['label']}\n{p['contribution']:+.3g}"
            for p in e["proponents"] + e["opponents"]
        ]
        colors = ["black"] + ["#1a7f37"] * len(e["proponents"]) + ["#cf222e"] * len(e["opponents"])
        figures["examples"].append(_figures.image_row(pictures, captions, colors))
    for name in ("total_influence", "self_influence"):
        ranked = attr[f"top_{name}"]
        if not ranked:
            continue
        figures[name] = _figures.image_row(
            [train_images[r["index"]] for r in ranked],
            [f"#{r['index']} y={r['label']}\npred {r['network_prediction']}" for r in ranked],
        )
    return figures


def _render(result: dict, figures: dict) -> str:
    from jinja2 import Environment, PackageLoader

    env = Environment(
        loader=PackageLoader("attribution", "templates"),
        autoescape=True,  # one HTML template; names and titles come from the user
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = _number
    env.filters["probability"] = _probability
    env.filters["layer"] = layer_label
    env.tests["infinite"] = lambda value: isinstance(value, float) and math.isinf(value)
    return env.get_template("report.html.j2").render(
        r=result, fig=figures, score=DEFAULT_SCORE, measures=MEASURES, singular=SINGULAR_KERNEL
    )


def _number(value, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    if isinstance(value, (float, np.floating)):
        return f"{float(value):.{digits}g}" if math.isfinite(value) else str(float(value))
    return str(value)


def _probability(value, relation: bool = False) -> str:
    """A probability to 3 significant figures that reads 1 or 0 only when it is: "> 0.999" and
    "< 0.001" otherwise; relation=True puts "= " before the other values ("p = 0.5")."""
    if value is not None and 0.999 < value < 1:
        return "> 0.999"
    if value is not None and 0 < value < 0.001:
        return "< 0.001"
    return ("= " if relation else "") + _number(value, 3)


def _plain(value):
    """JSON-ready: arrays and tensors as lists, non-finite floats as None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return _plain(value.tolist())
    if isinstance(value, (np.floating, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    return value


class _Clock:
    """Times each stage; a progress bar over the stages when `progress`."""

    def __init__(self, progress: bool):
        self.seconds: dict[str, float] = {}
        self.bar = tqdm(total=len(STAGES), disable=not progress, desc="report", unit="step")

    @contextmanager
    def __call__(self, stage: str):
        self.bar.set_description(stage)
        start = time.perf_counter()
        yield
        self.seconds[stage] = time.perf_counter() - start
        self.bar.update()

    def close(self) -> None:
        self.bar.close()
