"""A read-only functional view of an `nn.Module`: its trainable parameters grouped by the module
that owns them, and a forward pass `f(params, x) -> [B, O]` that never touches the module's
state."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import ExitStack, contextmanager, nullcontext
from typing import TypeVar

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrize

from . import inputs
from .seeding import seeded

_DROPOUT = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
_BATCHNORM = nn.modules.batchnorm._BatchNorm
T = TypeVar("T")


class ModelInputError(ValueError):
    """The model failed on the inputs it was given (wrong shape, dtype, ids out of range...)."""


class ModelForwardError(RuntimeError):
    """The model's forward pass failed after a layer with trainable parameters had taken the
    inputs: a fault inside the model (inner layers of mismatched sizes, any exception of its own
    code), not proof that the inputs are wrong. `module`: the name of the module that failed,
    with its type."""

    def __init__(self, message: str, module: str = ""):
        super().__init__(message)
        self.module = module


def check_module(model, name: str = "model") -> None:
    """Refuse anything but an nn.Module (a function, a class, a state dict) naming `name`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(model).__name__}")


def resolve_device(device) -> torch.device:
    """`torch.device(device)`, refused with a ValueError unless a tensor can be made there and
    hold values (not the meta device)."""
    try:
        resolved = torch.device(device)
        torch.empty(0, device=resolved)
    except (RuntimeError, AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"device={device!r} is not usable: {_first_line(e)}") from None
    if resolved.type == "meta":  # it failed deep inside ("Tensor.item() cannot be called on meta")
        raise ValueError(f"device={device!r} is not usable: meta tensors hold no values")
    return resolved


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def describe_inputs(x) -> str:
    """Per-sample shape and dtype of model inputs, for error messages."""
    if isinstance(x, torch.Tensor):
        return f"per-sample shape {tuple(x.shape[1:])} and dtype {x.dtype}"
    items = x.items() if isinstance(x, dict) else enumerate(x)
    parts = [
        f"{k}: {tuple(v.shape[1:])} {v.dtype}" if isinstance(v, torch.Tensor) else f"{k}: {v!r}"
        for k, v in items
    ]
    return "per-sample shapes and dtypes {" + ", ".join(parts) + "}"


def naming_failures(model: nn.Module, x, name: str, forward: Callable[[], T]) -> T:
    """`forward()`, a forward pass of `model` on `x` (the argument `name`), where a failure of the
    model names the argument, the per-sample shape and dtype it got, the parameters' dtype and
    the model's first error line. A failure (any exception) before any module owning trainable
    parameters has finished its forward pass is a `ModelInputError` (the inputs do not fit the
    model); one after is a `ModelForwardError` naming the module that failed (the model's first
    layer took the inputs, the fault lies further in). Embedding ids outside a table are named
    before the model indexes with them (on a GPU, indexing with them is a fatal device error).

    Only the embeddings carry hooks on the pass that succeeds; a pass that fails runs `forward`
    a second time with hooks on every module to find where. The callers' passes (eval mode, or
    functional with the buffers cloned) change no state, so the second run sees the model as the
    first did; a failure it does not repeat is raised as it was."""
    with _hooked(model, name, None):
        try:
            return forward()
        except ModelInputError:
            raise
        except Exception as e:
            failure = e
    trace = _Trace()
    with _hooked(model, name, trace):
        try:
            forward()
        except ModelInputError:
            raise
        except Exception as e:
            dtypes = sorted({str(p.dtype) for p in model.parameters()})
            where = f"inputs of {describe_inputs(x)} (its parameters are "
            where += f"{', '.join(dtypes) or 'none'})"
            if trace.finished and trace.entered:
                label, module = trace.entered[-1]
                module = f"'{label}' ({type(module).__name__})"
                raise ModelForwardError(
                    f"{name}: the model's forward pass failed in module {module} on {where}: "
                    f"{_first_line(e)}",
                    module,
                ) from e
            raise ModelInputError(
                f"{name}: the model failed on {where}: {_first_line(e)}{_dtype_hint(model, x)}"
            ) from e

    raise failure


