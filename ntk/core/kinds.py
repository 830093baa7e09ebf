"""Kernel kinds and the contraction of per-sample Jacobian features into each kind.

Every method produces, for a block of B samples, features indexed by a *cotangent* c: the rows
u_cᵀ J(x) of the Jacobian seen through C cotangent vectors u_c ∈ ℝ^O. For `full`, `diagonal`
and `trace` the cotangents are the O basis vectors; for `sum_logits` there is one, 1/√O · 1,
so that its kernel is (1/O) ∇(Σ_o f_o)·∇(Σ_o f_o) (Mohamadi et al., ICML 2023).
"""

from __future__ import annotations

import math

import torch

KINDS = ("full", "diagonal", "trace", "sum_logits")


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; valid kinds are {', '.join(KINDS)}")
    return kind


def cotangents(kind: str, num_outputs: int, *, dtype, device) -> torch.Tensor:
    """The C × O matrix whose rows are the cotangent vectors of `kind`."""
    if kind == "sum_logits":
        return torch.full(
            (1, num_outputs), 1.0 / math.sqrt(num_outputs), dtype=dtype, device=device
        )
    return torch.eye(num_outputs, dtype=dtype, device=device)


def tile_shape(kind: str, n1: int, n2: int, num_outputs: int) -> tuple[int, ...]:
    if kind == "full":
        return (n1, n2, num_outputs, num_outputs)
    if kind == "diagonal":
        return (n1, n2, num_outputs)
    return (n1, n2)


def pair_factor(kind: str, c: int) -> int:
    """Number of cotangent pairs a kind contracts (C² for full, C otherwise)."""
    return c * c if kind == "full" else c


def contract(g1: torch.Tensor, g2: torch.Tensor, kind: str) -> torch.Tensor:
    """Kernel tile from explicit features g [C, B, P] (P flattened parameters)."""
    c, b1, p = g1.shape
    b2 = g2.shape[1]
    if kind == "full":
        k = g1.reshape(c * b1, p) @ g2.reshape(c * b2, p).T
        return k.reshape(c, b1, c, b2).permute(1, 3, 0, 2)
    if kind == "diagonal":
        return torch.bmm(g1, g2.transpose(1, 2)).permute(1, 2, 0)
    # trace and sum_logits: Σ_c u_cᵀJ(x) · u_cᵀJ(x')
    return g1.transpose(0, 1).reshape(b1, c * p) @ g2.transpose(0, 1).reshape(b2, c * p).T


def contract_factored(
    gram_in: torch.Tensor, d1: torch.Tensor, d2: torch.Tensor, kind: str
) -> torch.Tensor:
    """Kernel tile of a weight shared over S positions, J = Σ_s δ_s ⊗ a_s, from its factors.

    gram_in [B1, S1, B2, S2] holds a_s(x)·a_t(x'); d [C, B, S, F] holds the backward signals δ.
    The tile is Σ_{s,t} (a_s·a'_t)(δ_cs·δ'_dt); with S = 1 it is (input Gram) ⊙ (cotangent Gram).
    """
    c, b1, s1, f = d1.shape
    b2, s2 = d2.shape[1], d2.shape[2]
    if s1 == 1 and s2 == 1:
        a = gram_in.reshape(b1, b2)
        # the cotangent Gram is a fresh product: scale it in place, no second tile-sized buffer
        if kind == "full":
            g = (d1.reshape(c * b1, f) @ d2.reshape(c * b2, f).T).reshape(c, b1, c, b2)
            return g.mul_(a[None, :, None, :]).permute(1, 3, 0, 2)
        if kind == "diagonal":
            g = torch.bmm(d1.reshape(c, b1, f), d2.reshape(c, b2, f).transpose(1, 2))
            return g.mul_(a[None]).permute(1, 2, 0)
        return (
            d1.transpose(0, 1).reshape(b1, c * f) @ d2.transpose(0, 1).reshape(b2, c * f).T
        ).mul_(a)
    if kind == "full":
        g = d1.reshape(c * b1 * s1, f) @ d2.reshape(c * b2 * s2, f).T
        g = g.reshape(c, b1, s1, c, b2, s2)
        return torch.einsum("isjt,cisdjt->ijcd", gram_in, g)
    if kind == "diagonal":
        g = torch.bmm(d1.reshape(c, b1 * s1, f), d2.reshape(c, b2 * s2, f).transpose(1, 2))
        return torch.einsum("isjt,cisjt->ijc", gram_in, g.reshape(c, b1, s1, b2, s2))
    g = (
        d1.permute(1, 2, 0, 3).reshape(b1 * s1, c * f)
        @ d2.permute(1, 2, 0, 3).reshape(b2 * s2, c * f).T
    )
    return (gram_in * g.reshape(b1, s1, b2, s2)).sum(dim=(1, 3))


def transpose_tile(tile: torch.Tensor, kind: str) -> torch.Tensor:
    """K(x2, x1) from K(x1, x2): swap samples (and output pairs for `full`)."""
    if kind == "full":
        return tile.permute(1, 0, 3, 2)
    if kind == "diagonal":
        return tile.permute(1, 0, 2)
    return tile.T
