"""Random projection of the engine's per-layer Jacobian terms, Φ_l = J_l R_l, without forming
per-sample gradients of factored weights.

*Explicit* terms g [C, B, P] (biases, normalisation affines, autodiff fallback) are projected
densely, Φ = g R/√k, in chunks of parameters (see `_projectors`).

*Factored* weights have Jacobian rows Σ_s δ_s ⊗ a_s (δ_s ∈ ℝ^{F_out}, a_s ∈ ℝ^{F_in}). They are
projected with a stacked Kronecker projector: k = r·m² columns made of r independent blocks
R_j = R_out,j ⊗ R_in,j (R_out,j ∈ ℝ^{F_out×m}, R_in,j ∈ ℝ^{F_in×m}, unit-variance entries
scaled by 1/√m, each block scaled by 1/√r), so that

    Φ_j = (1/√r) Σ_s (R_out,jᵀ δ_s) ⊗ (R_in,jᵀ a_s)      and      E[R Rᵀ] = I.

For an embedding a_s is one-hot, so R_in,jᵀ a_s is a row of R_in,j gathered by token id.
The cost per sample and cotangent is S·k·(F_in/m + F_out/m + 1) instead of P·k for the dense
projection of the P = F_out·F_in gradient. Variance: for one block with g = δ⊗a, g' = δ'⊗a',
the estimate is a product XY of independent unbiased estimates X of δ·δ' and Y of a·a' from
m-dimensional projections, so Var = μ_X²σ_Y² + μ_Y²σ_X² + σ_X²σ_Y² with (Gaussian entries)
σ_X² = (‖δ‖²‖δ'‖² + (δ·δ')²)/m. On the diagonal (g = g') this is ‖g‖⁴(4/m + 4/m²), and the
average of r = k/m² blocks has variance ‖g‖⁴(4m + 4)/k against 2‖g‖⁴/k for a dense Gaussian
projection of the same k: a single Kronecker product (r = 1, m = √k) has relative error
∝ k^(-1/4), not k^(-1/2). The default m = 1 (a row-wise Kronecker or "Khatri–Rao" projection,
Rakhshan & Rabusseau, AISTATS 2020) keeps the error within about √(8/2) = 2× the dense
projection's on the diagonal while it is the cheapest per column (`python
benchmarks/projection_speed.py` compares its error with TRAK's dense projection;
`benchmarks/projection_accuracy.py` measures the 1/√k trend). A weight shared over so many
positions that projecting the factors costs more (S·(F_in + F_out) > P, as in early
convolutions) is projected through its per-sample gradient G = Σ_s δ_s a_sᵀ (smaller than the
factors it replaces) instead, with the same matrices: Φ_j = (1/√r) vec(R_out,jᵀ G R_in,j), vec(G)
times the factors' Khatri–Rao product (a dense [P, k] matrix, held once per layer). The
cheaper route per sample wins, counting each projection's own multiply-adds (D·k for a dense
matrix, far less for an srht transform) and `PASS_COST` for each element written outside a
matrix product (the factors' route writes S·k·(1 + 2C)). The choice depends on the number of
positions S, which may differ between batches (sequences of other lengths, images of other
sizes); both routes give the same features, so every pair of samples is projected alike.
"""

from __future__ import annotations

import math

import torch

from ntk.core.structured import Explicit, Factored

from ._projectors import MatrixBank, integer_dtype, integer_matmul, integer_rows

# Multiply-adds that one element written and read back by a memory-bound pass costs, against a
# matrix product's: on the project's 2-core CPU a float32 product runs 1.3·10¹¹ multiply-adds/s
# and an elementwise product of tensors beyond the caches 0.8–2.6·10⁹ elements/s (fresh or
# reused output). Without it the factors' route was taken for a digits CNN's second convolution
# (8 × 8 positions, 10 cotangents, k = 2048) at 2.8× the time of its gradient's route.
PASS_COST = 64


