"""Structured derivatives: per-layer Jacobian factors without per-sample weight gradients.

For a weight used as y_s = W a_s (+ b) at positions s (tokens of a sequence, patches of a
convolution), the row of the Jacobian for cotangent c is Σ_s δ_cs ⊗ a_s, where δ_cs = ∂(u_cᵀf)/∂y_s
is the backward signal at the layer's output. Its kernel contribution is therefore
Σ_{s,t} (a_s·a'_t)(δ_cs·δ'_dt): an input Gram times a cotangent Gram (Novak et al., ICML 2022,
"Fast finite width neural tangent kernel"). Embeddings are the same with one-hot inputs
(a_s·a'_t = [i_s = i'_t]); the affine parameters of normalisation layers have small per-sample
gradients Σ_s δ_s x̂_s that are formed in closed form. The backward signals of every layer for all
C cotangents come from one batched backward pass through zero perturbations added to the layer
outputs. Parameters of other modules, parameters used outside the module that owns them (tied
weights) and modules called more than once are differentiated exactly by autodiff instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from . import inputs
from .jacobian import jacobian_features
from .kinds import pair_factor
from .model import ModelView

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)


def _qualified(layer: str, attr: str) -> str:
    return f"{layer}.{attr}" if layer else attr


def _supported(module: nn.Module) -> bool:
    kind = type(module)
    if kind in (nn.Conv1d, nn.Conv2d):
        return module.groups == 1
    if kind is nn.Embedding:
        return module.max_norm is None and not module.scale_grad_by_freq
    return kind in _WEIGHTED or kind in _NORMS


# --------------------------------------------------------------------------------------------
# Features of a block of samples
# --------------------------------------------------------------------------------------------


@dataclass
class Explicit:
    """Per-sample Jacobian rows g [C, B, P] of some parameters of `layer`."""

    layer: str
    g: torch.Tensor


@dataclass
class Factored:
    """A shared weight's Jacobian Σ_s δ_s ⊗ a_s kept as factors.

    `a` is [B, S, F_in] (inputs at each position), or [B, S] token ids for an embedding
    (`index=True`, ids equal to `padding_idx` contribute nothing); `d` is [C, B, S, F_out].
    """

    layer: str
    a: torch.Tensor
    d: torch.Tensor
    index: bool = False
    padding_idx: int | None = None

    def input_gram(self, other: Factored) -> torch.Tensor:
        b1, s1 = self.a.shape[:2]
        b2, s2 = other.a.shape[:2]
        if self.index:
            i1, i2 = self.a.reshape(-1, 1), other.a.reshape(1, -1)
            gram = i1 == i2
            if self.padding_idx is not None:
                gram &= i1 != self.padding_idx
            gram = gram.to(self.d.dtype)
        else:
            gram = self.a.reshape(b1 * s1, -1) @ other.a.reshape(b2 * s2, -1).T
        return gram.reshape(b1, s1, b2, s2)


def _linear_factors(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Inputs seen by the weight at each position: [B, S, F_in]."""
    if isinstance(module, nn.Linear):
        return x.reshape(x.shape[0], -1, x.shape[-1])
    if isinstance(module, nn.Conv1d):
        x = x.unsqueeze(2)
        kernel, stride, dilation = (
            (1, *module.kernel_size),
            (1, *module.stride),
            (1, *module.dilation),
        )
    else:
        kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    pad = list(module._reversed_padding_repeated_twice)
    x = F.pad(x, pad, mode=mode) if any(pad) else x
    # Sliding windows as strided views (several times faster than F.unfold's im2col on CPU):
    # a window of extent d(k−1)+1 every `stride`, keeping every d-th element for dilation d.
    for axis, (k, s, d) in enumerate(zip(kernel, stride, dilation), start=2):
        x = x.unfold(axis, d * (k - 1) + 1, s)[..., ::d]
    b, c, h, w, kh, kw = x.shape
    return x.permute(0, 2, 3, 1, 4, 5).reshape(b, h * w, c * kh * kw)  # [B, L, Cin·kh·kw]


def _normalised(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x̂, the input of a normalisation layer's affine map y = x̂ ⊙ w + b."""
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)
    if isinstance(module, nn.GroupNorm):
        return F.group_norm(x, module.num_groups, None, None, module.eps)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    mean = module.running_mean.reshape(shape)
    var = module.running_var.reshape(shape)
    return (x - mean) / torch.sqrt(var + module.eps)


def _signals(module: nn.Module, d: torch.Tensor) -> torch.Tensor:
    """Backward signals [C, B, *out] rearranged to [C, B, S, F_out]."""
    c, b = d.shape[:2]
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return d.reshape(c, b, d.shape[2], -1).transpose(2, 3)
    return d.reshape(c, b, -1, d.shape[-1])


# --------------------------------------------------------------------------------------------
# Plan: which parameters are handled by factors and which by autodiff
# --------------------------------------------------------------------------------------------


