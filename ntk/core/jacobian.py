"""Per-sample Jacobians by automatic differentiation: vmap(jacrev(functional_call)), or a loop
over samples for models that cannot be vmapped (`persample`)."""

from __future__ import annotations

import torch
from torch.func import jacrev

from .model import ModelView
from .persample import map_samples


def jacobian_features(
    view: ModelView, x, cot: torch.Tensor, names: list[str]
) -> dict[str, torch.Tensor]:
    """u_cᵀ ∂f(x_b)/∂θ_n for each parameter name n, as [C, B, numel(θ_n)]; cot: [C, O] shared by
    the samples, or [C, B, O] per sample.

    Only the parameters in `names` are differentiated; the others are held constant.
    """
    wrt = {n: view.params[n] for n in names}
    rest = {n: p for n, p in view.params.items() if n not in wrt}

    def projected_output(params, x_single, u):
        out = view.forward_single({**rest, **params}, x_single)
        return u.to(out.dtype) @ out  # the output's dtype may differ (mixed-precision models)

    if cot.dim() == 3:  # per-sample cotangents [C, B, O]: sample b's are cot[:, b]
        jac = map_samples(view, jacrev(projected_output), wrt, x, cot.transpose(0, 1))
    else:
        jac = map_samples(view, lambda p, xb: jacrev(projected_output)(p, xb, cot), wrt, x)
    c = cot.shape[0]
    return {n: j.reshape(j.shape[0], c, -1).transpose(0, 1) for n, j in jac.items()}
