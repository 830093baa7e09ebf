"""The effective number of parameters of a damped Gauss–Newton system, and the damping that keeps a
chosen number of them.

`influence`'s damping λ and `NTKPosterior`'s prior precision δ are the same quantity of the same
system A + λI (A = SΘS in kernel form, its projected or Kronecker-factored stand-in otherwise).
With the eigenvalues e_k of A, the effective number of parameters

    γ(λ) = Σ_k e_k / (e_k + λ)

falls from the rank of A at λ → 0 to 0 as λ → ∞; it counts the directions the data determine
against the damping. Choosing λ by a target γ is scale-free (it does not change when the loss or
the outputs are rescaled), which a fixed λ is not.

The damped system is then factored and solved here too (`damped_factor` for both, `cholesky`,
`cholesky_solve`, `log_det`), without the copies of the (N·O)² matrix that torch's factorisation
and solve make.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import scipy.linalg
import scipy.optimize
import torch

from ntk.core.checks import check_finite

# Systems up to this size get their exact spectrum; larger ones a randomized top of the spectrum
# (`spectrum`), whose cost is a few products with the system.
EXACT_SPECTRUM = 4096
# Gauss–Newton damping="auto" (`influence`, its method="surrogate" included; the surrogate's own
# default keeps `surrogate.GAUSS_NEWTON_DOF_FRACTION`, chosen for faithfulness): λ such
# that the effective number of parameters of the damped curvature, γ(λ) = Σ_k e_k/(e_k + λ), is
# DOF_FRACTION of its rank N·(O − 1). Chosen leave-one-setting-out on benchmarks/settings.py's
# three settings (`python benchmarks/damping.py`): each fold's choice (0.0125 or 0.015) scores
# LDS 0.668 / 0.618 / 0.608 held out on digits MLP / digits CNN / breast_cancer (in-sample best
# 0.674 / 0.619 / 0.608), against 0.674 / 0.617 / 0.338 for the previous rule λ = 3 × the mean
# eigenvalue. On a fourth setting added afterwards (wine MLP, never used to choose it) it scores
# 0.636 against 0.749 for that setting's best fraction and 0.762 for the previous rule
# (results/damping.md). Rechosen for `influence(method="surrogate")` (2026-12-06, the
# counterfactual of the Gauss–Newton machine, `surrogate_settings.py --fractions`): 0.015 in every
# fold, LDS 0.694 / 0.637 / 0.513 / 0.655 held out (digits MLP / CNN / breast_cancer / wine).
DOF_FRACTION = 0.015
# The numerical rank that caps a target γ counts each direction by a smooth step at f = RANK_FLOOR
# · top, e²/(e² + f²) (a count of e > tol · top jumps at rounding noise): float32 Jacobians J
# determine singular values to about √P · eps₃₂ ≈ 1e-6 of the largest, so eigenvalues of JᵀJ
# below ≈ 1e-12 of the top are rounding, and a hard count at 1e-12 put the float32 and float64
# copies of one network 3 apart (rank 67 vs 64: 13 % in the posterior's variance); here such an
# eigenvalue weighs ≤ 1e-3, float64 rounding (1e-16) nothing.
RANK_FLOOR = 1e-10
# Y ↦ AY for the system A, where a structured product is cheaper than the dense one
Product = Callable[[torch.Tensor], torch.Tensor]


def effective_parameters(eigenvalues: torch.Tensor, damping: float) -> float:
    """γ(λ) = Σ_k e_k/(e_k + λ)."""
    e = eigenvalues.detach().double().flatten().clamp_min(0).cpu()
    return float((e / (e + damping)).sum())


class ZeroCurvature(ValueError):
    """The Gauss–Newton curvature is zero (every training output saturated, or no trainable
    parameter moving the outputs): no rule keeps a share of its directions; `remedy` says what
    to give instead."""

    def __init__(self, remedy: str):
        super().__init__(
            "the Gauss–Newton curvature is zero (every training output is saturated, or no "
            "trainable parameter moves the outputs), so no damping keeps a share of its "
            f"directions; {remedy}"
        )


def damping_for(eigenvalues: torch.Tensor, target: float, option: str = "damping") -> float:
    """The λ > 0 with γ(λ) = target, at most half the spectrum's numerical rank (its directions
    counted by a smooth step at RANK_FLOOR · the top eigenvalue); a zero spectrum is
    `ZeroCurvature`, naming `option`, the caller's name for λ."""
    e = eigenvalues.detach().double().flatten().cpu()
    # NaN read as a zero curvature, inf failed in brentq
    check_finite(e, "the curvature's eigenvalues")
    e = e.clamp_min(0)
    top = float(e.max()) if e.numel() else 0.0
    if not top > 0:
        raise ZeroCurvature(f"pass {option}= explicitly")
    floor = RANK_FLOOR * top
    target = min(target, 0.5 * float((e**2 / (e**2 + floor**2)).sum()))

    def excess(log_lam: float) -> float:
        return float((e / (e + 10.0**log_lam)).sum()) - target

    lo, hi = math.log10(top) - 16, math.log10(top) + 8
    return float(10.0 ** scipy.optimize.brentq(excess, lo, hi, xtol=1e-12))


