"""`influence`: the effect of each training example on each test example's margin
f(z) = g_y(z) − logsumexp_{j≠y} g_j(z), by one of several kernel methods.

With J(x) = ∂g(x)/∂θ, Θ = J Jᵀ the all-logit eNTK, u_z = ∂f(z)/∂g the margin's gradient and
r_i = e_{y_i} − p_i the descent direction of example i's cross-entropy in logit space:

- `gauss_newton`: the first-order effect of up-weighting example i in the damped Gauss–Newton
  model of the training loss, τ(z, i) = u_zᵀ J_z (Σ_j J_jᵀ Λ_j J_j + λI)⁻¹ J_iᵀ r_i with the
  softmax curvature Λ_j = diag(p_j) − p_j p_jᵀ (the influence function of Koh & Liang, ICML 2017,
  with the Gauss–Newton Hessian). It is evaluated in kernel form,
  τ(z, ·) = u_zᵀ Θ(z, X) (Λ Θ(X, X) + λI)⁻¹ R, an (N·O)-dimensional solve. By default p_j
  (hence r_j and Λ_j) comes not from the network's training logits, which a converged network
  has fitted (r ≈ 0), but from the kernel's gradient flow stopped early (`kernel_flow`), and
  u_z then from the same flow's test logits.
- `grad_dot`: u_zᵀ Θ(z, x_i) r_i, the change of f(z) after a gradient step on example i.
- `surrogate`: the counterfactual of the Gauss–Newton `KernelSurrogate` (`machine="gauss_newton"`,
  the Gauss–Newton model of kernel logistic regression at the network's logits) fitted to the
  training labels, u_zᵀ (d(z) − d_{−i}(z)), the exact change of its decision when example i is
  removed and the kernel machine refitted (`KernelSurrogate.influence`, closed form; its λ keeps
  `damping.DOF_FRACTION` of the rank as effective parameters, the damping chosen for LDS, not the
  surrogate's own default, chosen for faithfulness; an (N·O)² system like the exact path's, refused
  with a MemoryError when it does not fit). Chosen over the centred ridge's counterfactual
  by `python benchmarks/surrogate_settings.py` (label-fitted counterfactual LDS).
- `trak`: TRAK as published (`attribution.trak`).
- `ekfac` / `kfac`: the Gauss–Newton influence in parameter space with the curvature
  Σ_j J_jᵀ Λ_j J_j replaced by its layer-wise Kronecker factorisation (`attribution.curvature`);
  time and memory grow linearly with N.

Scalar kinds (`trace`, `sum_logits`) stand in for Θ as k(x, x') ⊗ I_O. Several models
(`checkpoints`) average their scores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from ntk.core import inputs
from ntk.core.checks import check_amount
from ntk.core.floats import flush_denormals
from ntk.core.memory import available_bytes
from ntk.core.model import ModelView, check_module

from . import _kernels, curvature
from ._trak import trak
from .damping import (
    DOF_FRACTION,
    ZeroCurvature,
    cholesky_solve,
    damped_cholesky,
    kernel_system,
)
from .kernel_flow import FITTED_FRACTION, influence_state
from .outputs import (
    labels,
    margin_gradient,
    models,
    predicted_labels,
    psd_root,
    softmax_curvature,
    test_labels,
    train_test_logits,
)
from .surrogate import KernelSurrogate

METHODS = ("auto", "gauss_newton", "trak", "surrogate", "grad_dot", "ekfac", "kfac")
AUTO = "gauss_newton"
# ekfac / kfac with damping="auto": λ = KRONECKER_DAMPING × the mean eigenvalue tr(G)/(N·O) of
# the factored curvature. The effective-parameter rule scores lower on the factored spectrum
# (`python benchmarks/damping.py`, rows "ekfac": LDS 0.435 / 0.332 / 0.574 against 0.503 / 0.355
# / 0.625 on digits MLP / CNN / breast_cancer), so it keeps this rule.
KRONECKER_DAMPING = 3.0
# The largest projection of the fallback when exact kernels do not fit (every kernel method,
# "auto" included). The projected path costs N·O·k² for its Gram matrix: at N = 20,000 (MLP
# 64-256-256-10, `python benchmarks/attribution_scale.py --methods ekfac,projected2048,
# projected4096`) k = 2048 took 1.18× Kronfluence EK-FAC's time and k = 4096 3.42× (our EK-FAC
# 0.49×); on the CNN at N = 50,000 k = 2048 took 15.6× (our EK-FAC 2.4×). LDS of k = 1024 / 2048
# / 4096 on the four settings of benchmarks/settings.py (`python benchmarks/attribution_settings.py
# --no-peers`; digits MLP, digits CNN, breast_cancer, wine; exact with the network's logits, as
# the projected path uses them, 0.674 / 0.618 / 0.608 / 0.636,
# EK-FAC 0.503 / 0.355 / 0.625 / 0.698): 0.620 / 0.548 / 0.700 / 0.670, 0.641 / 0.566 / 0.688 /
# 0.671, 0.652 / 0.579 / 0.669 / 0.676; among the k within 2× Kronfluence's time on the MLP,
# every leave-one-setting-out fold picks 2048 (best mean LDS on the other three). On the digits
# benchmark (`attribution_scale.py --digits`): exact 0.671, k = 2048 0.638, EK-FAC 0.498,
# Kronfluence 0.551. The previous cap, 16384, cost 64× k = 2048's Gram.
MAX_DIM = 2048


def resolve_method(method: str) -> str:
    """The method `influence(method=...)` runs: "auto" resolved to `AUTO`, any other valid name
    as it is; an unknown name is a ValueError listing the valid ones."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods are {', '.join(METHODS)}")
    return AUTO if method == "auto" else method


