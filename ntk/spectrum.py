"""Spectral summaries of kernels: eigenvalues, condition number, kernel–label alignment and the
share of the labels that kernel gradient descent leaves unfitted."""

from __future__ import annotations

import numpy as np
import torch

from .core import inputs
from .core.checks import check_integer

CONSTANT = 1e-10  # kernel_alignment: a centred matrix this small relative to the raw one is zero
# descent_residual: negative eigenvalues beyond this share of the largest |λ| are no rounding
# (singular float32 eNTKs of 256–1,024 samples, narrow MLPs: −2e-8 at most)
INDEFINITE = 1e-3


def as_matrix(kernel) -> torch.Tensor:
    """A square kernel (a real tensor or array) as a symmetric matrix: [N, N] as is, `full`
    [N, N, O, O] flattened to [N·O, N·O] (sample-major), `diagonal` [N, N, O] as the
    block-diagonal [N·O, N·O]."""
    if isinstance(kernel, dict):
        raise TypeError(
            f"expected one kernel, got a dict of {len(kernel)} per-layer kernels (layers=...); "
            "pass one of them, or per_layer=False for their total"
        )
    if isinstance(kernel, torch.Tensor):
        k = kernel
    else:
        array = np.asarray(kernel)
        if array.dtype.kind not in "biufc":
            raise TypeError(
                f"kernel must be a numeric array, got {type(kernel).__name__} (dtype {array.dtype})"
            )
        k = torch.as_tensor(array)
    if k.is_complex():  # converted to a real matrix, it lost its imaginary part silently
        raise TypeError(f"kernel must be a real array, got dtype {k.dtype}")
    if k.dim() < 2 or k.shape[0] != k.shape[1]:
        raise ValueError(f"expected a square kernel [N, N, ...], got shape {tuple(k.shape)}")
    n = k.shape[0]
    if k.dim() == 2:
        return k
    if k.dim() == 4:
        if k.shape[2] != k.shape[3]:
            raise ValueError(
                f"expected a full kernel [N, N, O, O], got shape {tuple(k.shape)}: "
                "its output axes differ"
            )
        o = k.shape[2]
        return k.permute(0, 2, 1, 3).reshape(n * o, n * o)
    if k.dim() == 3:
        o = k.shape[2]
        return torch.block_diag(*[k[:, :, i] for i in range(o)])
    raise ValueError(f"expected a kernel of rank 2, 3 or 4, got shape {tuple(k.shape)}")


def eigenvalues(kernel) -> torch.Tensor:
    """Eigenvalues of a symmetric kernel K(x, x) in descending order (float64). A kernel that is
    not symmetric to rounding (max |K − Kᵀ| > 1e-4 · max |K|), such as a cross kernel K(x1, x2)
    of equal batch sizes, is refused."""
    return torch.linalg.eigvalsh(symmetric_matrix(kernel, "spectral summaries need")).flip(0)


def symmetric_matrix(kernel, needs: str) -> torch.Tensor:
    """`as_matrix(kernel)` in float64, symmetrised; refused (the message starts with `needs`, e.g.
    "spectral summaries need") unless it is non-empty, finite and symmetric to rounding: a kernel
    K(x, x), not a cross kernel K(x1, x2) of equal batch sizes."""
    m = as_matrix(kernel).to(torch.float64)
    if m.numel() == 0:
        raise ValueError("the kernel is empty (0 × 0)")
    if not bool(torch.isfinite(m).all()):
        raise ValueError("the kernel contains non-finite values")
    checked = m.detach()  # a kernel with autograd history stays differentiable
    asymmetry, scale = float((checked - checked.T).abs().max()), float(checked.abs().max())
    if asymmetry > 1e-4 * scale:
        raise ValueError(
            f"{needs} a symmetric kernel K(x, x), and this one is not "
            f"(max |K − Kᵀ| = {asymmetry:.3g}, max |K| = {scale:.3g}); a cross kernel "
            "K(x1, x2) of equal batch sizes is square but is no kernel of one set of samples"
        )
    return (m + m.T) / 2