def _dtype_hint(model: nn.Module, x) -> str:
    """How to fix floating inputs of another dtype than the model's floating parameters (a
    float64 tensor to a float32 model: tensors keep their dtype, numpy arrays are cast)."""
    params = {p.dtype for p in model.parameters() if p.is_floating_point()}
    try:
        given = {t.dtype for t in inputs._leaves(x) if torch.is_tensor(t) and t.is_floating_point()}
    except TypeError:
        return ""
    if len(params) != 1 or not given or given <= params:
        return ""
    (want,) = params
    return (
        f"; cast the inputs to {want} (x.to({want}); numpy arrays are cast to it for you), or "
        f"compute in {max(given, key=lambda d: d.itemsize)} (dtype= where the function has it, or "
        "a copy of the model in that dtype)"
    )


class _Trace:
    """The modules whose forward pass is running (innermost last), and whether one owning
    trainable parameters has finished its own."""

    def __init__(self):
        self.entered: list[tuple[str, nn.Module]] = []
        self.finished = False

    def enter(self, label: str):
        def hook(module, _):
            self.entered.append((label, module))

        return hook

    def leave(self, owns: bool):
        def hook(*_):
            self.entered.pop()
            self.finished = self.finished or owns

        return hook


@contextmanager
def _hooked(model: nn.Module, name: str, trace: _Trace | None):
    """Hooks that refuse embedding ids outside the table (naming `name`) and, with a `trace`,
    record it on every module."""

    def check_ids(label: str, module: nn.Embedding):
        def hook(_, args):
            ids = args[0] if args else None
            if not isinstance(ids, torch.Tensor) or ids.numel() == 0 or ids.is_floating_point():
                return
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= module.num_embeddings:
                raise ModelInputError(
                    f"{name}: the ids reaching embedding '{label}' range from {low} to {high}, "
                    f"but it has {module.num_embeddings} rows (ids 0–{module.num_embeddings - 1})"
                )

        return hook

    with ExitStack() as hooks:  # a RemovableHandle removes its hook on exit
        for label, m in model.named_modules():
            label = label or type(m).__name__
            if trace is not None:
                owns = any(p.requires_grad for p in m.parameters(recurse=False))
                hooks.enter_context(m.register_forward_pre_hook(trace.enter(label)))
                hooks.enter_context(m.register_forward_hook(trace.leave(owns)))
            if isinstance(m, nn.Embedding):
                hooks.enter_context(m.register_forward_pre_hook(check_ids(label, m)))
        yield


def check_output_rows(y: torch.Tensor, n: int, name: str) -> None:
    """The model's outputs `y` [B, O] on n samples of `name`: one finite row per sample."""
    if y.shape[0] != n:
        raise ValueError(
            f"the model returned {y.shape[0]} output rows for the {n} samples of {name} (the first "
            "axis of every input indexes samples)"
        )
    if not bool(torch.isfinite(y).all()):
        raise ValueError(f"the model produced non-finite outputs (NaN or inf) on {name}")


def check_eval_mode(model: nn.Module) -> None:
    """Refuse models whose output depends on the batch or is random."""
    for name, module in model.named_modules():
        label = name or type(module).__name__
        if isinstance(module, _DROPOUT) and module.training and module.p > 0:
            raise ValueError(
                f"module '{label}' is an active Dropout: the output is random. Call model.eval() "
                "before computing a kernel."
            )
        if isinstance(module, _BATCHNORM) and (module.training or not module.track_running_stats):
            fix = (
                "Call model.eval() before computing a kernel."
                if module.track_running_stats
                else "It has track_running_stats=False, so it does even in eval mode: replace it "
                "(e.g. by a LayerNorm or GroupNorm, which normalise each sample on its own)."
            )
            raise ValueError(
                f"module '{label}' is a BatchNorm that uses batch statistics, so each sample's "
                f"output depends on the rest of the batch. {fix}"
            )
        if isinstance(module, nn.MultiheadAttention) and module.training and module.dropout > 0:
            raise ValueError(
                f"module '{label}' applies attention dropout in training mode: the output is "
                "random. Call model.eval() before computing a kernel."
            )


