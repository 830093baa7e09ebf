"""Kronecker-factored Gauss–Newton curvature (K-FAC, EK-FAC): influence whose cost grows linearly
with the number of training examples N.

The Gauss–Newton curvature of the summed cross-entropy, G = Σ_i J_iᵀ Λ_i J_i, is approximated
block-diagonally over layers. Λ_i = diag(p_i) − p_i p_iᵀ = L_i L_iᵀ with the closed-form factor
L_i = diag(√p_i) − p_i √p_iᵀ (column c: √p_ic (e_c − p_i); Σ_c p_ic = 1), so with δ_ics the
backward signal of cotangent c at position s of a weight used as y_s = W a_s (one position for a
Linear, the output pixels of a convolution; a bias is one more input feature), the weight's block
is G_W = Σ_i Σ_c vec(g_ic) vec(g_ic)ᵀ with g_ic = Σ_s δ_ics a_isᵀ. K-FAC (Martens & Grosse,
ICML 2015; Grosse & Martens, ICML 2016 for convolutions) approximates it by

    G_W ≈ (Σ_{i,c,s} δ δᵀ) ⊗ (Σ_{i,s} a aᵀ) / (N·S) = (Q_G ⊗ Q_A) diag(e_G e_Aᵀ/(N·S)) (Q_G ⊗ Q_A)ᵀ,

and EK-FAC (George et al., NeurIPS 2018) keeps the eigenbasis Q_G ⊗ Q_A and refits the
eigenvalues to the exact diagonal of G_W in it, Λ_W = Σ_i Σ_c (Q_Gᵀ g_ic Q_A)² (one more pass over
the data; the trace of G_W becomes exact). Parameters without this structure (the affine maps of
normalisation layers, parameters of modules the engine does not factor) get their exact dense
block. Memory: Σ_W (d_in² + d_out² + d_in·d_out) for the factors; per-example gradients are
formed one batch at a time, never for all N at once.

`KroneckerCurvature.influence` gives τ(z, i) = u_zᵀ J_z (G + λI)⁻¹ J_iᵀ r_i, the Gauss–Newton
influence of `attribution.influence` with the block-diagonal factored G, with
(G_W + λI)⁻¹ g = Q_G [(Q_Gᵀ g Q_A) / (Λ_W + λ)] Q_Aᵀ. Per-sample derivatives are computed in the
model's dtype; factors, eigendecompositions and preconditioning in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ntk.core import inputs, structured
from ntk.core.memory import available_bytes
from ntk.core.model import ModelView, check_eval_mode

STRATEGIES = ("kfac", "ekfac")
MAX_DENSE = 8192  # most parameters of a block without Kronecker structure (kept dense)


@dataclass
class _Kronecker:
    """A weight's factors: input and output-signal second moments (sums) over N·S positions."""

    a: torch.Tensor  # [F_in, F_in]
    g: torch.Tensor  # [F_out, F_out]
    count: int = 0
    qa: torch.Tensor | None = None
    qg: torch.Tensor | None = None
    eigenvalues: torch.Tensor | None = None  # [F_out, F_in]

    def decompose(self, corrected: bool) -> None:
        ea, self.qa = torch.linalg.eigh(self.a)
        eg, self.qg = torch.linalg.eigh(self.g)
        self.eigenvalues = None if corrected else torch.outer(eg, ea).clamp_min(0) / self.count

    def precondition(self, grads: torch.Tensor, damping: float) -> torch.Tensor:
        """(G_W + λI)⁻¹ applied to gradients [M, F_out, F_in]."""
        rotated = self.qg.T @ grads @ self.qa
        return self.qg @ (rotated / (self.eigenvalues + damping)) @ self.qa.T


@dataclass
class _Dense:
    """An exact Gauss–Newton block Σ_i Σ_c g_ic g_icᵀ of P parameters."""

    cov: torch.Tensor  # [P, P]
    q: torch.Tensor | None = None
    eigenvalues: torch.Tensor | None = None

    def decompose(self, corrected: bool) -> None:
        self.eigenvalues, self.q = torch.linalg.eigh(self.cov)
        self.eigenvalues.clamp_(min=0)

    def precondition(self, grads: torch.Tensor, damping: float) -> torch.Tensor:
        return ((grads @ self.q) / (self.eigenvalues + damping)) @ self.q.T


