"""Layer importance from layerwise eNTKs: which layers (or blocks) drive what a network computes.

The eNTK splits exactly over the modules that own trainable parameters, Θ = Σ_l Θ_l with
Θ_l = J_l J_lᵀ (J_l the Jacobian with respect to layer l's own parameters), so each layer, or
group of layers G with Θ_G = Σ_{l∈G} Θ_l, gets scores from its own kernel component:

- ``share``           tr(Θ_l) / tr(Θ), the layer's part of the kernel's trace (raw ``trace``
  alongside);
- ``alignment``       Pearson correlation of Θ_l's entries with the ±1 label-agreement matrix, the
                      layer's own Label-Gradient Alignment (Mok et al., CVPR 2022); needs labels;
- ``top_eigenvalue``  λ_max(Θ_l);
- ``sensitivity``     tr(Θ_l)·E‖θ_l' − θ_l‖²/(P_l·N), the eNTK's first-order estimate of the
                      mean squared output change per sample when the layer's P_l parameters θ_l
                      are redrawn as θ_l' = θ_l + Δ by their initialiser: with J_l the [N·O, P_l]
                      Jacobian of all N samples, E‖J_l Δ‖²/N = tr(J_lᵀJ_l E[ΔΔᵀ])/N, and
                      E[ΔΔᵀ] taken as isotropic, (E‖Δ‖²/P_l)·I, this is tr(Θ_l)·E‖Δ‖²/(P_l·N)
                      (three draws of the modules' `reset_parameters()`, zeros where a module has
                      none);

and cheap baselines to compare them with:

- ``param_norm``      ‖θ_l‖₂;
- ``grad_norm``       ‖∇_l L‖₂ of the mean loss L on (x, y); needs labels;
- ``fisher``          (1/N) Σ_i ‖∇_l ℓ_i‖², the trace of the layer's empirical Fisher; needs labels;
- ``block_influence`` 1 − cos(input, output) of a block, per sample (inputs and outputs flattened),
                      averaged (Men et al. 2024, "ShortGPT"; they average per token); defined for
                      grouped rows (``group`` given) whose module's output has its input's shape:
                      meant for residual blocks, it is also given to any other such row (a
                      LayerNorm, a square Linear), where it reads how much the module changes its
                      input, not what removing it would do.

The default score ``sensitivity`` is the one ``benchmarks/layer_importance.py`` and, across
four model families, ``benchmarks/layer_families.py`` show to predict best the loss increase
when a layer is re-initialised (see benchmarks/README.md): the plain trace
``share`` ignores how far the layer's weights sit from where a re-draw would put them, so it misses
embeddings (large weights, sparse gradients) and overrates LayerNorms (weights ≈ their init).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import ntk
import projections
from ntk.core import inputs
from ntk.core.checks import check_integer
from ntk.core.jacobian import jacobian_features
from ntk.core.kinds import cross_entropy, loss_labels
from ntk.core.model import ModelView, check_eval_mode, check_output_rows, copy_module
from ntk.core.seeding import seeded
from ntk.spectrum import as_matrix

NTK_SCORES = ("sensitivity", "share", "alignment", "top_eigenvalue")
BASELINES = ("param_norm", "grad_norm", "fisher", "block_influence")
SCORES = NTK_SCORES + BASELINES
LABEL_SCORES = ("alignment", "grad_norm", "fisher")  # scores that need labels y
# Chosen leave-one-family-out on 14 trained models in 4 families (MLPs, CNNs with BatchNorm,
# residual MLPs, transformers) against re-initialisation damage (mean of 20 redraws), by the best
# worst-family mean Spearman ρ: every fold picks it, held-out ρ 0.82 / 0.99 / 0.89 / 0.94 (mean
# 0.91; with a 10-redraw truth the transformer fold picked `share` and the mean was 0.84); worst
# model 0.60. No score predicts the prune-and-fine-tune truth (best held-out mean 0.13).
# Reproduce with `python benchmarks/layer_families.py` (tables in benchmarks/results/nas.md).
# On two families no choice reads (`--held-out`: 1-D CNNs, MLPs on generated tabular data; 8
# models) its family means are 0.88 / 0.70 (mean 0.79); no other score does better there.
DEFAULT_SCORE = "sensitivity"
DRAWS = 3
Group = None | str | int


# -- layers and groups --------------------------------------------------------------------------


def layer_label(name: str) -> str:
    """A layer's name as tables, plots and reports show it: the root module (name "", as
    `named_modules()` gives it, and as the rows keep it) reads "(root)"."""
    return name or "(root)"


def _group_key(layer: str, group: Group) -> str:
    parts = layer.split(".") if layer else []
    if group is None:
        return layer
    if group == "blocks":
        for i, part in enumerate(parts):
            if part.isdigit():
                return ".".join(parts[: i + 1])
        return layer
    return ".".join(parts[:group])


def check_group(group: Group) -> Group:
    if group is None or group == "blocks":
        return group
    if isinstance(group, int) and not isinstance(group, bool) and group >= 1:
        return group
    raise ValueError(
        f"group must be None (one row per layer), 'blocks' (up to the first numbered "
        f"name component, e.g. 'blocks.3') or a positive name depth, got {group!r}"
    )


def layer_groups(model: nn.Module, group: Group = None) -> dict[str, list[str]]:
    """{row name: [layer names]} in `named_modules()` order. Layers are the modules that directly
    own trainable parameters; `group="blocks"` merges them up to the first numbered component of
    their name ("blocks.3.attn.qkv" → "blocks.3"), an integer d up to the first d components."""
    check_group(group)
    groups: dict[str, list[str]] = {}
    for layer in ModelView(model).layers:
        groups.setdefault(_group_key(layer, group), []).append(layer)
    return groups


def redraw(model: nn.Module, layer: str, seed: int) -> dict[str, torch.Tensor]:
    """Fresh values {parameter name: tensor} for the trainable parameters that module `layer` owns,
    drawn by its initialiser (`reset_parameters()`) on a copy with seed `seed`; zeros where the
    module has no initialiser. A parametrized module (weight_norm, spectral_norm) is drawn as a
    plain one and its parametrizations' parameters are set from the fresh tensor by their right
    inverse, as assigning `module.weight = w` sets them (zeros where there is none). Nothing else
    (and not the model) changes."""
    twin = copy_module(model.get_submodule(layer))
    lists = dict(twin.parametrizations) if parametrize.is_parametrized(twin) else {}
    if lists:  # removing a parametrization edits the module's class, which a copy shares
        cls = type(twin)
        namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        twin.__class__ = type(cls.__name__, cls.__bases__, namespace)
    for tensor in lists:
        parametrize.remove_parametrizations(twin, tensor, leave_parametrized=True)
    init = getattr(twin, "reset_parameters", None) or getattr(twin, "_reset_parameters", None)
    with seeded(seed, twin), torch.no_grad():  # the twin's devices: the caller's streams stay
        if init is not None:
            init()
        else:
            for p in twin.parameters(recurse=False):
                p.zero_()
        for tensor, parametrization in lists.items():
            try:
                parametrization.right_inverse(getattr(twin, tensor))
            except (NotImplementedError, RuntimeError):  # no right inverse
                for p in parametrization.parameters(recurse=False):
                    p.zero_()
    prefix = f"{layer}." if layer else ""
    fresh = {
        prefix + name: p.detach()
        for name, p in twin.named_parameters(recurse=False)
        if name not in lists and p.requires_grad
    }
    for tensor, parametrization in lists.items():
        for name, p in parametrization.named_parameters(recurse=False):
            if p.requires_grad:
                fresh[f"{prefix}parametrizations.{tensor}.{name}"] = p.detach()
    return fresh


def _displacement(model: nn.Module, view: ModelView, layer: str) -> float:
    """E‖θ_l' − θ_l‖² / P_l over `DRAWS` redraws of the layer."""
    total = 0.0
    for seed in range(DRAWS):
        fresh = redraw(model, layer, seed)
        total += sum(
            float(((fresh[p].to(view.params[p]) - view.params[p]).double() ** 2).sum())
            for p in view.layers[layer]
        )
    return total / DRAWS / view.layer_size(layer)


