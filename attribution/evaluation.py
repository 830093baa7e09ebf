"""Offline evaluation of data attribution: the linear datamodeling score (LDS), a vmapped
retraining harness for random α-subsets, and mislabelled-example detection.

LDS (Park et al., ICML 2023, "TRAK: Attributing model behavior at scale"): draw subsets S_j of
the training set, retrain on each, record the output f_j(z) on every test example z; the score of
an attribution τ is the Spearman correlation over j between Σ_{i∈S_j} τ(z, i) and f_j(z), averaged
over z.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import spearmanr
from sklearn.metrics import brier_score_loss, roc_auc_score
from torch import nn
from torch.func import stack_module_state

from ntk.core import inputs
from ntk.core.checks import check_amount, check_integer
from ntk.core.kinds import class_labels
from ntk.core.model import (
    FunctionalCall,
    check_output_fn,
    copy_module,
    from_factory,
    naming_failures,
)
from ntk.core.seeding import seeded
from ntk.demo import adam

from .layers import check_labels
from .outputs import labels, margins

# relative size of float64 rounding below which `lds` takes two predictions (or outputs) as equal
ROUNDING_EPS = 64 * np.finfo(np.float64).eps


def random_subsets(n: int, num_subsets: int, alpha: float = 0.5, *, seed: int = 0) -> torch.Tensor:
    """`num_subsets` random subsets of size round(α·n) of range(n), as a bool mask [num_subsets,
    n]."""
    n = check_integer(n, "n", least=0)
    num_subsets = check_integer(num_subsets, "num_subsets")
    check_amount(alpha, "alpha", below=1)
    seed = check_integer(seed, "seed", least=None)
    size = round(alpha * n)
    if not 0 < size < n:
        raise ValueError(f"alpha={alpha} gives empty or full subsets of {n} examples")
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(num_subsets, n, dtype=torch.bool)
    for j in range(num_subsets):
        mask[j, torch.randperm(n, generator=gen)[:size]] = True
    return mask


def _array(x) -> np.ndarray:
    """`x` (a tensor on any device, with or without autograd history, a numpy array or a list)
    as a numpy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _numbers(x, name: str) -> np.ndarray:
    """`_array(x)`, refused naming `name` unless it holds numbers (not strings or objects)."""
    return inputs.numbers(_array(x), name)


def _as_mask(subsets, n: int) -> torch.Tensor:
    try:
        mask = torch.as_tensor(_array(subsets))
    except (TypeError, ValueError):  # ragged index lists, objects
        raise ValueError(
            f"subsets must be a 0/1 (or bool) mask [num_subsets, {n}], one row per subset "
            "(index lists are not read)"
        ) from None
    if mask.dim() != 2 or mask.shape[1] != n:
        raise ValueError(
            f"subsets must be a mask [num_subsets, {n}], got shape {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("subsets must be a 0/1 (or bool) mask")
    return mask.bool()


def lds(scores, subsets, subset_outputs) -> float:
    """Linear datamodeling score of attribution `scores` [N_test, N_train].

    `subsets` is a 0/1 mask [S, N_train] of the training examples each retrained model saw and
    `subset_outputs` [S, N_test] the retrained models' outputs (e.g. margins, averaged over seeds).
    Test examples whose outputs or predictions are constant over subsets are skipped (warning).
    """
    scores = torch.as_tensor(_numbers(scores, "scores"), dtype=torch.float64)
    outputs = torch.as_tensor(_numbers(subset_outputs, "subset_outputs"), dtype=torch.float64)
    if scores.dim() != 2 or 0 in scores.shape:
        raise ValueError(
            f"scores must be [N_test, N_train] with at least one of each, got shape "
            f"{tuple(scores.shape)}"
        )
    mask = _as_mask(subsets, scores.shape[1])
    if tuple(outputs.shape) != (mask.shape[0], scores.shape[0]):
        raise ValueError(
            f"subset_outputs must be [num_subsets, N_test] = "
            f"[{mask.shape[0]}, {scores.shape[0]}], got {tuple(outputs.shape)}"
        )
    for name, values in (("scores", scores), ("subset_outputs", outputs)):
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"{name} must be finite (it holds NaN or infinite values)")
    if mask.shape[0] < 3:
        raise ValueError(
            f"the LDS is a rank correlation over subsets: it needs at least 3, got {mask.shape[0]}"
        )
    predicted = (mask.double() @ scores.T).numpy()
    # a sum's rounding error is of the order of eps times the sum of its terms' magnitudes:
    # predictions that differ by no more are equal (a test example with one score for every
    # training example predicts c·|S| for subsets of equal size, differing in the last bits)
    rounding = ROUNDING_EPS * (mask.double() @ scores.abs().T).numpy().max(0)
    rhos = []
    for z in range(scores.shape[0]):
        a, b = predicted[:, z], outputs[:, z].numpy()
        if np.ptp(a) > rounding[z] and np.ptp(b) > ROUNDING_EPS * np.abs(b).max():
            rhos.append(spearmanr(a, b).statistic)
    if len(rhos) < scores.shape[0]:
        warnings.warn(
            f"{scores.shape[0] - len(rhos)} test examples have constant outputs or "
            "predictions over the subsets and were skipped",
            RuntimeWarning,
            stacklevel=2,
        )
    if not rhos:
        raise ValueError("every test example has constant outputs or predictions over the subsets")
    return float(np.mean(rhos))


