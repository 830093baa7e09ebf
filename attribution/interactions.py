"""How training samples act on each other's learning, read off the labelled pseudo-NTK (lpNTK;
Guo, Ren, Albrecht & Smith, ICLR 2024).

A gradient step on sample j changes the labelled output s(y_i)ᵀ f(x_i) of sample i, with
s(y) = 2e_y − 1, by −η s(y_i)ᵀ Θ(x_i, x_j) s(y_j) times j's loss scale: the lpNTK
K_ij = s(y_i)ᵀ Θ(x_i, x_j) s(y_j) (`ntk.empirical_ntk(kind="lpntk")`) is the inner product of the
per-sample gradients g_i = ∇θ s(y_i)ᵀ f(x_i). Its cosine form C_ij = K_ij / √(K_ii K_jj) sorts
pairs as the paper does: C_ij ≈ 1, learning one teaches the other (interchangeable, redundant);
C_ij ≈ 0, unrelated; C_ij < 0, learning one unlearns the other (contradictory: a mislabelled
sample pulls against the correctly labelled samples that look like it). Per sample i, over the
other samples j ≠ i:

- agreement_i = mean_{j: y_j = y_i} C_ij: how much the samples that share its label agree with
  sample i (low: its label is at odds with its class, e.g. flipped; 0 when it is alone in its
  class). With O classes s(y) = 2e_y − 1 shares its −1 entries across classes, so C is mostly
  positive for O > 2 and the comparison within a label is what separates a flipped sample;
- support_i = mean_j C_ij: how much the rest of the data agrees with sample i (low: hard to
  learn, likely forgotten);
- contradiction_i = mean_j max(−C_ij, 0): the mass of contradicting pairs (the paper's negative
  entries; rarely nonzero for many classes, see agreement);
- redundancy_i = max_j C_ij and partner_i = argmax_j C_ij: its most interchangeable sample
  (pruning removes one of each highly redundant pair first).

Benchmarks (mislabel detection, data pruning): python benchmarks/lpntk_uses.py.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

import ntk
from ntk.core import kinds
from ntk.core.checks import check_integer

from .outputs import logits


def sample_interactions(
    model: nn.Module,
    x,
    y,
    *,
    projection_dim: int | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    device=None,
    output_fn: Callable | None = None,
    dtype: torch.dtype | None = None,
    return_kernel: bool = False,
) -> dict[str, np.ndarray]:
    """Per-sample interaction scores of (x, y) under the trained `model` (module docstring):
    {"agreement", "support", "contradiction", "redundancy": [N] float64, "partner": [N] int64}
    and, with
    return_kernel, "kernel": the lpNTK [N, N]. y: class labels [N]. projection_dim: None for the
    exact lpNTK, else the Gram matrix of `projections.features(kind="lpntk")` of that dimension
    (seeded by `seed`). output_fn and dtype as in `ntk.empirical_ntk`. The model is never
    modified."""
    projection_dim = check_integer(projection_dim, "projection_dim", optional=True)
    g = logits(model, x, output_fn=output_fn, name="x")
    n, o = g.shape
    if n < 2:
        raise ValueError(f"sample interactions need at least 2 samples, got {n}")
    y = kinds.get("lpntk").check_labels(y, n, o, "y").cpu()  # a classifier's labels
    opts = dict(batch_size=batch_size, device=device, output_fn=output_fn, dtype=dtype)
    if projection_dim is None:
        k = ntk.empirical_ntk(model, x, kind="lpntk", labels=y, **opts)
    else:
        import projections

        features = projections.features(
            model, x, dim=projection_dim, kind="lpntk", labels=y, seed=seed, **opts
        )
        phi = torch.as_tensor(features)
        k = phi @ phi.T
    k = torch.as_tensor(k).double().cpu()
    diag = k.diagonal()
    if not bool((diag > 0).all()):
        zero = int(torch.nonzero(diag <= 0)[0])
        raise ValueError(
            f"sample {zero} has a zero labelled gradient (lpNTK diagonal {float(diag[zero]):.3g}); "
            "its interactions are undefined"
        )
    scale = diag.sqrt()
    c = k / scale[:, None] / scale[None, :]
    c.fill_diagonal_(0.0)
    support = c.sum(1) / (n - 1)
    same = (y[:, None] == y[None, :]).double().cpu()
    same.fill_diagonal_(0.0)
    agreement = (c * same).sum(1) / same.sum(1).clamp_min(1)
    contradiction = (-c).clamp_min(0).sum(1) / (n - 1)
    c.fill_diagonal_(-torch.inf)
    redundancy, partner = c.max(1)
    out = {
        "agreement": agreement.numpy(),
        "support": support.numpy(),
        "contradiction": contradiction.numpy(),
        "redundancy": redundancy.numpy(),
        "partner": partner.numpy(),
    }
    if return_kernel:
        out["kernel"] = k.numpy()
    return out
