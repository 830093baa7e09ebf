"""The empirical neural tangent kernel Θ(x, x') = J(x) J(x')ᵀ of a PyTorch model, tiled."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from .core import inputs, kinds, ntk_vp, persample, structured
from .core.checks import check_integer
from .core.memory import KernelTooLargeError, available_bytes, block_size, human
from .core.model import ModelView, check_eval_mode, check_module, check_output_rows
from .core.tiles import Grid

METHODS = ("auto", "jacobian", "ntk_vp", "structured")
AUTO_BLOCK_LIMIT = 2048  # automatic tiles stop growing here: bigger ones only hold more memory
Kernel = torch.Tensor | dict


def empirical_ntk(
    model: nn.Module,
    x1,
    x2=None,
    *,
    kind: str | kinds.Kind = "full",
    labels=None,
    labels2=None,
    layers: None | str | Sequence[str] = None,
    per_layer: bool | None = None,
    method: str = "auto",
    batch_size: int | None = None,
    device=None,
    dtype: torch.dtype | None = None,
    output_fn: Callable | None = None,
    progress: bool = False,
    out=None,
) -> Kernel:
    """Empirical NTK of `model` between the samples of `x1` and `x2` (x2=None: x2 = x1).

    kind: `full` Θ [N1, N2, O, O]; `diagonal` Θ_oo [N1, N2, O]; `trace` Σ_o Θ_oo [N1, N2];
    `sum_logits` (1/O) Σ_oo' Θ_oo' [N1, N2]; `lpntk` s(y)ᵀ Θ s(y') [N1, N2] with s(y) = 2e_y − 1,
    which needs the class labels of x1 (`labels`, [N1]) and, when x2 is given, of x2 (`labels2`);
    or a `ntk.core.kinds.Kind` object (e.g. `Weighted()`, whose labels are cotangent vectors).
    layers: None (every layer), "all", or a list of module names (Θ = Σ_l J_l J_lᵀ over the
    modules that directly own trainable parameters) restricts the kernel to those layers.
    per_layer: True gives a dict {layer: component}, False the total over the chosen layers;
    None (the default) splits whenever `layers` is given. method: `jacobian`, `ntk_vp`,
    `structured` or `auto` (the same kernel to float rounding). batch_size: the tile size,
    samples per side of a tile; None picks it from the free memory and keeps the column blocks'
    features while they fit, an explicit size bounds the working memory by the tile (features
    are recomputed for each row of tiles). `out`: an optional preallocated tensor or numpy array
    (e.g. a memory-mapped `.npy`) that receives the total kernel tile by tile.
    The model is never modified.
    """
    fn = empirical_ntk_fn(
        model,
        kind=kind,
        layers=layers,
        per_layer=per_layer,
        method=method,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        output_fn=output_fn,
        progress=progress,
    )
    return fn(x1, x2, labels=labels, labels2=labels2, out=out)


def empirical_ntk_fn(
    model: nn.Module,
    *,
    kind: str | kinds.Kind = "full",
    layers: None | str | Sequence[str] = None,
    per_layer: bool | None = None,
    method: str = "auto",
    batch_size: int | None = None,
    device=None,
    dtype: torch.dtype | None = None,
    output_fn: Callable | None = None,
    progress: bool = False,
) -> Callable[..., Kernel]:
    """Build a kernel function `fn(x1, x2=None, *, labels=None, labels2=None, out=None)` with
    fixed settings (see `empirical_ntk`).

    The function reads the model's parameters when it is called, so it follows training.
    """
    computation = _Computation(
        model,
        kind=kind,
        layers=layers,
        per_layer=per_layer,
        method=method,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        output_fn=output_fn,
        progress=progress,
    )

    def kernel_fn(x1, x2=None, *, labels=None, labels2=None, out=None) -> Kernel:
        return computation.run(x1, x2, out, labels=labels, labels2=labels2)

    return kernel_fn


class _Computation:
    """The settings of a kernel, checked once; `run`/`grid` compute it for given samples."""

    def __init__(
        self,
        model,
        *,
        kind,
        layers,
        method,
        batch_size,
        device,
        dtype,
        output_fn,
        progress,
        per_layer=None,
    ):
        check_module(model)
        self.kind = kinds.get(kind)
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; valid methods are {', '.join(METHODS)}")
        batch_size = check_integer(batch_size, "batch_size", optional=True)
        if isinstance(layers, str) and layers != "all":
            raise ValueError(
                f"layers must be None, 'all' or a list of module names, got {layers!r}"
            )
        check_per_layer(per_layer)
        self.model, self.layers, self.per_layer, self.method = model, layers, per_layer, method
        # an explicit batch_size fixes the tile size and bounds memory by the tile (no cache)
        self.tile_size, self.device, self.dtype = batch_size, device, dtype
        self.output_fn, self.progress = output_fn, progress

    # -- the computation -------------------------------------------------------------------------
    def run(self, x1, x2, out, *, labels=None, labels2=None):
        grid = self.grid(x1, x2, out, labels=labels, labels2=labels2)
        results = grid.allocate(out)
        grid.fill(results, grid.compute(progress=self.progress), out)
        return grid.result(results)

    def grid(self, x1, x2, out=None, *, labels=None, labels2=None, in_memory: bool = True) -> Grid:
        """Validate, plan and size the tiles of K(x1, x2). in_memory=False: the caller streams
        the tiles elsewhere (to disk), so the kernel need not fit in memory."""
        check_eval_mode(self.model)
        kind = self.kind
        cast = self.dtype or inputs.param_dtype(self.model)  # numpy arrays of floats
        x1 = inputs.from_numpy(x1, "x1", cast)
        x2 = None if x2 is None else inputs.from_numpy(x2, "x2", cast)
        n1 = inputs.validate(x1, "x1")
        symmetric = x2 is None
        if not symmetric:
            n2 = inputs.validate(x2, "x2")
            inputs.check_structure(x1, x2)  # the model decides on shapes
        else:
            n2 = n1
            if labels2 is not None:
                raise ValueError("labels2= labels the samples of x2; x2 is None (pass labels=)")
        view = ModelView(self.model, output_fn=self.output_fn, device=self.device, dtype=self.dtype)
        only, selected = view.selection(self.layers, self.per_layer)
        if out is not None and selected is not None:
            raise ValueError("out= receives the total kernel only; use per_layer=False with out")
        x1 = inputs.convert(x1, view.device, self.dtype)
        x2 = x1 if symmetric else inputs.convert(x2, view.device, self.dtype)
        num_outputs = check_outputs(view, [x1] if symmetric else [x1, x2])
        param_dtype = next(iter(view.params.values())).dtype
        on = dict(dtype=param_dtype, device=view.device)
        y1 = kind.check_labels(labels, n1, num_outputs, "labels")
        cot1 = kind.cotangents(num_outputs, labels=y1, **on)
        if symmetric:
            cot2 = cot1
        else:
            y2 = kind.check_labels(labels2, n2, num_outputs, "labels2")
            cot2 = kind.cotangents(num_outputs, labels=y2, **on)
        c = cot1.shape[0]

        shape = kind.shape(n1, n2, num_outputs)
        n_components = 1 if selected is None else len(selected)
        itemsize = torch.empty((), dtype=param_dtype).element_size()
        out_bytes = itemsize * float(np.prod(shape)) * n_components
        avail = available_bytes(view.device)
        holds = in_memory and out is None
        if holds and out_bytes > 0.8 * avail:
            raise KernelTooLargeError(
                f"the {kind} kernel of shape {list(shape)}"
                f"{f' × {n_components} layers' if n_components > 1 else ''} needs "
                f"{human(out_bytes)} but only {human(avail)} is available. "
                + (
                    "Use "
                    if len(shape) == 2
                    else "Use a smaller kind ('trace' or 'sum_logits' are [N1, N2]), "
                )
                + "fewer samples or random projections (projections.projected_ntk, "
                "projections.featurize for an on-disk store, or the projection_dim of the "
                "function you called), or pass out= a memory-mapped array on disk "
                "(numpy.lib.format.open_memmap) to receive it tile by tile."
            )

        planned_tile = self.tile_size or min(max(n1, n2), 256)  # the cost model's tile size
        method = self.method
        # the largest tile, for auto's and structured's factors (the autodiff methods read none)
        largest = self.tile_size or min(max(n1, n2), AUTO_BLOCK_LIMIT)
        factors = method in ("auto", "structured")
        plan = structured.plan(view, x1, kind, c, planned_tile, largest if factors else 1, only)
        if method == "auto":
            # a model torch.func cannot vmap, or run at all (saved-tensor hooks: activation
            # checkpointing), is differentiated by autodiff one sample at a time: structured
            autodiff = not plan.covered or (
                persample.vmappable(view.model)
                and not plan.recomputes
                and structured.prefers_autodiff(plan, kind, c, planned_tile, view.device)
            )
            method = "jacobian" if autodiff else "structured"
        if method == "jacobian" or method == "ntk_vp":
            plan = structured.Plan.autodiff(plan)

        per_sample, per_pair = self._memory(view, plan, method, c, itemsize, n_components, shape)
        budget = max(0.4 * (avail - (out_bytes if holds else 0)), 64 << 20)
        tile_size = self.tile_size or min(
            AUTO_BLOCK_LIMIT, block_size(max(n1, n2), per_sample, per_pair, budget)
        )
        if method == "ntk_vp":
            groups = (
                {None: only or list(view.params)}
                if selected is None
                else {layer: view.layers[layer] for layer in selected}
            )

            def prepare(x, u):  # the tile needs the raw block and its cotangents
                return x, u

            def contract(a, b):
                return ntk_vp.tile(view, a[0], b[0], a[1], b[1], kind, groups)
        else:

            def prepare(x, u):
                return _by_component(structured.features(view, plan, x, u), selected)

            def contract(a, b):
                return _contract_terms(a, b, kind)

        return Grid(
            n1=n1,
            n2=n2,
            tile_size=tile_size,
            symmetric=symmetric,
            kind=kind,
            shape=shape,
            keys=[None] if selected is None else selected,
            dtype=param_dtype,
            device=view.device,
            row_features=lambda rs: prepare(inputs.take(x1, rs), kinds.rows(cot1, rs)),
            col_features=lambda cs: prepare(inputs.take(x2, cs), kinds.rows(cot2, cs)),
            contract=contract,
            cache_ok=self.tile_size is None and n2 * per_sample <= budget / 2,
            desc=f"{kind} eNTK",
        )

    def _memory(self, view, plan, method, c, itemsize, n_components, shape):
        """Bytes per sample (features held for a block) and per pair of samples (tile work)."""
        act = plan.activations
        if method == "ntk_vp":  # C tangent forward passes of a block, no features
            per_sample = 3 * c * act
        else:
            per_sample = act * (1 + c) + c * sum(view.params[n].numel() for n in plan.fallback)
            for layer, names in plan.covered.items():
                if layer not in plan.factored:  # per-sample gradient rows [C, P_layer]
                    per_sample += c * sum(view.params[n].numel() for n in names)
        pair_out = float(np.prod(shape[2:])) if len(shape) > 2 else 1.0
        s_max = max([plan.positions[layer] for layer in plan.factored] or [0])
        per_pair = pair_out * (n_components + 1) + s_max * s_max * (1 + self.kind.pair_factor(c))
        return itemsize * per_sample * 2, itemsize * per_pair


def check_per_layer(per_layer) -> None:
    if per_layer is not None and not isinstance(per_layer, bool):
        raise TypeError(f"per_layer must be True, False or None, got {per_layer!r}")


def check_outputs(view: ModelView, xs: list, names: list | None = None) -> int:
    """Forward every sample once (no grad): finite [B, O] outputs that do not depend on the
    rest of the batch. Returns O. `names` name the inputs in errors (default x1, x2)."""
    num_outputs = None
    names = names or ["x1", "x2"]
    with torch.no_grad():
        for x, name in zip(xs, names):
            n = inputs.count(x)
            for start in range(0, n, 1024):
                y = view.forward_checked(inputs.take(x, slice(start, start + 1024)), name)
                check_output_rows(y, min(1024, n - start), name)
                num_outputs = y.shape[1]
        probe = inputs.take(xs[0], slice(0, 4))
        batch = view.forward(view.params, probe)
        again = view.forward(view.params, probe)
        alone = view.forward(view.params, inputs.take(xs[0], slice(0, 1)))
        scale = float(batch.abs().max()) + 1e-12
        if batch.shape != again.shape or not torch.allclose(
            batch, again, rtol=1e-4, atol=1e-5 * scale
        ):
            raise ValueError(
                "the model's output is random (two identical calls differ); call "
                "model.eval() to switch off dropout and similar layers"
            )
        if batch[:1].shape != alone.shape or not torch.allclose(
            batch[:1], alone, rtol=1e-4, atol=1e-5 * scale
        ):
            raise ValueError(
                "a sample's output depends on the rest of the batch (e.g. BatchNorm in training "
                "mode, or statistics taken over the batch in forward): each sample needs an "
                "output of its own; call model.eval() if a layer in training mode causes it"
            )
    return num_outputs


def _by_component(terms: list, selected: list[str] | None) -> dict:
    """Group a block's terms by output component (None: all layers; else each selected layer),
    joining the per-sample gradient rows of a component into one Explicit term once per block
    rather than once per tile."""
    grouped = {}
    for key in [None] if selected is None else selected:
        mine = [t for t in terms if key is None or t.layer == key]
        explicit = [t.g for t in mine if isinstance(t, structured.Explicit)]
        joined = [structured.Explicit(key, torch.cat(explicit, 2))] if explicit else []
        grouped[key] = joined + [t for t in mine if isinstance(t, structured.Factored)]
    return grouped


def _contract_terms(f1: dict, f2: dict, kind: kinds.Kind) -> dict:
    """Tiles {component: Σ of its terms' contributions} from two blocks' grouped terms."""
    tiles = {}
    for key, left in f1.items():
        acc = None
        for a, b in zip(left, f2[key]):
            if isinstance(a, structured.Explicit):
                part = kind.contract(a.g, b.g)
            else:
                part = kind.contract_factored(a.input_gram(b), a.d, b.d)
            acc = part if acc is None else acc.add_(part)
        tiles[key] = acc
    return tiles