# -- losses and gradients ---------------------------------------------------------------------


def sample_losses(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample loss: cross-entropy for integer class labels (binary for a single output, a
    binary classifier's logit, `ntk.core.kinds.cross_entropy`), squared error for real targets."""
    if not y.is_floating_point():
        return cross_entropy(outputs, y, reduction="none")
    return ((outputs - y.reshape(outputs.shape)) ** 2).sum(1)


def check_labels(y, n: int, name: str = "y") -> torch.Tensor:
    """Integer class labels [N] (as long, what cross_entropy indexes with) or real targets."""
    y = inputs.targets(y, name)
    y = y if y.is_floating_point() else y.long()
    if y.dim() == 0 or y.shape[0] != n:
        raise ValueError(f"{name} must have one entry per sample ({n}), got shape {tuple(y.shape)}")
    if not y.is_floating_point() and y.dim() != 1:
        raise ValueError(
            f"{name} holds integer class labels of shape {tuple(y.shape)}; class labels are one "
            f"per sample, shape ({n},) (real-valued targets are floats)"
        )
    inputs.check_finite_targets(y, name)
    return y


def _check_targets(view: ModelView, x, y: torch.Tensor) -> torch.Tensor:
    """Labels must index the model's outputs; real targets must have one value per output. One
    whole-number float per sample for a model of several outputs holds class labels (as
    everywhere in the toolkit): returned as integers."""
    with torch.no_grad():
        out = view.forward_checked(
            inputs.convert(inputs.take(x, slice(0, 1)), view.device, None), "x"
        )
    check_output_rows(out, 1, "x")
    outputs = out.shape[1]
    if y.is_floating_point() and y.dim() == 1 and outputs > 1 and bool((y == y.round()).all()):
        y = y.long()
    if not y.is_floating_point():
        loss_labels(y, outputs, "y")
    elif y[0].numel() != outputs:
        raise ValueError(
            f"y holds {y[0].numel()} real value(s) per sample; real-valued targets need "
            f"{outputs} (one per model output)"
        )
    elif outputs > 1 and bool(((y == 0) | (y == 1)).all() and (y.flatten(1).sum(1) == 1).all()):
        warnings.warn(
            "y is one-hot (floats, a single 1 per sample): read as real-valued targets, the "
            "label scores use the squared error; pass the class indices (y.argmax(1)) for "
            "class labels and cross-entropy",
            stacklevel=3,
        )
    return y


def _gradient_stats(
    view: ModelView, x, y: torch.Tensor, groups: dict[str, list[str]], chunk: int
) -> dict[str, tuple[float, float]]:
    """Per group: (‖mean-loss gradient‖, mean squared per-sample gradient norm). Sample b's loss
    gradient is J_bᵀ ∂ℓ_b/∂f_b, `jacobian_features` with that cotangent (which falls back to
    torch.autograd for a model torch.func cannot run)."""
    n = inputs.count(x)
    total = {name: torch.zeros_like(p) for name, p in view.params.items()}
    squares = {name: 0.0 for name in view.params}
    for start in range(0, n, chunk):
        rows = slice(start, start + chunk)
        block = inputs.take(x, rows)
        with torch.enable_grad():
            out = view.forward(view.params, block).detach().requires_grad_(True)
            (signal,) = torch.autograd.grad(sample_losses(out, y[rows]).sum(), out)
        g = jacobian_features(view, block, signal[None], list(view.params))  # [1, B, numel]
        for name, gi in g.items():
            total[name] += gi[0].sum(0).reshape(total[name].shape)
            squares[name] += float((gi.double() ** 2).sum())
    stats = {}
    for row, layers in groups.items():
        names = [p for layer in layers for p in view.layers[layer]]
        norm = sum(float(((total[p].double() / n) ** 2).sum()) for p in names) ** 0.5
        stats[row] = (norm, sum(squares[p] for p in names) / n)
    return stats


def _block_influence(
    model: nn.Module, x, groups: dict[str, list[str]], chunk: int
) -> dict[str, float | None]:
    """1 − cos(flattened input, flattened output) per sample, averaged, for every row module
    whose (first) input and output are tensors of the same shape; None for the others.
    Hooks go on a copy, thrown away after, so the user's model is untouched."""
    twin = copy_module(model)
    sums: dict[str, list[float]] = {row: [0.0, 0] for row in groups}
    for row in groups:

        def hook(module, args, output, row=row):
            if (
                args
                and isinstance(args[0], torch.Tensor)
                and isinstance(output, torch.Tensor)
                and args[0].shape == output.shape
                and output.is_floating_point()
            ):
                cos = F.cosine_similarity(
                    args[0].flatten(1).double(), output.flatten(1).double(), dim=1
                )
                sums[row][0] += float((1 - cos).sum())
                sums[row][1] += cos.numel()

        twin.get_submodule(row).register_forward_hook(hook)
    with torch.no_grad():
        for start in range(0, inputs.count(x), chunk):
            args, kwargs = inputs.as_call(inputs.take(x, slice(start, start + chunk)))
            twin(*args, **kwargs)
    return {row: (s / c if c else None) for row, (s, c) in sums.items()}


# -- the scores -----------------------------------------------------------------------------------


def _labels_kernel(k: torch.Tensor) -> torch.Tensor:
    """An [N, N] kernel for label alignment: the trace over outputs of `full`/`diagonal` kernels."""
    if k.dim() == 4:
        return k.diagonal(dim1=2, dim2=3).sum(-1)
    if k.dim() == 3:
        return k.sum(-1)
    return k


def layer_importance(
    model: nn.Module,
    x,
    y=None,
    *,
    score: str = DEFAULT_SCORE,
    kind: str = "trace",
    group: Group = None,
    projection_dim: int | None = None,
    batch_size: int | None = None,
    device=None,
    output_fn: Callable | None = None,
    progress: bool = False,
) -> list[dict]:
    """Score every layer (module owning trainable parameters) or group of layers of `model` on
    the samples `x` (labels `y` optional) and rank them, most important first.

    Returns one dict per row: ``layer``, ``type`` (module class), ``params`` (count), the scores
    ``sensitivity``, ``share``, ``trace``, ``alignment``, ``top_eigenvalue``, ``param_norm``,
    ``grad_norm``,
    ``fisher``, ``block_influence`` (None where undefined: label scores without `y`,
    ``alignment`` of a row whose kernel is zero (it does not reach the outputs), block influence
    without `group` or where a row's output has another shape than its input), and ``rank``
    (1 = highest `score`; None, and listed last, where `score` is undefined).
    `pandas.DataFrame(rows)` makes a table of it. The layerwise kernels are
    ``ntk.empirical_ntk(model, x, kind=kind, layers="all")`` (kind="lpntk": labels=y) summed
    within each group, or with
    `projection_dim` k their unbiased estimates ``projections.projected_ntk(..., dim=k)`` (per-layer
    random projections, for models too large for exact kernels). `group` is None, "blocks" or a
    name depth (see `layer_groups`). batch_size: the kernels' tile size (projections: samples
    featurised at a time) and the samples per gradient pass of the label scores (None: from the
    free memory, 256 for the gradients). The model is never modified.
    """
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r}; valid scores are {', '.join(SCORES)}")
    if score == "block_influence" and group is None:  # was found undefined after all the work
        raise ValueError(
            "score 'block_influence' compares each block's input and output: it needs "
            "group='blocks' (or a name depth)"
        )
    projection_dim = check_integer(projection_dim, "projection_dim", optional=True)
    x = inputs.from_numpy(x, "x", inputs.param_dtype(model))  # numpy arrays of floats
    n = inputs.validate(x, "x")
    if y is not None:
        y = check_labels(y, n)
    elif score in LABEL_SCORES:
        raise ValueError(f"score {score!r} needs labels y")
    groups = layer_groups(model, group)
    view = ModelView(model, output_fn=output_fn, device=device)
    if y is not None:
        check_eval_mode(model)  # before the label scores' per-sample forward passes
        y = _check_targets(view, x, y)
    if kind == "lpntk" and (y is None or y.is_floating_point()):
        raise ValueError("kind='lpntk' weights the kernel by class labels: pass them as y")
    common = dict(
        kind=kind,
        labels=y if kind == "lpntk" else None,  # the label-aware kernel's s(y)
        layers="all",
        batch_size=batch_size,
        device=device,
        output_fn=output_fn,
        progress=progress,
    )
    if projection_dim is None:
        parts = ntk.empirical_ntk(model, x, **common)
    else:
        parts = projections.projected_ntk(model, x, dim=projection_dim, **common)
    parts = {layer: k.cpu() for layer, k in parts.items()}  # the scores are computed on the CPU
    kernels = {row: sum(parts[layer] for layer in layers) for row, layers in groups.items()}
    traces = {row: float(as_matrix(k).diagonal().sum()) for row, k in kernels.items()}
    total = sum(traces.values())
    sensitivity = {
        row: sum(
            float(as_matrix(parts[layer]).diagonal().sum()) * _displacement(model, view, layer)
            for layer in layers
        )
        / n
        for row, layers in groups.items()
    }
    xd = inputs.convert(x, view.device, None)
    chunk = batch_size or 256
    grads = None
    if y is not None:
        grads = _gradient_stats(view, xd, y.to(view.device), groups, chunk)
    influence = (
        _block_influence(model, xd, groups, chunk) if group is not None else dict.fromkeys(groups)
    )
    modules = dict(model.named_modules())
    rows = []
    for row, layers in groups.items():
        names = [p for layer in layers for p in view.layers[layer]]
        k = kernels[row]
        rows.append(
            {
                "layer": row,
                "type": type(modules[row]).__name__,
                "params": sum(view.params[p].numel() for p in names),
                "sensitivity": sensitivity[row],
                "share": traces[row] / total if total > 0 else 0.0,
                "trace": traces[row],
                "alignment": None
                if y is None or not traces[row] > 0  # no kernel (the layer cannot move f)
                else ntk.kernel_alignment(_labels_kernel(k), y.cpu(), centering="mean"),
                "top_eigenvalue": float(ntk.eigenvalues(k)[0]),
                "param_norm": sum(float((view.params[p].double() ** 2).sum()) for p in names)
                ** 0.5,
                "grad_norm": None if grads is None else grads[row][0],
                "fisher": None if grads is None else grads[row][1],
                "block_influence": influence[row],
            }
        )
    if all(r[score] is None for r in rows):
        raise ValueError(
            f"score {score!r} is undefined for every row (block influence needs "
            "group='blocks' and blocks whose output has their input's shape)"
        )
    rows.sort(key=lambda r: (r[score] is None, -(r[score] or 0.0)))
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank if r[score] is not None else None
    return rows