class _UsageProbe(TorchFunctionMode):
    """Records, during one forward pass, which module was running when each parameter was used
    and how often each module was called."""

    def __init__(self, param_ids: dict[int, str]):
        super().__init__()
        self.param_ids = param_ids
        self.stack: list[str] = []
        self.users: dict[str, set[str]] = {}
        self.calls: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        current = self.stack[-1] if self.stack else None
        for arg in (*args, *kwargs.values()):
            name = self.param_ids.get(id(arg))
            if name is not None:
                self.users.setdefault(name, set()).add(current)
        return func(*args, **kwargs)


@dataclass
class Plan:
    """Modules differentiated by factors, with the parameters they cover, and the rest."""

    modules: dict[str, nn.Module]  # layer name -> module handled by factors
    covered: dict[str, list[str]]  # layer name -> parameter names handled by factors
    factored: set[str]  # layers whose weight uses the factored contraction
    fallback: list[str]  # parameter names differentiated by autodiff
    positions: dict[str, int]  # layer name -> number of weight-sharing positions S
    activations: int  # elements of all module outputs for one sample

    @property
    def empty(self) -> bool:
        return not self.modules

    @classmethod
    def autodiff(cls, other: Plan) -> Plan:
        """The same parameters, all differentiated by autodiff (the `jacobian` method)."""
        names = other.fallback + [n for names in other.covered.values() for n in names]
        return cls({}, {}, set(), names, {}, other.activations)


_PROBE = 2  # samples in the planning pass: a module must see this batch axis to be factored


def plan(
    view: ModelView,
    x,
    kind: str,
    num_cotangents: int,
    block: int,
    only: list[str] | None = None,
    factor_all: bool = False,
) -> Plan:
    """Decide, from one forward pass on two copies of the first sample of `x`, how each
    parameter is differentiated.

    Only the parameters in `only` (default: all) are planned. A known module is factored only if
    it was called exactly once, its input and output carry the sample axis first (not, say,
    positions shared by all samples) and its parameters were used by it alone. A weight with S
    positions uses the factored contraction when it is cheaper than
    forming per-sample gradients (see `_prefer_factors`), or always with `factor_all=True`
    (random projections of the factors, which never need the kernel contraction).
    """
    module_of = dict(view.model.named_modules())
    names = {name: module_of[name] for name in view.layers}
    params = dict(view.params)
    probe = _UsageProbe({id(t): n for n, t in params.items()})
    x_probe = inputs.take(x, torch.zeros(_PROBE, dtype=torch.long))
    out_numel: dict[str, int] = {}  # per sample, for modules whose tensors are per sample
    activations = [0]

    def pre_hook(name):
        def hook(module, args):
            probe.stack.append(name)
            probe.calls[name] = probe.calls.get(name, 0) + 1

        return hook

    def post_hook(name):
        def hook(module, args, out):
            probe.stack.pop()
            if isinstance(out, torch.Tensor):
                activations[0] += out.numel() // _PROBE
            per_sample = (
                isinstance(out, torch.Tensor)
                and out.dim() > 0
                and out.shape[0] == _PROBE
                and args
                and isinstance(args[0], torch.Tensor)
                and args[0].dim() > 0
                and args[0].shape[0] == _PROBE
            )
            if name in names and per_sample:
                out_numel[name] = out.numel() // _PROBE

        return hook

    handles = []
    try:
        for name, module in view.model.named_modules():
            handles.append(module.register_forward_pre_hook(pre_hook(name)))
            handles.append(module.register_forward_hook(post_hook(name)))
        with torch.no_grad(), probe:
            view.forward(params, x_probe)
    finally:
        for h in handles:
            h.remove()

    modules, covered, fallback, positions, factored = {}, {}, [], {}, set()
    wanted = set(view.params if only is None else only)
    for layer, all_names in view.layers.items():
        pnames = [n for n in all_names if n in wanted]
        if not pnames:
            continue
        module = names[layer]
        ok_module = _supported(module) and probe.calls.get(layer, 0) == 1 and layer in out_numel
        mine = [
            n
            for n in pnames
            if ok_module and n not in view.shared and probe.users.get(n, set()) == {layer}
        ]
        fallback += [n for n in pnames if n not in mine]
        if not mine:
            continue
        modules[layer] = module
        covered[layer] = mine
        if isinstance(module, _WEIGHTED) and _qualified(layer, "weight") in mine:
            s = _positions(module, out_numel[layer])
            positions[layer] = s
            if factor_all or _prefer_factors(module, s, kind, num_cotangents, block):
                factored.add(layer)
    return Plan(modules, covered, factored, fallback, positions, activations[0])


