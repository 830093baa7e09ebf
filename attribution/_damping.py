"""The effective number of parameters of a damped Gauss–Newton system, and the damping that keeps a
chosen number of them.

`influence`'s damping λ and `NTKPosterior`'s prior precision δ are the same quantity of the same
system A + λI (A = SΘS in kernel form, its projected or Kronecker-factored stand-in otherwise).
With the eigenvalues e_k of A, the effective number of parameters

    γ(λ) = Σ_k e_k / (e_k + λ)

falls from the rank of A at λ → 0 to 0 as λ → ∞; it counts the directions the data determine
against the damping. Choosing λ by a target γ is scale-free (it does not change when the loss or
the outputs are rescaled), which a fixed λ is not.
"""

from __future__ import annotations

import math

import scipy.optimize
import torch

# Systems up to this size get their exact spectrum; larger ones a randomized top of the spectrum
# (`spectrum`), whose cost is a few products with the system.
EXACT_SPECTRUM = 4096


def effective_parameters(eigenvalues: torch.Tensor, damping: float) -> float:
    """γ(λ) = Σ_k e_k/(e_k + λ)."""
    e = eigenvalues.detach().double().flatten().clamp_min(0).cpu()
    return float((e / (e + damping)).sum())


def damping_for(eigenvalues: torch.Tensor, target: float) -> float:
    """The λ > 0 with γ(λ) = target (at most half the numerical rank of the spectrum)."""
    e = eigenvalues.detach().double().flatten().clamp_min(0).cpu()
    top = float(e.max()) if e.numel() else 0.0
    if not top > 0:
        raise ValueError(
            "the Gauss–Newton curvature is zero (every training output is saturated); pass "
            "damping= (influence) or prior_precision= (NTKPosterior) explicitly"
        )
    rank = int((e > top * 1e-12).sum())
    target = min(target, 0.5 * rank)

    def excess(log_lam: float) -> float:
        return float((e / (e + 10.0**log_lam)).sum()) - target

    lo, hi = math.log10(top) - 16, math.log10(top) + 8
    return float(10.0 ** scipy.optimize.brentq(excess, lo, hi, xtol=1e-12))


def damping_keeping(a: torch.Tensor, rank: int, target: float) -> float:
    """The λ with γ(λ) = target for the symmetric PSD system `a` of the given rank, from its
    `spectrum` (exact, or the top 4·target + 64 eigenvalues and the trace's rest)."""
    return damping_for(spectrum(a, rank, int(4 * target) + 64), target)


def spectrum(a: torch.Tensor, rank: int, top: int) -> torch.Tensor:
    """The eigenvalues of the symmetric PSD system `a` of known rank that `damping_for` needs:
    all of them up to EXACT_SPECTRUM rows; beyond, the `top` largest by a randomized range finder
    with two power iterations (Halko, Martinsson & Tropp, SIAM Review 2011) and the rest of the
    trace spread evenly over the remaining rank − top directions. At a λ that keeps γ well below
    `top` the top eigenvalues carry γ; the tail enters only through its mass."""
    d = a.shape[0]
    rank = min(d, rank)
    k = min(d, top)
    if d <= EXACT_SPECTRUM or k >= rank:
        return torch.linalg.eigvalsh(a)
    gen = torch.Generator(device="cpu").manual_seed(0)
    y = a @ torch.randn(d, k, generator=gen, dtype=a.dtype).to(a.device)
    for _ in range(2):
        y = a @ torch.linalg.qr(y).Q
    q = torch.linalg.qr(y).Q
    head = torch.linalg.eigvalsh(q.T @ a @ q).clamp_min(0)
    tail = max(float(a.trace()) - float(head.sum()), 0.0)
    rest = torch.full((rank - k,), tail / (rank - k), dtype=head.dtype, device=head.device)
    return torch.cat([head, rest])