@dataclass
class SubsetModels:
    """Models trained on subsets: parameters stacked [S·seeds, ...] (subset-major) over one base."""

    base: nn.Module
    params: dict
    buffers: dict
    num_subsets: int
    seeds: int
    output_fn: Callable | None = None

    def outputs(self, x) -> torch.Tensor:
        """Outputs of every model on x (a tensor, or a tuple/dict of tensors sharing the sample
        axis): [S, seeds, N, O]."""
        x = inputs.from_numpy(x, "x", inputs.param_dtype(self.base))  # numpy arrays of floats
        inputs.validate(x, "x")
        _check_fits(self.base, x)
        forward = FunctionalCall(self.base)
        call = lambda p, b: _call(forward, p, b, x, self.output_fn)  # noqa: E731
        with torch.no_grad():
            out = torch.vmap(call)(self.params, self.buffers)
        return out.reshape(self.num_subsets, self.seeds, *out.shape[1:])

    def margins(self, x, y: torch.Tensor) -> torch.Tensor:
        """Margins g_y − logsumexp_{j≠y} g_j on (x, y), averaged over seeds: [S, N]."""
        out = self.outputs(x).double()
        return margins(out, labels(y, out.shape[2], out.shape[3]).to(out.device)).mean(1)

    def modules(self) -> list[nn.Module]:
        """Every model as a module of its own (eval mode), subset-major: model s·seeds + r was
        trained on subset s with seed r. Networks trained on random halves of the training set
        (`random_subsets`), averaged by `influence(checkpoints=...)`, predict retraining better
        than networks trained on all of it (`benchmarks/training_logits.py --ensemble`)."""
        stacked = {**self.params, **self.buffers}
        out = []
        for j in range(self.num_subsets * self.seeds):
            module = copy_module(self.base)
            named = itertools.chain(module.named_parameters(), module.named_buffers())
            with torch.no_grad():  # named_parameters names a tied tensor once, as stacked
                for name, tensor in named:
                    tensor.copy_(stacked[name][j])
            out.append(module.eval())
        return out


