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

stopped once it has fitted a set share of the kernel's directions. Examples the kernel learns
easily are confident by then, the hard ones are not. The same flow moves any other input's logits
through the cross kernel, f_z(t) = −k(z, X)/N ∫₀ᵗ (softmax(f) − Y) ds (`cross`): `influence`
takes the test margins' gradients there too, so both sides of the influence function are read
at one state of the linearised training (LDS at FITTED_FRACTION against the network's own test
logits, settings of `python benchmarks/training_logits.py`: +0.021 digits MLP, +0.019 digits
CNN, −0.003 wine, 0 breast_cancer, whose two classes leave u independent of the logits).

Stopping rule: under a quadratic loss of curvature γ the flow has fitted the share 1 − e^{−tγe_k} of
the component along K's eigenvector k after a time t (e_k: its eigenvalue), so

    fitted(t) = (1/N) Σ_k (1 − e^{−t γ̄(t) e_k}),   γ̄ = mean_i tr Λ_i,  Λ_i = diag(p_i) − p_i p_iᵀ,

is the share of directions fitted, the flow's counterpart of ridge's effective number of
parameters Σ_k e_k/(e_k + λ) at λ = 1/(tγ̄). `influence` stops at FITTED_FRACTION of them. It
reads the kernel and the labels only, not how far the network was trained, and it does not depend
on the kernel's scale (a scaled kernel runs the same path at a scaled time).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

from ntk.core.checks import check_amount, check_finite, check_integer
from ntk.spectrum import require_semidefinite

from .outputs import margin_gradient

# `influence(training_logits="auto")` stops the flow when it has fitted this share of the kernel's
# directions (module docstring): the best mean LDS over the four settings of `python
# benchmarks/training_logits.py` (digits MLP, digits CNN, breast_cancer, wine, test margins at
# the flow's test logits: 0.782 / 0.747 / 0.594 / 0.723 against 0.674 / 0.618 / 0.608 / 0.636
# with the network's logits). Leave-one-setting-out the folds pick 0.045 / 0.04 / 0.045 / 0.045
# and score 0.782 / 0.734 / 0.594 / 0.723 held out (the previous rule, 6 × the network's training
# loss with the network's test margins: 0.738 / 0.684 / 0.577 / 0.693).
FITTED_FRACTION = 0.045
# Growth of the step per step. Stopped at the same loss, the LDS of the influence at these logits
# is within 0.002–0.006 of gradient descent's at step 1/e_max (digits MLP at 4 × its network's
# loss, digits CNN at 8 × and 16 ×); growth 1 % / 2 % / 5 % loses 0.006 / 0.012 / 0.026 on the
# digits MLP (twentieth session, results/training_logits.md). A few thousand steps, each two
# N × N × O products.
STEP_GROWTH = 1.003
# The first step, a share of the stable step 1/(γ e_max) of gradient descent at f = 0. The
# stopping rule reads the flow's time, which the first steps set: at 0.1 the time runs ahead and
# the state at a share is 2 % off gradient descent's on the test problem (0.17 % on the digits MLP
# at FITTED_FRACTION), at 0.01 0.4–0.5 % (0.02 %), for a few hundred more steps.
FIRST_STEP = 0.01
# Steps after which the flow stops short of its share (one the kernel does not reach)
MAX_STEPS = 20000
_BISECTIONS = 40


def fitted_share(f: torch.Tensor, time: torch.Tensor, eigenvalues: torch.Tensor) -> torch.Tensor:
    """(1/N) Σ_k (1 − e^{−t γ̄ e_k}) (module docstring) at logits f [..., N, O] and times t [...]
    of flows under kernels K = k/N with eigenvalues e_k [..., N]."""
    p = f.softmax(-1)
    mean_curvature = (p * (1 - p)).sum(-1).mean(-1)
    return -torch.expm1(-(time * mean_curvature)[..., None] * eigenvalues).mean(-1)


class FlowLogits(NamedTuple):
    """The flow's logits where it stopped: of the training examples [N, O] and, when `flow_logits`
    was given a cross kernel, of those inputs [M, O] (None otherwise); float64. A batch of flows
    has a leading batch dimension on both."""

    train: torch.Tensor
    test: torch.Tensor | None


