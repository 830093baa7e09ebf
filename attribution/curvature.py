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
(G_W + λI)⁻¹ g = Q_G [(Q_Gᵀ g Q_A) / (Λ_W + λ)] Q_Aᵀ. `output_covariance` gives the linearised
Laplace posterior's J(x)(G + δI)⁻¹J(x)ᵀ (`attribution.NTKPosterior`, whose Gaussian likelihood
enters through `fit_roots`: any Λ_i = R_i R_iᵀ, not only the softmax's). Per-sample
derivatives are computed in the model's dtype; factors, eigendecompositions and preconditioning
in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ntk.core import inputs, structured
from ntk.core.checks import check_amount, check_finite, check_integer
from ntk.core.memory import available_bytes
from ntk.core.model import ModelView, check_eval_mode
from ntk.core.tiles import require_finite
from ntk.empirical import check_outputs

STRATEGIES = ("kfac", "ekfac")
MAX_DENSE = 8192  # most parameters of a block without Kronecker structure (kept dense)
PROBE = 4  # training samples whose outputs are checked to be neither random nor batch-dependent
_LARGEST_BATCH = 4096  # samples of the largest automatic batch of the passes over the training set


class UnfactorableModelError(ValueError):
    """The model has a parameter block the factored curvature cannot hold (a dense block or an
    embedding's input factor over MAX_DENSE)."""