def train_on_subsets(
    factory: Callable[[], nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    subsets,
    *,
    seeds: int = 1,
    epochs: int = 60,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 1e-4,
    loss: str = "cross_entropy",
    chunk: int = 256,
    output_fn: Callable | None = None,
) -> SubsetModels:
    """Train one model per (subset, seed) with Adam, all at once with `torch.func.vmap`.

    Model (s, r) is `factory()` built after seeding torch with r (the same initialisation for
    every subset, so that subsets differ only in their data) and sees its subset in a random order
    drawn from seed r, in minibatches of `batch_size`, for `epochs` epochs — the recipe of
    `ntk.demo.train`. Adam is elementwise, so one Adam over the stacked parameters is exactly an
    independent Adam per model. `loss`: "cross_entropy" (y class labels) or "mse" (y targets).
    Models are trained `chunk` at a time to bound memory. x: a tensor, or a tuple/dict of tensors
    sharing the sample axis (e.g. input_ids and attention_mask, passed as keyword arguments);
    output_fn maps the model's output to the logits [B, O] (e.g. `lambda out: out.logits`). The
    models are vmapped, so the model's forward must not branch on data (models that cannot be
    vmapped are refused by torch.func). numpy arrays of floats are cast to the model's parameter
    dtype; inputs the model cannot take are refused naming x (`ModelInputError`). Parameters the
    factory's module freezes (requires_grad=False) stay as built, and a module the factory hands
    out (`lambda: model`) is never changed.
    """
    if isinstance(factory, nn.Module) or not callable(factory):
        raise TypeError(
            "factory must be a function that builds a new nn.Module (e.g. lambda: MyNet()), got "
            f"{type(factory).__name__}"
        )
    check_output_fn(output_fn)
    # a copy of the first model `_train_chunk` builds: its dtype, and x checked against it
    probe = from_factory(factory, 0).eval()
    x = inputs.from_numpy(x, "x", inputs.param_dtype(probe))  # numpy arrays of floats
    n = inputs.validate(x, "x")
    y = inputs.targets(y)
    if len(y) != n:
        raise ValueError(f"x holds {n} samples but y holds {len(y)}")
    mask = _as_mask(subsets, n)
    sizes = mask.sum(1)
    if not bool((sizes == sizes[0]).all()) or int(sizes[0]) == 0:
        raise ValueError("every subset must be non-empty and of the same size")
    if loss not in ("cross_entropy", "mse"):
        raise ValueError(f"loss must be 'cross_entropy' or 'mse', got {loss!r}")
    if loss == "cross_entropy":  # integer labels ≥ 0 of any dtype (their range: `_train_chunk`)
        y = class_labels(y, n, None, "y")
    else:  # finite targets (their width: `_train_chunk`)
        y = check_labels(y, n)
    for name, value, least in (
        ("seeds", seeds, 1),
        ("epochs", epochs, 0),
        ("batch_size", batch_size, 1),
        ("chunk", chunk, 1),
    ):
        check_integer(value, name, least=least)
    _check_fits(probe, x)
    members = torch.stack([torch.nonzero(row).squeeze(1) for row in mask])  # [S, m]
    jobs = [(s, r) for s in range(len(members)) for r in range(seeds)]
    trained = [
        _train_chunk(
            factory,
            x,
            y,
            members,
            jobs[i : i + chunk],
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            weight_decay=weight_decay,
            loss=loss,
            output_fn=output_fn,
        )
        for i in range(0, len(jobs), chunk)
    ]
    params = {k: torch.cat([t[0][k] for t in trained]) for k in trained[0][0]}
    buffers = {k: torch.cat([t[1][k] for t in trained]) for k in trained[0][1]}
    base = copy_module(trained[0][2])
    return SubsetModels(base, params, buffers, len(members), seeds, output_fn)


def _check_fits(model: nn.Module, x) -> None:
    """One sample of x through `model` (in eval mode): inputs it cannot take (a float64 tensor
    for a float32 model) are refused naming x (`ModelInputError`), not deep in the vmap."""
    one = inputs.take(x, slice(0, 1))
    args, kwargs = inputs.as_call(one)
    with torch.no_grad():
        naming_failures(model, one, "x", lambda: model(*args, **kwargs))


def _call(forward: FunctionalCall, params: dict, buffers: dict, x, output_fn: Callable | None):
    """The functional forward of the base module with (params, buffers) on inputs x, through
    output_fn."""
    args, kwargs = inputs.as_call(x)
    out = forward({**params, **buffers}, args, kwargs)
    return out if output_fn is None else output_fn(out)


def _train_chunk(
    factory, x, y, members, jobs, *, epochs, batch_size, lr, weight_decay, loss, output_fn
):
    models = []
    for _, r in jobs:
        with seeded(r):  # the caller's random state (CPU and GPUs) is left as it was
            models.append(factory())
    base = copy_module(models[0]).train()
    params, buffers = stack_module_state(models)  # requires_grad as in the factory's modules
    opt = adam(params.values(), lr, weight_decay)
    m = members.shape[1]
    gens = {r: torch.Generator().manual_seed(r) for r in {r for _, r in jobs}}
    rows = torch.tensor([s for s, _ in jobs])
    seed_of = [r for _, r in jobs]
    forward = FunctionalCall(base)
    call = lambda p, b, xb: _call(forward, p, b, xb, output_fn)  # noqa: E731
    checked = False  # the labels' range or the targets' width, once the outputs are known
    for _ in range(epochs):
        orders = {r: torch.randperm(m, generator=g) for r, g in gens.items()}
        order = torch.stack([orders[r] for r in seed_of])  # [K, m]
        for start in range(0, m, batch_size):
            idx = members[rows[:, None], order[:, start : start + batch_size]]  # [K, B]
            out = torch.vmap(call, randomness="different")(params, buffers, inputs.take(x, idx))
            target = y[idx]
            if not checked:
                _check_against_outputs(y, out.shape[-1], loss)
                checked = True
            if loss == "cross_entropy":
                per_model = (
                    nn.functional.cross_entropy(
                        out.flatten(0, 1), target.flatten(), reduction="none"
                    )
                    .view(idx.shape)
                    .mean(1)
                )
            else:
                diff = out - target.reshape(out.shape)
                per_model = diff.pow(2).flatten(1).mean(1)
            opt.zero_grad()
            per_model.sum().backward()
            opt.step()
    return ({k: v.detach() for k, v in params.items()}, buffers, base.eval())


def _check_against_outputs(y: torch.Tensor, o: int, loss: str) -> None:
    """Class labels in 0..o−1 (cross-entropy) or o target values per sample (mse)."""
    if loss == "cross_entropy":
        class_labels(y, len(y), o, "y")
    elif y[0].numel() != o:
        raise ValueError(
            f"y holds {y[0].numel()} target value(s) per sample; loss='mse' needs one per model "
            f"output ({o})"
        )


def flip_labels(y: torch.Tensor, fraction: float, num_classes: int, *, seed: int = 0):
    """Replace the labels of a random `fraction` of examples by a different random class.
    Returns (noisy labels, bool mask of the flipped examples)."""
    check_amount(fraction, "fraction", below=1)
    num_classes = check_integer(num_classes, "num_classes", least=2)
    seed = check_integer(seed, "seed", least=None)
    y = inputs.targets(y, "y")
    y = class_labels(y, len(y), num_classes, "y")
    gen = torch.Generator().manual_seed(seed)
    n = len(y)
    flipped = torch.zeros(n, dtype=torch.bool)
    flipped[torch.randperm(n, generator=gen)[: max(1, math.floor(fraction * n))]] = True
    shift = torch.randint(1, num_classes, (n,), generator=gen)
    noisy = torch.where(flipped, (y + shift) % num_classes, y)
    return noisy, flipped


def mislabel_auc(self_influence: Sequence[float], flipped: Sequence[bool]) -> float:
    """ROC AUC of detecting flipped labels by ranking training examples by self-influence.
    self_influence [N] scores, flipped [N] a mask (booleans or 0/1) with both flipped and clean
    samples (the AUC compares the two)."""
    scores, mask = _numbers(self_influence, "self_influence"), _array(flipped)
    if scores.ndim != 1 or mask.ndim != 1:
        raise ValueError(
            f"self_influence and flipped must be 1-D, one entry per sample, got shapes "
            f"{scores.shape} and {mask.shape}"
        )
    if len(scores) != len(mask):
        raise ValueError(
            f"self_influence has {len(scores)} scores but flipped has {len(mask)} entries; "
            "they must be of the same samples"
        )
    if mask.dtype != bool:
        odd = ~np.isin(mask, (0, 1))
        if odd.any():
            i = int(np.argmax(odd))
            raise ValueError(
                f"flipped must be a mask of 0/1 or booleans, got {mask[i].item()!r} at sample {i}"
            )
        mask = mask.astype(bool)
    scores = scores.astype(np.float64)
    if not np.isfinite(scores).all():
        i = int(np.argmax(~np.isfinite(scores)))
        raise ValueError(f"self_influence must be finite, got {scores[i]} at sample {i}")
    if mask.all() or not mask.any():
        raise ValueError(
            f"the mislabel AUC needs both flipped and clean samples; flipped marks "
            f"{int(mask.sum())} of {len(mask)}"
        )
    return float(roc_auc_score(mask, scores))


def _probabilities(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    """probs as float64 rows [N ≥ 1, C] of class probabilities (finite, non-negative) and labels
    as class indices [N] in 0..C−1, refused naming the argument otherwise."""
    p, y = _numbers(probs, "probs").astype(np.float64), _array(labels)
    if p.ndim != 2 or p.shape[1] < 2 or y.shape != (p.shape[0],):
        raise ValueError(
            f"probs must be [N, C] (a column per class, at least two; two classes: [1 − p, p]) "
            f"and labels [N], one per row of probs, got shapes {p.shape} and {y.shape}"
        )
    if len(p) == 0:
        raise ValueError("probs holds no samples: calibration needs at least one")
    if not np.isfinite(p).all() or (p < 0).any():
        raise ValueError("probs must be finite and non-negative")
    return p, class_labels(y, len(p), p.shape[1], "labels").numpy()


def reliability(probs, labels, n_bins: int = 15) -> dict[str, np.ndarray]:
    """The reliability diagram's bins: the confidence max_c p_c cut into `n_bins` equal-width
    bins, bin b holding confidences in ((b−1)/n_bins, b/n_bins] (the first also 0). Returns, for
    the non-empty bins in order, "confidence" (mean), "accuracy" (fraction correct) and "count".
    probs [N, C] rows of class probabilities (each summing to 1), labels [N] class indices."""
    p, y = _probabilities(probs, labels)
    off = np.abs(p.sum(1) - 1) > 1e-2
    if off.any():
        i = int(np.argmax(off))
        raise ValueError(
            f"probs must be rows of class probabilities summing to 1; row {i} sums to "
            f"{p[i].sum():.4g} (calibration_metrics renormalises its rows)"
        )
    n_bins = check_integer(n_bins, "n_bins")
    confidence, correct = p.max(1), (p.argmax(1) == y)
    bins = np.clip(np.ceil(confidence * n_bins).astype(int) - 1, 0, n_bins - 1)
    used = np.unique(bins)
    return {
        "confidence": np.array([confidence[bins == b].mean() for b in used]),
        "accuracy": np.array([correct[bins == b].mean() for b in used]),
        "count": np.array([(bins == b).sum() for b in used]),
    }


def expected_calibration_error(probs, labels, n_bins: int = 15) -> float:
    """ECE = Σ_b (|B_b|/N) |acc(B_b) − conf(B_b)| over the bins of `reliability` (Guo et al.,
    ICML 2017)."""
    bins = reliability(probs, labels, n_bins)
    gaps = np.abs(bins["accuracy"] - bins["confidence"])
    return float((bins["count"] * gaps).sum() / bins["count"].sum())


def calibration_metrics(probs, labels, n_bins: int = 15) -> dict[str, float]:
    """Accuracy, negative log-likelihood −mean_i log p_i,y_i, ECE (`n_bins` bins) and Brier score
    (mean_i Σ_c (p_ic − [y_i = c])², the squared distance to the one-hot label, for two classes
    too: scikit-learn's binary default halves it) of class probabilities [N, C]
    (rows renormalised in float64) against labels [N]. A label's probability of exactly 0 counts
    as the smallest positive float64 (708 nats; scikit-learn's log_loss clips at 2.2e-16, so
    every confident mistake counted 36 nats at most)."""
    p, y = _probabilities(probs, labels)
    total = p.sum(1, keepdims=True)
    if not (total > 0).all():
        raise ValueError(f"probs row {int(np.argmin(total[:, 0] > 0))} sums to 0")
    p = p / total
    classes = list(range(p.shape[-1]))
    return {
        "accuracy": float((p.argmax(-1) == y).mean()),
        "nll": float(
            -np.log(np.maximum(p[np.arange(len(y)), y], np.finfo(np.float64).tiny)).mean()
        ),
        "ece": expected_calibration_error(p, y, n_bins),
        "brier": float(brier_score_loss(y, p, labels=classes, scale_by_half=False)),
    }
