"""Kernels for attribution: exact (`ntk.empirical_ntk`) or projected (`projections`), as the
scalar kinds' [N1, N2] matrices (optionally cosine-normalised) or as an output kernel
[N1, N2, O, O] for methods that need the softmax curvature."""

from __future__ import annotations

from collections.abc import Callable

import torch

import ntk
from ntk.core import inputs
from ntk.core.checks import check_finite

SCALAR_KINDS = ("trace", "sum_logits")
OUTPUT_KINDS = ("full",) + SCALAR_KINDS


def compute(
    model,
    x1,
    x2=None,
    *,
    kind: str,
    dim: int | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    device=None,
    output_fn: Callable | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """ntk.empirical_ntk(kind=...) exactly (dim=None) or projections.projected_ntk with `dim`,
    computed in `dtype` (None: the model's) on `device` and returned in float64 on the CPU, where
    the kernel machines and solves downstream run."""
    opts = dict(kind=kind, batch_size=batch_size, device=device, dtype=dtype, output_fn=output_fn)
    if dim is None:
        k = ntk.empirical_ntk(model, x1, x2, **opts)
    else:
        import projections

        k = projections.projected_ntk(model, x1, x2, dim=dim, seed=seed, **opts)
    k = torch.as_tensor(k).to(device="cpu", dtype=torch.float64)
    check_finite(k, "the kernel")
    return k


def self_similarity(
    model,
    x,
    *,
    kind: str,
    dim: int | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    device=None,
    output_fn: Callable | None = None,
    dtype: torch.dtype | None = None,
    block: int = 256,
) -> torch.Tensor:
    """K(x, x) for every sample [N] of a scalar kind, in blocks (never the whole N × N)."""
    n = inputs.count(x)
    return torch.cat(
        [
            compute(
                model,
                inputs.take(x, slice(s, s + block)),
                kind=kind,
                dim=dim,
                seed=seed,
                batch_size=batch_size,
                device=device,
                output_fn=output_fn,
                dtype=dtype,
            ).diagonal()
            for s in range(0, n, block)
        ]
    )


def cosine(k: torch.Tensor, diag1: torch.Tensor, diag2: torch.Tensor) -> torch.Tensor:
    """K(x, x') / √(K(x, x) K(x', x')) — the trNTK of Engel et al. (ICLR 2024) for kind='trace'."""
    if bool((diag1 <= 0).any()) or bool((diag2 <= 0).any()):
        raise ValueError("cosine normalisation needs K(x, x) > 0 for every sample")
    return k / torch.sqrt(diag1[:, None] * diag2[None, :])


def output_kernel(model, x1, x2=None, *, kind: str, num_outputs: int, **options) -> torch.Tensor:
    """Θ [N1, N2, O, O]: the full kernel, or a scalar kind as k(x, x') ⊗ I_O on the scale of Θ's
    diagonal (trace / O; sum_logits as is: the pseudo-NTK approximates Θ ≈ k ⊗ I_O, Mohamadi et
    al., ICML 2023). options: those of `output_kernel_factor`."""
    k = output_kernel_factor(model, x1, x2, kind=kind, num_outputs=num_outputs, **options)
    return k if kind == "full" else k[:, :, None, None] * torch.eye(num_outputs, dtype=k.dtype)


def output_kernel_factor(
    model,
    x1,
    x2=None,
    *,
    kind: str,
    num_outputs: int,
    dim: int | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    device=None,
    output_fn: Callable | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`output_kernel` with a scalar kind left unexpanded: the full Θ [N1, N2, O, O], or the
    [N1, N2] factor c·k of a scalar kind's Θ = c·k ⊗ I_O (c = 1/O for trace, 1 for sum_logits)."""
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"kind must be one of {', '.join(OUTPUT_KINDS)}, got {kind!r}")
    k = compute(
        model,
        x1,
        x2,
        kind=kind,
        dim=dim,
        seed=seed,
        batch_size=batch_size,
        device=device,
        output_fn=output_fn,
        dtype=dtype,
    )
    return k if kind == "full" else k * _scalar_scale(kind, num_outputs)


def _scalar_scale(kind: str, num_outputs: int) -> float:
    """c of a scalar kind's stand-in c·k ⊗ I_O (trace / O; sum_logits as is)."""
    return 1.0 / num_outputs if kind == "trace" else 1.0


def output_self_blocks(
    model,
    x,
    *,
    kind: str,
    num_outputs: int,
    dim: int | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    device=None,
    output_fn: Callable | None = None,
    dtype: torch.dtype | None = None,
    block: int = 64,
) -> torch.Tensor:
    """Θ(x, x) [N, O, O] for every sample: the diagonal blocks of `output_kernel`, computed in
    blocks of `block` samples (never the whole N × N kernel)."""
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"kind must be one of {', '.join(OUTPUT_KINDS)}, got {kind!r}")
    opts = dict(
        kind=kind,
        dim=dim,
        seed=seed,
        batch_size=batch_size,
        device=device,
        output_fn=output_fn,
        dtype=dtype,
    )
    if kind != "full":
        k = self_similarity(model, x, block=block, **opts)
        return k[:, None, None] * (
            _scalar_scale(kind, num_outputs) * torch.eye(num_outputs, dtype=k.dtype)
        )
    n = inputs.count(x)
    blocks = []
    for s in range(0, n, block):
        k = compute(model, inputs.take(x, slice(s, s + block)), **opts)
        blocks.append(k.diagonal(dim1=0, dim2=1).permute(2, 0, 1))
    return torch.cat(blocks)