def check_functional(model: nn.Module) -> None:
    """Refuse models that cannot be called with other parameters without being modified:
    TorchScript modules (no functional calls, no hooks); nn.DataParallel, which torch.func's
    functional calls refuse (its `module` is the same function); and embeddings with max_norm,
    whose forward pass renormalises the rows it looks up in place, which would write to the
    model's weights (the view's parameters share their storage), and autograd does not
    differentiate through the renormalisation."""
    for name, module in model.named_modules():
        label = name or type(module).__name__
        if isinstance(module, torch.jit.ScriptModule):
            raise TypeError(
                f"module '{label}' is a TorchScript module (torch.jit.script or trace), which "
                "cannot be called with other parameters (torch.func) nor observed by hooks; "
                "use the nn.Module it was compiled from"
            )
        if isinstance(module, nn.DataParallel):
            raise TypeError(
                f"module '{label}' is an nn.DataParallel wrapper, which cannot be called with "
                "other parameters (torch.func); use the module it wraps, "
                f"`{'.'.join(['model', name] if name else ['model'])}.module`, in its place"
            )
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            raise ValueError(
                f"module '{label}' is an {type(module).__name__} with "
                f"max_norm={module.max_norm}: its forward pass renormalises the rows it looks up "
                "in place, which would modify the model. Renormalise its weight once "
                "(torch.embedding_renorm_ under torch.no_grad(), over all rows) and set "
                "max_norm=None before computing a kernel."
            )


def check_output_fn(output_fn) -> None:
    """`output_fn` must be None or a callable (a string such as "logits" failed inside the model's
    forward pass, blamed on the inputs)."""
    if output_fn is not None and not callable(output_fn):
        raise TypeError(
            "output_fn must be a function mapping the model output to a [B, O] tensor (e.g. "
            f"lambda out: out.logits), got {output_fn!r}"
        )


def output_tensor(out, output_fn: Callable | None = None) -> torch.Tensor:
    """The model output `out` through `output_fn`, refused with a TypeError unless a tensor."""
    if output_fn is not None:
        out = output_fn(out)
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"output_fn returned a {type(out).__name__}, not a [B, O] tensor"
            if output_fn is not None
            else f"the model output is a {type(out).__name__}, not a tensor: pass output_fn "
            "to map it to a [B, O] tensor"
        )
    return out


def copy_module(module: nn.Module) -> nn.Module:
    """copy.deepcopy(module), also of a module whose hooks keep a tensor computed from its
    parameters as a plain attribute (torch.nn.utils.prune's `weight`, the deprecated
    torch.nn.utils.weight_norm and spectral_norm): deepcopy refuses such non-leaf tensors. The
    copy gets a detached clone, which its hook recomputes on its next forward pass."""
    memo = {
        id(t): t.detach().clone()
        for m in module.modules()
        for t in vars(m).values()
        if isinstance(t, torch.Tensor) and not t.is_leaf
    }
    return copy.deepcopy(module, memo)