def require_semidefinite(eigenvalues: torch.Tensor, needs: str, scale: float = 1.0) -> None:
    """Refuse a kernel whose eigenvalues (ascending) reach below −INDEFINITE·max|λ|, beyond
    rounding: "{needs}, and this one has an eigenvalue … against a largest …", the eigenvalues
    shown times `scale` (where they are those of a scaled kernel)."""
    low, top = float(eigenvalues[0]), float(eigenvalues[-1])
    if low < -INDEFINITE * float(eigenvalues.abs().max()):
        raise ValueError(
            f"{needs}, and this one has an eigenvalue {low * scale:.3g} against a largest "
            f"{top * scale:.3g}"
        )


def condition_number(kernel) -> float:
    """κ = λmax / λmin; inf when the kernel is indefinite or its computed λmin is 0. A kernel
    singular to rounding has a λmin of either sign at about eps·λmax: inf, or a κ near 1/eps
    (10¹⁵–10¹⁶ in float64)."""
    return condition_from_eigenvalues(eigenvalues(kernel))


def condition_from_eigenvalues(ev) -> float:
    """`condition_number` from eigenvalues already computed in descending order (`eigenvalues`),
    so that a caller that shows both decomposes the kernel once."""
    lo = float(ev[-1])
    return float(ev[0]) / lo if lo > 0 else float("inf")


def _labels_or_targets(y) -> torch.Tensor:
    """y as a tensor of integer class labels [N] or finite real targets [N, ...]; integer labels
    of another shape are refused."""
    y = inputs.targets(y)
    if y.dim() == 0:
        raise ValueError(f"y must hold one label or target per sample, got a scalar {y.item()!r}")
    inputs.check_finite_targets(y)
    if not y.is_floating_point() and y.dim() != 1:  # an [N, 1] column of labels is no target
        raise ValueError(
            f"y holds integer class labels of shape {tuple(y.shape)}; class labels are one "
            f"per sample, shape ({len(y)},) (real-valued targets are floats)"
        )
    return y


def _labelled_kernel(kernel, n: int, name: str) -> torch.Tensor:
    """`symmetric_matrix` of a scalar kernel [N, N] of the n labelled samples; `name` (the
    function) heads the errors."""
    k = symmetric_matrix(kernel, f"{name} needs")
    if np.ndim(kernel) != 2:  # as_matrix flattens full and diagonal kernels to [N·O, N·O]
        raise ValueError(
            f"{name} needs an [N, N] kernel, got shape {tuple(np.shape(kernel))} "
            "(use kind='trace', 'sum_logits' or 'lpntk')"
        )
    if k.shape[0] != n:
        raise ValueError(f"kernel is {k.shape[0]} × {k.shape[0]} but y has {n} entries")
    return k


def label_matrix(y) -> torch.Tensor:
    """Targets as a kernel: ±1 label agreement for integer class labels [N], y yᵀ for real
    targets (one column per output for a 2-D y). Integer labels of another shape are refused."""
    y = _labels_or_targets(y)
    if not y.is_floating_point():
        return (y[:, None] == y[None, :]).to(torch.float64) * 2 - 1
    y = y.to(torch.float64).reshape(y.shape[0], -1)
    return y @ y.T


