"""`NTKPosterior`: the network linearised around its trained weights θ* as a Gaussian process
whose covariance is the eNTK — the function-space form of the linearised Laplace approximation
(Immer, Korzepa & Bauer, AISTATS 2021; laplace-torch's GLM predictive).

With the prior θ ~ N(0, δ⁻¹I), the Gauss–Newton curvature Λ_i of the loss with respect to the
outputs of training sample i (softmax: diag(p_i) − p_i p_iᵀ; Gaussian: I/σ²) and the eNTK Θ, the
outputs of the linearised network f(x) = f_θ*(x) + J(x)(θ − θ*) have the posterior
f(x) ~ N(f_θ*(x), Σ(x)),

    Σ(x) = J(x)(JᵀΛJ + δI)⁻¹J(x)ᵀ = [Θ(x, x) − Θ(x, X) S (δI + SΘS)⁻¹ S Θ(X, x)] / δ

(Woodbury's identity; S = Λ^½ block-diagonal, so the singular softmax curvature needs no
inverse), an (N·O)-dimensional Cholesky solve. The Laplace evidence of the prior precision is

    log Z(δ) = log p(y | f_θ*(X)) − ½ δ ‖θ*‖² − ½ log det(I + SΘS/δ).

It is the same damped system that `influence`'s Gauss–Newton path solves with damping δ.

The evidence takes the prior N(0, δ⁻¹I) literally, and a network trained without that prior has
a large ‖θ*‖² (its initialisation scale), so the evidence's δ = γ/‖θ*‖² is small and the
predictive is underconfident (`prior_precision="evidence"`). The default ("auto") instead sets
the shape and the size of Σ apart, with the effective number of parameters γ(δ) =
Σ_k e_k/(e_k + δ) of the eigenvalues e of SΘS (`damping`; the scale-free rule `influence` uses
for its damping). The shape is that of the δ keeping SHAPE_EFFECTIVE_PARAMETERS: so many that
the data, not the prior, say which directions are determined (an input unlike the training
set, e.g. with ink where no training digit has any, then has a larger variance than one like
it). The size is that of the posterior keeping the few EFFECTIVE_PARAMETERS, with the centred
logits on the training inputs spread by at most TRAINING_VARIANCE_RATIO of their mean square (a
network so confident on its training set that its curvature collapses): Σ is scaled by the
temperature T that gives the shaped posterior that spread on the training inputs,

    Σ(x) = T·J(x)(JᵀΛJ + δI)⁻¹J(x)ᵀ,

the Laplace posterior of the likelihood tempered by 1/T (laplace-torch's `temperature`) under
the prior precision δ/T. All three constants chosen leave-one-setting-out on trained networks
(the constants' comment). For regression the
softmax's bounded curvature is gone: the curvature scales as 1/σ², and σ² from the training
residual of a network that interpolates is orders of magnitude too small, so the rule's δ is
huge and the predictive as overconfident as the network. There "auto" maximises the evidence
over σ² and δ together (MacKay's evidence framework; laplace-torch's joint marginal-likelihood
fit of the prior precision and σ): with λ = σ²δ the log-determinant depends on λ alone and the
best σ² for a given λ is (RSS + λ‖θ*‖²)/(N·O), a one-dimensional search
(`benchmarks/posterior_regression.py`: chosen leave-one-setting-out on seven regression
networks, every fold). Given held-out data the
network did not train on, `fit(..., validation=(x_val, y_val))` instead picks δ minimising their
negative log predictive density (laplace-torch's "gridsearch" on a validation set), cheaply for
every δ from one eigendecomposition SΘS = U diag(e) Uᵀ: with Z = Uᵀ S Θ(X, x),

    Σ(x) = [Θ(x, x) − Σ_k Z_k(x) Z_k(x)ᵀ / (e_k + δ)] / δ.

With `curvature="ekfac"` (or "kfac") the Gauss–Newton matrix JᵀΛJ is replaced by its
block-diagonal Kronecker-factored approximation Ĝ = ⊕_W (Q_G ⊗ Q_A) diag(e_W) (Q_G ⊗ Q_A)ᵀ
(`attribution.curvature`), and every quantity above comes from its eigenpairs: Σ(x) =
Σ_W Σ_k (J_W(x) q_k)(J_W(x) q_k)ᵀ / (e_k + δ), log det(Ĝ + δI) = Σ_k log(e_k + δ), and γ(δ) from
the e_k: no N × N or P × P system is formed.
"""

from __future__ import annotations

import functools
import math
import warnings
from numbers import Integral, Real

import numpy as np
import scipy.optimize
import torch
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils import RegressorTags
from torch import nn

from ntk.core import inputs
from ntk.core.checks import check_amount, check_finite, check_integer
from ntk.core.jacobian import jacobian_features
from ntk.core.kinds import loss_labels
from ntk.core.memory import available_bytes
from ntk.core.model import ModelView

from . import _kernels, damping
from .curvature import STRATEGIES, KroneckerCurvature, UnfactorableModelError
from .fitted import check_fitted, record
from .outputs import (
    labels,
    logits,
    logits_like_training,
    psd_root,
    softmax_curvature,
    two_class_logits,
)