class Sketcher:
    """Projects the terms of one layer to k dimensions with matrices from a `MatrixBank`.

    kron: m, the side of each Kronecker block; route_count: the number of cotangents the cost
    model weighs when it chooses a factored weight's route (None: the terms' own C).
    """

    def __init__(
        self,
        bank: MatrixBank,
        dim: int,
        vocab: dict[str, int],
        kron: int = 1,
        route_count: int | None = None,
    ):
        if dim % (kron * kron):
            raise ValueError(f"dim={dim} must be a multiple of kron²={kron * kron}")
        self.bank, self.dim, self.vocab, self.m = bank, dim, vocab, kron
        self.r = dim // (kron * kron)
        self.route_count = route_count
        self._products: dict[tuple, tuple] = {}  # `_khatri_rao`'s, per layer

    def _dense(self, layer: str, part, rows: int):
        return self.bank.projection(("dense", layer, part), rows, self.dim, 1 / math.sqrt(self.dim))

    def explicit(self, layer: str, part, g: torch.Tensor) -> torch.Tensor:
        """g [C, B, P] → g R/√k [C, B, k]; `part` names the term within the layer."""
        return self._dense(layer, part, g.shape[-1]).matmul(g)

    def _factor(self, side: str, layer: str, rows: int):
        """The projection of a factored weight's inputs (side "in") or output signals ("out")."""
        return self.bank.projection((side, layer), rows, self.r * self.m, 1 / math.sqrt(self.m))

    def via_gradient(self, layer: str, s: int, f_in: int, f_out: int, c: int) -> bool:
        """Whether a factored weight (not an embedding) with S positions is projected through its
        per-sample gradient G = Σ_s δ_s a_sᵀ and a dense R rather than through its factors: the
        cheaper route per sample, counting each projection's own multiply-adds and
        `PASS_COST` for each element the route writes outside matrix products' inner loops
        (the factors' projections R_inᵀa_s, R_outᵀδ_s and their products at every position;
        the gradients G)."""
        n = self.route_count or c
        r_in, r_out = self._factor("in", layer, f_in), self._factor("out", layer, f_out)
        columns = self.r * self.m
        written = s * columns * (1 + n) + n * (s * self.r if self.m == 1 else self.dim)
        via_factors = s * (r_in.cost + n * r_out.cost) + n * s * self.dim + PASS_COST * written
        # G (S·F_out·F_in), then its product with the factors' Khatri–Rao matrix [P, k]
        gradient_work = s * f_out * f_in + f_out * f_in * self.dim
        via_gradient = n * gradient_work + PASS_COST * n * f_out * f_in
        return via_gradient < via_factors

    def elements_per_sample(
        self, layer: str, s: int, f_in: int, f_out: int, c: int, index: bool = False
    ) -> int:
        """Elements that projecting one sample's factored term of `layer` (C cotangents)
        holds at once, on the route `factored` takes (`work`: a projection's elements per
        vector)."""
        if not index and self.via_gradient(layer, s, f_in, f_out, c):
            return c * (f_out * f_in + self.dim)  # G and its projection (the matrix: shared)
        # an embedding's projected inputs are gathered rows of its own [vocabulary, r·m] matrix
        inputs = self.r * self.m if index else self._factor("in", layer, f_in).work
        products = c * s * self.r if self.m == 1 else c * self.dim
        return s * (inputs + c * self._factor("out", layer, f_out).work) + products

    def factored(self, t: Factored) -> torch.Tensor:
        """Σ_s δ_s ⊗ a_s projected with the stacked Kronecker projector → [C, B, k]."""
        c, b, s, f_out = t.d.shape
        m, r = self.m, self.r
        if t.index:
            r_in = self.bank.matrix(("in", t.layer), self.vocab[t.layer], r * m, 1 / math.sqrt(m))
            a_proj = r_in.gather(t.a.clamp(min=0))
            if t.padding_idx is not None:
                a_proj = a_proj * (t.a != t.padding_idx).unsqueeze(-1).to(a_proj.dtype)
        else:
            f_in = t.input_features
            if self.via_gradient(t.layer, s, f_in, f_out, c):
                return self._through_gradient(t, f_in, f_out)
            a_proj = self._factor("in", t.layer, f_in).matmul(t.a)  # [B, S, r·m]
        d_proj = self._factor("out", t.layer, f_out).matmul(t.d).reshape(c, b, s, r, m)
        a_proj = a_proj.reshape(b, s, r, m)
        phi = (
            (d_proj * a_proj).sum(2)
            if m == 1
            else torch.einsum("cbsrp,bsrq->cbrpq", d_proj, a_proj)
        )
        return phi.reshape(c, b, self.dim) / math.sqrt(r)

    def _through_gradient(self, t: Factored, f_in: int, f_out: int) -> torch.Tensor:
        """`factored`'s projection, with the same matrices, from the per-sample gradient
        G = Σ_s δ_s a_sᵀ: vec(G) times their Khatri–Rao product K [F_out·F_in, k], whose column
        (j, p, q) is R_out,j[:, p] ⊗ R_in,j[:, q] / √r, so Φ_j = (1/√r) vec(R_out,jᵀ G R_in,j).
        Samples whose positions make the other route cheaper (sequences of another length,
        images of another size) are projected by the same R: with independent matrices their
        cross terms had expectation 0."""
        key = (t.layer, f_in, f_out)
        if key not in self._products:  # one per layer: the gradient's route keeps P small
            self._products[key] = self._khatri_rao(t.layer, f_in, f_out)
        matrix, scale = self._products[key]
        g = t.gradient()
        if scale is None:
            return g.matmul(matrix)
        flat = integer_matmul(g.reshape(-1, g.shape[-1]), matrix).mul_(scale)
        return flat.reshape(*g.shape[:-1], self.dim)

    def _khatri_rao(self, layer: str, f_in: int, f_out: int) -> tuple[torch.Tensor, float | None]:
        """The Khatri–Rao product of the layer's factor matrices [F_out·F_in, k], as (int8 signs,
        their magnitude) where both factors are sign matrices (Rademacher, srht) multiplied by
        integers (`integer_rows`, `integer_dtype`), else as (the float matrix, None)."""
        m, r = self.m, self.r
        r_in = self._factor("in", layer, f_in).dense().reshape(f_in, r, m)
        r_out = self._factor("out", layer, f_out).dense().reshape(f_out, r, m)
        rows = f_out * f_in
        tops = [f.abs().amax() for f in (r_out, r_in)]
        signed = all(bool((f.abs() == top).all()) for f, top in zip((r_out, r_in), tops))
        if signed and integer_rows(rows) and integer_dtype(r_in.dtype, r_in.device):
            s_out, s_in = (torch.sign(f).to(torch.int8) for f in (r_out, r_in))
            signs = s_out[:, None, :, :, None] * s_in[None, :, :, None, :]
            return signs.reshape(rows, self.dim), float(tops[0] * tops[1]) / math.sqrt(r)
        product = torch.einsum("orp,irq->oirpq", r_out, r_in) / math.sqrt(r)
        return product.reshape(rows, self.dim), None

    def terms(self, terms: list, layers) -> dict:
        """Sum the projections of all terms per layer: {layer: Φ_l [C, B, k]} for the layers in
        `layers` (None: every layer, summed under the key None)."""
        out: dict = {}
        counts: dict[str, int] = {}
        dtype = self.bank.dtype  # a layer of a mixed-precision model may hold another
        for t in terms:
            key = None if layers is None else t.layer
            if layers is not None and t.layer not in layers:
                continue
            if isinstance(t, Explicit):
                part = counts.get(t.layer, 0)
                counts[t.layer] = part + 1
                phi = self.explicit(t.layer, part, t.g.to(dtype))
            else:
                phi = self.factored(t.to(dtype))
            out[key] = phi if key not in out else out[key] + phi
        return out
