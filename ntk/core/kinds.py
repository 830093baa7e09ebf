"""Kernel kinds as objects: which cotangents see the Jacobian, and how their features contract.

Every method produces, for a block of B samples, features indexed by a *cotangent* c: the rows
u_cᵀ J(x) of the Jacobian seen through C cotangent vectors u_c ∈ ℝ^O. A kind says which vectors
(`cotangents`: shared by all samples, [C, O], or one set per sample, [C, N, O], for the labelled
kinds) and how two blocks' features contract into a tile (`contract`, `contract_factored`), with
the tile's shape, its transpose K(x2, x1) and the reduction of NTK-vector products (`reduce`):

- `full` and `diagonal`: the O basis vectors; Θ(x, x') [O, O], or its diagonal [O];
- `trace`: the basis vectors, summed: Σ_o Θ_oo(x, x');
- `sum_logits`: one shared vector 1/√O · 1, so that the kernel is (1/O) ∇(Σ_o f_o)·∇(Σ_o f_o)
  (Mohamadi et al., ICML 2023);
- `lpntk`: one vector per sample, s(y) = 2e_y − 1 from its class label y, so that the kernel is
  s(y)ᵀ Θ(x, x') s(y') (the labelled pseudo-NTK, Guo, Ren, Albrecht, Smith, ICLR 2024); for a
  single output, a binary classifier's logit z with labels 0 and 1, s(y) = 2y − 1, which is the
  lpNTK of its class scores (0, z);
- `Weighted()` (an object, not a name): given per-sample vectors u(x), u(x)ᵀ Θ(x, x') u(x')
  (TRAK's margin-gradient kernel, so that it is featurised once per sample).

A new kind is one class below and one entry in `_NAMED`.
"""

from __future__ import annotations

import math

import torch

from . import inputs
from .checks import check_finite