def kernel_alignment(kernel, y, *, centering: str = "kernel") -> float:
    """Alignment ⟨K̃, L̃⟩_F / (‖K̃‖_F ‖L̃‖_F) between a kernel and the labels' kernel L.

    centering="kernel": K̃ = HKH with H = I − 11ᵀ/n (centred alignment, Cortes et al. 2012);
    centering="mean": K̃ = K − mean(K), the Pearson correlation of the entries used by
    Label-Gradient Alignment (Mok et al., CVPR 2022). Integer labels give L_ij = ±1; floating
    labels, integral or not (class labels read as floats included), are real targets, y yᵀ
    (`label_matrix`), so pass class labels as integers. The kernel
    is K(x, x) of the labelled samples: one that is not symmetric to rounding (a cross kernel
    K(x1, x2)) is refused, as by `eigenvalues`; so are labels or targets that are not finite.
    A constant kernel or constant labels (one class) have nothing to align: 0.
    """
    # alignment does not depend on the scale of the kernel or of the targets: at 1, their
    # products and norms neither overflow nor underflow
    y = _labels_or_targets(y)
    if y.is_floating_point() and bool(y.any()):
        y = y.to(torch.float64) / y.abs().max()
    lab = label_matrix(y)
    k = _labelled_kernel(kernel, n := len(lab), "kernel_alignment")
    k = k / k.abs().max() if bool(k.any()) else k
    scales = float(torch.linalg.norm(k)), float(torch.linalg.norm(lab))
    if centering == "kernel":
        h = torch.eye(n, dtype=torch.float64) - 1.0 / n
        k, lab = h @ k @ h, h @ lab @ h
    elif centering == "mean":
        k, lab = k - k.mean(), lab - lab.mean()
    else:
        raise ValueError(f"centering must be 'kernel' or 'mean', got {centering!r}")
    norms = float(torch.linalg.norm(k)), float(torch.linalg.norm(lab))
    # a constant kernel or labels (one class) centre to zero, up to the rounding of the centring
    if any(norm <= CONSTANT * scale for norm, scale in zip(norms, scales)):
        return 0.0
    return float((k * lab).sum()) / (norms[0] * norms[1])


def descent_residual(kernel, y, steps: int) -> float:
    """The share of the labels that `steps` steps of kernel gradient descent leave unfitted.

    Gradient descent on ½‖f − Y‖² moves the outputs of the network linearised at its
    initialisation by −η K (f − Y) per step (K the [N, N] kernel of the batch). From f = 0 with
    η = 1/λmax, the largest step that shrinks every direction monotonically, the residual after T
    steps is (I − K/λmax)^T Y, and the share of ‖Y‖² it keeps is

        Σ_i (1 − λ_i/λmax)^{2T} ‖u_iᵀ Y‖² / Σ_i ‖u_iᵀ Y‖²

    (λ_i, u_i the eigenpairs of K; rounding's negative eigenvalues count as 0, and a kernel with an
    eigenvalue below −INDEFINITE·max|λ| is refused). It joins what
    κ reads (how slowly the weakest directions fall) and what alignment reads (how much of Y lies
    in the strong ones). Y: integer class labels [N] as centred one-hot columns, real targets
    ([N] or [N, m]) centred; the centring leaves out the constant a bias fits at once.
    """
    steps = check_integer(steps, "steps")
    if steps >= 2**62:  # the exponent 2·steps is a 64-bit integer
        raise ValueError(f"steps must be a positive integer below 2**62, got {steps!r}")
    t = _labels_or_targets(y)
    k = _labelled_kernel(kernel, len(t), "descent_residual")
    if t.is_floating_point():
        t = t.to(torch.float64).reshape(t.shape[0], -1)
    else:  # classes as columns, whatever integers (or booleans) name them
        t = torch.nn.functional.one_hot(torch.unique(t, return_inverse=True)[1]).to(torch.float64)
    scale = float(t.square().sum())
    t = t - t.mean(0)
    total = float(t.square().sum())
    if total <= CONSTANT * scale:  # zero up to the rounding of the centring
        raise ValueError("y is constant (one class): there is nothing for descent to fit")
    lam, vectors = torch.linalg.eigh(k)
    require_semidefinite(
        lam, "descent_residual needs a positive semidefinite kernel K(x, x) of the batch"
    )
    lam = lam.clamp_min(0.0)
    if float(lam[-1]) <= 0.0:
        return 1.0  # a zero kernel moves nothing
    weights = (vectors.T @ t).square().sum(1)
    return float((weights * (1.0 - lam / lam[-1]).pow(2 * steps)).sum()) / total