def flow_logits(
    kernel: torch.Tensor,
    y: torch.Tensor,
    num_outputs: int,
    fitted_fraction: float = FITTED_FRACTION,
    loss_floor: float | None = None,
    cross: torch.Tensor | None = None,
    step_growth: float = STEP_GROWTH,
) -> FlowLogits:
    """Logits of the kernel gradient flow from f = 0 when it first has fitted `fitted_fraction`
    (in (0, 1)) of the kernel's directions (`fitted_share`), or sooner when its mean training
    cross-entropy reaches `loss_floor` (`influence` passes the network's own: the flow goes no
    further than the network went). kernel: the scalar kernel k(X, X) [N, N] (Θ = k ⊗ I_O);
    y: labels [N]; cross: k(Z, X) [M, N] for the logits of other inputs Z at the same time (module
    docstring). The share levels off once the flow fits its training set (t·γ̄ stops growing), so
    without a floor a share it does not reach runs MAX_STEPS and returns the last state. A batch
    of B flows (kernel [B, N, N], y [B, N], cross [B, M, N]) runs in lockstep, each with its own
    steps and stop, as if run one by one. step_growth: the factor by which each step exceeds the
    last (> 1; larger: fewer steps, coarser).

    Integrated in K's eigenbasis (K = V diag(e) Vᵀ): f = V c, and with the curvature frozen at γ
    over a step h the component k moves by c_k ← c_k − (1 − e^{−hγe_k})/γ · g_k, g = Vᵀ(p − Y);
    the integrated residual a = Vᵀ∫(p − Y) then moves by (1 − e^{−hγe_k})/(γe_k) · g_k (h where
    e_k = 0), so c = −e ⊙ a and f_z = −(k(Z, X)/N) V a."""
    single = kernel.dim() == 2
    if single:
        kernel, y = kernel[None], y[None]
        cross = None if cross is None else cross[None]
    b, n = kernel.shape[:2]
    if kernel.dim() != 3 or kernel.shape[1:] != (n, n) or y.shape != (b, n):
        raise ValueError(
            f"kernel must be [N, N] and y [N] (or a batch: [B, N, N] and [B, N]), got "
            f"{tuple(kernel.shape[single:])} and {tuple(y.shape[single:])}"
        )
    if cross is not None and (cross.dim() != 3 or cross.shape[0] != b or cross.shape[2] != n):
        raise ValueError(f"cross must be [M, N] with N = {n}, got {tuple(cross.shape[single:])}")
    for name, values in (("kernel", kernel), ("cross", cross)):
        if values is not None:
            check_finite(values, name)
    if check_integer(num_outputs, "num_outputs") < 2:  # the softmax of one output is constant
        raise ValueError(f"num_outputs must be at least 2 (class scores), got {num_outputs}")
    check_amount(fitted_fraction, "fitted_fraction", below=1)
    if not step_growth > 1:
        raise ValueError(f"step_growth must be > 1, got {step_growth!r}")
    if loss_floor is not None:
        check_amount(loss_floor, "loss_floor", zero=True)
    y = y.long()
    targets = F.one_hot(y, num_outputs).double()
    evals, evecs = torch.linalg.eigh(kernel.double() / n)
    for values in evals:  # the training logits would clamp what the cross logits read as it is
        require_semidefinite(values, "kernel must be positive semidefinite (a kernel k(X, X))", n)
    evals = evals.clamp_min(0)

    def advance(rows, integral, h, gamma, grad) -> tuple[torch.Tensor, torch.Tensor]:
        """The flows `rows` (a slice or index) one step h further, at curvature γ: (integral a,
        logits f)."""
        speed = gamma[:, None] * evals[rows]
        step = torch.where(speed > 0, -torch.expm1(-h[:, None] * speed) / speed, h[:, None])
        a = integral + step[..., None] * grad
        return a, evecs[rows] @ (-evals[rows][..., None] * a)

    def reached(rows, f, time) -> torch.Tensor:
        done = fitted_share(f, time, evals[rows]) >= fitted_fraction
        if loss_floor is not None:
            loss = -(f.log_softmax(-1).gather(-1, y[rows][..., None])).mean((-2, -1))
            done |= loss <= loss_floor
        return done

    integral = torch.zeros(b, n, num_outputs, dtype=torch.float64)  # a = Vᵀ ∫ (p − Y) dt
    f = torch.zeros(b, n, num_outputs, dtype=torch.float64)
    time = torch.zeros(b, dtype=torch.float64)
    every = slice(None)
    # a floor at or above log O, the loss at f = 0; or a zero kernel, along which the flow never
    # moves: stopped at the start
    active = ~(reached(every, f, time) | ~(evals[:, -1] > 0))
    h = FIRST_STEP / ((1 - 1 / num_outputs) * evals[:, -1].clamp_min(1e-300))
    for _ in range(MAX_STEPS):
        if not active.any():
            break
        # every flow steps (no copies of the eigenvectors); the stopped ones keep their state
        p = f.softmax(-1)
        gamma = (p * (1 - p)).sum(-1).amax(-1)
        grad = evecs.mT @ (p - targets)
        new_integral, new = advance(every, integral, h, gamma, grad)
        hit = active & reached(every, new, time + h)
        for at in hit.nonzero()[:, 0].tolist():  # its last step: the h that meets its stop
            one = [at]
            lo, hi = torch.zeros(1, dtype=torch.float64), h[one].clone()
            for _ in range(_BISECTIONS):
                mid = (lo + hi) / 2
                state = advance(one, integral[one], mid, gamma[one], grad[one])[1]
                below = ~reached(one, state, time[one] + mid)
                lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
            integral[one], f[one] = advance(one, integral[one], hi, gamma[one], grad[one])
        active &= ~hit
        moving = active[:, None, None]
        integral, f = torch.where(moving, new_integral, integral), torch.where(moving, new, f)
        time, h = torch.where(active, time + h, time), torch.where(active, h * step_growth, h)
    test = None if cross is None else -(cross.double() / n) @ (evecs @ integral)
    if single:
        return FlowLogits(f[0], None if test is None else test[0])
    return FlowLogits(f, test)


def influence_state(
    kernel: torch.Tensor,
    cross: torch.Tensor,
    network_logits: torch.Tensor,
    y: torch.Tensor,
    y_test: torch.Tensor,
    fitted_fraction: float = FITTED_FRACTION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where `influence` reads both sides of the Gauss–Newton influence function: the flow's
    training logits [N, O] (stopped at `fitted_fraction`, or at the network's own training loss
    CE(network_logits, y) if sooner) and the test margins' gradients u_z [M, O] at the flow's test
    logits. kernel: k(X, X) [N, N]; cross: k(Z, X) [M, N] (scalar kernels)."""
    loss = F.cross_entropy(network_logits, y).item()
    o = network_logits.shape[1]
    state = flow_logits(kernel, y, o, fitted_fraction, loss_floor=loss, cross=cross)
    return state.train, margin_gradient(state.test, y_test)
