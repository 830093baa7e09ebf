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
An embedding looked up once for the whole batch (position ids [1, S] or [S], as in HuggingFace
transformers) is factored too, with its output expanded to one copy per sample so that each sample
gets its own backward signal, once a planning pass has checked that the expansion leaves the
model's output unchanged.
Besides torch's Linear, Conv1d/2d, Embedding and normalisation layers, transformers' `Conv1D`
(GPT-2's y = x W + b with W stored as [F_in, F_out]) is factored like a Linear.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from . import inputs
from .jacobian import jacobian_features
from .kinds import Kind, get
from .model import ModelView, check_output_rows, naming_failures
from .persample import quiet_batching_notes

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)


def _qualified(layer: str, attr: str) -> str:
    return f"{layer}.{attr}" if layer else attr


def _is_hf_conv1d(module: nn.Module) -> bool:
    """Whether `module` is transformers' Conv1D (only possible once transformers is imported, so
    transformers is never imported here)."""
    cls = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return cls is not None and type(module) is cls


def _weighted(module: nn.Module) -> bool:
    return isinstance(module, _WEIGHTED) or _is_hf_conv1d(module)


def _supported(module: nn.Module) -> bool:
    if "forward" in vars(module):  # replaced on the instance: not the computation of its type
        return False
    if _global_forward_hooks():  # they act on every output before the perturbation is added
        return False
    if _is_hf_conv1d(module):
        return True
    kind = type(module)
    if kind in (nn.Conv1d, nn.Conv2d):
        return module.groups == 1
    return kind in _WEIGHTED or kind in _NORMS


def _global_forward_hooks() -> bool:
    """Whether forward hooks registered for every module (nn.modules.module.
    register_module_forward_hook) are active: torch runs them before a module's own hooks, so
    they would change a layer's output before the perturbation that reads its backward signal
    is added, and the factors would miss their effect (the kernel was 75 % off)."""
    return bool(nn.modules.module._global_forward_hooks)


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

    `source` is [B, S, F_in] (inputs at each position), a convolution's `Windows` (read as `a`,
    copied out when first read), or [B, S] token ids for an embedding (`index=True`, ids equal
    to `padding_idx` contribute nothing); `d` is [C, B, S, F_out].
    """

    layer: str
    source: torch.Tensor | Windows
    d: torch.Tensor
    index: bool = False
    padding_idx: int | None = None

    @functools.cached_property
    def a(self) -> torch.Tensor:
        """The inputs at each position [B, S, F_in] (token ids [B, S] for an embedding)."""
        return self.source.tensor() if isinstance(self.source, Windows) else self.source

    @property
    def input_features(self) -> int:
        """F_in, without copying out a convolution's windows."""
        return self.source.shape[-1]

    def gradient(self) -> torch.Tensor:
        """The per-sample gradients Σ_s δ_s a_sᵀ → [C, B, F_out·F_in] (not for embeddings)."""
        return weight_gradient(self.source, self.d)

    def to(self, dtype: torch.dtype) -> Factored:
        """The term with its signals (and inputs, unless token ids) in `dtype`."""
        source = self.source if self.index else self.source.to(dtype)
        return Factored(self.layer, source, self.d.to(dtype), self.index, self.padding_idx)

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


def _linear_factors(
    module: nn.Module, x: torch.Tensor, bias: bool = False
) -> torch.Tensor | Windows:
    """Inputs seen by the weight at each position: [B, S, F_in], or with bias=True [B, S, F_in + 1]
    whose last feature is 1 (y_s = W a_s + b = [W b] [a_s; 1]), written in one pass; for a
    convolution, its `Windows` (copied out when first needed)."""
    if isinstance(module, nn.Linear) or _is_hf_conv1d(module):
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        return _with_ones(x, x.shape[-1]) if bias else x
    # padded before a Conv1d's input becomes 2-d: reflect/replicate/circular pad the last axes only
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    pad = list(module._reversed_padding_repeated_twice)
    # a copy either way: the windows are read after the forward pass, which may change x in place
    x = F.pad(x, pad, mode=mode) if any(pad) else x.clone()
    if isinstance(module, nn.Conv1d):
        spec = ((1, *module.kernel_size), (1, *module.stride), (1, *module.dilation))
        return Windows(x.unsqueeze(2), *spec, bias)
    return Windows(x, module.kernel_size, module.stride, module.dilation, bias)


