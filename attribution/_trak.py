"""TRAK (Park, Georgiev, Ilyas, Leclerc, Madry, ICML 2023, "TRAK: Attributing model behavior at
scale"), as published.

For each model m: the margin f = g_y − logsumexp_{j≠y} g_j = log(p/(1 − p)), its projected
per-example gradients φ_i = Pᵀ∇θ f(z_i) (P a random projection, `projections.features`),
Φ = [φ_i], and the kernel part φ(z)ᵀ (ΦᵀΦ + λI)⁻¹ φ_i; the weighting Q_i = 1 − p_i.
score(z, i) = mean_m[kernel part] · mean_m[Q_i] — the two parts averaged separately over models.
λ = 0 (the paper's choice) uses the pseudo-inverse. The paper's soft-thresholding is not applied.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from numbers import Integral

import torch
from torch import nn

import ntk
from ntk.core import inputs, kinds
from ntk.core.checks import check_amount
from ntk.core.model import check_module

from .outputs import (
    labels,
    margin_gradient,
    margins,
    models,
    predicted_labels,
    test_labels,
    train_test_logits,
)

DEFAULT_DIM = 2048


def trak(
    model: nn.Module,
    x_train,
    y_train,
    x_test,
    y_test=None,
    *,
    dim: int | None = DEFAULT_DIM,
    checkpoints: Sequence | None = None,
    damping: float = 0.0,
    projector: str = "rademacher",
    seed: int = 0,
    batch_size: int | None = None,
    device=None,
    output_fn: Callable | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """TRAK scores [N_test, N_train] (= `influence(method="trak")`).

    dim: projection dimension (TRAK's default 2048), or None for the exact gradients (through
    the full eNTK: φ(z)ᵀ(ΦᵀΦ + λI)⁻¹Φᵀ = k(z, X)(K + λI)⁻¹ with K the margin-gradient kernel).
    checkpoints: models or state dicts (see `influence`); y_test=None: `model`'s predicted labels.
    damping: λ ≥ 0. The same projector (seed) serves every model, as in the paper.
    batch_size: samples featurised at a time (the exact kernels' tile size with dim=None);
    None: from the free memory. Each sample is featurised once, through its own margin
    gradient (one cotangent, not O). output_fn and dtype: as in `influence` (kernels and
    features in `dtype`, None: the model's; solves in float64).
    """
    check_module(model)
    check_amount(damping, "damping", zero=True)
    cast = dtype or inputs.param_dtype(model)  # numpy arrays of floats
    x_train, x_test = (
        inputs.from_numpy(x_train, "x_train", cast),
        inputs.from_numpy(x_test, "x_test", cast),
    )
    if dim is not None and not (isinstance(dim, Integral) and dim > 0):
        raise ValueError(f"dim must be a positive integer or None, got {dim!r}")
    kernel_part, q = 0.0, 0.0
    y_test = predicted_labels(model, x_test, y_test, checkpoints, output_fn)
    nets = models(model, checkpoints)
    for net in nets:
        g_train, g_test = train_test_logits(net, x_train, x_test, output_fn)
        if damping == 0 and net is nets[0]:
            _warn_if_interpolating(net, dim, g_train.shape[0])
        y_tr = labels(y_train, g_train.shape[0], g_train.shape[1], "y_train")
        u_train, u_test = (
            margin_gradient(g_train, y_tr),
            margin_gradient(g_test, test_labels(g_test, y_test)),
        )
        # the margin kernel u_iᵀ Θ(x_i, x_j) u_j: each sample's Jacobian seen through its own
        # margin gradient u_i (one cotangent per sample, not O)
        opts = dict(
            kind=kinds.Weighted(),
            batch_size=batch_size,
            device=device,
            output_fn=output_fn,
            dtype=dtype,
        )
        if dim is None:
            k_train = ntk.empirical_ntk(net, x_train, labels=u_train, **opts)
            k_test = ntk.empirical_ntk(net, x_test, x_train, labels=u_test, labels2=u_train, **opts)
            kernel_part = kernel_part + _solve(k_test.double(), k_train.double(), damping)
        else:
            import projections

            feats = dict(dim=dim, projector=projector, seed=seed, **opts)
            phi_train = torch.as_tensor(
                projections.features(net, x_train, labels=u_train, **feats)
            ).to(device="cpu", dtype=torch.float64)
            phi_test = torch.as_tensor(
                projections.features(net, x_test, labels=u_test, **feats)
            ).to(device="cpu", dtype=torch.float64)
            kernel_part = kernel_part + phi_test @ _inverse_times_transpose(phi_train, damping)
        q = q + (1 - torch.sigmoid(margins(g_train, y_tr)))
    return (kernel_part / len(nets)) * (q / len(nets))[None, :]


def _warn_if_interpolating(net: nn.Module, dim: int | None, n_train: int) -> None:
    """Warn when the features can reach the rank of the training examples, min(dim, P) ≥ N (P
    the trainable parameters; dim=None: P): Φ then has full row rank, (ΦᵀΦ)⁺Φᵀ = Φᵀ(ΦΦᵀ)⁻¹
    interpolates every training gradient, and the scores lose their meaning (LDS on the
    breast_cancer benchmark, N = 400: 0.187 / 0.101 / 0.065 / 0.011 / −0.000 at dim 50 / 100 /
    200 / 400 / 2048). The paper's dims are far below its N."""
    width = sum(p.numel() for p in net.parameters() if p.requires_grad)
    if width >= n_train and (dim is None or dim >= n_train):  # Φ = GR has rank ≤ min(dim, P)
        what = f"dim={dim}" if dim is not None else f"the exact gradients ({width} parameters)"
        warnings.warn(
            f"TRAK with {what} and {n_train} training examples: with at least as many features "
            "as examples the damping-free solve interpolates the training set and the scores "
            "carry little information; pass a dim well below the number of training examples "
            "or damping > 0",
            stacklevel=3,
        )


def _inverse_times_transpose(phi: torch.Tensor, damping: float) -> torch.Tensor:
    """(ΦᵀΦ + λI)⁻¹Φᵀ [k, N]; the pseudo-inverse Φ⁺ when λ = 0."""
    if damping == 0:
        return torch.linalg.pinv(phi)
    k = phi.shape[1]
    return torch.linalg.solve(phi.T @ phi + damping * torch.eye(k, dtype=phi.dtype), phi.T)


def _solve(k_test: torch.Tensor, k_train: torch.Tensor, damping: float) -> torch.Tensor:
    """k(z, X)(K + λI)⁻¹ (K⁺ when λ = 0)."""
    if damping == 0:
        return k_test @ torch.linalg.pinv(k_train, hermitian=True)
    return torch.linalg.solve(
        k_train + damping * torch.eye(len(k_train), dtype=k_train.dtype), k_test.T
    ).T
