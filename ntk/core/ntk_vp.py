"""NTK-vector products: Θ(x_i, X) u = J(X) (J(x_i)ᵀ u) without forming any Jacobian.

For each sample x_i of the left block, one vjp gives the C parameter-space vectors J(x_i)ᵀ u_c
(vmapped over the cotangents, or one at a time for a model calling an operation of
`jacobian.NESTED_VMAP_UNSAFE`, whose backward torch batches wrongly); one jvp through the whole
right block, vmapped over those C tangents, gives J(x_j) J(x_i)ᵀ u_c for every x_j at once.
Memory is O(C·P) plus C forward passes of the block, instead of the N²·O·P of the pairwise
double-vmap recipe. Fused attention kernels have no forward-mode derivative, so the tiles run with
PyTorch's composite (math) attention.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.func import jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import inputs
from .jacobian import forward_mode_wrong, nested_vmap_unsafe
from .kinds import Kind
from .memory import out_of_memory
from .model import ModelView


def tile(
    view: ModelView,
    x1,
    x2,
    u1: torch.Tensor,
    u2: torch.Tensor,
    kind: Kind,
    groups: dict[str | None, list[str]],
) -> dict[str | None, torch.Tensor]:
    """Kernel tiles K(x1, x2) of each parameter group ({key: parameter names}); u1, u2: the
    blocks' cotangents ([C, O] shared, or [C, B, O] per sample)."""
    params = view.params
    n1 = inputs.count(x1)
    rows: dict[str | None, list[torch.Tensor]] = {key: [] for key in groups}
    if forward_mode_wrong(view, x1):
        raise NotImplementedError(
            "method='ntk_vp' uses forward-mode derivatives, and torch's of scatter_reduce(..., "
            "reduce='prod'), which the model calls, are wrong; use method='jacobian' or "
            "'structured'"
        )
    one_at_a_time = nested_vmap_unsafe(view, x1)
    for i in range(n1):
        xi = inputs.take(x1, slice(i, i + 1))
        with _naming_transform_limits(view, xi):
            _, pullback = vjp(lambda p, xi=xi: view.forward(p, xi)[0], params)
        cotangents = u1 if u1.dim() == 2 else u1[:, i]
        if one_at_a_time:
            each = [pullback(u)[0] for u in cotangents]
            tangents = {n: torch.stack([t[n] for t in each]) for n in params}
        else:
            (tangents,) = vmap(pullback)(cotangents)  # name -> [C, *shape]
        for key, names in groups.items():
            primals = {n: params[n] for n in names}
            rest = {n: p for n, p in params.items() if n not in primals}

            def push(t, primals=primals, rest=rest):
                return jvp(lambda q: view.forward({**rest, **q}, x2), (primals,), (t,))[1]

            with _forward_mode_attention(), _naming_missing_forward_mode(view, x2):
                r = vmap(push)({n: tangents[n] for n in names})  # [C, B2, O]: J(x_j) J(x_i)ᵀ u_c
            rows[key].append(kind.reduce(r, u2))
    return {key: torch.stack(r) for key, r in rows.items()}


@contextmanager
def _naming_missing_forward_mode(view: ModelView, x):
    """An operation of the model without forward-mode derivatives (torch raises
    NotImplementedError: e.g. oneDNN LSTM, weight_norm, EmbeddingBag), or whose forward-mode
    derivative fails on the block x where its plain forward pass runs (RuntimeError: group_norm
    on a channels_last input, "view size is not compatible with input tensor's size and
    stride"), refused with the fix."""
    try:
        yield
    except (NotImplementedError, RuntimeError) as error:
        if out_of_memory(error):
            raise
        if not isinstance(error, NotImplementedError) and not _runs_plainly(view, x):
            raise  # the model's own failure
        first = (str(error).strip().splitlines() or [""])[0]
        which = "has none" if isinstance(error, NotImplementedError) else "fails in torch"
        raise NotImplementedError(
            "method='ntk_vp' needs forward-mode derivatives of every operation of the model, "
            f"and one {which} ({first}); use method='jacobian' or 'structured'"
        ) from error


@contextmanager
def _naming_transform_limits(view: ModelView, x):
    """A model that torch.func's transforms cannot run on the sample x where its plain forward
    pass runs (activation checkpointing's saved-tensor hooks, an autograd.Function without
    setup_context, a packed sequence through nn.GRU: "Cannot access data pointer of Tensor that
    doesn't have storage") refused with the fix: the `jacobian` method falls back to
    torch.autograd for such models."""
    try:
        yield
    except RuntimeError as error:
        if out_of_memory(error):
            raise
        first = (str(error).strip().splitlines() or [""])[0]
        named = "torch.func" in first or "functorch" in first
        if not named and not _runs_plainly(view, x):  # the model's own failure
            raise
        raise NotImplementedError(
            f"method='ntk_vp' runs the model under torch.func's transforms, which cannot run it "
            f"({first}); use method='jacobian' or 'structured'"
        ) from error


def _runs_plainly(view: ModelView, x) -> bool:
    """Whether the model's forward pass runs on x without torch.func's transforms."""
    try:
        with torch.no_grad():
            view.forward(view.params, x)
    except Exception:
        return False
    return True


@contextmanager
def _forward_mode_attention():
    """Use the composite attention implementations, which support forward-mode AD: no fused
    nn.MultiheadAttention fast path, the math backend of scaled_dot_product_attention."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)