LIKELIHOODS = ("classification", "regression")
LINKS = ("probit", "mc")
KINDS = _kernels.OUTPUT_KINDS
PRIORS = ("auto", "evidence")
# curvature="auto" takes EK-FAC where it applies: leave-one-setting-out on 11 trained networks
# (`python benchmarks/posterior_prior.py --curvature ekfac` and `--curvature exact`, the
# library's prior rule; results/posterior_prior.md, last section) every fold picks EK-FAC, mean
# log(test NLL / MAP NLL) −0.215 held out and in sample against −0.210 for the exact curvature.
CURVATURES = ("auto", "exact", *STRATEGIES)
# prior_precision="auto" without validation data (classification, module docstring): the shape
# of Σ from the δ keeping SHAPE_EFFECTIVE_PARAMETERS, its size (the variance of the centred
# logits on at most VARIANCE_SAMPLES evenly spaced training inputs, mean_i tr(C Σ(x_i) C) with
# C = I − 11ᵀ/O) that of the δ keeping EFFECTIVE_PARAMETERS, at most TRAINING_VARIANCE_RATIO of
# the centred logits' mean square mean_i ‖C f(x_i)‖². The cap: where the training fit is so
# confident that the Gauss–Newton curvature collapses (a tanh MLP, a CNN with BatchNorm, both
# without weight decay), the γ rule alone spread the logits by more than their own size (test NLL
# 2.3× and 7.4× the MAP softmax's). The shape: with the size's own δ the posterior is mostly the
# prior and the predictive entropy separated pixel-permuted digits from the test digits worse
# than the softmax's (AUROC 0.885 against 0.894 over five splits of the digits MLP). All three
# chosen leave-one-setting-out on twelve trained networks, five random splits each (`python
# benchmarks/posterior_prior.py --curvature ekfac --splits 5`, results/posterior_prior.md, last
# section), by the mean of log(test NLL / MAP's) + log(ECE / MAP's) + max(0, log((1 − OOD
# AUROC) / MAP's)): 9 of 12 folds pick (2.37, 0.05, 42.2); mean log(NLL / MAP's) −0.207 held out
# (−0.217 in sample), log(ECE / MAP's) −0.055 (−0.130); digits MLP NLL / ECE / permuted AUROC
# 0.118 / 0.0110 / 0.911 against the MAP's 0.136 / 0.0193 / 0.894, AUROC and ECE no worse on
# 5 of 5 splits.
EFFECTIVE_PARAMETERS = 10**0.375
TRAINING_VARIANCE_RATIO = 0.05
SHAPE_EFFECTIVE_PARAMETERS = 10**1.625
VARIANCE_SAMPLES = 256
EVIDENCE_DECADES = 10.0  # the evidence is maximised over δ in [δ_max·10⁻¹⁰, δ_max]
EVIDENCE_TOL = 0.01  # in log10 δ
# the validation NLL is minimised over δ in D/‖θ*‖² · 10^(±6), D the dimension of the system
# (`_size`: N·O in kernel form, P in parameter space or with the factored curvature); an optimum
# beyond that range is taken at its edge: at the top, the limit of no posterior spread (which
# validation data the network predicts well prefer); at the bottom, with a warning, since
# VALIDATION_EDGE decades of it (a posterior that broad flattens every prediction)
VALIDATION_DECADES = 6.0
VALIDATION_EDGE = 0.05
VALIDATION_GRID = 25  # coarse grid points over that range before the bounded Brent search
PREDICT_BLOCK = 128  # test samples per block of the predictive covariance
# Exact kernels, kind="full": the posterior runs in parameter space when P ≤ ratio · N·O. Its
# Gram JᵀΛJ costs N·O·P² multiply-adds and its Cholesky P³/3, against (N·O)³/3 for the kernel
# form's Cholesky: smaller when P ≲ 0.53·N·O. Measured (benchmarks/uncertainty.py cases, fit and
# four predictions): digits CNN P/(N·O) = 0.34, 18.9 s → 3.1 s; digits MLP at 0.88 was 8 %
# slower in parameter space (results/uncertainty.md).
PARAMETER_SPACE_RATIO = 0.5
# The kernel form's Σ(x) = (Θ(x, x) − WᵀW)/δ subtracts two terms of the kernels' size: a variance
# below PRECISION_MARGIN rounding units of the kernels' dtype times Θ(x, x)/δ is not resolved by
# them (float32 kernels, a small δ and a small noise: negative variances, and a validation search
# that failed in torch's MultivariateNormal), and is refused (predictions) or skipped (the search).
PRECISION_MARGIN = 10.0


