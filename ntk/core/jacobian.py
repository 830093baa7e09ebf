"""Per-sample Jacobians by automatic differentiation: vmap(jacrev(functional_call)), a loop over
samples for models that cannot be vmapped (`persample`), or, for models that torch.func cannot
differentiate at all, one torch.autograd backward pass per sample and cotangent."""

from __future__ import annotations

import weakref

import torch
from torch.func import grad, jacrev
from torch.overrides import TorchFunctionMode

from . import inputs
from .memory import out_of_memory
from .model import ModelView
from .persample import failure_reason, fall_back, map_samples

# Operations whose parameter derivatives torch.func gets wrong under nested vmap (samples ×
# cotangents), silently (torch 2.13):
# - the weight gradient of prelu (nn.PReLU, F.prelu, Tensor.prelu), when as many samples as
#   cotangents are mapped (it fails otherwise);
# - cdist (any p) whenever its cotangents are mapped: jacrev of one sample's distances is wrong
#   (its batching rule mishandles a batched gradient of unbatched inputs), vmap over samples of
#   one cotangent's gradient is right;
# - linalg.solve and solve_ex (any left=) of an unbatched matrix A [n, n] against a sample's
#   right-hand side [1, n, k]: jacrev of one sample's solution is wrong w.r.t. A and B (vmap
#   over samples of it failed whenever the samples were not as many as the cotangents, and the
#   loop over samples that follows used jacrev too);
# - lu_solve (torch.linalg's, and the deprecated torch.lu_solve / Tensor.lu_solve): the
#   derivative w.r.t. the right-hand side under vmap over samples of jacrev (jacrev of one
#   sample alone is right).
# A model whose forward calls one is differentiated one cotangent at a time (vmap over the
# samples only, which is right).
NESTED_VMAP_UNSAFE = frozenset(
    {
        torch.prelu,
        torch.Tensor.prelu,
        torch.cdist,
        torch.linalg.solve,
        torch.linalg.solve_ex,
        torch.linalg.lu_solve,
        torch.lu_solve,
        torch.Tensor.lu_solve,
    }
)
# scatter_reduce with reduce="prod": torch's forward-mode derivative is wrong even without vmap
# (0 where the reverse mode is right), so ntk_vp (forward mode) refuses models calling it.
_SCATTER_REDUCE = frozenset({torch.scatter_reduce, torch.Tensor.scatter_reduce})
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Calls of a forward
# model -> the error of torch.func that made `jacobian_features` use torch.autograd alone
_AUTOGRAD_ONLY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Calls(TorchFunctionMode):
    """The torch functions a forward pass calls, and whether one is a scatter_reduce "prod"."""

    def __init__(self):
        super().__init__()
        self.called: set = set()
        self.scatter_prod = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.called.add(func)
        if func in _SCATTER_REDUCE:
            reduce = kwargs.get("reduce", args[4] if len(args) > 4 else None)
            self.scatter_prod = self.scatter_prod or reduce == "prod"
        return func(*args, **kwargs)


def _calls(view: ModelView, x) -> _Calls:
    """What the model's forward on the first sample of `x` calls (probed once per model)."""
    if view.model not in _PROBED:
        calls = _Calls()
        with torch.no_grad(), calls:
            view.forward(view.params, inputs.take(x, slice(0, 1)))
        _PROBED[view.model] = calls
    return _PROBED[view.model]


def nested_vmap_unsafe(view: ModelView, x) -> bool:
    """Whether the model's forward on (the first sample of) `x` calls an operation of
    NESTED_VMAP_UNSAFE."""
    return bool(_calls(view, x).called & NESTED_VMAP_UNSAFE)


def forward_mode_wrong(view: ModelView, x) -> bool:
    """Whether the model's forward calls an operation whose forward-mode derivative torch gets
    wrong (scatter_reduce with reduce="prod")."""
    return _calls(view, x).scatter_prod