def spectrum_keeping(
    a: torch.Tensor, rank: int, target: float, product: Product | None = None
) -> torch.Tensor:
    """The `spectrum` of the symmetric PSD system `a` of the given rank that `damping_for` needs
    for any target up to `target` effective parameters: exact, or the top 4·target + 64
    eigenvalues and the trace's rest."""
    return spectrum(a, rank, int(4 * target) + 64, product)


def damping_keeping(
    a: torch.Tensor,
    rank: int,
    target: float,
    product: Product | None = None,
    option: str = "damping",
) -> float:
    """The λ with γ(λ) = target for the symmetric PSD system `a` of the given rank, from its
    `spectrum_keeping` (option: the caller's name for λ, in errors)."""
    return damping_for(spectrum_keeping(a, rank, target, product), target, option)


def scalar_kernel_system(k: torch.Tensor, root: torch.Tensor) -> tuple[torch.Tensor, Product]:
    """The Gauss–Newton system A = S(k ⊗ I_O)S [N·O, N·O] of a scalar kernel k [N, N] and the
    per-sample curvature roots S_i [N, O, O] (block (i, j) = k_ij S_i S_j), and its product
    Y ↦ AY = S((k ⊗ I)(SY)): N²·O·r + 2·N·O²·r multiply-adds for r columns instead of (N·O)²·r."""
    n, o, _ = root.shape
    k = k.to(root.dtype)
    # (S_i S_j)_{oq} for every pair as one product, then scaled by k_ij in place: a single
    # [N·O, N·O] allocation
    a = root.reshape(n * o, o) @ root.permute(1, 0, 2).reshape(o, n * o)
    a.view(n, o, n, o).mul_(k[:, None, :, None])

    def product(y: torch.Tensor) -> torch.Tensor:
        z = torch.einsum("iop,ipr->ior", root, y.reshape(n, o, -1))
        z = (k @ z.reshape(n, -1)).reshape(n, o, -1)
        return torch.einsum("iop,ipr->ior", root, z).reshape(n * o, -1)

    return a, product


def kernel_system(theta: torch.Tensor, root: torch.Tensor) -> tuple[torch.Tensor, Product | None]:
    """The Gauss–Newton system SΘS [N·O, N·O] of a training kernel Θ [N, N, O, O], or of a scalar
    kind's factor k [N, N] (Θ = k ⊗ I_O, never expanded) with its structured product
    (`scalar_kernel_system`); per-sample curvature roots S_i [N, O, O]."""
    if theta.dim() == 2:
        return scalar_kernel_system(theta, root)
    n, o, _ = root.shape
    return torch.einsum("iop,ijpr,jrq->iojq", root, theta, root).reshape(n * o, n * o), None


def spectrum(a: torch.Tensor, rank: int, top: int, product: Product | None = None) -> torch.Tensor:
    """The eigenvalues of the symmetric PSD system `a` of known rank that `damping_for` needs:
    all of them up to EXACT_SPECTRUM rows; beyond, the `top` largest by a randomized range finder
    with two power iterations (Halko, Martinsson & Tropp, SIAM Review 2011) and the rest of the
    trace spread evenly over the remaining rank − top directions. At a λ that keeps γ well below
    `top` the top eigenvalues carry γ; the tail enters only through its mass. product: a cheaper
    Y ↦ aY for the range finder (`scalar_kernel_system`); default the dense product."""
    d = a.shape[0]
    rank = min(d, rank)
    k = min(d, top)
    if d <= EXACT_SPECTRUM or k >= rank:
        return torch.linalg.eigvalsh(a)
    times = product or a.__matmul__
    gen = torch.Generator(device="cpu").manual_seed(0)
    y = times(torch.randn(d, k, generator=gen, dtype=a.dtype).to(a.device))
    for _ in range(2):
        y = times(torch.linalg.qr(y).Q)
    q = torch.linalg.qr(y).Q
    head = torch.linalg.eigvalsh(q.T @ times(q)).clamp_min(0)
    tail = max(float(a.trace()) - float(head.sum()), 0.0)
    rest = torch.full((rank - k,), tail / (rank - k), dtype=head.dtype, device=head.device)
    return torch.cat([head, rest])