class Windows:
    """The inputs a 2-d convolution's weight sees at its S output positions, kept as (a copy of)
    the padded input x [B, C_in, H, W] until needed: `tensor()` copies them out as [B, S, F_in] with
    F_in = C_in·k_h·k_w (+ 1 with bias) in the weight's order; `gradient(d)` forms the per-sample
    gradients Σ_s δ_s a_sᵀ."""

    def __init__(self, x: torch.Tensor, kernel, stride, dilation, bias: bool):
        self.x, self.bias = x, bias
        self.kernel, self.stride, self.dilation = tuple(kernel), tuple(stride), tuple(dilation)
        positions = math.prod(
            (n - d * (k - 1) - 1) // s + 1
            for n, k, s, d in zip(x.shape[2:], self.kernel, self.stride, self.dilation)
        )
        self.shape = (x.shape[0], positions, x.shape[1] * math.prod(self.kernel) + bias)

    def to(self, dtype: torch.dtype) -> Windows:
        return Windows(self.x.to(dtype), self.kernel, self.stride, self.dilation, self.bias)

    def _views(self, x: torch.Tensor, first: int) -> torch.Tensor:
        """Sliding windows over the spatial axes first, first + 1 of x as strided views (several
        times faster than F.unfold's im2col on CPU): a window of extent ρ(k−1)+1 every σ, keeping
        every ρ-th element, appended as the last two axes."""
        for axis, (k, s, d) in enumerate(zip(self.kernel, self.stride, self.dilation), first):
            x = x.unfold(axis, d * (k - 1) + 1, s)[..., ::d]
        return x

    def tensor(self) -> torch.Tensor:
        """[B, S, F_in]."""
        windows = self._views(self.x, 2).permute(0, 2, 3, 1, 4, 5)  # [B, h, w, C_in, k_h, k_w]
        features = self.shape[2] - self.bias
        out = windows.new_empty(self.shape)
        # one copy per kernel row: its k_w elements are contiguous on both sides, which torch's
        # copy of the whole 6-d view does not exploit (2-3× slower on CPU for 3 × 3 kernels)
        rows = out[..., :features].view(windows.shape)
        for i in range(windows.shape[-2]):
            rows[..., i, :] = windows[..., i, :]
        if self.bias:
            out[..., features] = 1
        return out

    def gradient(self, d: torch.Tensor) -> torch.Tensor:
        """Σ_s δ_s a_sᵀ for d [C, B, S, F_out] → [C, B, F_out·F_in]. The windows are copied with
        runs of k_w elements in the weight's order; when C_in > k_w and the gradients
        (C·F_out·F_in per sample) are smaller than the windows (S·F_in), they are copied
        channels-last instead (runs of C_in elements, order (k_h, k_w, C_in)), and the smaller
        gradients are put back into the weight's order."""
        c, b, s, f_out = d.shape
        cin = self.x.shape[1]
        kh, kw = self.kernel
        if cin <= kw or c * f_out >= s:
            return einsum_gradient(self.tensor(), d)
        channels_last = self.x.permute(0, 2, 3, 1).contiguous()  # [B, H, W, C_in]
        views = self._views(channels_last, 1)  # [B, h, w, C_in, k_h, k_w]
        windows = views.new_empty((*views.shape[:3], kh, kw, cin))
        windows.copy_(views.permute(0, 1, 2, 4, 5, 3))
        a = windows.view(b, s, kh * kw * cin)
        out = d.new_empty((c, b, f_out, self.shape[2]))
        weights = out[..., : kh * kw * cin].view(c, b, f_out, cin, kh, kw)
        product = einsum_gradient(a, d).view(c, b, f_out, kh, kw, cin)
        weights.copy_(product.permute(0, 1, 2, 5, 3, 4))
        if self.bias:
            out[..., -1] = d.sum(2)
        return out.reshape(c, b, -1)