@dataclass
class _Kronecker:
    """A weight's factors: input and output-signal second moments (sums) over N·S positions."""

    a: torch.Tensor  # [F_in, F_in]
    g: torch.Tensor  # [F_out, F_out]
    count: int = 0
    qa: torch.Tensor | None = None
    qg: torch.Tensor | None = None
    eigenvalues: torch.Tensor | None = None  # [F_out, F_in]
    rotated: bool = False  # scores are computed in the eigenbasis (`choose_basis`)

    def decompose(self, corrected: bool) -> None:
        if not (bool(torch.isfinite(self.a).all()) and bool(torch.isfinite(self.g).all())):
            raise ValueError(
                "the Kronecker factors of the curvature are not finite: the model's activations "
                "or output gradients overflow on the training inputs (check their scale)"
            )
        ea, self.qa = torch.linalg.eigh(self.a)
        eg, self.qg = torch.linalg.eigh(self.g)
        self.eigenvalues = None if corrected else torch.outer(eg, ea).clamp_min(0) / self.count

    def precondition(self, grads: torch.Tensor, damping: float) -> torch.Tensor:
        """(G_W + λI)⁻¹ applied to gradients [M, F_out, F_in] (each product one GEMM)."""
        rotated = (grads @ self.qa).transpose(1, 2) @ self.qg  # [M, F_in, F_out]
        rotated = rotated / (self.eigenvalues.T + damping)
        return (rotated @ self.qg.T).transpose(1, 2) @ self.qa.T

    def choose_basis(self, n_train: int, n_test: int, dtype: torch.dtype) -> None:
        """Score in the eigenbasis (rotate every example's factors: N·S·(F_out² + F_in²)) or in
        the parameter basis (rotate the test gradients twice: M·F_out·F_in·(F_out + F_in)),
        whichever costs fewer multiply-adds."""
        f_out, f_in = self.eigenvalues.shape
        positions = self.count / n_train
        self.rotated = n_train * positions * (f_out**2 + f_in**2) < n_test * f_out * f_in * (
            f_out + f_in
        )
        self._rotations = (self.qa.to(dtype), self.qg.to(dtype))

    def gradients(self, a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """Per-example gradients Σ_s δ_s a_sᵀ [B, F_out·F_in] for one cotangent (d [1, B, S,
        F_out]), in the scoring basis."""
        if self.rotated:
            qa, qg = self._rotations
            a, d = a @ qa, d @ qg
        if a.shape[1] == 1:  # one position: an outer product
            return (d[0, :, 0, :, None] * a[:, 0, None, :]).flatten(1)
        return torch.einsum("bso,bsi->boi", d[0], a).flatten(1)

    def preconditioned(self, a: torch.Tensor, d: torch.Tensor, damping: float) -> torch.Tensor:
        """(G_W + λI)⁻¹ applied to the gradients of a batch, in the scoring basis."""
        if self.rotated:
            g = self.gradients(a, d).double().reshape(-1, *self.eigenvalues.shape)
            return (g / (self.eigenvalues + damping)).flatten(1)
        g = torch.einsum("bso,bsi->boi", d[0], a).double()
        return self.precondition(g, damping).flatten(1)


@dataclass
class _Dense:
    """An exact Gauss–Newton block Σ_i Σ_c g_ic g_icᵀ of P parameters."""

    cov: torch.Tensor  # [P, P]
    q: torch.Tensor | None = None
    eigenvalues: torch.Tensor | None = None

    def decompose(self, corrected: bool) -> None:
        self.eigenvalues, self.q = torch.linalg.eigh(self.cov)
        self.eigenvalues.clamp_(min=0)

    def gradients(self, g: torch.Tensor) -> torch.Tensor:
        return g[0]

    def preconditioned(self, g: torch.Tensor, damping: float) -> torch.Tensor:
        return ((g[0].double() @ self.q) / (self.eigenvalues + damping)) @ self.q.T


class KroneckerCurvature:
    """The block-diagonal Kronecker-factored Gauss–Newton curvature of a classifier's
    cross-entropy (module docstring).

    strategy: "ekfac" (eigenvalue-corrected) or "kfac". batch_size: samples per pass (None: from
    free memory). output_fn maps the model's output to the logits [B, O]; dtype: the per-sample
    derivatives' (None: the model's). The model is used read-only through a functional view
    (eval mode required).
    """

    def __init__(
        self,
        model,
        *,
        strategy: str = "ekfac",
        batch_size: int | None = None,
        device=None,
        output_fn=None,
        dtype: torch.dtype | None = None,
    ):
        if strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {strategy!r}; valid strategies are {', '.join(STRATEGIES)}"
            )
        batch_size = check_integer(batch_size, "batch_size", optional=True)
        check_eval_mode(model)
        self.view = ModelView(model, output_fn=output_fn, device=device, dtype=dtype)
        self.strategy = strategy
        self.batch_size = batch_size
        self.dtype = dtype  # floating inputs are cast to it (None: left as given)
        self.blocks: dict[tuple[str, str], _Kronecker | _Dense] = {}
        self.num_train = self.num_outputs = 0

    # -- per-batch gradients -----------------------------------------------------------------

    def _terms(self, x, cot: torch.Tensor, name: str | None = None) -> dict[tuple[str, str], tuple]:
        """Per-block derivatives of a batch for cotangents cot [C, B, O]: ("kron", layer) →
        (a [B, S, F_in], δ [C, B, S, F_out]) and ("dense", layer) → g [C, B, P], refused where
        not finite. name: check the forward pass as the argument `name` (`structured.features`)
        and name it in errors."""
        out: dict[tuple[str, str], tuple] = {}
        dense: dict[str, list[torch.Tensor]] = {}
        for t in structured.features(self.view, self.plan, x, cot, name):
            if isinstance(t, structured.Factored):
                a = t.a
                if t.index:  # an embedding: one-hot inputs
                    size = self.plan.modules[t.layer].num_embeddings
                    if size > MAX_DENSE:
                        raise UnfactorableModelError(
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
                raise UnfactorableModelError(
                    f"module '{layer}' has {g.shape[-1]} parameters without Kronecker structure "
                    "(not the weight of a Linear, Conv1d/2d or Embedding used once: another "
                    "module, a grouped convolution, or a weight applied more than once or tied "
                    f"to another's); at most {MAX_DENSE} are kept as an exact dense block: use "
                    "the exact curvature (influence's method='gauss_newton', NTKPosterior's "
                    "curvature='exact')"
                )
            out[("dense", layer)] = (g,)
        for value in out.values():
            for t in value:
                require_finite(t, f"the Jacobian of the model's outputs on {name or 'the inputs'}")
        return out

    def _batches(self, x, per_sample: int):
        n = inputs.count(x)
        if self.batch_size is not None:
            b = self.batch_size
        else:
            budget = min(1 << 30, available_bytes(self.view.device) // 8)
            b = max(1, min(n, _LARGEST_BATCH, budget // max(per_sample, 1)))
        for s in range(0, n, b):
            yield slice(s, min(s + b, n))

    def _per_sample_bytes(self, c: int) -> int:
        """Rough working memory per sample of a pass with c cotangents (activations, signals and
        the per-example gradients of the widest weight)."""
        item = torch.finfo(self._dtype).bits // 8
        widest = max((self.view.layer_size(n) for n in self.plan.modules), default=1)
        return item * c * (3 * self.plan.activations + 2 * widest)

    # -- fitting ---------------------------------------------------------------------------

    def _cast(self) -> torch.dtype | None:
        """What numpy arrays of floats are cast to: `dtype`, or the model's parameters'."""
        return self.dtype or inputs.param_dtype(self.view.model)

    def fit(self, x, logits: torch.Tensor) -> KroneckerCurvature:
        """Fit the factors (and, for EK-FAC, the corrected eigenvalues) of the cross-entropy's
        curvature on training inputs `x` and the network's logits on them [N, O]."""
        x = inputs.from_numpy(x, "x_train", self._cast())
        n = inputs.validate(x, "x_train")
        logits = torch.as_tensor(logits).detach()  # the network's, perhaps with their graph
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(
                f"logits must be [N, O] for the {n} training inputs, got {tuple(logits.shape)}"
            )
        if logits.shape[1] < 2:  # the softmax of one output is constant: a zero curvature
            raise ValueError(
                "logits must hold two class scores at least; a binary classifier's one logit z "
                "has the curvature of fit_roots with roots √(σ(z)(1 − σ(z))) [N, 1, 1]"
            )
        p = logits.to(torch.float64).softmax(1)
        return self._fit(x, _softmax_roots(p), "logits", logits)

    def fit_roots(self, x, roots: torch.Tensor) -> KroneckerCurvature:
        """Fit the curvature G = Σ_i J_iᵀ R_i R_iᵀ J_i of any loss whose Hessian with respect to
        sample i's outputs is Λ_i = R_i R_iᵀ, given roots [N, O, C] (the softmax's L_i of the
        module docstring; I/σ for a Gaussian likelihood)."""
        x = inputs.from_numpy(x, "x_train", self._cast())
        n = inputs.validate(x, "x_train")
        roots = torch.as_tensor(roots).detach()
        if roots.dim() != 3 or roots.shape[0] != n:
            raise ValueError(
                f"roots must be [N, O, C] for the {n} training inputs, got {tuple(roots.shape)}"
            )
        return self._fit(x, roots, "roots", roots)

    def _fit(self, x, roots: torch.Tensor, name: str, given: torch.Tensor) -> KroneckerCurvature:
        """`fit_roots` of checked inputs; `given` (logits or roots, `name`) must be finite and
        hold the model's number of outputs."""
        check_finite(given, name)
        n = inputs.count(x)
        self._dtype = next(iter(self.view.params.values())).dtype
        x = inputs.convert(x, self.view.device, self.dtype)
        # as the kernels do: a functional dropout or a statistic over the batch in forward
        # would make every per-sample term below depend on the draw or on the batch
        outputs = check_outputs(self.view, [inputs.take(x, slice(0, PROBE))], ["x_train"])
        if given.shape[1] != outputs:
            raise ValueError(
                f"{name} hold {given.shape[1]} outputs per sample, but the model gives {outputs}"
            )
        cot = roots.permute(2, 0, 1).to(self.view.device, self._dtype)  # [C, N, O]
        largest = min(n, self.batch_size or _LARGEST_BATCH)  # `_batches`' largest
        self.plan = structured.plan(
            self.view, x, "full", roots.shape[1], 1, largest, factor_all=True, name="x_train"
        )
        self.num_train, self.num_outputs = n, roots.shape[1]
        self.blocks = {}
        batches = list(self._batches(x, self._per_sample_bytes(cot.shape[0])))
        for sl in batches:
            for key, value in self._terms(inputs.take(x, sl), cot[:, sl], "x_train").items():
                self._accumulate(key, value)
        corrected = self.strategy == "ekfac"
        for block in self.blocks.values():
            block.decompose(corrected)
        if corrected:
            self._correct_eigenvalues(x, cot, batches)
        return self

    def _accumulate(self, key, value) -> None:
        if key[0] == "dense":
            g = value[0].flatten(0, 1).double()
            if key not in self.blocks:
                self.blocks[key] = _Dense(
                    torch.zeros(g.shape[1], g.shape[1], dtype=g.dtype, device=g.device)
                )
            self.blocks[key].cov += g.T @ g
            return
        a, d = value
        a2, d2 = a.flatten(0, 1), d.flatten(0, 2)
        if key not in self.blocks:
            on = dict(dtype=torch.float64, device=a2.device)
            self.blocks[key] = _Kronecker(
                torch.zeros(a2.shape[1], a2.shape[1], **on),
                torch.zeros(d2.shape[1], d2.shape[1], **on),
            )
        block = self.blocks[key]
        block.a += (a2.T @ a2).double()
        block.g += (d2.T @ d2).double()
        block.count += a2.shape[0]

    def _correct_eigenvalues(self, x, cot: torch.Tensor, batches) -> None:
        """Λ_W = Σ_i Σ_c (Q_Gᵀ g_ic Q_A)²: the exact diagonal of each block in its eigenbasis."""
        kron = {k: b for k, b in self.blocks.items() if k[0] == "kron"}
        for block in kron.values():
            block.eigenvalues = torch.zeros(
                block.qg.shape[0], block.qa.shape[0], dtype=torch.float64, device=block.qa.device
            )
        rotations = {k: (b.qa.to(self._dtype), b.qg.to(self._dtype)) for k, b in kron.items()}
        for sl in batches:
            terms = self._terms(inputs.take(x, sl), cot[:, sl], "x_train")
            for key, block in kron.items():
                a, d = terms[key]
                qa, qg = rotations[key]
                a_rot, d_rot = a @ qa, d @ qg
                if a.shape[1] == 1:  # one position: g_ic is the outer product δ_ic a_iᵀ
                    sq = (d_rot[:, :, 0] ** 2).sum(0).T @ (a_rot[:, 0] ** 2)
                else:
                    sq = (torch.einsum("cbso,bsi->cboi", d_rot, a_rot) ** 2).sum((0, 1))
                block.eigenvalues += sq.double()

    # -- the posterior of the linearised network (attribution.NTKPosterior) ----------------

    @property
    def eigenvalues(self) -> torch.Tensor:
        """Every eigenvalue of the block-diagonal factored curvature [P] (float64, CPU)."""
        self._check_fitted()
        return torch.cat([b.eigenvalues.flatten().cpu() for b in self.blocks.values()])

    def _rotated(self, x, name: str = "x") -> list[_Rotated]:
        """Per block, the Jacobian of every output in the block's eigenbasis, J_W(x)(Q_G ⊗ Q_A)
        (float64): as its two factors for a weight used at one position, else [O, B, P_W]; `name`
        names the inputs in errors."""
        o = self.num_outputs
        b = inputs.count(x)
        eye = torch.eye(o, dtype=self._dtype, device=self.view.device)
        terms = self._terms(x, eye[:, None, :].expand(o, b, o), name)  # new inputs: checked
        out = []
        for key, block in self.blocks.items():
            if isinstance(block, _Kronecker):
                a, d = terms[key]
                a, d = a.double() @ block.qa, d.double() @ block.qg
                if a.shape[1] == 1:  # one position: the outer product δ̃_o ã
                    out.append(_Rotated(block.eigenvalues, d[:, :, 0], a[:, 0] ** 2))
                    continue
                g = torch.einsum("cbso,bsi->cboi", d, a).flatten(2)
            else:
                g = terms[key][0].double() @ block.q
            out.append(_Rotated(block.eigenvalues.flatten(), g=g))
        return out

    def _output_batches(self, x, name: str = "x"):
        """Batches of `x` (the argument `name`) for `_rotated` (its per-sample memory: at most
        O·P float64 values)."""
        x = inputs.from_numpy(x, name, self._cast())
        inputs.validate(x, name)
        x = inputs.convert(x, self.view.device, self.dtype)
        o = self.num_outputs
        for sl in self._batches(x, self._per_sample_bytes(o) + 8 * o * self.view.num_params):
            yield inputs.take(x, sl)

    def output_covariance(self, x, damping: float) -> torch.Tensor:
        """Σ(x) = J(x)(G + δI)⁻¹J(x)ᵀ [M, O, O] (float64, CPU) with the factored G and δ =
        `damping`: per block Σ_k (J_W(x) q_k)(J_W(x) q_k)ᵀ / (e_k + δ) over its eigenpairs."""
        self._check_fitted()
        check_amount(damping, "damping")
        return torch.cat(
            [_covariance(self._rotated(xb), damping) for xb in self._output_batches(x)]
        )

    def covariance_function(self, x, name: str = "x"):
        """δ ↦ Σ(x) for many δ from one pass over `x` (its rotated Jacobians, M·O·P values, are
        kept); `name` names the inputs in errors."""
        self._check_fitted()
        rotated = [self._rotated(xb, name) for xb in self._output_batches(x, name)]

        def covariance(damping: float) -> torch.Tensor:
            check_amount(damping, "damping")  # δ ≤ 0 gave negative or 1e31 variances
            return torch.cat([_covariance(r, damping) for r in rotated])

        return covariance

    # -- influence -------------------------------------------------------------------------

    @property
    def trace(self) -> float:
        """tr(G) of the factored curvature (exact for EK-FAC and the dense blocks)."""
        self._check_fitted()
        return float(sum(b.eigenvalues.sum() for b in self.blocks.values()))

    def _check_fitted(self) -> None:
        if not self.blocks:
            raise RuntimeError("call fit(x_train, logits) first")

    def _stream(self, x, cot: torch.Tensor, name: str):
        """Per-block derivatives (`_terms`) of batches of `x` (the argument `name`) for one
        cotangent per sample."""
        n = inputs.validate(x, name)
        if cot.shape[0] != n:
            raise ValueError(f"{cot.shape[0]} cotangents for {n} inputs")
        x = inputs.convert(x, self.view.device, self.dtype)
        cot = cot.to(self.view.device, self._dtype)
        for sl in self._batches(x, self._per_sample_bytes(1)):
            yield sl, self._terms(inputs.take(x, sl), cot[sl].unsqueeze(0), name)

    def influence(
        self, x_test, u_test: torch.Tensor, x_train, r_train: torch.Tensor, damping: float
    ) -> torch.Tensor:
        """τ(z, i) = u_zᵀ J_z (G + λI)⁻¹ J_iᵀ r_i [N_test, N_train] for output cotangents u_test
        [N_test, O] (the margin's gradient) and r_train [N_train, O] (e_y − p)."""
        self._check_fitted()
        check_amount(damping, "damping")
        x_train, x_test = (
            inputs.from_numpy(x_train, "x_train", self._cast()),
            inputs.from_numpy(x_test, "x_test", self._cast()),
        )
        n_train, n_test = inputs.count(x_train), inputs.count(x_test)
        for block in self.blocks.values():
            if isinstance(block, _Kronecker):
                block.choose_basis(n_train, n_test, self._dtype)
        left = {k: [] for k in self.blocks}
        for _, terms in self._stream(x_test, torch.as_tensor(u_test), "x_test"):
            for k, block in self.blocks.items():
                left[k].append(block.preconditioned(*terms[k], damping).to(self._dtype))
        left = {k: torch.cat(v) for k, v in left.items()}
        scores = torch.zeros(n_test, n_train, dtype=torch.float64, device=self.view.device)
        for sl, terms in self._stream(x_train, torch.as_tensor(r_train), "x_train"):
            batch = scores[:, sl]
            for k, block in self.blocks.items():
                batch += left[k] @ block.gradients(*terms[k]).to(self._dtype).T
        return scores.cpu()


@dataclass
class _Rotated:
    """One block's output Jacobians in its eigenbasis: g [O, B, P_W], or for a weight used at
    one position its factors d [O, B, F_out] and the squared inputs a2 [B, F_in]
    (g[c, b, (o, i)] = d[c, b, o] · √a2[b, i])."""

    eigenvalues: torch.Tensor  # [P_W], or [F_out, F_in] with the factors
    d: torch.Tensor | None = None
    a2: torch.Tensor | None = None
    g: torch.Tensor | None = None


def _covariance(rotated: list[_Rotated], damping: float) -> torch.Tensor:
    """Σ_blocks G̃ diag(1/(e + δ)) G̃ᵀ per sample [B, O, O] from `_rotated`'s blocks; with the
    factors, Σ_(o,i) d_co d_eo a_i² / (e_oi + δ) = Σ_o d_co d_eo v_o with v = a² (1/(e + δ))ᵀ."""
    total = 0.0
    for block in rotated:
        w = 1.0 / (block.eigenvalues + damping)
        if block.g is None:
            total = total + torch.einsum("cbo,ebo->bce", block.d * (block.a2 @ w.T), block.d)
        else:
            total = total + torch.einsum("cbp,ebp->bce", block.g * w, block.g)
    return total.cpu()


def _softmax_roots(p: torch.Tensor) -> torch.Tensor:
    """L_i = diag(√p_i) − p_i √p_iᵀ for each row of p [N, O] (L_i L_iᵀ = Λ_i), as [N, O, O]:
    column c is √p_ic (e_c − p_i)."""
    eye = torch.eye(p.shape[1], dtype=p.dtype, device=p.device)
    return (eye[None] - p[:, :, None]) * p.sqrt()[:, None, :]