def from_factory(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """A private copy of the module `factory()` builds under `seed` (the global random state is
    restored afterwards): a factory may hand out a module the caller holds (`lambda: model`),
    which training or calibrating would otherwise modify. A factory that fails or returns no
    nn.Module is refused naming it."""
    with seeded(seed):
        try:
            net = factory()
        except Exception as exc:
            # the caller's factory is bad input, as a module that fails on x is
            raise ValueError(f"the factory raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(net, nn.Module):
        raise TypeError(f"the factory returned a {type(net).__name__}, not an nn.Module")
    return copy_module(net)


def tensor_aliases(model: nn.Module) -> dict[str, list[str]]:
    """{name: other names} of every parameter or buffer reachable under several names through
    distinct (module, attribute) slots: the tied weights of two modules (dec.weight =
    enc.weight). Names as `named_parameters()` / `named_buffers()` give them (the first one). A
    module registered under two names (self.b = self.a) reaches one slot twice: not an alias."""
    modules = dict(model.named_modules(remove_duplicate=False))
    slots: dict[int, dict[tuple[int, str], str]] = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:
        prefix, _, attribute = name.rpartition(".")
        slot = (id(modules[prefix]), attribute)
        slots.setdefault(id(tensor), {}).setdefault(slot, name)
    groups = [list(names.values()) for names in slots.values()]
    return {names[0]: names[1:] for names in groups if len(names) > 1}


# Embedding options that change autograd's gradient of the weight, not the function:
# scale_grad_by_freq divides it by each id's count in the batch (a training heuristic, not ∂f/∂θ,
# which forward mode gives); sparse returns it as a sparse tensor, which torch.func cannot batch.
_GRADIENT_OPTIONS = ("scale_grad_by_freq", "sparse")
# A module's backward hooks (register_full_backward_hook, register_backward_hook,
# register_full_backward_pre_hook) act on autograd's gradients, not on the function; torch.func's
# transforms refuse the autograd.Function that runs them, and one that rescales a gradient would
# make the autograd methods differentiate another f.
_BACKWARD_HOOKS = ("_backward_hooks", "_backward_pre_hooks")


class FunctionalCall:
    """`model(*args, **kwargs)` with given tensors ({name: tensor}, first names as
    `named_parameters()` / `named_buffers()` give them) in place of its parameters and buffers,
    leaving the model exactly as it was. What the call needs from the module tree (tied names,
    recurrent modules) is found once, here, not on every forward pass.

    torch.func.functional_call's own tying (tie_weights=True) swaps each name of a tied tensor in
    and, afterwards, back in turn; a module registered under two names gives two names for one
    attribute, so the second records the first's replacement as its original and the model keeps
    a detached copy instead of its Parameter. Here every (module, attribute) slot is set once.
    The oneDNN (mkldnn) CPU kernels of LSTM/GRU/RNN have a backward that vmap cannot batch
    (per-sample Jacobians fail inside it): models with recurrent modules run without them.
    derivative=True: embeddings run without the options that change autograd's gradient and
    not the function (`_GRADIENT_OPTIONS`), and modules without their backward hooks
    (`_BACKWARD_HOOKS`, also those registered for every module), during the call, so that every
    method differentiates the same f."""

    def __init__(self, model: nn.Module, derivative: bool = False):
        self.model, self.derivative = model, derivative
        self.aliases = tensor_aliases(model)
        self.recurrent = any(isinstance(m, nn.RNNBase) for m in model.modules())
        # torch < 2.6 has no set_stance: compiled modules run as compiled there
        eager = hasattr(torch.compiler, "set_stance")
        self.compiled = eager and any(_compiled(m) for m in model.modules())
        self.gradient_options = [
            (m, option, False)
            for m in model.modules()
            if derivative and isinstance(m, (nn.Embedding, nn.EmbeddingBag))
            for option in _GRADIENT_OPTIONS
            if getattr(m, option)
        ] + [
            (m, hooks, {})
            for m in model.modules()
            if derivative
            for hooks in _BACKWARD_HOOKS
            if getattr(m, hooks)
        ]

    def __call__(self, tensors: dict[str, torch.Tensor], args, kwargs):
        full = dict(tensors)
        for name, others in self.aliases.items():
            if name in full:
                full.update(dict.fromkeys(others, full[name]))
        hooks = nn.modules.module  # those registered for every module (register_module_...)
        everywhere = [
            (hooks, f"_global{name}", {})
            for name in _BACKWARD_HOOKS
            if self.derivative and getattr(hooks, f"_global{name}")
        ]
        # parametrize.cached() hands out the tensors computed from the model's own parameters,
        # not from those swapped in (the kernel missed the parametrized weights, 50 % off)
        if parametrize._cache_enabled:
            everywhere.append((parametrize, "_cache_enabled", 0))
        with (
            _without_onednn() if self.recurrent else nullcontext(),
            _switched_off(self.gradient_options + everywhere),
            torch.compiler.set_stance("force_eager") if self.compiled else nullcontext(),
        ):
            return functional_call(self.model, full, args, kwargs, tie_weights=False)


def uncompiled(module: nn.Module) -> nn.Module:
    """The module a torch.compile(module) wrapper holds (the same function), else `module`."""
    if type(module).__name__ == "OptimizedModule" and isinstance(
        getattr(module, "_orig_mod", None), nn.Module
    ):
        return module._orig_mod
    return module


def _compiled(module: nn.Module) -> bool:
    """Whether `module` runs through torch.compile: a wrapper of torch.compile(module), or a
    module compiled in place (module.compile()). Dynamo traced the functional calls, the
    transforms and the hooks set here (after method='jacobian', ntk_vp and structured failed in
    their hooks: "'int' object is not subscriptable"): the call runs it eagerly
    (torch.compiler.set_stance("force_eager")), the same function."""
    wrapper = uncompiled(module) is not module
    return wrapper or getattr(module, "_compiled_call_impl", None) is not None


@contextmanager
def _without_onednn():
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = previous


@contextmanager
def _switched_off(options: list[tuple[nn.Module, str, object]]):
    """The (module, attribute, off) options set to `off`, and back to what they were afterwards
    (autograd records them when the forward pass runs)."""
    previous = [getattr(m, option) for m, option, _ in options]
    for m, option, off in options:
        setattr(m, option, off)
    try:
        yield
    finally:
        for (m, option, _), value in zip(options, previous):
            setattr(m, option, value)


def parametrized_module(name: str, module: nn.Module) -> str:
    """The layer that the parameters module `name` owns count for: itself, unless it is the
    `parametrizations.<tensor>` list that `torch.nn.utils.parametrize` registers under the
    module it parametrizes ("fc.parametrizations.weight" → "fc"; "" for the root)."""
    if isinstance(module, parametrize.ParametrizationList):
        return name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""
    return name


class ModelView:
    """Trainable parameters (grouped into layers) and a pure forward function of a module.

    A *layer* is a module that directly owns trainable parameters; layers are keyed by their
    `named_modules()` name ("" for the root) and listed in `named_modules()` order. A parameter
    registered under several modules (tied weights) belongs to the first of them. The
    parameters of a parametrization (`torch.nn.utils.parametrize`, e.g. weight_norm's
    `fc.parametrizations.weight.original0`) belong to the module it parametrizes (`fc`).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        output_fn: Callable | None = None,
        device=None,
        dtype: torch.dtype | None = None,
    ):
        check_module(model)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(
                f"dtype must be a floating torch.dtype (torch.float64...), got {dtype!r}"
            )
        if torch.is_inference_mode_enabled():  # it failed deep in autograd ("does not require
            raise RuntimeError(  # grad and does not have a grad_fn")
                "torch.inference_mode() is on: kernels, features and attributions differentiate "
                "the model, which inference mode forbids; call this outside it (torch.no_grad() "
                "is fine)"
            )
        check_functional(model)
        check_output_fn(output_fn)
        self.model = model
        self.output_fn = output_fn
        first = next(iter(model.parameters()), None)
        self.device = (
            resolve_device(device)
            if device is not None
            else (first.device if first is not None else torch.device("cpu"))
        )
        self.dtype = dtype

        def convert(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if dtype is not None and t.is_floating_point():
                return t.to(device=self.device, dtype=dtype)
            return t.to(device=self.device)

        self.params: dict[str, torch.Tensor] = {}  # trainable, detached copies
        self.constants: dict[str, torch.Tensor] = {}  # frozen parameters
        self.layers: dict[str, list[str]] = {}  # layer name -> its parameter names
        self.owner: dict[str, str] = {}  # parameter name -> layer name
        seen: set[int] = set()
        for mod_name, module in model.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                if p.requires_grad:
                    layer = parametrized_module(mod_name, module)
                    self.params[full] = convert(p)
                    self.layers.setdefault(layer, []).append(full)
                    self.owner[full] = layer
                else:
                    self.constants[full] = convert(p)
        if not self.params:
            raise ValueError(
                "the model has no trainable parameters (requires_grad=True); "
                "the eNTK is defined over trainable parameters only"
            )
        # Each forward pass gets its own copies (`tensors`): none reaches the model's own state.
        self.buffers = {n: convert(b) for n, b in model.named_buffers()}
        self.shared = self._registered_more_than_once(model)
        self.call = FunctionalCall(model, derivative=True)

    @staticmethod
    def _registered_more_than_once(model: nn.Module) -> set[str]:
        """Names (as kept in `params`) of parameters registered under more than one module."""
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        return {group[0] for group in names.values() if len(group) > 1}

    def select(self, layers) -> list[str] | None:
        """Validate a `layers` argument: None (the total), "all", or a list of layer names."""
        if layers is None:
            return None
        if isinstance(layers, str):
            if layers != "all":
                raise ValueError(
                    f"layers must be None, 'all' or a list of module names, got {layers!r}"
                )
            return list(self.layers)
        names = list(layers)
        if not names:
            raise ValueError("layers is an empty list; pass None for the total")
        unknown = [n for n in names if n not in self.layers]
        if unknown:
            raise ValueError(
                f"{self._not_layers(unknown)}; layers owning trainable parameters "
                f"are {list(self.layers)}"
            )
        return names

    def _not_layers(self, names: list[str]) -> str:
        """Why each of `names` is not a layer: not a module, a module whose trainable parameters
        are all registered first under another (tied weights: counted there) or one without
        trainable parameters of its own."""
        modules = dict(self.model.named_modules(remove_duplicate=False))
        first = {id(p): self.owner[n] for n, p in self.model.named_parameters() if n in self.owner}
        reasons = []
        for name in names:
            if name not in modules:
                reasons.append(f"unknown layer name {name!r}")
                continue
            owners = {
                first[id(p)]
                for p in modules[name].parameters(recurse=False)
                if p.requires_grad and id(p) in first
            }
            if isinstance(modules[name], parametrize.ParametrizationList):
                reasons.append(
                    f"{name!r} is a parametrization of {parametrized_module(name, modules[name])!r}"
                    ", whose layer counts its parameters"
                )
                continue
            reasons.append(
                f"{name!r} shares its trainable parameters with {sorted(owners)} (tied weights: "
                "their kernel is counted there)"
                if owners
                else f"{name!r} owns no trainable parameters"
            )
        return "; ".join(reasons)

    def selection(self, layers, per_layer: bool | None = None):
        """(the parameter names that `layers` keeps, None for all; the layers the kernel splits
        into, None for a total). per_layer=None splits whenever `layers` is given."""
        chosen = self.select(layers)
        only = None if chosen is None else [n for layer in chosen for n in self.layers[layer]]
        split = layers is not None if per_layer is None else per_layer
        if not split:
            return only, None
        return only, list(self.layers) if chosen is None else chosen

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def layer_size(self, layer: str) -> int:
        return sum(self.params[n].numel() for n in self.layers[layer])

    def tensors(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The frozen parameters, fresh copies of the buffers and `params`, for one forward pass.
        A pass that writes to a buffer in place (a call counter; spectral_norm's power iteration
        in training mode) then reaches neither the model nor the next pass, which sees the same
        function, and torch.func's transforms accept the write (they refuse to mutate a tensor
        captured from outside)."""
        return {**self.constants, **{n: b.clone() for n, b in self.buffers.items()}, **params}

    def forward(self, params: dict[str, torch.Tensor], x: inputs.Inputs) -> torch.Tensor:
        """Model outputs as a [B, O] tensor for a batch `x`, with `params` replacing the
        trainable parameters (frozen parameters and buffers stay constant)."""
        args, kwargs = inputs.as_call(x)
        out = self.call(self.tensors(params), args, kwargs)
        return self.to_matrix(out)

    def forward_checked(self, x: inputs.Inputs, name: str) -> torch.Tensor:
        """`forward` with the view's parameters, a failure of the model on `x` (the argument
        `name`) reported by `naming_failures`."""
        args, kwargs = inputs.as_call(x)
        tensors = self.tensors(self.params)
        out = naming_failures(self.model, x, name, lambda: self.call(tensors, args, kwargs))
        return self.to_matrix(out)

    def to_matrix(self, out) -> torch.Tensor:
        out = output_tensor(out, self.output_fn)
        if out.dim() == 1:
            return out.unsqueeze(1)
        if out.dim() != 2:
            raise ValueError(
                f"the model output has shape {tuple(out.shape)}; the kernel needs [B, O] or [B]. "
                "Pass output_fn to map it to [B, O] (e.g. lambda out: out[:, -1] for the last "
                "token)"
            )
        return out

    def forward_single(self, params: dict[str, torch.Tensor], x_single) -> torch.Tensor:
        """Outputs [O] for one sample without its sample axis (the per-sample function for vmap)."""
        return self.forward(params, inputs.unsqueeze(x_single))[0]