class NTKPosterior(ClassifierMixin, BaseEstimator):
    """Calibrated probabilities and uncertainty from the eNTK of a trained `model`.

    likelihood: "classification" (softmax over the model's O ≥ 2 outputs, integer labels; a
    model with one output is a binary classifier's logit z, taken as the logits (0, z) of the
    classes 0 and 1, so Σ has a zero row and column for class 0) or
    "regression" (Gaussian with variance `noise`: a float, or "auto": chosen together with δ,
    by the evidence, or by the validation data given to `fit`; with a numeric prior_precision,
    the mean squared training residual). kind: the covariance, "full" (exact, [N, N, O, O]) or a
    scalar kind ("trace", "sum_logits": the cheaper stand-in k(x, x') ⊗ I_O of
    `_kernels.output_kernel`).
    curvature: "ekfac" / "kfac", the block-diagonal Kronecker-factored Gauss–Newton curvature
    of `attribution.curvature` (the one `influence(method="ekfac")` uses), Σ(x) =
    J(x)(Ĝ + δI)⁻¹J(x)ᵀ from each block's eigenbasis: memory O(Σ_l d_in² + d_out²), cost linear
    in N (kind="full", exact Jacobians only); "exact", the kernel or parameter-space forms below;
    "auto" (default), EK-FAC where kind="full", projection_dim=None and every parameter block
    fits it (`UnfactorableModelError` otherwise), else exact. The fitted `curvature_` says which.
    projection_dim: None for exact kernels, else a random projection of that dimension
    (`projections`, seeded by `seed`); with kind="full" and N·O > projection_dim the posterior
    is computed in the projected parameter space, a k × k system (Σ(x) = Φ(x)(ΨᵀΨ + δI)⁻¹Φ(x)ᵀ,
    Ψ = SΦ: the kernel form's Σ with Θ = ΦΦᵀ by the push-through identity), so N is limited by
    the features' memory only. With exact kernels, kind="full" and at most half as many trainable
    parameters P as N·O (PARAMETER_SPACE_RATIO), the same parameter-space form runs on the exact
    per-sample Jacobians (Φ = J: a P × P system instead of the N·O × N·O one, the same Σ(x) to
    rounding). prior_precision: δ > 0; "auto" for the δ keeping SHAPE_EFFECTIVE_PARAMETERS
    effective parameters with Σ scaled by the temperature `temperature_` that sizes it as the
    posterior keeping EFFECTIVE_PARAMETERS, its logit variance on the training inputs within
    TRAINING_VARIANCE_RATIO of their spread (classification; module docstring), or the δ
    maximising the evidence (regression), or, when `fit` is given validation data, the δ
    minimising their negative log predictive density; "evidence" to maximise the Laplace
    evidence `log_marginal_likelihood` (bounded Brent search on log δ). The fitted
    `prior_precision_` is the δ of the damped system JᵀΛJ + δI and `temperature_` the T of
    Σ(x) = T·J(x)(JᵀΛJ + δI)⁻¹J(x)ᵀ (1 but for the "auto" rule without validation data).
    link (classification):
    "probit" — p ≈ softmax(μ_o / √(1 + π/8 · s_o)) with μ the mean logits and s the diagonal of
    their covariance, both after removing the component along (1, …, 1), which no softmax can see
    (so that a constant added to every logit changes nothing) — or "mc", the mean softmax of
    `mc_samples` draws of the logits. output_fn maps the model's output to the logits [B, O]
    (e.g. `lambda out: out.logits` for a HuggingFace model); dtype: the kernels' dtype (None: the
    model's; the posterior algebra is float64 either way). The model is never modified. Only its
    trainable parameters (requires_grad) are random under the posterior: a copy with every
    parameter but the last layer's frozen gives the last-layer Laplace approximation
    (laplace-torch's subset_of_weights="last_layer"), far cheaper (benchmarks/uncertainty.py's
    "last layer" rows).
    Benchmarks: python benchmarks/uncertainty.py.
    """

    _parameter_constraints: dict = {
        "model": [nn.Module],
        "kind": [str],
        "curvature": [str],
        "likelihood": [str],
        "prior_precision": [Real, str],
        "noise": [Real, str],
        "link": [str],
        "mc_samples": [Integral],
        "projection_dim": [Integral, None],
        "seed": [Integral],
        "batch_size": [Integral, None],
        "device": [str, torch.device, None],
        "output_fn": [callable, None],
        "dtype": [torch.dtype, None],
    }

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        kind: str = "full",
        curvature: str = "auto",
        likelihood: str = "classification",
        prior_precision: float | str = "auto",
        noise: float | str = "auto",
        link: str = "probit",
        mc_samples: int = 1000,
        projection_dim: int | None = None,
        seed: int = 0,
        batch_size: int | None = None,
        device=None,
        output_fn=None,
        dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.kind = kind
        self.curvature = curvature
        self.likelihood = likelihood
        self.prior_precision = prior_precision
        self.noise = noise
        self.link = link
        self.mc_samples = mc_samples
        self.projection_dim = projection_dim
        self.seed = seed
        self.batch_size = batch_size
        self.device = device
        self.output_fn = output_fn
        self.dtype = dtype

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        if self.likelihood == "regression":
            tags.estimator_type, tags.classifier_tags = "regressor", None
            tags.regressor_tags = RegressorTags()
        return tags

    # -- checks ----------------------------------------------------------------------------------
    def _check_params(self) -> None:
        self._validate_params()  # types, from _parameter_constraints
        for name, valid in (
            ("kind", KINDS),
            ("curvature", CURVATURES),
            ("likelihood", LIKELIHOODS),
            ("link", LINKS),
        ):
            if getattr(self, name) not in valid:
                raise ValueError(
                    f"{name} must be one of {', '.join(valid)}, got {getattr(self, name)!r}"
                )
        # sklearn's Integral and Real let a bool through: every number again by the shared checks
        for name, words in (("prior_precision", PRIORS), ("noise", ("auto",))):
            check_amount(getattr(self, name), name, words=words)
        check_integer(self.mc_samples, "mc_samples")
        check_integer(self.projection_dim, "projection_dim", optional=True)
        check_integer(self.seed, "seed", least=None)
        check_integer(self.batch_size, "batch_size", optional=True)
        if self.curvature in STRATEGIES and not self._full_exact_jacobians():
            raise ValueError(
                f"curvature={self.curvature!r} is the Kronecker-factored curvature of the full "
                "Jacobians: it needs kind='full' and projection_dim=None"
            )

    def _full_exact_jacobians(self) -> bool:
        """Whether the posterior is of the full kernel from unprojected Jacobians: what the
        Kronecker-factored curvatures need."""
        return self.kind == "full" and self.projection_dim is None

    def _inputs(self, x, name: str = "x"):
        """numpy arrays, alone or in a tuple/dict, as tensors (floating ones in the model's
        parameter dtype; left as they are for a model without parameters, which `logits` refuses
        naming the problem); `name` names the argument in errors."""
        return inputs.from_numpy(x, name, inputs.param_dtype(self.model))

    def _opts(self) -> dict:
        return dict(
            kind=self.kind,
            num_outputs=self.n_outputs_,
            dim=self.projection_dim,
            seed=self.seed,
            batch_size=self.batch_size,
            device=self.device,
            output_fn=self.output_fn_,
            dtype=self.dtype,
        )

    # -- fitting ---------------------------------------------------------------------------------
    def fit(self, x_train, y_train, validation=None) -> NTKPosterior:
        """Condition the linearised network on (x_train, y_train): class labels [N]
        (classification) or targets [N, O] / [N] for a single output (regression).
        validation: optional (x_val, y_val) the network was not trained on; with
        prior_precision="auto" δ then minimises their negative log predictive density instead
        of keeping EFFECTIVE_PARAMETERS effective parameters (module docstring). A fit that
        fails leaves the posterior unfitted (not half of the new fit over the previous one)."""
        vars(self).pop("factor_", None)  # what check_fitted looks for: set last
        self._check_params()
        # the link and its draws are the predictions' own; the seed too when nothing is projected
        free = ("link", "mc_samples", *(("seed",) if self.projection_dim is None else ()))
        record(self, free)
        x_train = self._inputs(x_train, "x_train")
        self.output_fn_ = self.output_fn
        g = logits(self.model, x_train, output_fn=self.output_fn_, name="x_train")
        n, o = g.shape
        joint = False
        if self.likelihood == "classification":
            self.one_logit_ = o == 1
            if o == 1:  # a binary classifier's logit z: the classes' logits (0, z)
                self.output_fn_ = functools.partial(two_class_logits, self.output_fn)
                g = torch.cat([torch.zeros_like(g), g], 1)
                o = 2
            y = self._labels(y_train, n, o, "y_train")
            root = psd_root(softmax_curvature(g))
            self.log_likelihood_ = -float(nn.functional.cross_entropy(g, y, reduction="sum"))
            self.classes_ = np.arange(o)
        else:
            self.flat_targets_ = np.ndim(y_train) == 1  # predict then returns [N], as sklearn's
            y = _targets(y_train, n, o, "y_train")
            rss = float(((y - g) ** 2).sum())
            # noise and prior from the evidence together: the system is fitted at unit noise
            joint = self.noise == "auto" and self.prior_precision in PRIORS
            if joint:
                noise = 1.0
            else:
                noise = rss / (n * o) if self.noise == "auto" else float(self.noise)
            if self.noise == "auto" and validation is None and not rss > 0:
                # σ² from the training residual, or the evidence's σ², which then runs to the
                # bottom of its search range
                raise ValueError(
                    "the model fits the targets exactly (zero training residual), so "
                    "noise='auto' has no residual to estimate it from; pass noise > 0 or "
                    "validation data"
                )
            root = torch.eye(o, dtype=torch.float64).expand(n, o, o) / math.sqrt(noise)
            self._set_noise(noise, rss, n * o)
        # a copy: the kernel form compares new inputs with these at every prediction
        self.n_outputs_, self.x_train_, self.root_ = o, inputs.clone(x_train), root
        a = self._fit_curvature(x_train, root)
        self.sq_norm_ = sum(
            float(p.detach().double().pow(2).sum())
            for p in self.model.parameters()
            if p.requires_grad
        )
        if validation is not None and self.prior_precision != "auto":
            raise ValueError("validation data choose prior_precision: pass prior_precision='auto'")
        if joint:
            noise, self.prior_precision_ = (
                self._maximise_joint_evidence(a, rss)
                if validation is None
                else self._minimise_validation_loss(a, validation, joint=True)
            )
            self._set_noise(noise, rss, n * o)
            self.root_ = root / math.sqrt(noise)  # the system scales as 1/σ²
            a = self._fit_curvature(x_train, self.root_) if a is None else a.div_(noise)
            self.temperature_ = 1.0
        else:
            self.prior_precision_, self.temperature_ = self._choose_prior(a, validation)
        if a is None:
            self.factor_, logdet = None, self._logdet(a, self.prior_precision_)
        else:
            self.factor_ = damping.damped_factor(a, self.prior_precision_, option="prior_precision")
            logdet = damping.log_det(self.factor_)
        self.evidence_ = self._evidence(self.prior_precision_, logdet, self._size(a))
        return self

    def _set_noise(self, noise: float, rss: float, count: int) -> None:
        """The Gaussian likelihood's variance σ² and log p(y | f_θ*(X)) of `count` targets."""
        self.noise_ = noise
        self.log_likelihood_ = -0.5 * rss / noise - 0.5 * count * math.log(2 * math.pi * noise)

    def _choose_prior(self, a: torch.Tensor | None, validation) -> tuple[float, float]:
        """(δ, T) for a fixed likelihood: the given δ; with validation data the δ minimising their
        negative log predictive density; the evidence's δ ("evidence", and "auto" for
        regression); T = 1 for all of these. Else ("auto", classification) `_tempered_prior`."""
        if not isinstance(self.prior_precision, str):
            return float(self.prior_precision), 1.0
        if validation is not None:
            return self._minimise_validation_loss(a, validation), 1.0
        if self.prior_precision == "evidence" or self.likelihood == "regression":
            return self._maximise_evidence(a), 1.0
        return self._tempered_prior(a)

    def _fit_curvature(self, x_train, root: torch.Tensor) -> torch.Tensor | None:
        """Resolve `curvature` into curvature_ and fit it: the Kronecker-factored curvature
        (kronecker_; returns None), or the exact system `a` (`_system`). "auto" takes EK-FAC
        for kind="full" with exact Jacobians when every parameter block of the model fits it,
        else the exact forms."""
        n, o = root.shape[0], self.n_outputs_
        self.kronecker_ = None
        auto = self.curvature == "auto" and self._full_exact_jacobians()
        if auto or self.curvature in STRATEGIES:
            strategy = "ekfac" if auto else self.curvature
            try:
                self.kronecker_ = KroneckerCurvature(
                    self.model,
                    strategy=strategy,
                    batch_size=self.batch_size,
                    device=self.device,
                    output_fn=self.output_fn_,
                    dtype=self.dtype,
                ).fit_roots(x_train, root)
            except UnfactorableModelError:
                if not auto:
                    raise
        if self.kronecker_ is not None:
            self.curvature_, self.parameter_space_ = strategy, True
            return None
        self.curvature_ = "exact"
        if self.projection_dim is None:
            exact_parameters = PARAMETER_SPACE_RATIO * n * o >= ModelView(self.model).num_params
            self.parameter_space_ = self.kind == "full" and exact_parameters
        else:
            self.parameter_space_ = self.kind == "full" and n * o > self.projection_dim
        return self._system()

    def _system(self) -> torch.Tensor:
        """The Gauss–Newton system of the fitted training set: SΘS [N·O, N·O] in kernel form, or
        with kind="full" and N·O above the features' dimension (projection_dim, or P for exact
        Jacobians) their Gram ΨᵀΨ (Ψ = SΦ) in parameter space (`parameter_space_`)."""
        root, x_train = self.root_, self.x_train_
        n, o = root.shape[0], self.n_outputs_
        if self.parameter_space_:
            phi = self._features(x_train)
            psi = torch.einsum("iop,ipk->iok", root, phi).reshape(n * o, phi.shape[-1])
            return psi.T @ psi
        theta = _kernels.output_kernel_factor(self.model, x_train, **self._opts())
        return damping.kernel_system(theta, root)[0]

    def _spectrum(self, a: torch.Tensor | None, target: float) -> torch.Tensor:
        """The eigenvalues `damping.damping_for` needs for targets up to `target`: of the system
        `a` (`damping.spectrum_keeping`; the rank of SΘS is N·(O − 1) for the softmax, N·O for
        the Gaussian likelihood), or the factored curvature's whole spectrum (a None)."""
        if a is None:
            return self.kronecker_.eigenvalues
        return damping.spectrum_keeping(a, self._rank(), target)

    def _tempered_prior(self, a: torch.Tensor | None) -> tuple[float, float]:
        """The default (δ, T) without held-out data: the shape of Σ from the δ keeping
        SHAPE_EFFECTIVE_PARAMETERS, its size from the δ_size keeping EFFECTIVE_PARAMETERS (both
        from one spectrum); T scales the former so that the variance ratio v(δ) =
        mean_i tr(C Σ_δ(x_i) C) / mean_i ‖C f(x_i)‖² over (at most VARIANCE_SAMPLES of) the
        training inputs is T·v(δ) = min(v(δ_size), TRAINING_VARIANCE_RATIO)."""
        e = self._spectrum(a, max(SHAPE_EFFECTIVE_PARAMETERS, EFFECTIVE_PARAMETERS))
        delta = damping.damping_for(e, SHAPE_EFFECTIVE_PARAMETERS, "prior_precision")
        variance_ratio = self._variance_ratio(a)
        if variance_ratio is None:  # logits with no spread on the training inputs
            return delta, 1.0
        size = variance_ratio(damping.damping_for(e, EFFECTIVE_PARAMETERS, "prior_precision"))
        return delta, min(size, TRAINING_VARIANCE_RATIO) / variance_ratio(delta)

    def _variance_ratio(self, a: torch.Tensor | None):
        """δ ↦ v(δ) (`_tempered_prior`) on at most VARIANCE_SAMPLES evenly spaced training inputs,
        one factorisation of the damped system per δ (exact) or one pass over the inputs for all
        δ where their rotated Jacobians fit in a quarter of the memory (factored); None where the
        centred training logits are all zero."""
        n = inputs.count(self.x_train_)
        rows = torch.linspace(0, n - 1, min(n, VARIANCE_SAMPLES)).round().long()
        x = inputs.take(self.x_train_, rows)
        logit = self._mean(x)
        scale = float((logit - logit.mean(-1, keepdim=True)).pow(2).sum())
        if not scale > 0:
            return None
        o = self.n_outputs_
        centre = torch.eye(o, dtype=torch.float64) - 1.0 / o
        if a is None:
            covariance = functools.partial(self.kronecker_.output_covariance, x)
            if len(rows) * o * self._size(None) * 8 <= available_bytes(torch.device("cpu")) // 4:
                covariance = self.kronecker_.covariance_function(x)
        else:
            b, prior = self._columns(x)

            def covariance(delta: float) -> torch.Tensor:
                factor = damping.damped_factor(a, delta, option="prior_precision", copy=True)
                w = torch.linalg.solve_triangular(factor, b, upper=False)
                return self._assemble(w.reshape(-1, len(rows), o), prior, delta)

        def variance_ratio(delta: float) -> float:
            total = torch.einsum("ab,nbc,ca->", centre, covariance(delta), centre)
            return float(total) / scale

        return variance_ratio

    def _size(self, a: torch.Tensor | None) -> int:
        """The dimension of the system: N·O or the features' (kernel or parameter space), P
        for the factored curvature (a None)."""
        return self.kronecker_.eigenvalues.numel() if a is None else a.shape[0]

    def _factored_spectrum(self) -> torch.Tensor:
        """The factored curvature's largest eigenvalues, as many as the Gauss–Newton matrix's
        rank can be (N·(O − 1) for the softmax, N·O for the Gaussian likelihood): its other
        eigenvalues are artefacts of the Kronecker approximation, whose rank is not bounded by
        N, and would count in log det(I + Ĝ/δ) as directions the data determine."""
        e = self.kronecker_.eigenvalues.flatten().double().clamp_min(0)
        return e.topk(min(self._rank(), e.numel())).values

    def _rank(self) -> int:
        """The rank the Gauss–Newton matrix of the fitted training set can have: N·(O − 1) for
        the softmax (each Λ_i has rank O − 1), N·O for the Gaussian likelihood."""
        o = self.n_outputs_
        return self.root_.shape[0] * (o - 1 if self.likelihood == "classification" else o)

    def _logdet(self, a: torch.Tensor | None, delta: float) -> float:
        """log det(A + δI) of the system, for the factored curvature (a None) from its
        `_factored_spectrum` (the remaining eigenvalues taken as 0)."""
        if a is None:
            e = self._factored_spectrum()
            return float((e + delta).log().sum()) + (self._size(a) - e.numel()) * math.log(delta)
        factor = damping.damped_factor(a, delta, option="prior_precision", copy=True)
        return damping.log_det(factor)

    def _evidence(self, delta: float, logdet: float, count: int) -> float:
        """log Z(δ) from log det(A + δI) of the count × count system A (SΘS, or ΨᵀΨ in parameter
        space: the same nonzero eigenvalues, so log det(I + A/δ) is the same)."""
        return (
            self.log_likelihood_
            - 0.5 * delta * self.sq_norm_
            - 0.5 * (logdet - count * math.log(delta))
        )

    def _maximise_evidence(self, a: torch.Tensor) -> float:
        """argmax_δ log Z(δ). At the optimum δ = γ/‖θ*‖² with γ = tr(SΘS (SΘS + δI)⁻¹) ≤ N·O the
        effective number of parameters, so the search runs over 10 decades below N·O/‖θ*‖²."""
        if not self.sq_norm_ > 0:
            raise ValueError(
                "prior_precision='evidence' needs trainable parameters with nonzero norm"
            )
        size = self._size(a)
        top = math.log10(size / self.sq_norm_)

        def negative(log_delta: float) -> float:
            delta = 10.0**log_delta
            return -self._evidence(delta, self._logdet(a, delta), size)

        best = scipy.optimize.minimize_scalar(
            negative,
            bounds=(top - EVIDENCE_DECADES, top),
            method="bounded",
            options={"xatol": EVIDENCE_TOL},
        )
        return float(10.0**best.x)

    def _maximise_joint_evidence(self, a: torch.Tensor | None, rss: float) -> tuple[float, float]:
        """(σ², δ) maximising log Z over the Gaussian noise and the prior together, from the
        system A₁ fitted at unit noise (A = A₁/σ²). With λ = σ²δ, log det(I + A/δ) =
        log det(I + A₁/λ), and for a fixed λ the evidence is largest at σ² = (RSS + λ‖θ*‖²)/(N·O),
        so a bounded search runs over λ alone (coarse grid, then Brent), maximising
        −(N·O/2) log(RSS + λ‖θ*‖²) − ½ Σ_k log(1 + e_k/λ) over the eigenvalues e of A₁
        (`_factored_spectrum` for the factored curvature)."""
        if not self.sq_norm_ > 0:
            raise ValueError(
                "the evidence needs trainable parameters with nonzero norm; pass noise= and "
                "prior_precision= explicitly"
            )
        count = self.root_.shape[0] * self.n_outputs_
        e = self._factored_spectrum() if a is None else torch.linalg.eigvalsh(a).clamp_min(0)

        def negative(log_lam: float) -> float:
            lam = 10.0**log_lam
            logdet = float(torch.log1p(e / lam).sum())
            return 0.5 * count * math.log(rss + lam * self.sq_norm_) + 0.5 * logdet

        centre = math.log10(self._size(a) / self.sq_norm_)
        lam = 10.0 ** _grid_then_brent(
            negative, centre - EVIDENCE_DECADES, centre + EVIDENCE_DECADES / 2
        )
        noise = (rss + lam * self.sq_norm_) / count
        return float(noise), float(lam / noise)

    def _minimise_validation_loss(self, a: torch.Tensor | None, validation, joint: bool = False):
        """argmin_δ of the mean −log p(y_val | x_val) (coarse grid, then bounded Brent). joint
        (regression, `a` fitted at unit noise): (σ², δ) minimising it together. The predictive
        covariance is then σ²(C(λ) + I), C(λ) the unit-noise Σ at prior precision λ = σ²δ, so for
        each λ the best σ² is the mean of rᵀ(C(λ) + I)⁻¹r / O over the validation residuals r,
        and the search runs over λ alone."""
        if not (isinstance(validation, (tuple, list)) and len(validation) == 2):
            raise ValueError("validation must be a pair (x_val, y_val)")
        if not self.sq_norm_ > 0:
            raise ValueError("prior_precision='auto' needs trainable parameters with nonzero norm")
        x_val, y_val = validation
        x_val = self._inputs(x_val, "x_val")
        mean = self._mean(x_val, "x_val")
        m, o = mean.shape
        y_val = (
            self._labels(y_val, m, o, "y_val")
            if self.likelihood == "classification"
            else _targets(y_val, m, o, "y_val")
        )
        residual = (y_val - mean).unsqueeze(-1) if joint else None
        if joint and not residual.abs().max() > 0:  # σ² would be 0
            raise ValueError(
                "the model predicts the validation targets exactly (zero residual), so "
                "noise='auto' has no residual to estimate it from; pass noise > 0"
            )
        if a is None:
            covariance = self.kronecker_.covariance_function(x_val, "x_val")
            prior = None
        else:
            _, covariance, prior = self._spectral_covariance(a, x_val)

        eye = torch.eye(o, dtype=torch.float64)

        def scaled(lam: float) -> tuple[float, torch.Tensor]:  # joint: (σ², C(λ) + I)
            total = covariance(lam) + eye
            quadratic = residual.transpose(1, 2) @ torch.linalg.solve(total, residual)
            return float(quadratic.mean()) / o, total

        def loss(log_value: float) -> float:
            value = 10.0**log_value
            if not self._resolved(covariance(value), prior, value):
                return math.inf  # below the kernels' precision: no value to compare
            if joint:
                noise, total = scaled(value)
                return -float(_gaussian_log_density(mean, noise * total, y_val).mean())
            return -float(self._log_density(mean, covariance(value), y_val).mean())

        centre = math.log10(self._size(a) / self.sq_norm_)
        lo = centre - VALIDATION_DECADES
        log_chosen = _grid_then_brent(loss, lo, centre + VALIDATION_DECADES)
        chosen = 10.0**log_chosen
        noise = scaled(chosen)[0] if joint else 1.0
        if log_chosen - lo < VALIDATION_EDGE:  # warned to fit's caller
            warnings.warn(
                "the validation loss falls as the prior precision shrinks, down to the edge of "
                f"its search range: δ = {chosen / noise:.3g} is taken, the broadest posterior "
                "searched (the network is confidently wrong on the validation data: are they "
                "labelled as the training data are?)",
                stacklevel=3 + (not joint),
            )
        return (noise, chosen / noise) if joint else chosen

    def _spectral_covariance(self, a: torch.Tensor, x):
        """The eigenvalues e of the fitted system `a`, δ ↦ Σ(x) [M, O, O] and the prior blocks
        Θ(x, x), from one eigendecomposition a = U diag(e) Uᵀ (module docstring): with
        W = diag(1/√(e + δ)) Uᵀ B(x), `_assemble`."""
        e, u = torch.linalg.eigh(a)
        e = e.clamp_min(0)
        b, prior = self._columns(x)
        z = (u.T @ b).reshape(u.shape[1], -1, self.n_outputs_)
        del b, u

        def covariance(delta: float) -> torch.Tensor:
            return self._assemble(z / (e + delta).sqrt()[:, None, None], prior, delta)

        return e, covariance, prior

    def log_marginal_likelihood(self) -> float:
        """The Laplace evidence log Z(δ) at the fitted prior precision δ (module docstring), of
        the untempered posterior: `temperature_` scales the predictive covariance only."""
        check_fitted(self, "factor_")
        return self.evidence_

    # -- prediction ------------------------------------------------------------------------------
    def predict_variance(self, x, diagonal: bool = False) -> np.ndarray:
        """Posterior covariance of the outputs Σ(x) [N, O, O], or its diagonal [N, O]."""
        check_fitted(self, "factor_")
        cov = self._predictive(x)[1]
        return (cov.diagonal(dim1=1, dim2=2) if diagonal else cov).numpy()

    def _covariance(self, x) -> torch.Tensor:
        """Σ(x) [N, O, O], in blocks of PREDICT_BLOCK samples, with L the Cholesky factor of the
        damped system and W = L⁻¹ B(x) (`_columns`, `_assemble`)."""
        x = self._inputs(x)
        if self.kronecker_ is not None:
            return self.kronecker_.output_covariance(x, self.prior_precision_)
        n = inputs.validate(x, "x")
        out = []
        for s in range(0, n, PREDICT_BLOCK):
            b, prior = self._columns(inputs.take(x, slice(s, s + PREDICT_BLOCK)))
            w = torch.linalg.solve_triangular(self.factor_, b, upper=False)
            cov = self._assemble(w.reshape(w.shape[0], -1, self.n_outputs_), prior)
            if not self._resolved(cov, prior, self.prior_precision_):
                raise ValueError(
                    "the predictive variance of x is below the precision of the kernels "
                    f"({self._kernel_dtype()}): the kernel form's Σ = (Θ(x, x) − explained)/δ "
                    f"loses it to cancellation at prior_precision {self.prior_precision_:.3g}; "
                    "pass dtype=torch.float64, curvature='ekfac' (kind='full') or a larger "
                    "prior_precision"
                )
            out.append(cov)
        return torch.cat(out)

    def _columns(self, x) -> tuple[torch.Tensor, torch.Tensor | None]:
        """B(x) [system size, N·O], the right-hand sides of the damped system for the samples x
        (checked by `_mean`), and the prior blocks Θ(x, x) [N, O, O]: B = S Θ(X, x) in kernel
        form; in parameter space B = Φ(x)ᵀ and no prior blocks (None)."""
        o = self.n_outputs_
        if self.parameter_space_:
            phi = self._features(x)
            return phi.reshape(phi.shape[0] * o, -1).T, None
        cross = _kernels.output_kernel(self.model, x, self.x_train_, **self._opts())
        m = cross.shape[0]
        b = torch.einsum("mipq,iqr->irmp", cross, self.root_).reshape(-1, m * o)
        del cross
        return b, _kernels.output_self_blocks(self.model, x, **self._opts())

    def _assemble(self, w: torch.Tensor, prior, delta: float | None = None) -> torch.Tensor:
        """Σ [N, O, O] from W [system size, N, O] with WᵀW the explained part:
        (Θ(x, x) − WᵀW)/δ in kernel form (δ: the fitted prior precision unless given), WᵀW in
        parameter space (prior None)."""
        explained = torch.einsum("kmp,kmq->mpq", w, w)
        if prior is None:
            return explained
        return (prior - explained) / (self.prior_precision_ if delta is None else delta)

    def _kernel_dtype(self) -> torch.dtype:
        """The dtype the kernels are computed in: `dtype`, else the model's least precise
        floating parameter's."""
        if self.dtype is not None:
            return self.dtype
        floating = [p.dtype for p in self.model.parameters() if p.is_floating_point()]
        return max(floating, key=lambda t: torch.finfo(t).eps, default=torch.float64)

    def _resolved(self, cov: torch.Tensor, prior, delta: float) -> bool:
        """Whether every variance of the kernel form's Σ = (Θ(x, x) − WᵀW)/δ is resolved by the
        kernels' precision, at least PRECISION_MARGIN rounding units of Θ(x, x)/δ (always, in
        parameter space: prior None)."""
        if prior is None:
            return True
        unit = torch.finfo(self._kernel_dtype()).eps / delta
        floor = PRECISION_MARGIN * unit * prior.diagonal(dim1=1, dim2=2)
        return bool((cov.diagonal(dim1=1, dim2=2) >= floor).all())

    def _features(self, x) -> torch.Tensor:
        """Φ(x) [N, O, k] in float64: the projected Jacobians (`projections.features`, the
        features whose Gram matrix is the projected kernel of the kernel form), or with exact
        kernels the per-sample Jacobians J(x) [N, O, P] (ΦΦᵀ = Θ), computed in the kernels'
        dtype."""
        import projections

        if self.projection_dim is None:
            phi = self._jacobians(x)
        else:
            phi = projections.features(
                self.model,
                x,
                dim=self.projection_dim,
                kind="full",
                seed=self.seed,
                batch_size=self.batch_size,
                device=self.device,
                output_fn=self.output_fn_,
                dtype=self.dtype,
            )
        phi = torch.as_tensor(phi).to(torch.float64).cpu()
        check_finite(phi, "the Jacobian features")
        return phi

    def _jacobians(self, x) -> torch.Tensor:
        """J(x) [N, O, P] over the trainable parameters, PREDICT_BLOCK samples at a time."""
        view = ModelView(
            self.model, output_fn=self.output_fn_, device=self.device, dtype=self.dtype
        )
        dtype = next(iter(view.params.values())).dtype
        eye = torch.eye(self.n_outputs_, dtype=dtype, device=view.device)
        names = list(view.params)
        blocks = []
        for s in range(0, inputs.count(x), PREDICT_BLOCK):
            xb = inputs.take(x, slice(s, s + PREDICT_BLOCK))
            xb = inputs.convert(xb, view.device, self.dtype)
            jac = jacobian_features(view, xb, eye, names)  # {name: [O, B, numel]}
            blocks.append(torch.cat([jac[n] for n in names], -1).transpose(0, 1).cpu())
        return torch.cat(blocks)

    def _predictive(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """The posterior mean f_θ*(x) [N, O] and covariance T·Σ(x) [N, O, O]: the mean first, whose
        checked forward pass names `x` when the model fails on it (the kernels name it x1)."""
        x = self._inputs(x)
        return self._mean(x), self.temperature_ * self._covariance(x)

    def _mean(self, x, name: str = "x") -> torch.Tensor:
        """f_θ*(x) [N, O], run before any kernel or Jacobian of x: x has the training inputs'
        structure (type, keys), and may have other per-sample shapes (sequences of another
        length) where the model takes it and gives O outputs."""
        return logits_like_training(
            self.model,
            self._inputs(x, name),
            self.x_train_,
            self.n_outputs_,
            output_fn=self.output_fn_,
            name=name,
        )

    def predict_proba(self, x) -> np.ndarray:
        """Predictive class probabilities [N, O] through `link`."""
        self._check_classification("predict_proba")
        return self._proba(*self._predictive(x)).numpy()

    def _proba(self, mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
        if self.link == "mc":
            return self._samples(mean, cov).softmax(-1).mean(0)
        o = self.n_outputs_
        centre = torch.eye(o, dtype=torch.float64) - 1.0 / o
        s = (centre @ cov @ centre).diagonal(dim1=1, dim2=2).clamp_min(0)
        return ((mean @ centre) / torch.sqrt(1 + math.pi / 8 * s)).softmax(-1)

    def _samples(self, mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
        """`mc_samples` draws of the outputs [S, N, O] (seeded by `seed`)."""
        gen = torch.Generator().manual_seed(int(self.seed))  # numpy integers too
        eps = torch.randn(self.mc_samples, *mean.shape, generator=gen, dtype=torch.float64)
        return mean + torch.einsum("npq,snq->snp", psd_root(cov), eps)

    def predict(self, x) -> np.ndarray:
        """The most probable class (classification) or the posterior mean f_θ*(x) (regression;
        [N] when fitted to targets [N], else [N, O])."""
        check_fitted(self, "factor_")
        if self.likelihood == "regression":
            mean = self._mean(x).numpy()
            return mean[:, 0] if self.flat_targets_ else mean
        return self.classes_[self.predict_proba(x).argmax(1)]

    def uncertainty(self, x) -> dict[str, np.ndarray]:
        """Per sample [N]: "entropy", the entropy of `predict_proba` (total uncertainty), and
        "mutual_information" between the label and the outputs, H[E p] − E[H[p]] over
        `mc_samples` draws (the epistemic part)."""
        self._check_classification("uncertainty")
        mean, cov = self._predictive(x)
        p = self._proba(mean, cov)
        draws = self._samples(mean, cov).log_softmax(-1)
        expected = -(draws.exp() * draws).sum(-1).mean(0)
        total = entropy(p)
        mutual = entropy(draws.exp().mean(0)) - expected
        return {"entropy": total.numpy(), "mutual_information": mutual.clamp_min(0).numpy()}

    def _labels(self, y, n: int, o: int, name: str) -> torch.Tensor:
        """Class labels [n] of the o classes; a model with one logit (`one_logit_`, whose two
        classes the posterior makes) takes 0 and 1, and its errors say it has one output."""
        if self.one_logit_:
            loss_labels(y, 1, name)
        return labels(y, n, o, name)

    def score(self, x, y, sample_weight=None) -> float:
        """Mean log predictive density of y (higher is better): log p(y | x) through `link`
        (classification), or log N(y; f_θ*(x), Σ(x) + σ²I) (regression)."""
        check_fitted(self, "factor_")
        mean, cov = self._predictive(x)
        n, o = mean.shape
        if self.likelihood == "classification":
            y = self._labels(y, n, o, "y")
        else:
            y = _targets(y, n, o, "y")
        logp = self._log_density(mean, cov, y)
        w = None if sample_weight is None else np.asarray(sample_weight, dtype=float)
        if w is not None and w.shape != (n,):
            raise ValueError(
                f"sample_weight must hold one weight per sample, shape ({n},), got {w.shape}"
            )
        return float(np.average(logp.numpy(), weights=w))

    def _log_density(self, mean: torch.Tensor, cov: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """log p(y_n | x_n) [N] for checked labels (classification) or targets (regression)."""
        if self.likelihood == "classification":
            p = self._proba(mean, cov)
            return p[torch.arange(len(y)), y].clamp_min(1e-300).log()
        total = cov + self.noise_ * torch.eye(mean.shape[1], dtype=torch.float64)
        return _gaussian_log_density(mean, total, y)

    def _check_classification(self, what: str) -> None:
        check_fitted(self, "factor_")
        if self.likelihood != "classification":
            raise ValueError(f"{what} needs likelihood='classification'")


def _gaussian_log_density(mean: torch.Tensor, covariance: torch.Tensor, y: torch.Tensor):
    """log N(y_n; mean_n, covariance_n) [N]."""
    return torch.distributions.MultivariateNormal(mean, covariance_matrix=covariance).log_prob(y)


def _grid_then_brent(f, lo: float, hi: float) -> float:
    """argmin of a scalar f over [lo, hi]: the best of VALIDATION_GRID grid points, refined by a
    bounded Brent search between its neighbours (kept only if it improves on the grid)."""
    grid = np.linspace(lo, hi, VALIDATION_GRID)
    values = [f(g) for g in grid]
    best = int(np.argmin(values))
    found = scipy.optimize.minimize_scalar(
        f,
        bounds=(grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]),
        method="bounded",
        options={"xatol": EVIDENCE_TOL},
    )
    return float(found.x if found.fun <= values[best] else grid[best])


def _targets(y, n: int, o: int, name: str) -> torch.Tensor:
    """Regression targets as float64 [n, o] ([n] allowed for a single output); `name` names
    the argument in errors."""
    y = inputs.targets(y, name).to(device="cpu", dtype=torch.float64)
    if y.dim() == 1 and o == 1:
        y = y[:, None]
    if tuple(y.shape) != (n, o):
        raise ValueError(
            f"{name}: regression targets must have shape [{n}, {o}], got {tuple(y.shape)}"
        )
    inputs.check_finite_targets(y, name)
    return y


def entropy(p: torch.Tensor) -> torch.Tensor:
    """−Σ_c p_c log p_c over the last axis (0 log 0 = 0)."""
    return -(p * p.clamp_min(1e-300).log()).sum(-1)