def auto_damping(
    eigenvalues: torch.Tensor, n: int, o: int, fraction: float = DOF_FRACTION
) -> float:
    """The λ with γ(λ) = Σ_k e_k/(e_k + λ) = fraction · N·(O − 1) (`damping_for`) for
    the eigenvalues e of the Gauss–Newton curvature (SΘS, or its projected / Kronecker-factored
    stand-in). N·(O − 1) is the rank of Σ_i J_iᵀΛ_iJ_i (each softmax Λ_i has rank O − 1), so
    the rule keeps the same share of the directions the data determine whatever the number of
    classes (DOF_FRACTION's comment gives its leave-one-setting-out figures)."""
    return damping_for(eigenvalues, fraction * n * max(o - 1, 1))


def damped_cholesky(
    a: torch.Tensor,
    damping: str | float,
    n: int,
    o: int,
    fraction: float = DOF_FRACTION,
    product: Product | None = None,
    option: str = "damping",
) -> tuple[torch.Tensor, float]:
    """(Cholesky factor of a + λI, λ), in place on a (`damped_factor`); λ = damping or, for
    "auto", the λ keeping fraction · N·(O − 1) effective parameters (`damping_keeping`, from a's
    spectrum; N samples, O outputs; `product`: a cheaper Y ↦ aY for it). option: the caller's
    name for λ, in errors."""
    rank = n * max(o - 1, 1)
    if damping == "auto":
        lam = damping_keeping(a, rank, fraction * rank, product, option)
    else:
        lam = float(damping)
    return damped_factor(a, lam, option=option), lam


def damped_factor(
    a: torch.Tensor, damping: float, *, option: str = "damping", copy: bool = False
) -> torch.Tensor:
    """The lower Cholesky factor of a + λI (λ = damping) for the symmetric PSD system `a`,
    formed and factored over a's own memory on the CPU (`cholesky`; copy: on a copy, a kept). A
    damped system that is still not positive definite is refused, naming `option`, the caller's
    name for λ (damping, prior_precision, alpha)."""
    m = a.clone() if copy else a
    check_finite(m, "the Gauss–Newton system")
    m.diagonal().add_(damping)
    factor = cholesky(m)
    if factor is None:
        raise ValueError(
            f"the damped Gauss–Newton system is not positive definite at {option}={damping:.3g} "
            f"(singular, or a kernel that is not positive semi-definite in floating point); use "
            f"a larger {option}"
        )
    return factor


def log_det(factor: torch.Tensor) -> float:
    """log det(L Lᵀ) from the lower Cholesky factor L."""
    return 2.0 * float(factor.diagonal().log().sum())


def cholesky(a: torch.Tensor) -> torch.Tensor | None:
    """The lower Cholesky factor L (a = L Lᵀ) of the symmetric positive-definite `a`, or None
    when it is not positive definite; `a` is consumed. On the CPU, LAPACK's potrf (through scipy)
    writes L over a's own memory: a's row-major storage is the column-major storage of aᵀ = a,
    and L comes back as a column-major view of it. torch's factorisation works on a copy, which
    for a Gauss–Newton system is another (N·O)²·8 bytes. Other devices: torch's."""
    if a.device.type == "cpu" and a.is_contiguous() and not a.requires_grad:
        (potrf,) = scipy.linalg.get_lapack_funcs(("potrf",), (a.numpy(),))
        factor, info = potrf(a.numpy().T, lower=True, overwrite_a=True, clean=True)
        factor, info = torch.from_numpy(factor), int(info)
    else:
        factor, info = torch.linalg.cholesky_ex(a)
    # potrf reports success on a system of NaN, whose factor is NaN
    return factor if info == 0 and bool(torch.isfinite(factor.diagonal()).all()) else None


def cholesky_solve(b: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """(L Lᵀ)⁻¹ b for the lower Cholesky factor L [D, D] and b [D, M]: two triangular solves,
    which read L where it lies (torch.cholesky_solve copies it)."""
    y = torch.linalg.solve_triangular(factor, b, upper=False)
    return torch.linalg.solve_triangular(factor.mT, y, upper=True)
