"""Architecture proxies: how well will a network train, judged before (or just after) training.

Kernel proxies read the empirical NTK Θ of one batch (kind `sum_logits` by default, the
pseudo-NTK of Mohamadi et al., ICML 2023):

- `lga`  Label-Gradient Alignment (Mok et al., CVPR 2022): the Pearson correlation of the entries
  of Θ with the label-agreement matrix L_ij = ±1, ⟨Θ − μ_Θ, L − μ_L⟩_F / (‖Θ − μ_Θ‖ ‖L − μ_L‖).
- `condition_number`  TE-NAS (Chen et al., ICLR 2021): κ = λmax/λmin, reported as −log κ so that
  higher is better; the raw κ is kept in `ProxyScore.raw`.
- `trace` tr Θ, `frobenius` ‖Θ‖_F, `mean` the mean entry of Θ (KNAS, Xu et al., KDD 2021).
- normalised and per-layer variants: `lga_cosine` LGA of the cosine kernel
  Θ_ij / √(Θ_ii Θ_jj) (each sample's gradient scale divided out); `lga_centred` the centred
  alignment ⟨HΘH, HLH⟩_F / (‖HΘH‖ ‖HLH‖), H = I − 11ᵀ/n (Cortes et al., JMLR 2012);
  `layer_condition` the mean over layers l of −log κ(Θ_l), Θ_l the layer's own kernel
  (layer kernels with λmin ≤ 1e-10 λmax, numerically singular, left out; NaN when all are).
- `label_condition`  −log κ of the label-aware kernel, the lpNTK s(y_i)ᵀ Θ(x_i, x_j) s(y_j) with
  s(y) = 2e_y − 1 (Guo et al., ICLR 2024; `ntk.empirical_ntk(kind="lpntk")`): the conditioning
  of the kernel in the directions the labels point the outputs; needs labels, and always uses
  the lpNTK (the `kind` option does not apply). With two classes (or one logit) s(y) = ±(1, −1):
  the lpNTK is D Θ₀₁ D, Θ₀₁ the kernel of f₀ − f₁ and D = diag(±1), whose κ the labels do not
  change. Other kernel metrics read the lpNTK with kind="lpntk".
- `descent`  what a short training can fit: −log of the share of the centred one-hot labels Y
  that T = 256 steps of gradient descent on the linearised network (step 1/λmax, from zero
  outputs) leave unfitted, Σ_i (1 − λ_i/λmax)^{2T} ‖u_iᵀY‖² / ‖Y‖² over the eigenpairs of Θ
  (`ntk.spectrum.descent_residual`; the share is `ProxyScore.raw`). It reads both what κ reads
  (the slow directions) and what LGA reads (how much of Y the fast ones hold).

Zero-cost baselines (Abdelfattah et al., ICLR 2021) on the same batch, with the cross-entropy loss
L (binary for a model with one output, a logit): `grad_norm` Σ_p ‖∂L/∂θ_p‖ over parameter tensors;
`snip` Σ |θ ⊙ ∂L/∂θ|; `synflow` Σ |θ ⊙ ∂R/∂θ| with R = 1ᵀ f_|θ|(1) the output of the network with
absolute weights on an all-ones input, in float64 (Tanaka et al., NeurIPS 2020); `jacob_cov`
−Σ_i log(v_i + k) + 1/(v_i + k), v the eigenvalues of the correlation matrix of the input Jacobians
∂(Σ_o f_o)/∂x, k = 1e-5 (Mellor et al., 2021); `naswot` log |det K_H|, K_H the sum over activation
layers of the number of units on which two samples' activation patterns (sign of the activation's
input) agree (Mellor et al., ICML 2021; when the batch exceeds the rank of K_H, at most the
number of activation units plus one (each unit's term lies in the span of 1 and its pattern), det
K_H is 0 and the float64 log-determinant −inf or a large negative number made of rounding (about
−32 per missing rank; −1522 for 16 ReLUs on 64 samples, 47 ranks short), so very
narrow candidates rank last, roughly in the order of their rank deficit; it does not read y; an
activation whose input does not hold the samples along its first axis, such as a sequence-first
[S, B, H], is refused with a MetricUndefinedError; with a dict input holding an "attention_mask"
[B, L], the units of an activation input [B, L, ...] at padding positions are not counted, two
samples agreeing only on the positions both hold); `params` the number of trainable parameters.

A training-speed estimate (Ru et al., "Speedy performance estimation for neural architecture
search", NeurIPS 2021), which trains instead of reading one batch at initialisation: `tse`
−(1/T) Σ_t L_t, the mean of the minibatch losses L_t of T = TSE_STEPS Adam steps (lr warmup_lr)
on minibatches of 64 samples drawn from all of x (as the warm-up's; batch_size does not apply),
each loss taken before its step (`ProxyScore.raw` the published sum Σ_t L_t). A network that
fits its data sooner scores higher.

`rank` orders a candidate set by one metric, or by the mean rank over several (a vote, as in
Abdelfattah et al.'s majority vote of proxies). The defaults (`score`: `label_condition` on 256
samples; `rank`: the vote of `label_condition` and `naswot` on 64) are chosen
leave-one-space-out over five search spaces: `python benchmarks/nas/compare.py` (four) and
`python benchmarks/nas/nb201.py --cached` (the four and NAS-Bench-201).

Every score works on a private copy of the network: the user's model is never modified. A
copy whose BatchNorm layers have never seen data takes their statistics from the scored batch
(what a training-mode forward pass would use), then everything is measured in eval mode.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import rankdata
from torch import nn
from tqdm.auto import tqdm

from .core import inputs, kinds
from .core.checks import check_amount, check_integer
from .core.model import (
    check_output_fn,
    copy_module,
    from_factory,
    naming_failures,
    output_tensor,
    resolve_device,
    uncompiled,
)
from .core.seeding import seeded
from .core.tiles import require_finite
from .empirical import empirical_ntk
from .spectrum import condition_number, descent_residual, eigenvalues, kernel_alignment

KERNEL_METRICS = (
    "lga",
    "condition_number",
    "trace",
    "frobenius",
    "mean",
    "lga_cosine",
    "lga_centred",
    "layer_condition",
    "label_condition",
    "descent",
)
BASELINE_METRICS = ("naswot", "synflow", "grad_norm", "snip", "jacob_cov", "params")
# Read from a short training run on all of x rather than from one batch at initialisation.
TRAINING_METRICS = ("tse",)
METRICS = KERNEL_METRICS + BASELINE_METRICS + TRAINING_METRICS
# Metrics that differentiate or replace the input, so need one floating-point input tensor (no
# token ids, no dict or tuple inputs): never part of a default, which must serve every model.
FLOAT_INPUT_METRICS = ("synflow", "jacob_cov")
# Chosen leave-one-space-out among every metric defined for every model input (not
# FLOAT_INPUT_METRICS) at 64 and 256 samples (and, for `rank`, every vote of two or three of them
# at one of them), by the best worst-space Kendall τ on the other spaces, over five NAS spaces:
# digits MLPs, digits CNNs, breast-cancer MLPs, attention nets on a pointer task (truths: the mean
# of 20 training seeds) and a sample of NAS-Bench-201 cells (CIFAR-10 truth, proxies on upsampled
# digits); benchmarks/results/nas.md, `python benchmarks/nas/nb201.py --cached` (five spaces),
# `python benchmarks/nas/compare.py` (the first four).
# `score`: −log κ of the lpNTK on 256 samples; τ 0.64 / 0.66 / 0.70 / 0.61 / 0.59 at 2 repeats
# (digits MLPs / CNNs / cancer MLPs / attention / NAS-Bench-201). The four-space rule picks it in
# every fold; the five-space rule in every fold but the attention one (held out 0.53 there).
# The best zero-cost baseline's worst space: NASWOT's 0.45 (64 samples; jacob_cov 0.45 on 256).
# `rank`: the vote of the lpNTK's κ and NASWOT on 64 samples, the five-space rule's pick: τ 0.73
# / 0.82 / 0.73 / 0.66 / 0.66 (worst 0.657); its folds pick it on every space but NAS-Bench-201
# (there descent + NASWOT on 256 samples, 0.55 held out). On the four trainable spaces alone
# the rule picks that vote (0.73 / 0.82 / 0.74 / 0.75, the only candidate ≥ 0.70 on all four).
# Checked on two spaces no rule reads (`python benchmarks/nas/holdout.py`: 1-D CNNs on a generated
# majority task / MLPs on generated tabular data): `score` 0.39 / 0.65, `rank` 0.49 / 0.71,
# NASWOT alone 0.56 / 0.66 — both defaults fall below NASWOT on the 1-D CNNs. With the two in the
# rule (seven spaces) the folds' held-out worst is lower still (0.37 / 0.33), so they stay.
DEFAULT = "label_condition"
DEFAULT_KIND = "sum_logits"
DEFAULT_BATCH_SIZE = 256
DEFAULT_RANKING = ("label_condition", "naswot")
RANKING_BATCH_SIZE = 64
# Repeats (fresh initialisations and random batches averaged), chosen after the metrics by the
# same rule over 1–4 repeats and over (candidate, repeats) jointly, on the five spaces
# (`python benchmarks/nas/repeats.py --cached`; every default candidate scored with 4 repeats,
# each repeat kept). `score`'s default at 1 / 2 / 3 / 4 repeats: worst-space τ 0.587 / 0.591 /
# 0.620 / 0.616; the joint rule on all five picks it with 3 repeats (0.64 / 0.65 / 0.70 / 0.62 /
# 0.62); held out 0.64 / 0.65 / 0.70 / 0.62 / 0.62, each ≥ 0.60. `rank`'s vote at 1 / 2 / 3 / 4
# repeats: worst 0.555 / 0.657 / 0.606 / 0.564; the joint rule on all five picks it with 2
# repeats; held out 0.734 / 0.820 / 0.729 / 0.544 / 0.555 (the attention and NAS-Bench-201 folds
# pick other votes).
DEFAULT_REPEATS = 3
RANKING_REPEATS = 2
# `descent`'s number of steps T, picked in an exploration on four NAS spaces (digits MLPs / CNNs,
# cancer MLPs, attention; NAS-Bench-201 took no part) over T = 1 … 4096 in the vote with NASWOT:
# its worst-space τ was flat from T = 64 to 4096 (0.67–0.70) (5-seed truths). A candidate of the
# defaults since the 20-seed truths, on which the pool with it chooses better held out
# (benchmarks/nas/compare.py's JUDGED, `python benchmarks/nas/repeats.py --cached`).
DESCENT_STEPS = 256
# `tse`'s number of training steps T, picked in an exploration (`/tmp` script, 2 repeats) over
# T = 128 / 256 / 512 by the worst Kendall τ of `tse` alone over the four trainable NAS spaces
# (digits MLPs / CNNs, cancer MLPs, attention; NAS-Bench-201 not scored, about 0.1 s a step
# there): 0.566 / 0.644 / 0.712. The attention nets need the long run (0.566 at 128, 0.773 at
# 512), the cancer MLPs the short one (0.777 at 128, 0.712 at 512); on the two held-out spaces
# 0.743 / 0.807 (1-D CNNs / tabular MLPs); on NAS-Bench-201 (scored afterwards, T not re-picked)
# 0.416. No candidate of the defaults: with it in the pool the held-out worst falls (`score`
# 0.616 → 0.437, `rank` 0.544 → 0.444; benchmarks/nas/compare.py's OUTSIDE_POOL, `python
# benchmarks/nas/repeats.py --cached`); benchmarks/results/nas.md, "A training-speed estimate".
TSE_STEPS = 512
TRAINING_BATCH = 64  # the minibatch of the warm-up's and `tse`'s Adam steps
SINGULAR = 1e-10  # layer_condition: relative λmin below which a layer kernel counts as singular
_NEEDS_LABELS = (
    "lga",
    "lga_cosine",
    "lga_centred",
    "label_condition",
    "descent",
    "grad_norm",
    "snip",
    "tse",
)
_ACTIVATIONS = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ELU,
    nn.CELU,
    nn.SELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Softplus,
    nn.Tanh,
    nn.Hardtanh,
    nn.Sigmoid,
    nn.Hardswish,
)

Candidate = nn.Module | Callable[[], nn.Module]


class MetricUndefinedError(ValueError):
    """A metric that does not apply to a model (naswot without activation modules)."""


class VoteMemberDroppedWarning(UserWarning):
    """A metric of a `rank` vote did not apply to every candidate and was left out of the vote."""


@dataclass(frozen=True)
class ProxyScore:
    """A proxy's score over repeats. `value` (mean) and `values` are oriented so that higher is
    better; `raw` holds the quantity as published (κ itself for `condition_number`). For a vote
    of several metrics (`rank` with a list of metrics) `value` is the mean rank, `values` the
    candidate's rank under each metric, `std` their spread, and `parts` each metric's score."""

    metric: str
    value: float
    std: float
    values: tuple
    raw: tuple
    seconds: float
    parts: dict | None = None


def score(
    model: Candidate,
    x,
    y=None,
    *,
    metric: str = DEFAULT,
    kind: str = DEFAULT_KIND,
    batch_size: int = DEFAULT_BATCH_SIZE,
    repeats: int = DEFAULT_REPEATS,
    warmup_steps: int = 0,
    warmup_lr: float = 1e-3,
    seed: int = 0,
    layers: Sequence[str] | None = None,
    device=None,
    output_fn: Callable | None = None,
    return_details: bool = False,
) -> float | ProxyScore:
    """Score one architecture with `metric` (higher is better); returns the mean over `repeats`.
    The default, −log κ of the label-aware NTK (lpNTK) on 256 samples averaged over 3 repeats,
    has the best worst-space τ held out over the project's NAS spaces (`python
    benchmarks/nas/compare.py`, `benchmarks/nas/repeats.py`); it needs y.

    model: an `nn.Module` (copied, never modified) or a factory returning one (instantiated
    under `torch.manual_seed(seed + r)` for repeat r, and copied too). Each repeat scores a
    random batch of `batch_size` samples of (x, y) (all of them when x has fewer), after
    `warmup_steps` Adam steps (lr `warmup_lr`, minibatches of 64 from all of x, y) on the copy.
    kind: the kernel kind of the kernel metrics; layers: restrict their kernel to these modules.
    x may be a tensor or a tuple/dict of tensors (e.g. input_ids and attention_mask; `synflow` and
    `jacob_cov` need one floating-point input tensor); output_fn maps the model's output to
    [B, O] (e.g. `lambda out: out.logits`). return_details=True gives a `ProxyScore`.
    `tse` trains the copy for TSE_STEPS Adam steps (lr `warmup_lr`, after any warm-up) on
    minibatches of 64 samples from all of x, y instead of scoring one batch of batch_size.
    y: class labels [N] in 0..O−1 (O the model's outputs; integral floats are taken as integers),
    read by the lga metrics, `label_condition`, `grad_norm`, `snip`, `tse`, the kernel metrics on
    kind="lpntk" and warm-up, which refuse labels outside that range with a ValueError naming y,
    the first offending label and the range; the other metrics (`naswot` included) ignore y,
    whatever it holds (regression targets too).
    """
    _check_options(metric, kind, batch_size, repeats, warmup_steps, warmup_lr, seed)
    # numpy integers as Python's: torch's generators and randperm take only these
    batch_size, repeats, warmup_steps, seed = map(int, (batch_size, repeats, warmup_steps, seed))
    check_output_fn(output_fn)
    layers = _layer_names(layers)
    given, y = x, _check_data(x, y, metric, warmup_steps, kind)[1]
    if device is not None:
        device = resolve_device(device)
        y = None if y is None else y.to(device)
    start = time.perf_counter()
    values, raws = [], []
    prepared: dict = {}  # x per parameter dtype (numpy arrays of floats cast to it), on device
    for r in range(repeats):
        generator = torch.Generator().manual_seed(seed + r)
        net = _prepare(model, seed + r)
        net = net if device is None else net.to(device)
        cast = inputs.param_dtype(net)
        if cast not in prepared:  # once, unless a repeat's network has another dtype
            x = inputs.from_numpy(given, "x", cast)
            prepared[cast] = x if device is None else inputs.convert(x, device, None)
        x = prepared[cast]
        if y is not None:
            _check_labels(net, x, y, output_fn)
        with seeded(seed + r, net):  # what dropout draws in training and calibration
            if warmup_steps:
                _train(net, x, y, warmup_steps, warmup_lr, generator, output_fn)
            if metric in TRAINING_METRICS:  # read from the training run itself, not a batch
                losses = _train(
                    net, x, y, TSE_STEPS, warmup_lr, generator, output_fn, "tse's training"
                )
                values.append(-float(np.mean(losses)))
                raws.append(float(np.sum(losses)))
                continue
            idx = torch.randperm(inputs.count(x), generator=generator)[:batch_size]
            xb, yb = inputs.take(x, idx), None if y is None else y[idx.to(y.device)]
            net = _calibrate_norms(net, xb).eval()
        _check_outputs(net, xb, output_fn)
        value, raw = _MEASURES[metric](net, xb, yb, kind=kind, layers=layers, output_fn=output_fn)
        values.append(value)
        raws.append(raw)
    with np.errstate(invalid="ignore"):  # the spread of infinite values is NaN
        result = ProxyScore(
            metric,
            float(np.mean(values)),
            float(np.std(values)),
            tuple(values),
            tuple(raws),
            time.perf_counter() - start,
        )
    return result if return_details else result.value


# `rank`'s options: those of `score` that rank does not take itself
_OPTIONS = {
    name: p.default
    for name, p in inspect.signature(score).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name not in ("metric", "batch_size", "return_details")
}


def rank(
    candidates: Mapping[str, Candidate],
    x,
    y=None,
    *,
    metric: str | Sequence[str] = DEFAULT_RANKING,
    batch_size: int = RANKING_BATCH_SIZE,
    progress: bool = False,
    return_details: bool = False,
    **options,
) -> list:
    """Score every candidate (modules or factories, one at a time so memory stays flat) and
    return [(name, score)] best first (NaN scores last). Options are those of `score`.

    metric: one metric, or several to order candidates by their mean rank over those metrics
    (`mean_rank`; the score is then that mean rank, 1 = worst). The default, the vote of
    `label_condition` and `naswot` on batches of 64 samples, each averaged over
    RANKING_REPEATS = 2 repeats unless `repeats` is given, has the best worst-space τ over the
    project's five NAS spaces (`python benchmarks/nas/nb201.py --cached`,
    `benchmarks/nas/repeats.py`); it needs y. A member of a vote that does not apply to some
    candidate (naswot on a model without activation modules: MetricUndefinedError) is left out
    of the vote for every candidate, with a VoteMemberDroppedWarning; a single metric raises.
    Any other failure of a candidate stops the ranking with an error of the same class naming
    the candidate (no candidate is silently dropped). return_details=True gives
    (name, ProxyScore) pairs.
    """
    metrics = [metric] if isinstance(metric, str) else list(metric)
    if not metrics:
        raise ValueError("metric is an empty list; name at least one metric")
    for m in metrics:
        _check_metric(m)
    twice = sorted({m for m in metrics if metrics.count(m) > 1})
    if twice:  # a vote would weigh it double
        raise ValueError(f"metric names {', '.join(twice)} more than once; name each once")
    if not isinstance(candidates, Mapping):
        raise TypeError(
            f"candidates must be a dict of name -> module or factory, got "
            f"{type(candidates).__name__}"
        )
    if not candidates:
        raise ValueError("no candidates to rank: the candidate set is empty")
    for name, candidate in candidates.items():
        if not (isinstance(candidate, nn.Module) or callable(candidate)):
            raise TypeError(
                f"candidate {name!r} is a {type(candidate).__name__}, not an nn.Module "
                "or a factory returning one"
            )
    options.setdefault("repeats", RANKING_REPEATS)
    if "layers" in options:  # names read by every candidate
        options["layers"] = _layer_names(options["layers"])
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"rank() got unknown options {', '.join(unknown)}; its options are metric, "
            f"batch_size, progress, return_details and those of score: {', '.join(_OPTIONS)}"
        )
    # options and data once, before any candidate: their errors are no candidate's
    settings = {**_OPTIONS, **options}
    kind, steps = settings["kind"], settings["warmup_steps"]
    for m in metrics:
        _check_options(
            m, kind, batch_size, settings["repeats"], steps, settings["warmup_lr"], settings["seed"]
        )
        _check_data(x, y, m, steps, kind)
    check_output_fn(settings["output_fn"])
    if settings["device"] is not None:
        resolve_device(settings["device"])
    details: dict[str, dict] = {}
    for name, candidate in tqdm(
        candidates.items(), disable=not progress, desc=f"{'+'.join(metrics)} proxy", unit="arch"
    ):
        details[name] = {}
        for m in list(metrics):
            try:
                details[name][m] = score(
                    candidate,
                    x,
                    y,
                    metric=m,
                    batch_size=batch_size,
                    return_details=True,
                    **options,
                )
            except MetricUndefinedError as exc:
                if len(metrics) == 1:
                    raise MetricUndefinedError(f"candidate {name!r}: {exc}") from exc
                metrics.remove(m)  # a vote of the metrics defined for every candidate
                warnings.warn(
                    f"{m} is left out of the vote ({'+'.join(metrics)} ranks the candidates): "
                    f"candidate {name!r}: {exc}",
                    VoteMemberDroppedWarning,
                    stacklevel=2,
                )
            except Exception as exc:  # name the failed candidate
                raise _blamed(exc, name) from exc
    details = {n: {m: d[m] for m in metrics} for n, d in details.items()}
    names = list(details)
    if len(metrics) == 1:
        results = [details[n][metrics[0]] for n in names]
    else:
        ranks = np.array([_ranks([details[n][m].value for n in names]) for m in metrics])
        results = [
            ProxyScore(
                "+".join(metrics),
                float(r.mean()),
                float(r.std()),
                tuple(r.tolist()),
                (),
                sum(d.seconds for d in details[n].values()),
                details[n],
            )
            for n, r in zip(names, ranks.T)
        ]
    order = sorted(
        range(len(names)), key=lambda i: (math.isnan(results[i].value), -results[i].value)
    )
    _warn_unordered(metrics, [names[i] for i in order], [results[i].value for i in order])
    return [(names[i], results[i] if return_details else results[i].value) for i in order]


def _warn_unordered(metrics: list[str], names: list[str], values: list[float]) -> None:
    """Warn where several candidates share a non-finite score (−inf: a singular kernel or an
    activation-pattern matrix of deficient rank; NaN): `rank` keeps them in the order given,
    which the metric does not decide. A vote's mean ranks already break such ties."""
    if len(metrics) > 1:
        return
    groups: dict[str, list[str]] = {}
    for name, value in zip(names, values):
        if not math.isfinite(value):
            groups.setdefault(str(value), []).append(name)
    for value, tied in groups.items():
        if len(tied) > 1:
            shown = ", ".join(map(repr, tied[:5])) + (", ..." if len(tied) > 5 else "")
            why = (
                " (a singular kernel: fewer parameters or ranks than samples)"
                if value == "-inf"
                else ""
            )
            warnings.warn(
                f"{len(tied)} candidates score {value} by {metrics[0]}{why}: {shown}; they are "
                "listed in the order given, which the metric does not decide (a vote of several "
                "metrics, or a smaller batch_size, separates them)",
                stacklevel=3,
            )


def _blamed(exc: Exception, name: str) -> Exception:
    """`exc`, raised scoring candidate `name`, as an exception of its own class whose message
    names the candidate (a ModelInputError stays one); a RuntimeError with that message where
    the class cannot be rebuilt from a message alone (a KeyError would print it quoted)."""
    if isinstance(exc, (ValueError, TypeError, RuntimeError)):
        message = f"candidate {name!r}: {exc}"
    else:
        message = f"candidate {name!r} failed: {type(exc).__name__}: {exc}"
    try:
        blamed = type(exc)(message)
    except Exception:
        blamed = None
    return blamed if blamed is not None and str(blamed) == message else RuntimeError(message)


def _ranks(scores) -> np.ndarray:
    """Ranks of scores, 1 = worst; ties share the average rank and NaN ranks below everything."""
    return rankdata(np.nan_to_num(np.asarray(scores, dtype=float), nan=-np.inf))


def mean_rank(columns) -> np.ndarray:
    """Mean over metrics of each candidate's rank (1 = worst, ties share the average rank, NaN
    ranks below everything): a vote of several proxies on one candidate set. columns: one
    sequence of scores per metric, aligned over candidates."""
    columns = [np.asarray(c, dtype=float) for c in columns]
    if not columns or any(c.ndim != 1 for c in columns):
        raise ValueError(
            "mean_rank takes one sequence of scores per metric, each over the candidates (e.g. "
            "[[0.2, 0.5], [3.0, 1.0]] for two metrics and two candidates); got "
            f"{'none' if not columns else f'columns of shapes {[c.shape for c in columns]}'}"
        )
    if len({len(c) for c in columns}) > 1:
        raise ValueError(
            f"the columns score different numbers of candidates: {[len(c) for c in columns]}"
        )
    return np.mean([_ranks(c) for c in columns], axis=0)


# --------------------------------------------------------------------------------------------
# Inputs, copies, warm-up
# --------------------------------------------------------------------------------------------


def _check_metric(metric) -> None:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; valid metrics are {', '.join(METRICS)}")


def _layer_names(layers):
    """`layers` as the kernels take it: None, "all" (another string is refused there, not split
    into characters) or a list of module names, read once so that every repeat sees them."""
    return layers if layers is None or isinstance(layers, str) else list(layers)


def _check_options(metric, kind, batch_size, repeats, warmup_steps, warmup_lr, seed) -> None:
    _check_metric(metric)
    shape = kinds.get(kind).shape(1, 1, 1)
    if metric in KERNEL_METRICS and metric != "label_condition" and len(shape) != 2:
        raise ValueError(
            f"metric {metric!r} needs an [N, N] kernel; kind {kind!r} gives one of shape "
            f"[{', '.join('NNOO'[: len(shape)])}] (use 'sum_logits', 'trace' or 'lpntk')"
        )
    check_integer(batch_size, "batch_size", least=2)
    check_integer(repeats, "repeats")
    check_integer(warmup_steps, "warmup_steps", least=0)
    check_integer(seed, "seed", least=None)
    if warmup_steps or metric in TRAINING_METRICS:
        check_amount(warmup_lr, "warmup_lr")


def _check_data(x, y, metric, warmup_steps, kind):
    x = inputs.from_numpy(x, "x")
    n = inputs.validate(x, "x")  # finite
    if n < 2:
        raise ValueError(f"x must hold at least 2 samples, got {n}")
    lpntk = kind == "lpntk" and metric in KERNEL_METRICS
    if not (metric in _NEEDS_LABELS or warmup_steps or lpntk):
        return x, None  # y is not read, so any y (regression targets too) is ignored
    if y is None:
        needs = "with warm-up " if warmup_steps else ""
        needs += "on kind 'lpntk' " if lpntk else ""
        raise ValueError(f"y is missing: metric {metric!r} {needs}needs class labels")
    y = inputs.targets(y)
    if y.dim() == 1 and len(y) != n:
        raise ValueError(f"x has {n} samples but y has {len(y)} labels")
    return x, kinds.class_labels(y, n, None, "y")  # their range once the model is known


def _prepare(candidate: Candidate, seed: int) -> nn.Module:
    """A private copy of a module, or of the instance a factory builds under `seed` (the global
    random state is restored afterwards): a factory may hand out a module the caller holds
    (`lambda: model`), which warm-up, calibration and synflow would otherwise modify."""
    # a torch.compile wrapper that has run does not call hooks registered on its submodules
    # afterwards, which `naswot` relies on: the module it wraps is the same function
    if isinstance(candidate, nn.Module):
        return uncompiled(copy_module(candidate))
    if not callable(candidate):
        raise TypeError(f"model must be an nn.Module or a factory, got {type(candidate).__name__}")
    return uncompiled(from_factory(candidate, seed))


def _check_outputs(net: nn.Module, x, output_fn: Callable | None) -> None:
    """The scored batch must run through the network (errors name x) to finite outputs."""
    with torch.no_grad():
        out = naming_failures(net, x, "x", functools.partial(_forward, net, x, output_fn))
    if isinstance(out, torch.Tensor) and not bool(torch.isfinite(out).all()):
        raise ValueError("the model produced non-finite outputs (NaN or inf) on x")


def _check_labels(net: nn.Module, x, y: torch.Tensor, output_fn: Callable | None) -> None:
    """y must label the model's outputs (0..O−1; a single output, [B] or [B, 1], is a binary
    classifier's logit: labels 0 and 1), whichever metric reads them: checked once, on one
    sample's output (eval mode, no gradients), before any warm-up step. Outputs that are not
    [B] or [B, O] tensors are left to the metrics."""
    training = net.training
    one = inputs.take(x, slice(0, 1))
    net.eval()
    try:
        with torch.no_grad():
            out = naming_failures(net, one, "x", functools.partial(_forward, net, one, output_fn))
    finally:
        net.train(training)
    if not (isinstance(out, torch.Tensor) and out.dim() in (1, 2)):
        return
    kinds.loss_labels(y, 1 if out.dim() == 1 else out.shape[1], "y")


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the model output: class scores [B, O], or a single output ([B]
    or [B, 1], a binary classifier's logit z, labels 0 and 1) whose binary cross-entropy is the
    cross-entropy of the two-class scores (0, z)."""
    if out.dim() not in (1, 2):
        raise ValueError(
            f"the model output has shape {tuple(out.shape)}; class scores [B, O] "
            "are needed for a cross-entropy loss"
        )
    return kinds.cross_entropy(out, y)


def _forward(net: nn.Module, x, output_fn: Callable | None = None):
    """net called on a batch (a tensor, or a tuple/dict of tensors), through `output_fn`."""
    args, kwargs = inputs.as_call(x)
    out = net(*args, **kwargs)
    return out if output_fn is None else output_fn(out)


def _outputs(net: nn.Module, x, output_fn: Callable | None = None) -> torch.Tensor:
    """`_forward` for the measures that read the output: a tensor, or a TypeError naming
    output_fn (a dict or tuple output failed inside them with an AttributeError)."""
    return output_tensor(_forward(net, x), output_fn)


def _float_input(x, metric: str) -> torch.Tensor:
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        raise ValueError(
            f"{metric} needs one floating-point input tensor (it differentiates or replaces the "
            "input), not token ids or a tuple/dict of tensors"
        )
    return x


def _train(
    net: nn.Module,
    x,
    y,
    steps: int,
    lr: float,
    generator: torch.Generator,
    output_fn: Callable | None = None,
    what: str = "the warm-up",
) -> list[float]:
    """`steps` Adam steps of cross-entropy on minibatches of TRAINING_BATCH cycling through
    (x, y) in training mode; returns each step's minibatch loss (before its update). A run that
    diverges (a non-finite loss or parameter, or a step too large for the parameters' dtype) is
    refused naming warmup_lr; `what` names the run in the error (the warm-up, or a metric's)."""
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr) if params else None
    net.train()
    order = torch.empty(0, dtype=torch.long)
    losses = []
    for step in range(1, steps + 1):
        if len(order) == 0:
            order = torch.randperm(inputs.count(x), generator=generator)
        idx, order = order[:TRAINING_BATCH], order[TRAINING_BATCH:]
        xb = inputs.take(x, idx)
        loss = _loss(_outputs(net, xb, output_fn), y[idx.to(y.device)])
        if not bool(torch.isfinite(loss)):
            if step == 1:  # no update yet: the model's own outputs, if they are the cause
                _check_outputs(net, xb, output_fn)
            raise ValueError(
                f"{what} diverged: its loss is {loss.item()} at step {step} of {steps}; "
                f"lower warmup_lr (got {lr:g})"
            )
        losses.append(float(loss.detach()))
        if loss.requires_grad:  # else it depends on no trainable parameter: nothing to train
            opt.zero_grad()
            loss.backward()
            try:
                opt.step()
            except RuntimeError as error:  # "value cannot be converted to type float without
                if "overflow" not in str(error):  # overflow": lr beyond the dtype's range
                    raise
                raise ValueError(
                    f"warmup_lr={lr:g} overflows the parameters' dtype in Adam's step; lower it"
                ) from None
    if not all(bool(torch.isfinite(p).all()) for p in params):
        raise ValueError(
            f"{what} diverged: after its {steps} steps the parameters hold NaN or infinite "
            f"values; lower warmup_lr (got {lr:g})"
        )
    return losses


def _calibrate_norms(net: nn.Module, x) -> nn.Module:
    """BatchNorm layers that never saw data get the batch statistics of `x` (a forward pass with
    those layers in training mode and cumulative averaging, every other module in eval mode as
    when scored; the running variance, which torch keeps unbiased, scaled by (n − 1)/n to the
    biased one of n values per channel that training mode divides by), so that eval mode
    normalises the batch as training mode would. Never seeing data means no batch counted and
    the initial statistics (mean 0, variance 1): a layer whose statistics were loaded from a
    checkpoint that does not count batches keeps them. Dropout stays off, whatever mode the
    candidate came in: a module built in training mode (every factory's) and the same module in
    eval mode are one function with one score."""
    fresh = [
        m
        for m in net.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and m.track_running_stats
        and int(m.num_batches_tracked) == 0
        and not bool(m.running_mean.any())
        and bool((m.running_var == 1).all())
    ]
    if fresh:
        momenta = [m.momentum for m in fresh]
        counts: dict[nn.Module, int] = {}  # values per channel in the batch

        def count(m: nn.Module, args: tuple) -> None:
            counts.setdefault(m, args[0].numel() // args[0].shape[1])

        net.eval()
        for m in fresh:
            m.momentum = None
            m.train()
        with contextlib.ExitStack() as hooks:  # a RemovableHandle removes its hook on exit
            for m in fresh:
                hooks.enter_context(m.register_forward_pre_hook(count))
            with torch.no_grad():
                _forward(net, x)
        for m, momentum in zip(fresh, momenta):
            m.momentum = momentum
            n = counts.get(m, 0)
            if n > 1:
                m.running_var.mul_((n - 1) / n)
    return net


# --------------------------------------------------------------------------------------------
# The measures: (net in eval mode, batch) -> (higher-is-better value, raw value)
# --------------------------------------------------------------------------------------------


def _kernel(net, x, y, kind, layers, output_fn):
    """The batch's [N, N] kernel; the label-aware kind (lpntk) takes the batch's labels y."""
    return empirical_ntk(
        net,
        x,
        kind=kind,
        labels=y if kind == "lpntk" else None,
        layers=layers,
        per_layer=False,
        output_fn=output_fn,
    )


def _square(k: torch.Tensor) -> torch.Tensor:
    if k.dim() != 2:
        raise ValueError(
            f"the kernel metrics need an [N, N] kernel; kind gives shape "
            f"{tuple(k.shape)} (use 'sum_logits' or 'trace')"
        )
    return k.to(torch.float64)


def _lga(net, x, y, *, kind, layers, output_fn):
    k = _square(_kernel(net, x, y, kind, layers, output_fn))
    value = kernel_alignment(k, y, centering="mean")
    return value, value


def _condition(net, x, y, *, kind, layers, output_fn):
    kappa = condition_number(_square(_kernel(net, x, y, kind, layers, output_fn)))
    return -math.log(kappa), kappa


def _trace(net, x, y, *, kind, layers, output_fn):
    value = float(_square(_kernel(net, x, y, kind, layers, output_fn)).diagonal().sum())
    return value, value


def _frobenius(net, x, y, *, kind, layers, output_fn):
    value = float(torch.linalg.norm(_square(_kernel(net, x, y, kind, layers, output_fn))))
    return value, value


def _mean(net, x, y, *, kind, layers, output_fn):
    value = float(_square(_kernel(net, x, y, kind, layers, output_fn)).mean())
    return value, value


def _lga_cosine(net, x, y, *, kind, layers, output_fn):
    k = _square(_kernel(net, x, y, kind, layers, output_fn))
    d = k.diagonal().clamp_min(torch.finfo(k.dtype).tiny).sqrt()
    value = kernel_alignment(k / d[:, None] / d[None, :], y, centering="mean")
    return value, value


def _lga_centred(net, x, y, *, kind, layers, output_fn):
    value = kernel_alignment(
        _square(_kernel(net, x, y, kind, layers, output_fn)), y, centering="kernel"
    )
    return value, value


def _label_condition(net, x, y, *, kind, layers, output_fn):
    return _condition(net, x, y, kind="lpntk", layers=layers, output_fn=output_fn)


def _descent(net, x, y, *, kind, layers, output_fn):
    k = _square(_kernel(net, x, y, kind, layers, output_fn))
    share = descent_residual(k, y, DESCENT_STEPS)
    return (-math.log(share) if share > 0 else math.inf), share


def _layer_condition(net, x, y, *, kind, layers, output_fn):
    parts = empirical_ntk(
        net,
        x,
        kind=kind,
        labels=y if kind == "lpntk" else None,
        layers="all" if layers is None else layers,
        per_layer=True,
        output_fn=output_fn,
    )
    logs = []
    for k in parts.values():
        ev = eigenvalues(_square(k))
        if float(ev[-1]) > SINGULAR * float(ev[0]):
            logs.append(math.log(float(ev[0]) / float(ev[-1])))
    value = -float(np.mean(logs)) if logs else float("nan")
    return value, value


def _trainable(net) -> list:
    """The parameters the gradient metrics differentiate: those with requires_grad=True."""
    params = [p for p in net.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "the model has no trainable parameters (requires_grad=True); the gradient metrics "
            "differentiate with respect to them"
        )
    return params


def _gradients(root: torch.Tensor, tensors: list, what: str) -> list:
    """∂root/∂tensors, checked finite (`what` names them in the error); zeros for the tensors that
    root does not depend on, every one of them when the output depends on none."""
    grads = (
        torch.autograd.grad(root, tensors, allow_unused=True)
        if root.requires_grad
        else [None] * len(tensors)
    )
    for g in grads:
        if g is not None:
            require_finite(g, what)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads)]


def _loss_grads(net, x, y, output_fn):
    params = _trainable(net)
    loss = _loss(_outputs(net, x, output_fn), y)
    return list(zip(params, _gradients(loss, params, "the gradient of the loss on x")))


def _grad_norm(net, x, y, *, output_fn, **_):
    value = float(sum(g.norm() for _, g in _loss_grads(net, x, y, output_fn)))
    return value, value


def _snip(net, x, y, *, output_fn, **_):
    value = float(sum((p.detach() * g).abs().sum() for p, g in _loss_grads(net, x, y, output_fn)))
    return value, value


def _synflow(net, x, y, *, output_fn, **_):
    x = _float_input(x, "synflow")
    net = net.double()
    with torch.no_grad():
        for p in net.parameters():
            p.abs_()
    params = _trainable(net)
    ones = torch.ones((1, *x.shape[1:]), dtype=torch.float64, device=x.device)
    grads = _gradients(_outputs(net, ones, output_fn).sum(), params, "the synflow gradient")
    value = float(sum((p.detach() * g).abs().sum() for p, g in zip(params, grads)))
    return value, value


def _jacob_cov(net, x, y, *, output_fn, **_):
    x = _float_input(x, "jacob_cov").detach().clone().requires_grad_(True)
    (jac,) = _gradients(_outputs(net, x, output_fn).sum(), [x], "the input Jacobian of x")
    with np.errstate(invalid="ignore", divide="ignore"):  # a constant row gives NaN below
        corr = np.corrcoef(jac.reshape(len(x), -1).cpu().double().numpy())
    if not np.isfinite(corr).all():
        return float("nan"), float("nan")
    v = np.linalg.eigvalsh(corr)
    k = 1e-5
    value = float(-np.sum(np.log(v + k) + 1.0 / (v + k)))
    return value, value


def _naswot(net, x, y, **_):
    """Mellor et al.'s score of the activation patterns of x; y is not read."""
    activations = [
        (name or type(m).__name__, m)
        for name, m in net.named_modules()
        if isinstance(m, _ACTIVATIONS)
    ]
    if not activations:
        raise MetricUndefinedError(
            "naswot needs activation modules (nn.ReLU, nn.GELU, ...) in the model; functional "
            "activations (torch.relu, F.gelu) cannot be observed"
        )
    n = inputs.count(x)
    mask = _token_mask(x, n)
    alone = _activation_inputs(net, inputs.take(x, slice(0, 1)), activations)
    codes = []

    def record(name, t):
        # the patterns are rows of [samples, units]: the batch's input to each activation must
        # hold the samples along its first axis, sample 0's values first as when it runs alone
        one = alone[len(codes)] if len(codes) < len(alone) else None
        flat = t.reshape(-1)
        if (
            one is None
            or flat.numel() != n * one.numel()
            or not torch.allclose(flat[: one.numel()], one, rtol=1e-3, atol=1e-4 * _scale(one))
        ):
            raise MetricUndefinedError(
                f"naswot reads each activation's input as [samples, units], and the input of "
                f"activation module '{name}' (shape {tuple(t.shape)} for {n} samples) does not "
                "hold the samples along its first axis (a sequence-first layer?)"
            )
        code = (t.reshape(n, -1) > 0).to(torch.float64).cpu()
        codes.append((code, _unpadded(t, mask)))

    _activation_inputs(net, x, activations, record)
    if not codes:  # the forward pass bypassed the modules' hooks (e.g. a TorchScript module)
        raise MetricUndefinedError(
            "naswot reads the inputs of the activation modules through forward hooks, and no "
            "hook was called on x (a scripted or otherwise wrapped model?)"
        )
    k = torch.zeros(n, n, dtype=torch.float64)
    for code, counted in codes:
        on, off = code, 1 - code
        if counted is not None:  # only the units of positions that both samples hold
            on, off = on * counted, off * counted
        k += on @ on.T + off @ off.T
    value = float(torch.linalg.slogdet(k).logabsdet)
    return value, value


def _token_mask(x, n: int) -> torch.Tensor | None:
    """The [n, L] attention mask of a dict input (HuggingFace's "attention_mask": 1 for a token,
    0 for padding), as float64; None when x holds none."""
    if not isinstance(x, Mapping) or "attention_mask" not in x:
        return None
    mask = x["attention_mask"]
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != n:
        return None
    return (mask != 0).to("cpu", torch.float64)


def _unpadded(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """[n, units] as the activation's input t [n, L, ...] flattened: 1 on the units of a token's
    position, 0 on those of padding; None (every unit counts) without a mask or for another
    layout."""
    if mask is None or t.dim() < 3 or tuple(t.shape[:2]) != tuple(mask.shape):
        return None
    per_position = mask.reshape(*mask.shape, *([1] * (t.dim() - 2)))
    return per_position.expand(t.shape).reshape(t.shape[0], -1)


def _scale(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _activation_inputs(net, x, activations, record=None) -> list:
    """The inputs of the `activations` ((name, module) pairs) in the order of their calls on x,
    flattened; or, with `record`, `record(name, input)` called on each instead."""
    seen = []

    def hook(name):
        def observe(module, inp, out):
            if record is None:
                seen.append(inp[0].detach().reshape(-1).clone())
            else:
                record(name, inp[0])

        return observe

    with contextlib.ExitStack() as hooks:
        for name, m in activations:
            hooks.enter_context(m.register_forward_hook(hook(name)))
        with torch.no_grad():
            _forward(net, x)
    return seen


def _params(net, x, y, **_):
    value = float(sum(p.numel() for p in net.parameters() if p.requires_grad))
    return value, value


_MEASURES = {
    "lga": _lga,
    "condition_number": _condition,
    "trace": _trace,
    "frobenius": _frobenius,
    "mean": _mean,
    "lga_cosine": _lga_cosine,
    "lga_centred": _lga_centred,
    "layer_condition": _layer_condition,
    "label_condition": _label_condition,
    "descent": _descent,
    "naswot": _naswot,
    "synflow": _synflow,
    "grad_norm": _grad_norm,
    "snip": _snip,
    "jacob_cov": _jacob_cov,
    "params": _params,
}