def jacobian_features(
    view: ModelView, x, cot: torch.Tensor, names: list[str]
) -> dict[str, torch.Tensor]:
    """u_cᵀ ∂f(x_b)/∂θ_n for each parameter name n, as [C, B, numel(θ_n)]; cot: [C, O] shared by
    the samples, or [C, B, O] per sample.

    Only the parameters in `names` are differentiated; the others are held constant. A model
    whose forward torch.func's transforms cannot run even one sample at a time (a packed
    sequence through nn.GRU / nn.LSTM: "Cannot access data pointer of Tensor that doesn't have
    storage") is differentiated by torch.autograd alone from then on, with a warning, if that
    works on the block (the same values; B·C backward passes); otherwise torch.func's error is
    raised, with a note of autograd's.
    """
    wrt = {n: view.params[n] for n in names}
    rest = {n: p for n, p in view.params.items() if n not in wrt}
    if view.model in _AUTOGRAD_ONLY:
        return _autograd_features(view, wrt, rest, x, cot)
    try:
        return _functorch_features(view, wrt, rest, x, cot)
    except Exception as error:
        if out_of_memory(error):
            raise
        try:
            features = _autograd_features(view, wrt, rest, x, cot)
        except Exception as fallback:  # not torch.func's limit alone: the model's own failure
            error.add_note(f"torch.autograd failed on it too: {failure_reason(fallback)}")
            raise error from None
        fall_back(
            _AUTOGRAD_ONLY,
            view.model,
            error,
            "torch.func cannot differentiate {model} ({reason}); computing per-sample "
            "derivatives by torch.autograd, one backward pass per sample and output",
        )
        return features


def _functorch_features(view: ModelView, wrt: dict, rest: dict, x, cot: torch.Tensor) -> dict:
    """`jacobian_features` by torch.func: jacrev of u·f, vmapped over samples where it can be."""

    def projected_output(params, x_single, u):
        out = view.forward_single({**rest, **params}, x_single)
        return u.to(out.dtype) @ out  # the output's dtype may differ (mixed-precision models)

    c = cot.shape[0]
    if nested_vmap_unsafe(view, x):
        derivative = grad(projected_output)  # of one cotangent's scalar u·f
        if cot.dim() == 3:
            rows = [map_samples(view, derivative, wrt, x, cot[k]) for k in range(c)]
        else:
            rows = [map_samples(view, lambda p, xb, u=u: derivative(p, xb, u), wrt, x) for u in cot]
        return {n: torch.stack([r[n].reshape(r[n].shape[0], -1) for r in rows]) for n in wrt}
    if cot.dim() == 3:  # per-sample cotangents [C, B, O]: sample b's are cot[:, b]
        jac = map_samples(view, jacrev(projected_output), wrt, x, cot.transpose(0, 1))
    else:
        jac = map_samples(view, lambda p, xb: jacrev(projected_output)(p, xb, cot), wrt, x)
    return {n: j.reshape(j.shape[0], c, -1).transpose(0, 1) for n, j in jac.items()}


def _autograd_features(view: ModelView, wrt: dict, rest: dict, x, cot: torch.Tensor) -> dict:
    """`jacobian_features` by torch.autograd alone: for each sample b, one forward pass and, for
    each cotangent u_c, the backward pass of u_c·f(x_b) ([C, B, numel] per parameter; a
    parameter the output does not depend on gets zeros)."""
    leaves = {n: p.detach().requires_grad_(True) for n, p in wrt.items()}
    c, count = cot.shape[0], inputs.count(x)
    rows = {
        n: torch.zeros(c, count, p.numel(), dtype=p.dtype, device=p.device) for n, p in wrt.items()
    }
    for b in range(count):
        with torch.enable_grad():
            out = view.forward_single({**rest, **leaves}, inputs.take(x, b))
            for k in range(c):
                u = cot[k, b] if cot.dim() == 3 else cot[k]
                grads = torch.autograd.grad(
                    u.to(out.dtype) @ out,
                    list(leaves.values()),
                    retain_graph=k < c - 1,
                    allow_unused=True,
                )
                for n, g in zip(leaves, grads):
                    if g is not None:
                        rows[n][k, b] = g.reshape(-1)
    return rows