class KroneckerCurvature:
    """The block-diagonal Kronecker-factored Gauss–Newton curvature of a classifier's
    cross-entropy (module docstring).

    strategy: "ekfac" (eigenvalue-corrected) or "kfac". batch_size: samples per pass (None: from
    free memory). The model is used read-only through a functional view (eval mode required).
    """

    def __init__(
        self, model, *, strategy: str = "ekfac", batch_size: int | None = None, device=None
    ):
        if strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {strategy!r}; valid strategies are {', '.join(STRATEGIES)}"
            )
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be None or a positive integer, got {batch_size!r}")
        check_eval_mode(model)
        self.view = ModelView(model, device=device)
        self.strategy = strategy
        self.batch_size = batch_size
        self.blocks: dict[tuple[str, str], _Kronecker | _Dense] = {}
        self.num_train = 0

    # -- per-batch gradients -----------------------------------------------------------------

    def _terms(self, x, cot: torch.Tensor) -> dict[tuple[str, str], tuple]:
        """Per-block derivatives of a batch for cotangents cot [C, B, O]: ("kron", layer) →
        (a [B, S, F_in], δ [C, B, S, F_out]) and ("dense", layer) → g [C, B, P]."""
        out: dict[tuple[str, str], tuple] = {}
        dense: dict[str, list[torch.Tensor]] = {}
        for t in structured.features(self.view, self.plan, x, cot):
            if isinstance(t, structured.Factored):
                a = t.a
                if t.index:  # an embedding: one-hot inputs
                    size = self.plan.modules[t.layer].num_embeddings
                    if size > MAX_DENSE:
                        raise ValueError(
                            f"embedding '{t.layer}' has {size} rows; the Kronecker curvature "
                            f"handles at most {MAX_DENSE} (its input factor is dense)"
                        )
                    a = F.one_hot(t.a, size).to(t.d.dtype)
                    if t.padding_idx is not None:
                        a = a * (t.a != t.padding_idx).unsqueeze(-1).to(a.dtype)
                out[("kron", t.layer)] = (a, t.d)
            else:
                dense.setdefault(t.layer, []).append(t.g)
        for layer, parts in dense.items():
            g = torch.cat(parts, dim=-1)
            if g.shape[-1] > MAX_DENSE:
                raise ValueError(
                    f"module '{layer}' has {g.shape[-1]} parameters without Kronecker structure "
                    f"(not a Linear, Conv1d/2d or Embedding weight); at most {MAX_DENSE} are kept "
                    "as an exact dense block"
                )
            out[("dense", layer)] = (g,)
        return out

    @staticmethod
    def _gradients(terms: dict) -> list[torch.Tensor]:
        """Per-example gradients of each block for one cotangent, [B, P_block] each."""
        grads = []
        for key, value in terms.items():
            if key[0] == "kron":
                a, d = value
                grads.append(torch.einsum("bso,bsi->boi", d[0], a).flatten(1))
            else:
                grads.append(value[0][0])
        return grads

    def _batches(self, x, per_sample: int):
        n = inputs.count(x)
        if self.batch_size is not None:
            b = self.batch_size
        else:
            budget = min(1 << 30, available_bytes(self.view.device) // 8)
            b = max(1, min(n, 4096, budget // max(per_sample, 1)))
        for s in range(0, n, b):
            yield slice(s, min(s + b, n))

    def _per_sample_bytes(self, c: int) -> int:
        """Rough working memory per sample of a pass with c cotangents (activations, signals and
        the per-example gradients of the widest weight)."""
        item = torch.finfo(self._dtype).bits // 8
        widest = max((self.view.layer_size(n) for n in self.plan.modules), default=1)
        return item * c * (3 * self.plan.activations + 2 * widest)

    # -- fitting ---------------------------------------------------------------------------

    def fit(self, x, logits: torch.Tensor) -> KroneckerCurvature:
        """Fit the factors (and, for EK-FAC, the corrected eigenvalues) on training inputs `x`
        and the network's logits on them [N, O]."""
        n = inputs.validate(x, "x_train")
        logits = torch.as_tensor(logits)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(
                f"logits must be [N, O] for the {n} training inputs, got {tuple(logits.shape)}"
            )
        x = inputs.convert(x, self.view.device, None)
        o = logits.shape[1]
        self._dtype = next(iter(self.view.params.values())).dtype
        self.plan = structured.plan(self.view, x, "full", o, 1, factor_all=True)
        p = logits.to(self.view.device, torch.float64).softmax(1)
        self.num_train = n
        self.blocks = {}
        batches = list(self._batches(x, self._per_sample_bytes(o)))
        for sl in batches:
            terms = self._terms(inputs.take(x, sl), _curvature_cotangents(p[sl], self._dtype))
            for key, value in terms.items():
                self._accumulate(key, value)
        corrected = self.strategy == "ekfac"
        for block in self.blocks.values():
            block.decompose(corrected)
        if corrected:
            self._correct_eigenvalues(x, p, batches)
        return self

    def _accumulate(self, key, value) -> None:
        if key[0] == "dense":
            g = value[0].flatten(0, 1).double()
            if key not in self.blocks:
                self.blocks[key] = _Dense(torch.zeros(g.shape[1], g.shape[1], dtype=g.dtype))
            self.blocks[key].cov += g.T @ g
            return
        a, d = value
        a2, d2 = a.flatten(0, 1), d.flatten(0, 2)
        if key not in self.blocks:
            self.blocks[key] = _Kronecker(
                torch.zeros(a2.shape[1], a2.shape[1], dtype=torch.float64),
                torch.zeros(d2.shape[1], d2.shape[1], dtype=torch.float64),
            )
        block = self.blocks[key]
        block.a += (a2.T @ a2).double()
        block.g += (d2.T @ d2).double()
        block.count += a2.shape[0]

    def _correct_eigenvalues(self, x, p: torch.Tensor, batches) -> None:
        """Λ_W = Σ_i Σ_c (Q_Gᵀ g_ic Q_A)²: the exact diagonal of each block in its eigenbasis."""
        kron = {k: b for k, b in self.blocks.items() if k[0] == "kron"}
        for block in kron.values():
            block.eigenvalues = torch.zeros(
                block.qg.shape[0], block.qa.shape[0], dtype=torch.float64
            )
        rotations = {k: (b.qa.to(self._dtype), b.qg.to(self._dtype)) for k, b in kron.items()}
        for sl in batches:
            terms = self._terms(inputs.take(x, sl), _curvature_cotangents(p[sl], self._dtype))
            for key, block in kron.items():
                a, d = terms[key]
                qa, qg = rotations[key]
                a_rot, d_rot = a @ qa, d @ qg
                if a.shape[1] == 1:  # one position: g_ic is the outer product δ_ic a_iᵀ
                    sq = (d_rot[:, :, 0] ** 2).sum(0).T @ (a_rot[:, 0] ** 2)
                else:
                    sq = (torch.einsum("cbso,bsi->cboi", d_rot, a_rot) ** 2).sum((0, 1))
                block.eigenvalues += sq.double()

    # -- influence -------------------------------------------------------------------------

    @property
    def trace(self) -> float:
        """tr(G) of the factored curvature (exact for EK-FAC and the dense blocks)."""
        self._check_fitted()
        return float(sum(b.eigenvalues.sum() for b in self.blocks.values()))

    def _check_fitted(self) -> None:
        if not self.blocks:
            raise RuntimeError("call fit(x_train, logits) first")

    def _stream(self, x, cot: torch.Tensor):
        """Per-example gradients J_bᵀ cot_b, one list of per-block [B, P_block] per batch."""
        n = inputs.validate(x, "x")
        if cot.shape[0] != n:
            raise ValueError(f"{cot.shape[0]} cotangents for {n} inputs")
        x = inputs.convert(x, self.view.device, None)
        cot = cot.to(self.view.device, self._dtype)
        for sl in self._batches(x, self._per_sample_bytes(1)):
            yield sl, self._gradients(self._terms(inputs.take(x, sl), cot[sl].unsqueeze(0)))

    def influence(
        self, x_test, u_test: torch.Tensor, x_train, r_train: torch.Tensor, damping: float
    ) -> torch.Tensor:
        """τ(z, i) = u_zᵀ J_z (G + λI)⁻¹ J_iᵀ r_i [N_test, N_train] for output cotangents u_test
        [N_test, O] (the margin's gradient) and r_train [N_train, O] (e_y − p)."""
        self._check_fitted()
        if not (isinstance(damping, (int, float)) and damping > 0):
            raise ValueError(f"damping must be a positive number, got {damping!r}")
        shapes = [
            (b.qg.shape[0], b.qa.shape[0]) if isinstance(b, _Kronecker) else (b.q.shape[0],)
            for b in self.blocks.values()
        ]
        left = []
        for _, grads in self._stream(x_test, torch.as_tensor(u_test)):
            left.append(
                torch.cat(
                    [
                        block.precondition(g.double().reshape(-1, *shape), damping).flatten(1)
                        for block, g, shape in zip(self.blocks.values(), grads, shapes)
                    ],
                    dim=1,
                ).to(self._dtype)
            )
        left = torch.cat(left)
        scores = torch.empty(left.shape[0], inputs.count(x_train), dtype=torch.float64)
        for sl, grads in self._stream(x_train, torch.as_tensor(r_train)):
            scores[:, sl] = (left @ torch.cat(grads, dim=1).T).double()
        return scores


def _curvature_cotangents(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Columns of L_i = diag(√p_i) − p_i √p_iᵀ (L_i L_iᵀ = Λ_i) as cotangents [O, B, O]:
    entry [c, i, o] = √p_ic (δ_co − p_io)."""
    eye = torch.eye(p.shape[1], dtype=p.dtype, device=p.device)
    cot = p.sqrt().T[:, :, None] * (eye[:, None, :] - p[None])
    return cot.to(dtype)