def einsum_gradient(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Σ_s δ_s a_sᵀ for a [B, S, F_in] and d [C, B, S, F_out] → [C, B, F_out·F_in]."""
    c, b = d.shape[:2]
    return torch.einsum("cbso,bsi->cboi", d, a).reshape(c, b, -1)


def weight_gradient(a: torch.Tensor | Windows, d: torch.Tensor) -> torch.Tensor:
    """Per-sample gradients Σ_s δ_s a_sᵀ → [C, B, F_out·F_in] from a layer's inputs or Windows."""
    return a.gradient(d) if isinstance(a, Windows) else einsum_gradient(a, d)


def _with_ones(x: torch.Tensor, features: int) -> torch.Tensor:
    """x [B, …], whose other axes read in order as S positions × `features`, copied into a new
    [B, S, features + 1] tensor whose last feature is 1 (one copy, no concatenation)."""
    out = x.new_empty((x.shape[0], x[0].numel() // features, features + 1))
    out[..., :features].view(x.shape).copy_(x)
    out[..., features] = 1
    return out


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
        # nested too: a weight inside a list or tuple argument (torch.cat([w, w]), einsum's list)
        for arg in tree_leaves((args, kwargs)):
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
    shared: set[str] = field(default_factory=set)  # embeddings looked up once for the batch
    recomputes: bool = False  # saves tensors through hooks (activation checkpointing)

    @property
    def empty(self) -> bool:
        return not self.modules

    def bias_input(self, layer: str) -> bool:
        """Whether the weight and the bias of `layer` are covered: its inputs a_s then carry one
        more feature, 1, for the bias (y_s = W a_s + b = [W b] [a_s; 1])."""
        covered = self.covered[layer]
        return _qualified(layer, "weight") in covered and _qualified(layer, "bias") in covered

    def factor_sizes(self, layer: str) -> tuple[int, int]:
        """(F_in, F_out) of the `Factored` term of `layer`, its bias feature included."""
        return factor_sizes(self.modules[layer], self.bias_input(layer))

    @classmethod
    def autodiff(cls, other: Plan) -> Plan:
        """The same parameters, all differentiated by autodiff (the `jacobian` method)."""
        names = other.fallback + [n for names in other.covered.values() for n in names]
        return cls({}, {}, set(), names, {}, other.activations)

    def leave_to_autodiff(self, layers) -> None:
        """Differentiate the parameters these layers cover by autodiff (modules `_settle` found
        running on micro-batches)."""
        for layer in layers:
            self.fallback += self.covered.pop(layer)
            del self.modules[layer]
            self.positions.pop(layer, None)
            self.factored.discard(layer)
            self.shared.discard(layer)


_PROBE = 2  # samples in the planning pass: a module must see this batch axis to be factored
_CONFIRM = 3  # samples in a second pass that tells the sample axis from an axis of _PROBE entries
_CHUNKS = 16  # samples `_settle`'s pass takes (up to `largest`) whatever its memory cap
_SETTLE_BYTES = 1 << 30  # module outputs `_settle`'s pass may hold, if more than _CHUNKS samples'


def plan(
    view: ModelView,
    x,
    kind: str | Kind,
    num_cotangents: int,
    tile_size: int,
    largest: int,
    only: list[str] | None = None,
    factor_all: bool = False,
    name: str | None = None,
) -> Plan:
    """Decide, from a forward pass on two copies of the first sample of `x` (and others on
    three, `_leading_sample_axis`, and on up to `largest`, `_settle`), how each parameter is
    differentiated.

    Only the parameters in `only` (default: all) are planned. A known module is factored only if
    it was called exactly once, its input and output carry the sample axis first (or, for an
    embedding, its ids are shared by the whole batch, see `_expand_shared`) and its parameters were
    used by it alone. A weight with S
    positions uses the factored contraction when it is cheaper than
    forming per-sample gradients (see `_prefer_factors`), or always with `factor_all=True`
    (random projections of the factors, which never need the kernel contraction).

    largest: the most samples a block read through this plan holds. A module that a pass on that
    many samples (x's, repeated) runs on micro-batches is left to autodiff, as any module called
    more than once, so no block changes the plan (`_settle`; name: the argument its failures
    name). 1 for a plan whose factors no block reads (the autodiff methods).
    """
    module_of = dict(view.model.named_modules())
    names = {name: module_of[name] for name in view.layers}
    params = dict(view.params)
    probe = _UsageProbe({id(t): n for n, t in params.items()})
    x_probe = inputs.take(x, torch.zeros(_PROBE, dtype=torch.long))
    out_numel: dict[str, int] = {}  # per sample, for modules whose tensors are per sample
    shared: set[str] = set()  # embeddings whose ids are shared by the batch
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
            if name in names and _leads_with(args, out, _PROBE):
                out_numel[name] = out.numel() // _PROBE
            elif name in names and _batch_shared(module, args, out):
                out_numel[name] = out.numel()
                shared.add(name)

        return hook

    with contextlib.ExitStack() as hooks:  # a RemovableHandle removes its hook on exit
        for layer, module in view.model.named_modules():
            hooks.enter_context(module.register_forward_pre_hook(pre_hook(layer)))
            hooks.enter_context(module.register_forward_hook(post_hook(layer), prepend=True))
        with torch.no_grad(), probe:
            reference = view.forward(params, x_probe)
    candidates = {n for n in shared if probe.calls.get(n, 0) == 1}
    shared = {n for n in candidates if _expansion_keeps_output(view, x_probe, {n}, reference)}
    if len(shared) > 1 and not _expansion_keeps_output(view, x_probe, shared, reference):
        shared = set()
    per_sample = _leading_sample_axis(view, x, names)
    out_numel = {
        n: v
        for n, v in out_numel.items()
        if n in shared or (n not in candidates and n in per_sample)
    }

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
        if _weighted(module) and _qualified(layer, "weight") in mine:
            s = _positions(module, out_numel[layer])
            positions[layer] = s
            if factor_all or _prefer_factors(module, s, kind, num_cotangents, tile_size):
                factored.add(layer)
    result = Plan(
        modules,
        covered,
        factored,
        fallback,
        positions,
        activations[0],
        shared & set(modules),
        bool(modules) and _saves_through_hooks(view, x_probe),
    )
    _settle(view, result, x, largest, name)
    return result


_HOOKS_SEEN = "ntk: the model saves tensors for its backward pass through hooks"


def _saves_through_hooks(view: ModelView, x) -> bool:
    """Whether the model's forward pass with gradients registers saved-tensor hooks, as
    activation checkpointing (torch.utils.checkpoint, use_reentrant=False) does to recompute its
    segments in the backward pass (`_reading`)."""
    try:
        with torch.enable_grad(), torch.autograd.graph.disable_saved_tensors_hooks(_HOOKS_SEEN):
            view.forward(view.params, x)
    except RuntimeError as exc:
        return str(exc) == _HOOKS_SEEN
    except Exception:  # the model's own failure: the blocks' passes name it
        return False
    return False


def _leads_with(args, out, b: int) -> bool:
    """Whether a module's first input and its output are tensors whose first axis has b entries."""
    return (
        isinstance(out, torch.Tensor)
        and out.dim() > 0
        and out.shape[0] == b
        and bool(args)
        and isinstance(args[0], torch.Tensor)
        and args[0].dim() > 0
        and args[0].shape[0] == b
    )


def _leading_sample_axis(view: ModelView, x, names: dict[str, nn.Module]) -> set[str]:
    """The layers among `names` whose input and output lead with the sample axis, row b holding
    sample b: in a forward pass on _CONFIRM copies of the first sample of `x` (the planning pass
    alone cannot tell the sample axis from another axis of _PROBE entries: a sequence-first
    [S, B, F] with S = 2, the default layout of nn.TransformerEncoderLayer, would be factored as
    if S were the samples), and, in a pass on up to _CONFIRM distinct samples, with each row equal
    to that sample's own pass (a model that sorts, flips or routes the batch around a layer feeds
    it other samples' rows). Modules run on micro-batches are found by `_settle`."""
    captured: dict[str, list] = {}  # layer → (input, output) of each call leading with the rows
    rows = [_CONFIRM]  # samples in the current pass

    def hook(name):
        def record(module, args, out):
            if _leads_with(args, out, rows[0]):
                captured.setdefault(name, []).append((args[0].detach(), out.detach()))

        return record

    def run(idx: list[int]) -> None:
        captured.clear()
        rows[0] = len(idx)
        with torch.no_grad():
            view.forward(view.params, inputs.take(x, torch.tensor(idx, dtype=torch.long)))

    with contextlib.ExitStack() as hooks:
        for n, module in names.items():
            hooks.enter_context(module.register_forward_hook(hook(n), prepend=True))
        run([0] * _CONFIRM)
        confirmed = set(captured)
        distinct = list(range(min(_CONFIRM, inputs.count(x))))
        try:
            if len(distinct) > 1:
                run(distinct)
                batched = {n: calls[0] for n, calls in captured.items() if len(calls) == 1}
                for b in distinct:
                    run([b])
                    batched = {
                        n: pair
                        for n, pair in batched.items()
                        if len(captured.get(n, ())) == 1
                        and all(_same(t[b], one[0]) for t, one in zip(pair, captured[n][0]))
                    }
                confirmed &= set(batched)
        except Exception:
            confirmed = set()  # a sample the model fails on: the blocks' own passes name it
    return confirmed


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether one sample's row of a batched pass matches its own pass, to rounding."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5 * scale + 1e-12))


def _batch_shared(module: nn.Module, args, out) -> bool:
    """An embedding whose ids carry no sample axis: [S], or [1, S] broadcast over the batch."""
    if type(module) is not nn.Embedding or not args or not isinstance(args[0], torch.Tensor):
        return False
    ids = args[0]
    return isinstance(out, torch.Tensor) and (
        ids.dim() == 1 or (ids.dim() > 1 and ids.shape[0] == 1)
    )


def _expand_shared(out: torch.Tensor, ids: torch.Tensor, b: int):
    """A batch-shared embedding's output and ids with a sample axis of b: ([b, *per-sample
    output], [b, S]). The output is materialised (zeros added) so each sample can carry its own
    perturbation."""
    if ids.dim() > 1:
        out, ids = out[0], ids[0]
    return out + out.new_zeros((b, *out.shape)), ids.reshape(1, -1).expand(b, -1)


def _expansion_keeps_output(view: ModelView, x_probe, layers: set[str], reference) -> bool:
    """Whether the model gives the same output with these embeddings' outputs expanded to one
    copy per sample (it does when they are only broadcast, e.g. added to per-sample tensors)."""
    module_of = dict(view.model.named_modules())

    def expand(module, args, out):
        return _expand_shared(out, args[0], _PROBE)[0]

    with contextlib.ExitStack() as hooks:
        for n in layers:
            hooks.enter_context(module_of[n].register_forward_hook(expand, prepend=True))
        try:
            with torch.no_grad():
                out = view.forward(view.params, x_probe)
        except Exception:  # any failure (nn.MultiheadAttention asserts its query's rank): not safe
            return False
    return out.shape == reference.shape and bool(torch.allclose(out, reference))


def _positions(module: nn.Module, out_numel: int) -> int:
    if isinstance(module, nn.Embedding):
        return max(1, out_numel // module.embedding_dim)
    if isinstance(module, nn.Linear):
        return max(1, out_numel // module.out_features)
    if _is_hf_conv1d(module):
        return max(1, out_numel // module.weight.shape[1])
    return max(1, out_numel // module.out_channels)


def _prefer_factors(module: nn.Module, s: int, kind: str | Kind, c: int, tile_size: int) -> bool:
    """Whether the factored contraction is cheaper than explicit per-sample gradients for one
    tile of `tile_size` × `tile_size` samples (see `_layer_costs`)."""
    explicit, factors, _ = _layer_costs(module, s, get(kind).pair_factor(c), c, tile_size)
    return factors <= explicit


# Multiply-adds one copied (memory-bound) element costs, by device type. CUDA: on an H200 the
# structured path was faster in all six cases of `hf_engine.py --device cuda` (CNN, MLP, ResNet;
# full and trace; 0.62-0.89 of jacobian's time), where weighting copies at >= 0.6 picks jacobian
# for some; there the launches, not the copies, dominate.
COPY_COST = {"cpu": 8, "cuda": 0}


def factor_sizes(module: nn.Module, bias: bool = False) -> tuple[int, int]:
    """(F_in, F_out): the features per position of a factored weight's inputs a_s and output
    signals δ_s (`Factored`); an embedding's input is one token id. bias: the bias is covered with
    the weight, as one more input feature."""
    if isinstance(module, nn.Embedding):
        return 1, module.embedding_dim
    w = module.weight
    f_in, f_out = (w.shape[0], w.shape[1]) if _is_hf_conv1d(module) else (w[0].numel(), w.shape[0])
    return f_in + int(bias), f_out


def _layer_costs(module: nn.Module, s: int, kf: int, c: int, b: int) -> tuple[float, float, float]:
    """Costs of one b × b tile for a weight with S positions: (explicit, factored, copies).

    explicit: multiply-adds of the per-sample gradients of both blocks, 2·B·C·S·|W|, then their
    contraction kf·B²·|W| (kf cotangent pairs); factored: B²·S²·(F_in + kf·F_out + kf)
    multiply-adds; copies: elements the structured path materialises to form the explicit
    gradients (the inputs seen at each position and the rearranged output signals,
    2·B·S·(F_in + C·F_out)); autodiff forms the same gradients inside the backward pass without
    them."""
    f_in, f_out = factor_sizes(module)
    if isinstance(module, nn.Embedding):
        build, dense = c * s * f_out, module.num_embeddings * f_out
    else:
        dense = module.weight.numel()
        build = c * s * dense
    explicit = 2 * b * build + kf * b * b * dense
    factors = b * b * s * s * (f_in + kf * f_out + kf)
    copies = 2 * b * s * (f_in + c * f_out)
    return float(explicit), float(factors), float(copies)


def cost_terms(plan_: Plan, kind: str | Kind, c: int, tile_size: int) -> tuple[float, float, float]:
    """The `auto` method's cost model over the plan's covered weights, for one tile:
    (autodiff multiply-adds, structured multiply-adds, elements the structured path copies).

    Both methods share the forward and backward passes and the parameters the plan leaves to
    autodiff; on covered weights autodiff pays the explicit gradients and the structured path
    either the factored contraction or the explicit gradients plus the copies that form them."""
    kf = get(kind).pair_factor(c)
    autodiff_cost = structured_cost = copied = 0.0
    for layer, s in plan_.positions.items():
        explicit, factors, copies = _layer_costs(plan_.modules[layer], s, kf, c, tile_size)
        autodiff_cost += explicit
        if layer in plan_.factored:
            structured_cost += factors
        else:
            structured_cost += explicit
            copied += copies
    return autodiff_cost, structured_cost, copied


def prefers_autodiff(
    plan_: Plan, kind: str | Kind, c: int, tile_size: int, device: torch.device | None = None
) -> bool:
    """Whether `auto` should differentiate every parameter by autodiff (`jacobian`) rather than
    follow this structured plan: `cost_terms` with each copied element weighted by the device
    type's COPY_COST. Measured by `python benchmarks/hf_engine.py --sections auto [--device]`.
    """
    autodiff_cost, structured_cost, copied = cost_terms(plan_, kind, c, tile_size)
    weight = COPY_COST.get(torch.device(device or "cpu").type, COPY_COST["cpu"])
    return autodiff_cost < structured_cost + weight * copied


# --------------------------------------------------------------------------------------------
# Features
# --------------------------------------------------------------------------------------------


def features(view: ModelView, plan_: Plan, x, cot: torch.Tensor, name: str | None = None) -> list:
    """Explicit and factored Jacobian terms of every trainable parameter for a block `x`, seen
    through the cotangents `cot` ([C, O] shared by the samples, or [C, B, O] per sample).
    name: check the block's forward pass as the argument `name` (a failing model raises
    `ModelInputError` naming it; one finite output row per sample, `check_output_rows`).
    A module of the plan that the pass runs more than once or on fewer than the block's samples
    (micro-batches in a block larger than the plan's `largest` or than its pass could hold, see
    `_settle`) is refused naming it."""
    b = inputs.count(x)
    terms: list = []
    if not plan_.empty:
        with torch.enable_grad(), _reading(view, plan_, x, name) as read:
            out, layer_inputs, perturbations, chunked = read
            if chunked:
                layer, rows = next(iter(chunked.items()))
                smaller = f"batches of at most {rows} samples (batch_size), or " if rows < b else ""
                raise RuntimeError(
                    f"the structured eNTK reads module {layer!r} once per forward pass with all "
                    f"{b} samples, but it ran again or on {rows} of them (micro-batches?): use "
                    f"{smaller}method='jacobian' where the function takes one"
                )
            if name is not None:
                check_output_rows(out, b, name)
            b, o = out.shape
            if o != cot.shape[-1]:  # the cotangents were made for the first batch's outputs
                raise ValueError(
                    f"the model returned {o} outputs per sample on {name or 'these inputs'}, "
                    f"earlier batches had {cot.shape[-1]}"
                )
            grad_out = (cot[:, None, :] if cot.dim() == 2 else cot).expand(cot.shape[0], b, o)
            grad_out = grad_out.contiguous()
            layers = list(perturbations)
            targets = [perturbations[n] for n in layers]
            if not out.requires_grad:  # no factored layer reaches the outputs (a torch.no_grad())
                signals = [None] * len(targets)
            elif grad_out.shape[0] == 1:  # one cotangent: a plain backward pass, no vmap over it
                signals = torch.autograd.grad(out, targets, grad_out[0], allow_unused=True)
                signals = [None if s is None else s.unsqueeze(0) for s in signals]
            else:
                signals = _batched_signals(out, targets, grad_out)
                out = out.detach()  # frees the graph, retained for its per-cotangent passes
        for layer, d in zip(layers, signals):
            if d is None:
                d = torch.zeros(
                    (cot.shape[0], *perturbations[layer].shape), dtype=out.dtype, device=out.device
                )
            terms += _module_terms(layer, plan_, layer_inputs[layer], d)
    elif name is not None:
        with torch.no_grad():
            check_output_rows(_checked(view, x, name), b, name)
    if plan_.fallback:
        jac = jacobian_features(view, x, cot, plan_.fallback)
        terms += [Explicit(view.owner[n], g) for n, g in jac.items()]
    return terms


@contextlib.contextmanager
def _reading(view: ModelView, plan_: Plan, x, name: str | None, record: bool = True):
    """One forward pass on the block `x` through the plan's modules: yields (outputs, each
    module's inputs as its terms read them, the zero perturbation added to each module's output,
    and {module: rows of its call} for modules run again or on fewer than the block's samples).
    record=False: only find those modules. Until the block's backward passes are done (the
    context's end), a module run again is given its perturbation again: activation
    checkpointing (torch.utils.checkpoint) recomputes its segment in the backward pass, and the
    recomputed tensors must be those the forward pass saved."""
    layer_inputs: dict[str, torch.Tensor | None] = {}
    perturbations: dict[str, torch.Tensor] = {}
    chunked: dict[str, int] = {}
    b = inputs.count(x)
    replaying = False  # after the forward pass: calls are recomputations

    def hook(layer):
        def read(module, args, out):
            x_in = args[0].detach()
            if replaying:
                if layer not in perturbations:
                    return None
                if layer in plan_.shared:
                    out = _expand_shared(out, x_in, b)[0]
                return out + perturbations[layer]
            if layer in chunked:
                return None
            if layer in layer_inputs or (layer not in plan_.shared and x_in.shape[0] != b):
                chunked[layer] = x_in.shape[0]
                return None
            if not record:
                layer_inputs[layer] = None  # seen: a second call is found
                return None
            if layer in plan_.shared:
                out, x_in = _expand_shared(out, x_in, b)
            if isinstance(module, nn.Embedding):
                layer_inputs[layer] = x_in.reshape(x_in.shape[0], -1)
            elif isinstance(module, _NORMS):
                layer_inputs[layer] = _normalised(module, x_in)
            else:
                layer_inputs[layer] = _linear_factors(module, x_in, plan_.bias_input(layer))
            # a zero perturbation whose gradient is ∂f/∂out: one scalar leaf broadcast to the
            # output's shape (no zero-filled copy of the activation)
            zero = torch.zeros((), dtype=out.dtype, device=out.device, requires_grad=True)
            eps = zero.expand(out.shape)
            perturbations[layer] = eps
            return out + eps

        return read

    # before the model's own forward hooks, which may change the output (autograd follows)
    with contextlib.ExitStack() as hooks:
        for n, m in plan_.modules.items():
            hooks.enter_context(m.register_forward_hook(hook(n), prepend=True))
        out = _checked(view, x, name)
        replaying = True
        with _own_parameters_frozen(view.model) if plan_.recomputes else contextlib.nullcontext():
            yield out, layer_inputs, perturbations, chunked


@contextlib.contextmanager
def _own_parameters_frozen(model: nn.Module):
    """The model's own parameters marked as needing no gradient, as the view's detached copies
    that the forward pass used: a segment that activation checkpointing recomputes in the
    backward pass runs on the model's own parameters (the functional call has returned), and
    must save the tensors that the forward pass saved. Restored on exit."""
    own = [p for p in model.parameters() if p.requires_grad]
    try:
        for p in own:
            p.requires_grad_(False)
        yield
    finally:
        for p in own:
            p.requires_grad_(True)


def _settle(view: ModelView, plan_: Plan, x, largest: int, name: str | None) -> None:
    """Leave to autodiff (`Plan.leave_to_autodiff`) the modules that a forward pass on up to
    `largest` samples (x's, repeated; checked as the argument `name`) runs again or on fewer
    rows (micro-batches), before any block is computed, so that blocks of up to that many samples
    never change the plan. The pass holds about _SETTLE_BYTES of module outputs at most, and takes
    min(largest, _CHUNKS) samples at least; `features` refuses chunks in larger blocks."""
    if plan_.empty or largest < 2:  # a block of one sample cannot be split
        return
    itemsize = next(iter(view.params.values())).element_size()
    rows = max(_CHUNKS, _SETTLE_BYTES // max(1, plan_.activations * itemsize))
    index = torch.arange(min(largest, rows)) % inputs.count(x)
    with torch.no_grad(), _reading(view, plan_, inputs.take(x, index), name, False) as read:
        plan_.leave_to_autodiff(read[3])


def _batched_signals(out: torch.Tensor, targets: list, grad_out: torch.Tensor) -> list:
    """∂(cotangent · out)/∂target for each of the C cotangents grad_out [C, B, O]: one backward
    pass vmapped over them, or one pass per cotangent where the vmap fails inside a backward
    formula (GroupNorm on a channels_last tensor: "NYI: querying is_contiguous inside of vmap")."""
    try:
        with quiet_batching_notes():
            return torch.autograd.grad(
                out,
                targets,
                grad_outputs=grad_out,
                is_grads_batched=True,
                allow_unused=True,
                retain_graph=True,
            )
    except RuntimeError as exc:
        if "vmap" not in str(exc):
            raise
    passes = [
        torch.autograd.grad(out, targets, g, allow_unused=True, retain_graph=True) for g in grad_out
    ]
    return [None if parts[0] is None else torch.stack(parts) for parts in zip(*passes, strict=True)]


def _checked(view: ModelView, x, name: str | None) -> torch.Tensor:
    """The view's outputs on `x`, checked as the argument `name` unless it is None."""
    forward = functools.partial(view.forward, view.params, x)
    return forward() if name is None else naming_failures(view.model, x, name, forward)


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
    # with the bias covered, `a` ends with the feature 1 (`Plan.bias_input`)
    if layer in plan_.factored:
        return [Factored(layer, a, d)]
    return [Explicit(layer, weight_gradient(a, d))]
