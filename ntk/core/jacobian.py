"""Per-sample Jacobians by automatic differentiation: vmap(jacrev(functional_call))."""

from __future__ import annotations

import torch
from torch.func import jacrev, vmap

from .model import ModelView


def jacobian_features(
    view: ModelView, x, cot: torch.Tensor, names: list[str]
) -> dict[str, torch.Tensor]:
    """u_cᵀ ∂f(x_b)/∂θ_n for each parameter name n, as [C, B, numel(θ_n)], for cotangents `cot`
    [C, O] shared by the samples or [C, B, O], one set per sample.

    Only the parameters in `names` are differentiated; the others are held constant.
    """
    wrt = {n: view.params[n] for n in names}
    rest = {n: p for n, p in view.params.items() if n not in wrt}

    def projected_output(params, x_single, cot_single):
        return cot_single @ view.forward_single({**rest, **params}, x_single)

    per_sample = 1 if cot.dim() == 3 else None
    jac = vmap(jacrev(projected_output), in_dims=(None, 0, per_sample))(wrt, x, cot)
    c = cot.shape[0]
    return {n: j.reshape(j.shape[0], c, -1).transpose(0, 1) for n, j in jac.items()}