@flush_denormals()
def influence(
    model: nn.Module,
    x_train,
    y_train,
    x_test,
    y_test=None,
    *,
    method: str = "auto",
    kind: str | None = None,
    dim: int | None = None,
    train_features=None,
    checkpoints: Sequence | None = None,
    damping: str | float = "auto",
    training_logits: str | float = "auto",
    seed: int = 0,
    batch_size: int | None = None,
    device=None,
    output_fn: Callable | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Scores [N_test, N_train]: influence of each training example on each test margin.

    method: "auto" (= "gauss_newton" with the trace kernel, the best LDS in `python
    benchmarks/attribution_digits.py --sections lds`), "trak", "surrogate", "grad_dot", "ekfac"
    or "kfac" (module docstring). kind: the kernel, "trace" (default; "full" for grad_dot),
    "full" or "sum_logits". dim: None for exact kernels (method="trak": TRAK's projection to
    2048 dimensions, as published; `attribution.trak(dim=None)` for the exact gradients), or the
    dimension of a random projection (`projections`; with kind="full" the Gauss–Newton system is
    then solved in the k-dimensional projected parameter space, so N is limited only by the
    features' memory); when exact kernels would not fit in memory (sized by the free memory of
    the device the kernels are computed on), the kernel methods, "auto" included, use the full
    kernel projected to `default_dim(model)` (linear in N; within 0.05 LDS of the exact path on
    the digits benchmark, where "ekfac", the Kronecker-factored curvature of
    `attribution.curvature`, is 0.17 below it but faster, on CNNs several times: MAX_DIM's
    comment). The projected path streams the training features batch by batch (memory k² + N·k,
    never [N, O, k]);
    train_features: the path of a feature store of x_train
    written by `projections.featurize(model, x_train, path, dim=k, kind="full")`, read instead of
    featurising x_train again (gauss_newton / grad_dot; its dim, seed and projector are used for
    the test side). y_test=None uses `model`'s predicted labels. checkpoints: models or
    state dicts of `model`'s architecture whose scores are averaged (each with its own kernel and
    curvature; None uses `model` alone): independently trained copies, or checkpoints saved along
    one training run (`ntk.demo.train_checkpoints`), which predict retraining better than the
    final weights alone (`python benchmarks/checkpoints.py`). Copies each trained on its own
    random half of x_train (`train_on_subsets(..., random_subsets(N, K, seed=...)).modules()`)
    predict it better than copies trained on all of it (`python benchmarks/training_logits.py
    --ensemble 10`: picked in every leave-one-setting-out fold). damping (gauss_newton, ekfac,
    kfac): λ, or "auto" for `damping.auto_damping`: the λ at which the damped curvature keeps an
    effective number of parameters Σ_k e_k/(e_k + λ) = DOF_FRACTION · N·(O − 1) (e: eigenvalues
    of ΛΘ); for ekfac/kfac, KRONECKER_DAMPING × tr(G)/(N·O) of the factored curvature; for
    trak, a number is TRAK's λ ("auto": the paper's λ = 0). training_logits (gauss_newton on
    a kernel): where the residuals r_i and the curvature Λ_i are evaluated: "network" (each
    model's logits), a share D in (0, 1) (the logits of `kernel_flow.flow_logits` on each model's
    training kernel: the gradient flow of the cross-entropy from f = 0, stopped once it has
    fitted the share D of the kernel's directions, or at the model's own training loss if
    sooner; the test margins' gradients u_z are then taken at the same flow's test logits),
    "flow" (D = `kernel_flow.FITTED_FRACTION`) or "auto" (the default: "flow" where
    the N × N kernel is solved; "network" for the other methods and for the projected
    parameter-space path, where "flow" or a share is refused).
    batch_size: the kernels' tile size and the projections' featurisation batch (None: from the
    free memory). output_fn: maps the model's output to the logits [B, O] (e.g.
    `lambda out: out.logits` for a HuggingFace model); inputs may be tensors, tuples or dicts of
    tensors (e.g. input_ids and attention_mask). dtype: the dtype of kernels and projected
    features (None: the model's); the solves, the curvature and the parameter-space Gram are
    float64 either way; torch.float64 computes the kernels in float64 too (the network's logits
    stay its own, computed in its parameters' dtype). numpy arrays of floats are cast to `dtype`
    (None: the model's parameters'); tensors keep theirs.
    """
    check_module(model)
    cast = dtype or inputs.param_dtype(model)
    x_train, x_test = (
        inputs.from_numpy(x_train, "x_train", cast),
        inputs.from_numpy(x_test, "x_test", cast),
    )
    inputs.check_structure(x_train, x_test, ("x_train", "x_test"))  # shapes: the model decides
    method = resolve_method(method)
    if train_features is not None:
        if method not in ("gauss_newton", "grad_dot") or kind not in (None, "full"):
            raise ValueError(
                "train_features holds projected Jacobians of kind 'full': it serves method "
                "'gauss_newton' or 'grad_dot' with kind 'full'"
            )
        if checkpoints is not None:
            raise ValueError("train_features belongs to one model's weights, not to checkpoints")
        kind = "full"
    parameter_space = kind == "full" and (dim is not None or train_features is not None)
    flow = _flow_fraction(training_logits, method, parameter_space)
    if method == "trak":
        if kind not in (None, "full"):
            raise ValueError(
                "method='trak' uses the gradients of the margin (one output): kind does not apply"
            )
        return trak(
            model,
            x_train,
            y_train,
            x_test,
            y_test,
            checkpoints=checkpoints,
            seed=seed,
            batch_size=batch_size,
            device=device,
            output_fn=output_fn,
            dtype=dtype,
            **({} if dim is None else {"dim": dim}),
            **({} if damping == "auto" else {"damping": damping}),
        )
    if method in curvature.STRATEGIES and (kind not in (None, "full") or dim is not None):
        raise ValueError(
            f"method={method!r} factors the full Gauss–Newton curvature: kind and dim do not apply"
        )
    if method == "surrogate" and kind == "full":
        raise ValueError(
            "method='surrogate' is the Gauss–Newton kernel machine on a scalar kernel: kind must "
            "be 'trace' or 'sum_logits'"
        )
    kind = kind or ("full" if method == "grad_dot" else "trace")
    if method in ("grad_dot", "surrogate") and not (isinstance(damping, str) and damping == "auto"):
        raise ValueError(
            f"method={method!r} takes no damping (it applies to gauss_newton, ekfac, kfac and "
            f"trak; the surrogate's Gauss–Newton machine sets its own), got damping={damping!r}"
        )
    check_amount(damping, "damping", words=("auto",))  # > 0: Λ is singular
    y_test = predicted_labels(model, x_test, y_test, checkpoints, output_fn)
    scores = [
        _one_model(
            m,
            x_train,
            y_train,
            x_test,
            y_test,
            method=method,
            kind=kind,
            dim=dim,
            train_features=train_features,
            damping=damping,
            flow=flow,
            seed=seed,
            batch_size=batch_size,
            device=device,
            output_fn=output_fn,
            dtype=dtype,
        )
        for m in models(model, checkpoints)
    ]
    return torch.stack(scores).mean(0)


def _one_model(
    model,
    x_train,
    y_train,
    x_test,
    y_test,
    *,
    method,
    kind,
    dim,
    train_features,
    damping,
    flow,
    seed,
    batch_size,
    device,
    output_fn,
    dtype,
) -> torch.Tensor:
    g_train, g_test = train_test_logits(model, x_train, x_test, output_fn)
    y_train = labels(y_train, g_train.shape[0], g_train.shape[1], "y_train")
    y_test = test_labels(g_test, y_test)
    u = margin_gradient(g_test, y_test)  # [M, O]
    if method == "surrogate":
        surrogate = KernelSurrogate(
            model,
            kind=kind,
            projection_dim=dim,
            machine="gauss_newton",
            effective_parameters=DOF_FRACTION,
            seed=seed,
            batch_size=batch_size,
            device=device,
            output_fn=output_fn,
            dtype=dtype,
        )
        try:
            surrogate.fit(x_train, y_train)
        except ZeroCurvature:
            raise ZeroCurvature(
                "method='surrogate' sets its own damping: use method='gauss_newton' with damping="
            ) from None
        return torch.einsum(
            "mio,mo->mi", torch.as_tensor(surrogate.influence(x_test, output="all")), u
        )
    n, o = g_train.shape
    r = nn.functional.one_hot(y_train, o).double() - g_train.softmax(1)  # [N, O]
    store = None
    if train_features is not None:
        store = feature_store(train_features, model, x_train, dim, o, output_fn)
        dim = store["dim"]
    fits = dim is not None or _exact_fits(
        n, u.shape[0], o, kind, ModelView(model, device=device).device
    )
    if method in curvature.STRATEGIES:
        curv = curvature.KroneckerCurvature(
            model,
            strategy=method,
            batch_size=batch_size,
            device=device,
            output_fn=output_fn,
            dtype=dtype,
        ).fit(x_train, g_train)
        lam = KRONECKER_DAMPING * curv.trace / (n * o) if damping == "auto" else float(damping)
        if not lam > 0:  # "auto" on a zero curvature (an explicit damping is > 0)
            raise ZeroCurvature("pass damping= explicitly")
        return curv.influence(x_test, u, x_train, r, lam)
    if not fits:
        if flow is not None and flow.explicit:
            raise ValueError(
                "training_logits asks for the kernel's gradient flow, which runs on the N × N "
                "training kernel; it does not fit in memory here: pass training_logits='network' "
                "(or 'auto') to use the network's logits"
            )
        kind, dim, flow = "full", default_dim(model), None
    if kind == "full" and dim is not None:  # parameter space on projected Jacobians
        from projections import Featurizer

        projection = dict(seed=seed, dtype=dtype) if store is None else store["featurizer"]
        fz = Featurizer(
            model, dim=dim, kind="full", device=device, output_fn=output_fn, **projection
        )
        left = torch.cat(
            [
                torch.einsum("mo,mok->mk", u[rows], phi)
                for rows, phi in _feature_batches(fz, x_test, "x_test", batch_size)
            ]
        )
        train = _feature_batches(fz, x_train, "x_train", batch_size, store)
        h, w = _parameter_space(train, g_train, r, gram=method != "grad_dot")
        if method == "grad_dot":
            return left @ w.T
        return cholesky_solve(left.T, damped_cholesky(h, damping, n, o)[0]).T @ w.T
    opts = dict(
        kind=kind,
        num_outputs=o,
        dim=dim,
        seed=seed,
        batch_size=batch_size,
        device=device,
        output_fn=output_fn,
        dtype=dtype,
    )
    # Θ [·, N, O, O], or a scalar kind's factor [·, N] with Θ = that ⊗ I_O (never expanded)
    if method == "grad_dot":
        cross = _kernels.output_kernel_factor(model, x_test, x_train, **opts)
        if cross.dim() == 2:
            return cross * (u @ r.T)
        return (torch.einsum("mo,mioq->miq", u, cross) * r).sum(-1)
    if dim is None and u.shape[0] <= n and inputs.signature(x_train) == inputs.signature(x_test):
        # one symmetric kernel of train + test: each sample's Jacobian is formed once (the
        # test × test block it adds is at most the size of the test × train one); test inputs of
        # other per-sample shapes (longer sequences) cannot join the training batch
        joined = inputs.cat(x_train, x_test, ("x_train", "x_test"))  # tensors since `influence`
        joint = _kernels.output_kernel_factor(model, joined, **opts)
        theta, cross = joint[:n, :n], joint[n:, :n]
    else:
        theta = _kernels.output_kernel_factor(model, x_train, **opts)
        cross = _kernels.output_kernel_factor(model, x_test, x_train, **opts)
    if flow is not None:  # both sides at the flow's state: training residuals, test margins
        scalar, scalar_cross = (
            (theta, cross) if theta.dim() == 2 else (output_average(theta), output_average(cross))
        )
        g_train, u = influence_state(scalar, scalar_cross, g_train, y_train, y_test, flow.fraction)
    if cross.dim() == 2:
        left = cross[:, :, None] * u[:, None, :]
    else:
        left = torch.einsum("mo,mioq->miq", u, cross)
    return gauss_newton(left, theta, g_train, y_train, damping)


def output_average(theta: torch.Tensor) -> torch.Tensor:
    """The scalar kernel (1/O) Σ_o Θ(·, ·)_oo [A, B] of an all-output kernel [A, B, O, O]."""
    return theta.diagonal(dim1=2, dim2=3).mean(-1)


class _Flow(NamedTuple):
    """Where the training logits of the Gauss–Newton influence come from when not the network's."""

    fraction: float  # of the kernel's directions fitted (`kernel_flow.flow_logits`)
    explicit: bool  # asked for by the caller (an error where it cannot run) rather than "auto"


def _flow_fraction(training_logits, method: str, parameter_space: bool) -> _Flow | None:
    """The kernel gradient flow whose logits replace the network's training logits, or None for
    the network's own; refused where no N × N kernel is solved (other methods, the Gauss–Newton
    system in projected parameter space), where "auto" falls back to the network's logits."""
    check_amount(training_logits, "training_logits", words=("auto", "flow", "network"))
    if training_logits == "network":
        return None
    if not isinstance(training_logits, str) and training_logits >= 1:
        raise ValueError(
            "training_logits, as a number the share of the kernel's directions the flow has "
            f"fitted, must lie in (0, 1), got {training_logits!r}"
        )
    explicit = training_logits != "auto"
    fraction = FITTED_FRACTION if isinstance(training_logits, str) else float(training_logits)
    if method == "gauss_newton" and not parameter_space:
        return _Flow(fraction, explicit)
    if explicit:
        where = "parameter space" if method == "gauss_newton" else f"method={method!r}"
        raise ValueError(
            f"training_logits={training_logits!r} runs the kernel's gradient flow for method "
            f"'gauss_newton' on a kernel, not in {where}; pass 'network' or 'auto'"
        )
    return None


def _exact_fits(n_train: int, n_test: int, o: int, kind: str, device: torch.device) -> bool:
    """Whether the exact kernels (at most one of train + test; a scalar kind's without its
    O × O identity) and the (N·O)² system (float64; factored in place on the CPU, with torch's
    working copy elsewhere: `damping.cholesky`) fit in half the free memory of `device`, where
    they are computed and solved."""
    kernels = (n_train + n_test) ** 2 * (o * o if kind == "full" else 1)
    systems = 1 if device.type == "cpu" else 2
    return 8 * (kernels + systems * (n_train * o) ** 2) < 0.5 * available_bytes(device)


def default_dim(model: nn.Module) -> int:
    """The projection used when exact kernels do not fit: the power of two ≥ the number of
    trainable parameters P, at most MAX_DIM (k ≈ P is within the seed noise of exact, smaller k
    lose a little accuracy, larger ones cost N·O·k²: MAX_DIM's comment)."""
    p = ModelView(model).num_params
    return min(MAX_DIM, 1 << max(p - 1, 1).bit_length())


def gauss_newton(
    left: torch.Tensor,
    theta: torch.Tensor,
    g_train: torch.Tensor,
    y_train: torch.Tensor,
    damping: str | float = "auto",
) -> torch.Tensor:
    """τ(z, i) = B (ΛΘ + λI)⁻¹ R over (sample, output) pairs, with B [M, N, O] = u_zᵀ Θ(z, x_i),
    Θ the training kernel ([N, N, O, O], or a scalar kind's factor k [N, N] for Θ = k ⊗ I_O),
    Λ the softmax curvature and R's column i holding r_i.

    Solved as a symmetric positive-definite system: r_i = Λ_i w_i with w_i = e_{y_i}/p_{i,y_i},
    and (ΛΘ + λI)⁻¹Λ = S (SΘS + λI)⁻¹ S with S = Λ^½, so τ = (BS)(SΘS + λI)⁻¹(S w) (Cholesky).
    """
    n, o = g_train.shape
    p = g_train.softmax(1)
    s = psd_root(softmax_curvature(g_train))  # [N, O, O]
    v = s[torch.arange(n), :, y_train] / p[torch.arange(n), y_train][:, None]  # S_i w_i
    a, product = kernel_system(theta, s)
    factor, _ = damped_cholesky(a, damping, n, o, product=product)
    bs = torch.einsum("miq,iqo->mio", left, s).reshape(left.shape[0], n * o)
    y = cholesky_solve(bs.T, factor).T
    return (y.reshape(-1, n, o) * v).sum(-1)


def _feature_batches(fz, x, name: str, batch_size: int | None, store: dict | None = None):
    """(rows, projected Jacobians Φ [B, O, k] in float64 on the CPU) batch by batch: computed by the
    `projections.Featurizer` `fz`, or read from a feature store of `x` (`store["features"]`,
    1,024 samples at a time unless batch_size says otherwise)."""
    x = inputs.from_numpy(x, name)
    if store is None:
        blocks = fz.batches(x, batch_size, name=name)
    else:
        n, batch = inputs.validate(x, name), batch_size or 1024
        blocks = (
            (rows, torch.from_numpy(np.array(store["features"][rows])))
            for rows in (slice(s, min(s + batch, n)) for s in range(0, n, batch))
        )
    for rows, phi in blocks:
        yield rows, phi.to(device="cpu", dtype=torch.float64)


def _parameter_space(batches, g_train: torch.Tensor, r: torch.Tensor, gram: bool = True):
    """From projected Jacobians Φ_i (Θ ≈ ΦΦᵀ) streamed in batches: the Gauss–Newton matrix
    H = Σ_i Φ_iᵀ Λ_i Φ_i [k, k] (when `gram`) and w_i = Φ_iᵀ r_i [N, k], so that the influence
    τ(z, i) = φ_z (H + λI)⁻¹ w_i with φ_z = u_zᵀ Φ_z is a k × k Cholesky solve. Memory: k² +
    N·k + one batch, never the [N, O, k] features."""
    h, w = None, []
    for rows, phi in batches:
        if gram:
            part = torch.einsum("iok,iop,ipl->kl", phi, softmax_curvature(g_train[rows]), phi)
            h = part if h is None else h.add_(part)
        w.append(torch.einsum("io,iok->ik", r[rows], phi))
    return h, torch.cat(w)


def feature_store(path, model: nn.Module, x_train, dim: int | None, o: int, output_fn=None) -> dict:
    """The feature store at `path` checked against the influence call that reads it: written by
    `projections.featurize(model, x_train, path, dim=k, kind="full")` from these weights and
    these inputs (both checked by `projections.featurize`, which only reads a complete store and
    resumes an incomplete one), with the model's o outputs; `dim`, if given, must be the store's.
    Returns its features (memory-mapped) and the settings that reproduce its projection."""
    import projections

    info = projections.store_info(path)
    n = inputs.count(inputs.from_numpy(x_train, "x_train"))
    problems = []
    if info["kind"] != "full":
        problems.append(f"it holds kind={info['kind']!r} features, influence needs kind='full'")
    if info["samples"] != n:
        problems.append(f"it holds {info['samples']} samples, x_train has {n}")
    if info["num_outputs"] != o:
        problems.append(f"it holds {info['num_outputs']} outputs, the model has {o}")
    if dim is not None and dim != info["dim"]:
        problems.append(f"it was projected to dim={info['dim']}, not dim={dim}")
    if problems:
        raise ValueError(f"train_features {path}: " + "; ".join(problems))
    settings = dict(
        projector=info["projector"], seed=info["seed"], dtype=getattr(torch, info["compute_dtype"])
    )
    features = projections.featurize(
        model,
        x_train,
        path,
        dim=info["dim"],
        kind="full",
        block=info["block"],
        store_dtype=info["store_dtype"],
        output_fn=output_fn,
        progress=False,
        **settings,
    )
    return {"features": features, "featurizer": settings, "dim": info["dim"]}