def _positions(module: nn.Module, out_numel: int) -> int:
    if isinstance(module, nn.Embedding):
        return max(1, out_numel // module.embedding_dim)
    if isinstance(module, nn.Linear):
        return max(1, out_numel // module.out_features)
    return max(1, out_numel // module.out_channels)


def _prefer_factors(module: nn.Module, s: int, kind: str, c: int, block: int) -> bool:
    """Compare multiply-adds of the factored contraction and of explicit per-sample gradients
    for one tile of `block` × `block` samples."""
    kf = pair_factor(kind, c)
    if isinstance(module, nn.Embedding):
        f_in, f_out, build = 1, module.embedding_dim, c * s * module.embedding_dim
        dense = module.num_embeddings * module.embedding_dim
    else:
        w = module.weight
        f_out, f_in = w.shape[0], w[0].numel()
        dense = w.numel()
        build = c * s * dense
    explicit = 2 * block * build + kf * block * block * dense
    factors = block * block * s * s * (f_in + kf * f_out + kf)
    return factors <= explicit


# --------------------------------------------------------------------------------------------
# Features
# --------------------------------------------------------------------------------------------


def features(view: ModelView, plan_: Plan, x, cot: torch.Tensor) -> list:
    """Explicit and factored Jacobian terms of every trainable parameter for a block `x`, for
    cotangents `cot` [C, O] shared by the samples or [C, B, O], one set per sample."""
    layer_inputs: dict[str, torch.Tensor] = {}
    perturbations: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args, out):
            x_in = args[0].detach()
            if isinstance(module, nn.Embedding):
                layer_inputs[name] = x_in.reshape(x_in.shape[0], -1)
            elif isinstance(module, _NORMS):
                layer_inputs[name] = _normalised(module, x_in)
            else:
                layer_inputs[name] = _linear_factors(module, x_in)
            eps = torch.zeros_like(out, requires_grad=True)
            perturbations[name] = eps
            return out + eps

        return record

    terms: list = []
    if not plan_.empty:
        handles = [m.register_forward_hook(hook(n)) for n, m in plan_.modules.items()]
        try:
            with torch.enable_grad():
                out = view.forward(view.params, x)
        finally:
            for h in handles:
                h.remove()
        b, o = out.shape
        grad_out = cot if cot.dim() == 3 else cot[:, None, :].expand(cot.shape[0], b, o)
        grad_out = grad_out.contiguous()
        names = list(perturbations)
        signals = torch.autograd.grad(
            out,
            [perturbations[n] for n in names],
            grad_outputs=grad_out,
            is_grads_batched=True,
            allow_unused=True,
        )
        for name, d in zip(names, signals):
            if d is None:
                d = torch.zeros(
                    (cot.shape[0], *perturbations[name].shape), dtype=out.dtype, device=out.device
                )
            terms += _module_terms(name, plan_, layer_inputs[name], d)
    if plan_.fallback:
        jac = jacobian_features(view, x, cot, plan_.fallback)
        terms += [Explicit(view.owner[n], g) for n, g in jac.items()]
    return terms


def _module_terms(layer: str, plan_: Plan, a: torch.Tensor, d: torch.Tensor) -> list:
    module = plan_.modules[layer]
    covered = plan_.covered[layer]
    c, b = d.shape[:2]
    if isinstance(module, _NORMS):
        terms = []
        if isinstance(module, nn.LayerNorm):
            shape = (c, b, -1, *module.normalized_shape)
            prod = (d * a).reshape(shape).sum(2).reshape(c, b, -1)
            bias = d.reshape(shape).sum(2).reshape(c, b, -1)
        else:  # channel axis 1 of each sample
            prod = (d * a).reshape(c, b, d.shape[2], -1).sum(3)
            bias = d.reshape(c, b, d.shape[2], -1).sum(3)
        for pname, g in ((_qualified(layer, "weight"), prod), (_qualified(layer, "bias"), bias)):
            if pname in covered:
                terms.append(Explicit(layer, g))
        return terms

    d = _signals(module, d)  # [C, B, S, F_out]
    weight, bias = _qualified(layer, "weight") in covered, _qualified(layer, "bias") in covered
    if bias and not weight:
        return [Explicit(layer, d.sum(2))]
    if isinstance(module, nn.Embedding):
        if layer in plan_.factored:
            return [Factored(layer, a, d, index=True, padding_idx=module.padding_idx)]
        grad = torch.zeros(
            (c, b, module.num_embeddings, d.shape[-1]), dtype=d.dtype, device=d.device
        )
        valid = a if module.padding_idx is None else torch.where(a == module.padding_idx, -1, a)
        mask = (valid >= 0).to(d.dtype)
        index = valid.clamp(min=0)[None, :, :, None].expand(c, b, a.shape[1], d.shape[-1])
        grad.scatter_add_(2, index, d * mask[None, :, :, None])
        return [Explicit(layer, grad.reshape(c, b, -1))]
    if bias:  # y_s = W a_s + b = [W b] [a_s; 1]: the bias is one more input feature
        a = torch.cat([a, a.new_ones(a.shape[:-1] + (1,))], dim=-1)
    if layer in plan_.factored:
        return [Factored(layer, a, d)]
    return [Explicit(layer, torch.einsum("cbso,bsi->cboi", d, a).reshape(c, b, -1))]
