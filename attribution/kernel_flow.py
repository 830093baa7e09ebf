"""Training logits of the kernel's gradient flow, stopped early: the state the influence function
reads its residuals and curvature from when the network itself has fitted its training set.

The Gauss–Newton influence weighs each training example by its residual r_i = e_{y_i} − p_i and
the softmax curvature Λ_i at the network's logits. A network trained to convergence fits its
training set, so most r_i and Λ_i are near zero and the influence function no longer sees what
each example did while it was being learnt; checkpoints from early in training predict retraining
better (`python benchmarks/checkpoints.py`), and mostly through their logits, not their kernel.
Without checkpoints, `flow_logits` reconstructs such logits from the final network's kernel: the
gradient flow of the mean cross-entropy in function space,

    df/dt = −K (softmax(f) − Y),   K = k(X, X) / N,   f(0) = 0,

stopped when the training loss reaches a target (`influence` uses a multiple of the network's own
training loss). Examples the kernel learns easily are confident by then, the hard ones are not.

Integration: in the eigenbasis of K (f = V c), an exponential Euler step with the scalar
curvature bound γ = max_i tr Λ_i ≥ ‖Λ_i‖: c ← c − (1 − e^{−hγe}) / γ · Vᵀ r (e: eigenvalues of K),
exact for a quadratic loss of curvature γ and stable for any step h, so the steps grow
geometrically (STEP_GROWTH) instead of staying below 2/e_max as gradient descent's must; the last
step is bisected to land on the target loss.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

# `influence(training_logits="auto")` stops the flow at LOSS_RATIO × the network's training loss:
# the best mean LDS over the four settings of `python benchmarks/training_logits.py` (digits MLP,
# digits CNN, breast_cancer, wine: 0.759 / 0.699 / 0.589 / 0.708 against 0.674 / 0.617 / 0.608 /
# 0.636 with the network's logits). Leave-one-setting-out the folds pick 8 / 4 / 8 / 4 and score
# 0.738 / 0.684 / 0.577 / 0.693 held out (breast_cancer is best with the network's logits).
LOSS_RATIO = 6.0
# Growth of the step per step. At the same loss the LDS of the influence at these logits is within
# 0.002–0.006 of gradient descent's at step 1/e_max (digits MLP at 4 ×, digits CNN at 8 × and
# 16 ×); growth 1 % / 2 % / 5 % loses 0.006 / 0.012 / 0.026 on the digits MLP (twentieth session,
# results/training_logits.md). A few thousand steps, each two N × N × O products.
STEP_GROWTH = 1.003
# Steps after which the flow stops short of its target (a loss the kernel cannot reach)
MAX_STEPS = 20000
_BISECTIONS = 40


def flow_logits(
    kernel: torch.Tensor, y: torch.Tensor, num_outputs: int, target_loss: float
) -> torch.Tensor:
    """Logits f [N, O] (float64) of the kernel gradient flow from f = 0 when its mean training
    cross-entropy first reaches `target_loss` (module docstring). kernel: the scalar kernel
    k(X, X) [N, N] (Θ = k ⊗ I_O); y: labels [N]. A target at or above log O (the loss at f = 0)
    returns zeros; a loss the flow cannot reach within MAX_STEPS (labels the kernel cannot
    separate) returns the last state."""
    n = kernel.shape[0]
    if kernel.shape != (n, n) or y.shape != (n,):
        raise ValueError(
            f"kernel must be [N, N] and y [N], got {tuple(kernel.shape)} and {tuple(y.shape)}"
        )
    if not target_loss > 0:
        raise ValueError(f"target_loss must be > 0, got {target_loss}")
    y = y.long()
    targets = F.one_hot(y, num_outputs).double()
    evals, evecs = torch.linalg.eigh(kernel.double() / n)
    evals = evals.clamp_min(0)
    coef = torch.zeros(n, num_outputs, dtype=torch.float64)  # f = V c

    def advance(h: float, gamma: float, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = coef - (-torch.expm1(-h * gamma * evals) / gamma)[:, None] * grad
        return c, evecs @ c

    def loss(f: torch.Tensor) -> float:
        return F.cross_entropy(f, y).item()

    f = torch.zeros(n, num_outputs, dtype=torch.float64)
    if loss(f) <= target_loss:  # log O: the target lies at or before the start
        return f
    h = 0.1 / ((1 - 1 / num_outputs) * max(evals[-1].item(), 1e-300))
    for _ in range(MAX_STEPS):
        p = f.softmax(1)
        gamma = (p * (1 - p)).sum(1).max().item()
        grad = evecs.T @ (p - targets)
        new_coef, new = advance(h, gamma, grad)
        if loss(new) <= target_loss:  # the last step: the h at which the loss meets the target
            lo, hi = 0.0, h
            for _ in range(_BISECTIONS):
                mid = (lo + hi) / 2
                above = loss(advance(mid, gamma, grad)[1]) > target_loss
                lo, hi = (mid, hi) if above else (lo, mid)
            return advance(hi, gamma, grad)[1]
        coef, f, h = new_coef, new, h * STEP_GROWTH
    return f