class Kind:
    """A kernel kind whose cotangent features are summed over c: K = Σ_c u_cᵀ Θ u'_c [N1, N2]."""

    name = ""
    labelled = False  # one set of cotangents per sample, built from `labels=`
    single = False  # exactly one cotangent: projected features are [N, k], not [N, C, k]

    def __repr__(self) -> str:
        return self.name or type(self).__name__

    # -- cotangents ------------------------------------------------------------------------------
    def count(self, num_outputs: int) -> int:
        """C, the number of cotangents."""
        return 1 if self.single else num_outputs

    def cotangents(self, num_outputs: int, *, dtype, device, labels=None) -> torch.Tensor:
        """The cotangent vectors: [C, O] for every sample, or [C, N, O] (labelled kinds, from
        labels already checked by `check_labels`)."""
        return torch.eye(num_outputs, dtype=dtype, device=device)

    def check_labels(self, labels, n: int, num_outputs: int, name: str = "labels"):
        """Validate the `labels=` of `n` samples (None for the kinds that take none)."""
        if labels is not None:
            raise ValueError(f"{name}= is only used by labelled kinds (lpntk), not kind={self!r}")
        return None

    # -- the kernel ------------------------------------------------------------------------------
    def shape(self, n1: int, n2: int, num_outputs: int) -> tuple[int, ...]:
        return (n1, n2)

    def pair_factor(self, c: int) -> int:
        """Number of cotangent pairs the contraction multiplies (C² for full, C otherwise)."""
        return c

    def contract(self, g1: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        """Kernel tile from explicit features g [C, B, P] (P flattened parameters)."""
        c, b1, p = g1.shape
        b2 = g2.shape[1]
        return g1.transpose(0, 1).reshape(b1, c * p) @ g2.transpose(0, 1).reshape(b2, c * p).T

    def contract_factored(
        self, gram_in: torch.Tensor, d1: torch.Tensor, d2: torch.Tensor
    ) -> torch.Tensor:
        """Kernel tile of a weight shared over S positions, J = Σ_s δ_s ⊗ a_s, from its factors.

        gram_in [B1, S1, B2, S2] holds a_s(x)·a_t(x'); d [C, B, S, F] holds the backward signals
        δ. The tile is Σ_{s,t} (a_s·a'_t)(δ_cs·δ'_dt); with S = 1 it is (input Gram) ⊙
        (cotangent Gram), the cotangent Gram, a fresh product, scaled in place.
        """
        c, b1, s1, f = d1.shape
        b2, s2 = d2.shape[1], d2.shape[2]
        if s1 == 1 and s2 == 1:
            a = gram_in.reshape(b1, b2)
            return (
                d1.transpose(0, 1).reshape(b1, c * f) @ d2.transpose(0, 1).reshape(b2, c * f).T
            ).mul_(a)
        g = (
            d1.permute(1, 2, 0, 3).reshape(b1 * s1, c * f)
            @ d2.permute(1, 2, 0, 3).reshape(b2 * s2, c * f).T
        )
        return (gram_in * g.reshape(b1, s1, b2, s2)).sum(dim=(1, 3))

    def transpose(self, tile: torch.Tensor) -> torch.Tensor:
        """K(x2, x1) from K(x1, x2): swap samples (and output pairs for `full`)."""
        return tile.T

    def reduce(self, r: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
        """Row K(x_i, ·) from NTK-vector products r[c, j, o] = e_oᵀ Θ(x_j, x_i) u_c(x_i) and the
        right block's cotangents u2 ([C, O] or [C, B2, O])."""
        if u2.dim() == 2:
            return torch.einsum("cjo,co->j", r, u2)
        return torch.einsum("cjo,cjo->j", r, u2)

    # -- projected features ----------------------------------------------------------------------
    def route_count(self, num_outputs: int) -> int:
        """The cotangent count for which projections choose each layer's route (dense or
        Kronecker): C, or O for per-sample kinds, so that their features are exactly the
        per-sample contraction uᵀ Φ_full of the full kind's (the same random matrices)."""
        return num_outputs if self.labelled else self.count(num_outputs)

    def feature_axes(self) -> int:
        """Axes of projected features: 2 ([N, k]) with a single cotangent, else 3 ([N, C, k])."""
        return 2 if self.single else 3

    def shape_features(self, phi: torch.Tensor) -> torch.Tensor:
        """Features [C, B, k] as [B, k] (single cotangent) or [B, C, k]."""
        return phi[0] if self.single else phi.transpose(0, 1)

    def contract_features(self, f1: torch.Tensor, f2: torch.Tensor) -> torch.Tensor:
        """The kernel of projected features [N, k] or [N, C, k]."""
        return f1.reshape(f1.shape[0], -1) @ f2.reshape(f2.shape[0], -1).T


class Full(Kind):
    """Θ(x, x') [N1, N2, O, O]."""

    name = "full"

    def shape(self, n1, n2, num_outputs):
        return (n1, n2, num_outputs, num_outputs)

    def pair_factor(self, c):
        return c * c

    def contract(self, g1, g2):
        c, b1, p = g1.shape
        b2 = g2.shape[1]
        k = g1.reshape(c * b1, p) @ g2.reshape(c * b2, p).T
        return k.reshape(c, b1, c, b2).permute(1, 3, 0, 2)

    def contract_factored(self, gram_in, d1, d2):
        c, b1, s1, f = d1.shape
        b2, s2 = d2.shape[1], d2.shape[2]
        if s1 == 1 and s2 == 1:
            a = gram_in.reshape(b1, b2)
            g = (d1.reshape(c * b1, f) @ d2.reshape(c * b2, f).T).reshape(c, b1, c, b2)
            return g.mul_(a[None, :, None, :]).permute(1, 3, 0, 2)
        g = d1.reshape(c * b1 * s1, f) @ d2.reshape(c * b2 * s2, f).T
        g = g.reshape(c, b1, s1, c, b2, s2)
        return torch.einsum("isjt,cisdjt->ijcd", gram_in, g)

    def transpose(self, tile):
        return tile.permute(1, 0, 3, 2)

    def reduce(self, r, u2):
        return r.permute(1, 0, 2)  # [B2, O(c), O(o)]

    def contract_features(self, f1, f2):
        return torch.einsum("iak,jbk->ijab", f1, f2)


class Diagonal(Kind):
    """Θ_oo(x, x') [N1, N2, O]."""

    name = "diagonal"

    def shape(self, n1, n2, num_outputs):
        return (n1, n2, num_outputs)

    def contract(self, g1, g2):
        return torch.bmm(g1, g2.transpose(1, 2)).permute(1, 2, 0)

    def contract_factored(self, gram_in, d1, d2):
        c, b1, s1, f = d1.shape
        b2, s2 = d2.shape[1], d2.shape[2]
        if s1 == 1 and s2 == 1:
            a = gram_in.reshape(b1, b2)
            g = torch.bmm(d1.reshape(c, b1, f), d2.reshape(c, b2, f).transpose(1, 2))
            return g.mul_(a[None]).permute(1, 2, 0)
        g = torch.bmm(d1.reshape(c, b1 * s1, f), d2.reshape(c, b2 * s2, f).transpose(1, 2))
        return torch.einsum("isjt,cisjt->ijc", gram_in, g.reshape(c, b1, s1, b2, s2))

    def transpose(self, tile):
        return tile.permute(1, 0, 2)

    def reduce(self, r, u2):
        return torch.diagonal(r, dim1=0, dim2=2)  # [B2, O]

    def contract_features(self, f1, f2):
        return torch.einsum("iok,jok->ijo", f1, f2)


class Trace(Kind):
    """Σ_o Θ_oo(x, x') [N1, N2]."""

    name = "trace"

    def reduce(self, r, u2):
        return torch.diagonal(r, dim1=0, dim2=2).sum(-1)


class SumLogits(Kind):
    """(1/O) Σ_oo' Θ_oo'(x, x') [N1, N2]: one cotangent 1/√O · 1."""

    name = "sum_logits"
    single = True

    def cotangents(self, num_outputs, *, dtype, device, labels=None):
        return torch.full(
            (1, num_outputs), 1.0 / math.sqrt(num_outputs), dtype=dtype, device=device
        )

    def reduce(self, r, u2):
        return r[0].sum(-1) / math.sqrt(r.shape[-1])


class Weighted(Kind):
    """u(x)ᵀ Θ(x, x') u(x') [N1, N2] for given per-sample cotangents u ([N, O], passed as
    `labels=`): one cotangent per sample."""

    name = "weighted"
    labelled = True
    single = True

    def check_labels(self, labels, n, num_outputs, name="labels"):
        if labels is None:
            raise ValueError(f"kind={self!r} needs {name}= (one cotangent vector per sample)")
        u = torch.as_tensor(labels)
        if tuple(u.shape) != (n, num_outputs) or not u.is_floating_point():
            raise ValueError(
                f"{name} must be a float array [{n}, {num_outputs}] of cotangent vectors, got "
                f"{u.dtype} {tuple(u.shape)}"
            )
        check_finite(u, name)
        return u

    def cotangents(self, num_outputs, *, dtype, device, labels=None):
        return labels.to(dtype=dtype, device=device)[None]


class LpNTK(Weighted):
    """s(y)ᵀ Θ(x, x') s(y') [N1, N2] with s(y) = 2e_y − 1 from class labels y (`labels=`); a single
    output is a binary classifier's logit z (labels 0 and 1): s(y) = 2y − 1, the lpNTK of the
    class scores (0, z), whose signs (1, −1) and (−1, 1) see (0, ∇z) as −∇z and ∇z."""

    name = "lpntk"

    def check_labels(self, labels, n, num_outputs, name="labels"):
        if labels is None:
            whose = "x2's samples" if name == "labels2" else "every sample"
            raise ValueError(f"kind='lpntk' needs {name}= (the class labels of {whose})")
        return loss_labels(class_labels(labels, n, None, name), num_outputs, name)

    def cotangents(self, num_outputs, *, dtype, device, labels=None):
        labels = labels.to(device)
        if num_outputs == 1:
            signs = (2 * labels - 1)[:, None]
        else:
            signs = 2 * torch.nn.functional.one_hot(labels, num_outputs) - 1
        return signs.to(dtype)[None]


_NAMED = {kind.name: kind for kind in (Full(), Diagonal(), Trace(), SumLogits(), LpNTK())}
KINDS = tuple(name for name, kind in _NAMED.items() if not kind.labelled)  # need no labels
LABELLED_KINDS = tuple(name for name, kind in _NAMED.items() if kind.labelled)


def get(kind: str | Kind) -> Kind:
    """The Kind object of a name (or the object itself)."""
    if isinstance(kind, Kind):
        return kind
    if not isinstance(kind, str) or kind not in _NAMED:
        raise ValueError(f"unknown kind {kind!r}; valid kinds are {', '.join(_NAMED)}")
    return _NAMED[kind]


def rows(cot: torch.Tensor, index) -> torch.Tensor:
    """The cotangents of a block of samples: shared [C, O] as they are, per-sample [C, N, O]
    indexed along the samples."""
    return cot if cot.dim() == 2 else cot[:, index]


# How a binary classifier with one logit (BCEWithLogitsLoss) gets an output per class.
ONE_LOGIT = (
    "a binary classifier with one logit z has the class scores "
    "output_fn=lambda z: torch.stack([torch.zeros_like(z), z], -1).reshape(len(z), 2)"
)


def class_labels(y, n: int, num_outputs: int | None, name: str = "y") -> torch.Tensor:
    """Class labels (a tensor, numpy array or list of integers, or of integral floats) as a long
    tensor [n] in 0..num_outputs−1, refused otherwise with an error naming `name` (the caller's
    argument), the first offending label and the valid range. num_outputs=None: the model is not
    known yet, the labels need only be integers ≥ 0 (check them again once it is)."""
    y = inputs.targets(y, name)
    if y.dim() != 1 or y.shape[0] != n:
        raise ValueError(
            f"{name} must be a 1-d tensor of {n} class labels, got shape {tuple(y.shape)}"
        )
    if y.is_complex():
        raise ValueError(f"{name} must hold integer class labels, got {y.dtype}")
    if y.is_floating_point():
        bad = ~(torch.isfinite(y) & (y == y.round()))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"{name} must hold integer class labels, got {float(y[i])!r} at sample {i}"
            )
    y = y.long()
    if num_outputs is None:
        bad = y < 0
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"{name} holds a negative label: {int(y[i])} at sample {i} (class labels are "
                "integers ≥ 0)"
            )
        return y
    bad = (y < 0) | (y >= num_outputs)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        outputs = f"{num_outputs} outputs" if num_outputs != 1 else f"1 output; {ONE_LOGIT}"
        raise ValueError(
            f"{name} holds labels outside 0..{num_outputs - 1}: {int(y[i])} at sample {i} (the "
            f"model has {outputs})"
        )
    return y


def loss_labels(y, num_outputs: int, name: str = "y") -> torch.Tensor:
    """Class labels for the cross-entropy of a model with `num_outputs` outputs (`cross_entropy`):
    0..O−1, or 0 and 1 for a single output, a binary classifier's logit."""
    if num_outputs != 1:
        return class_labels(y, len(y), num_outputs, name)
    y = class_labels(y, len(y), None, name)
    if bool((y > 1).any()):
        i = int((y > 1).nonzero()[0])
        raise ValueError(
            f"{name} holds labels outside 0..1: {int(y[i])} at sample {i} (the model has one "
            "output, a binary classifier's logit)"
        )
    return y


def cross_entropy(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The cross-entropy of class scores out [B, O] for labels y; a single output ([B] or [B, 1],
    a binary classifier's logit z, labels 0 and 1) takes the binary cross-entropy of z, which is
    the cross-entropy of the two-class scores (0, z)."""
    if out.dim() == 1 or (out.dim() == 2 and out.shape[1] == 1):
        return torch.nn.functional.binary_cross_entropy_with_logits(
            out.reshape(-1), y.to(out.dtype), reduction=reduction
        )
    return torch.nn.functional.cross_entropy(out, y, reduction=reduction)
