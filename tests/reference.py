"""An independent reference eNTK: plain per-sample, per-output torch.autograd.grad loops."""

from __future__ import annotations

import torch


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ over all entries, in float64 on the CPU (a may live on another device)."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float(torch.linalg.norm((a - b).reshape(-1)) / torch.linalg.norm(b.reshape(-1)))


def layer_params(model):
    """{module name: [trainable parameters it owns directly]}, first registration wins."""
    seen, layers = set(), {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                layers.setdefault(name, []).append(p)
    return layers


def parametrized_layers(ref: dict) -> dict:
    """`kernels`' layers with each parametrization's list ("fc.parametrizations.weight", whose
    parameters weight_norm & co. register) merged into the layer it parametrizes ("fc")."""
    out = {}
    for name, value in ref.items():
        if name is not None:
            head, parametrized, _ = f".{name}".rpartition(".parametrizations.")
            name = head[1:] if parametrized else name
        out[name] = out[name] + value if name in out else value
    return out


def _call(model, x, i):
    if isinstance(x, dict):
        return model(**{k: v[i : i + 1] for k, v in x.items()})
    return model(x[i : i + 1])


def _count(x):
    return next(iter(x.values())).shape[0] if isinstance(x, dict) else x.shape[0]


def jacobians(model, x, output_fn=None):
    """{layer: J [N, O, P_layer]} by one autograd.grad call per sample and output; `output_fn`
    maps the model's output (e.g. a HuggingFace ModelOutput) to a tensor."""
    layers = layer_params(model)
    per_layer = {name: [] for name in layers}
    for i in range(_count(x)):
        out = _call(model, x, i)
        out = (out if output_fn is None else output_fn(out)).reshape(-1)
        rows = {name: [] for name in layers}
        for o in range(out.shape[0]):
            for name, params in layers.items():
                grads = torch.autograd.grad(out[o], params, retain_graph=True, allow_unused=True)
                rows[name].append(
                    torch.cat(
                        [
                            (g if g is not None else torch.zeros_like(p)).reshape(-1)
                            for g, p in zip(grads, params)
                        ]
                    )
                )
        for name in layers:
            per_layer[name].append(torch.stack(rows[name]))
    return {name: torch.stack(v) for name, v in per_layer.items()}


def kernels(model, x1, x2=None, output_fn=None):
    """{layer: full kernel [N1, N2, O, O]} and the total under key None."""
    j1 = jacobians(model, x1, output_fn)
    j2 = j1 if x2 is None else jacobians(model, x2, output_fn)
    out = {name: torch.einsum("iop,jqp->ijoq", j1[name], j2[name]) for name in j1}
    out[None] = sum(out.values())
    return out


def of_kind(full: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "full":
        return full
    diag = torch.diagonal(full, dim1=2, dim2=3)
    if kind == "diagonal":
        return diag
    if kind == "trace":
        return diag.sum(-1)
    return full.sum((2, 3)) / full.shape[-1]  # sum_logits


def signs(y: torch.Tensor, num_outputs: int) -> torch.Tensor:
    """s(y) = 2e_y − 1 [N, O]; for one output (a binary classifier's logit z), the signs of the
    class scores (0, z) on z: 2y − 1 [N, 1]."""
    if num_outputs == 1:
        return (2 * y.double() - 1)[:, None]
    return 2 * torch.nn.functional.one_hot(y, num_outputs).double() - 1


def lpntk(full: torch.Tensor, y1: torch.Tensor, y2: torch.Tensor) -> torch.Tensor:
    """s(y)ᵀ Θ(x, x') s(y') [N1, N2] from the full kernel [N1, N2, O, O]."""
    o = full.shape[-1]
    return torch.einsum("io,ijoq,jq->ij", signs(y1, o), full.double(), signs(y2, o))


def gauss_newton_influence(j, left, g, y, damping: float) -> torch.Tensor:
    """u_zᵀ J_z (Σ_i J_iᵀ Λ_i J_i + λI)⁻¹ J_iᵀ r_i in parameter space, with residuals
    r_i = e_{y_i} − p_i and curvature Λ_i = diag(p_i) − p_i p_iᵀ at the training logits g [N, O];
    j: Jacobians [N, O, P]; left: u_zᵀ J_z [M, P]."""
    p = g.softmax(1)
    r = torch.eye(g.shape[1], dtype=torch.float64)[y] - p
    curvature = torch.stack([torch.diag(q) - torch.outer(q, q) for q in p])
    h = torch.einsum("iop,ioa,ipb->ab", curvature, j, j)
    h = h + damping * torch.eye(j.shape[2], dtype=torch.float64)
    return left @ torch.linalg.solve(h, torch.einsum("io,ioa->ai", r, j))
