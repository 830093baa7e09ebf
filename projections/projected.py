"""Projected Jacobian features Φ(x) = J(x) R and the projected kernel Φ Φᵀ, an unbiased estimate
of the empirical NTK for every kind (E[R Rᵀ] = I).

R is block-diagonal over layers (the modules that directly own trainable parameters): Φ(x) =
Σ_l J_l(x) R_l with an independent R_l per layer, built by `_sketch` from the engine's per-layer
Jacobian factors, so per-sample gradients of factored weights are never formed. The features
of the cotangents of a kind (the rows u_cᵀ J of `ntk.core.kinds`) give Φ [N, k] for `sum_logits`
and `lpntk` (one cotangent; per sample for `lpntk`) and Φ [N, O, k] for `trace`, `diagonal` and
`full`; the kernels are contractions of Φ over k.
This is the projection used by TRAK (Park et al., ICML 2023) and by the projected trNTK of
Engel et al. (ICLR 2024), applied to factors instead of materialised gradients.
"""

from __future__ import annotations

import hashlib
import numbers
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ntk.core import inputs, kinds, structured
from ntk.core.checks import check_integer
from ntk.core.memory import available_bytes, block_size
from ntk.core.model import ModelView, check_eval_mode, check_module
from ntk.core.tiles import Grid, require_finite
from ntk.empirical import check_outputs, check_per_layer

from ._projectors import DEFAULT_PROJECTOR, MatrixBank, check_projector
from ._sketch import Sketcher

Features = torch.Tensor | dict
_PROBE = 4  # samples `Featurizer.prepare` runs through the model (`block` checks the rest)
_LARGEST = 512  # samples of `default_batch`'s largest batches: `prepare` looks for micro-batches


class Featurizer:
    """Fixed projection settings for one model; call `prepare(x)` on a first batch, then
    `block(x)` on batches of samples.

    The random matrices are generated once and reused for every batch. The model is read
    through a functional view and never modified.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        dim: int,
        kind: str | kinds.Kind = "trace",
        projector: str = DEFAULT_PROJECTOR,
        seed: int = 0,
        layers: None | str | Sequence[str] = None,
        per_layer: bool | None = None,
        device=None,
        dtype: torch.dtype | None = None,
        output_fn: Callable | None = None,
    ):
        check_module(model)
        dim = check_integer(dim, "dim")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an integer, got {seed!r}")
        seed = int(seed)
        self.kind = kinds.get(kind)
        check_projector(projector)
        check_eval_mode(model)
        check_per_layer(per_layer)
        self.dim, self.projector, self.seed = dim, projector, seed
        self.dtype = dtype
        self.view = ModelView(model, output_fn=output_fn, device=device, dtype=dtype)
        self._only, self.layers = self.view.selection(layers, per_layer)
        self._warn_if_not_compressing()
        self.param_dtype = next(iter(self.view.params.values())).dtype
        self.num_outputs: int | None = None
        self._plan = None
        self._sketcher = None
        self._name = "x"

    def _warn_if_not_compressing(self) -> None:
        """Warn when every projection maps its parameters to at least as many dimensions: the
        features then estimate a kernel that is cheaper to compute exactly."""
        v = self.view
        if self.layers is None:
            names = v.params if self._only is None else self._only
            largest = sum(v.params[n].numel() for n in names)
        else:
            largest = max(v.layer_size(layer) for layer in self.layers)
        if self.dim >= largest:
            where = "the model's" if self.layers is None else "its largest layer's"
            warnings.warn(
                f"dim={self.dim} is not below {where} {largest} trainable parameters: the "
                "random projection adds noise and saves nothing; use the exact gradients "
                "instead (dim=None where the method takes it; ntk.empirical_ntk, `ntk kernel`)",
                stacklevel=3,
            )

    def fingerprint(self) -> str:
        """SHA-256 of every tensor the forward pass reads (trainable, frozen, buffers)."""
        h = hashlib.sha256()
        v = self.view
        for group in (v.params, v.constants, v.buffers):
            for name in sorted(group):
                inputs.hash_tensor(h, name, group[name])
        return h.hexdigest()

    def prepare(self, x, name: str = "x") -> Featurizer:
        """Validate a batch (finite inputs; on its first samples, outputs that are neither
        random nor dependent on the rest of the batch) and plan once; `name` names the inputs
        in errors. `block` checks the outputs of every sample it featurises (one finite row
        each) on the forward pass it runs anyway."""
        inputs.validate(x, name)
        x = inputs.convert(x, self.view.device, self.dtype)
        o = check_outputs(self.view, [inputs.take(x, slice(0, _PROBE))], [name])
        self._name = name
        if self.num_outputs is not None and o != self.num_outputs:
            raise ValueError(
                f"the model returned {o} outputs, earlier batches had {self.num_outputs}"
            )
        if self._plan is None:
            self.num_outputs = o
            self._plan = structured.plan(
                self.view,
                x,  # its first samples: the plan checks each layer's rows are their samples
                self.kind,
                self.kind.count(o),
                1,
                # modules run on micro-batches of batches up to this large are left to autodiff
                # now, not by the first batch that shows them: every batch is projected alike
                # (larger chunks in larger batches are refused naming the module)
                _LARGEST,
                only=self._only,
                factor_all=True,
                name=name,
            )
            vocab = {
                l: m.num_embeddings
                for l, m in self._plan.modules.items()
                if isinstance(m, nn.Embedding)
            }
            bank = MatrixBank(
                self.projector, self.seed, dtype=self.param_dtype, device=self.view.device
            )
            self._sketcher = Sketcher(bank, self.dim, vocab, route_count=self.kind.route_count(o))
        return self

    def default_batch(self, n: int) -> int:
        """Samples per batch so that activations, factors and features stay within memory."""
        p = self._plan
        c = self.kind.count(self.num_outputs)
        itemsize = torch.empty((), dtype=self.param_dtype).element_size()
        explicit = sum(self.view.params[n].numel() for n in p.fallback)
        outputs = 1 if self.layers is None else len(self.layers)
        # the factored layers are projected one at a time: the largest one's route
        routes = (
            self._sketcher.elements_per_sample(
                layer,
                p.positions[layer],
                *p.factor_sizes(layer),
                c,
                index=isinstance(module, nn.Embedding),
            )
            for layer, module in p.modules.items()
            if layer in p.factored
        )
        per_sample = itemsize * (
            2 * p.activations * (1 + c)
            + c * explicit
            + c * self.dim * outputs
            + max(routes, default=0)
        )
        budget = max(0.25 * available_bytes(self.view.device), 64 << 20)
        return max(1, min(_LARGEST, block_size(n, per_sample, 0.0, budget)))

    def batches(
        self,
        x,
        batch_size: int | None = None,
        progress: bool = False,
        name: str = "x",
        labels=None,
        labels_name: str = "labels",
    ):
        """(rows, features of x[rows]) batch by batch, `batch_size` samples at a time (None: from
        the free memory): the features of a whole set without holding them all."""
        batch_size = check_integer(batch_size, "batch_size", optional=True)
        self.prepare(x, name)  # validates x
        n = inputs.count(x)
        y = self.kind.check_labels(labels, n, self.num_outputs, labels_name)
        batch = batch_size or self.default_batch(n)
        for start in tqdm(range(0, n, batch), disable=not progress, desc="features", unit="batch"):
            rows = slice(start, min(start + batch, n))
            yield rows, self._block(inputs.take(x, rows), None if y is None else y[rows])

    def block(self, x, labels=None) -> Features:
        """Features of a prepared batch: [B, k] or [B, O, k] (dict per layer with per_layer);
        `labels`: the batch's labels, for a labelled kind."""
        if self._plan is None:
            raise RuntimeError("call prepare(x) first: it checks the model's outputs and plans")
        if inputs.count(x) == 0:
            raise ValueError("x holds no samples")
        return self._block(x, self.kind.check_labels(labels, inputs.count(x), self.num_outputs))

    def _block(self, x, labels) -> Features:
        """`block` of checked labels (`batches` checks a whole set's once, naming its argument)."""
        x = inputs.convert(x, self.view.device, self.dtype)
        # a fresh copy (index by tensor): the arithmetic must not depend on where the batch sits
        # in memory (alignment changes SIMD paths), so a store's bytes do not depend on the source
        b = inputs.count(x)
        x = inputs.take(x, torch.arange(b, device=self.view.device))
        cot = self.kind.cotangents(
            self.num_outputs, labels=labels, dtype=self.param_dtype, device=self.view.device
        )
        with torch.no_grad():
            terms = structured.features(self.view, self._plan, x, cot, name=self._name)
            phis = self._sketcher.terms(terms, self.layers)
        shaped = {}
        for key in [None] if self.layers is None else self.layers:
            phi = phis.get(key)
            if phi is None:  # a selected layer that does not affect the outputs
                phi = torch.zeros(
                    (cot.shape[0], b, self.dim),
                    dtype=self.param_dtype,
                    device=self.view.device,
                )
            require_finite(phi, f"the projected features of a batch of {b} samples")
            shaped[key] = self.kind.shape_features(phi)
        return shaped[None] if self.layers is None else shaped


def features(
    model: nn.Module,
    x,
    *,
    dim: int,
    kind: str | kinds.Kind = "trace",
    labels=None,
    projector: str = DEFAULT_PROJECTOR,
    seed: int = 0,
    layers: None | str | Sequence[str] = None,
    per_layer: bool | None = None,
    batch_size: int | None = None,
    device=None,
    dtype: torch.dtype | None = None,
    output_fn: Callable | None = None,
    progress: bool = False,
) -> Features:
    """Projected Jacobian features Φ(x) = J(x) R with E[R Rᵀ] = I, so that Φ Φᵀ estimates the
    eNTK of `kind` without bias.

    Returns [N, dim] for `sum_logits` and `lpntk` (Φ(x) = s(y)ᵀ J(x) R, which needs `labels`, the
    class labels of x) and [N, O, dim] for `trace`, `diagonal` and `full`. layers restricts the
    features to those modules; per_layer=True (None: whenever `layers` is given) gives a dict
    {layer: features}, each layer with its own independent projection. projector:
    "rademacher" (default), "gaussian", "sparse" or "srht" (subsampled randomized Hadamard
    transforms of gradients and Kronecker factors: faster, and on the benchmark CNN more
    accurate; `_projectors`). batch_size: samples featurised at a time (None: from the free
    memory). The same `seed` gives the same projection whatever `batch_size`, device or the
    model's dtype, so the same features up to float rounding (bit for bit only with the same
    batches: a feature store's, restarted at each block, equal `features` where the blocks are
    a multiple of its batch).
    """
    fz = Featurizer(
        model,
        dim=dim,
        kind=kind,
        projector=projector,
        seed=seed,
        layers=layers,
        per_layer=per_layer,
        device=device,
        dtype=dtype,
        output_fn=output_fn,
    )
    x = inputs.from_numpy(x, "x", fz.param_dtype)  # numpy arrays of floats, as featurize casts
    return _features_of(fz, x, batch_size, progress, "x", labels, "labels")


def _features_of(
    fz: Featurizer, x, batch_size, progress, name: str, labels=None, labels_name: str = "labels"
) -> Features:
    parts = [block for _, block in fz.batches(x, batch_size, progress, name, labels, labels_name)]
    if fz.layers is None:
        return torch.cat(parts)
    return {layer: torch.cat([p[layer] for p in parts]) for layer in fz.layers}


def projected_ntk(
    model: nn.Module,
    x1,
    x2=None,
    *,
    dim: int,
    kind: str | kinds.Kind = "trace",
    labels=None,
    labels2=None,
    projector: str = DEFAULT_PROJECTOR,
    seed: int = 0,
    layers: None | str | Sequence[str] = None,
    per_layer: bool | None = None,
    batch_size: int | None = None,
    device=None,
    dtype: torch.dtype | None = None,
    output_fn: Callable | None = None,
    progress: bool = False,
):
    """Φ(x1) Φ(x2)ᵀ contracted as `kind`: an unbiased estimate of
    `ntk.empirical_ntk(model, x1, x2, kind=kind, labels=labels, labels2=labels2, layers=layers,
    per_layer=per_layer)`, with the same shape ([N1, N2, O, O], [N1, N2, O] or [N1, N2]; a dict
    per layer when split). The per-layer kernels of one seed do not sum to the total projected
    kernel (Φ_l Φ_lᵀ drops the cross-layer terms J_l R_l R_mᵀ J_mᵀ, zero only in expectation);
    each is unbiased for its own layer. batch_size: samples featurised at a time."""
    fz = Featurizer(
        model,
        dim=dim,
        kind=kind,
        projector=projector,
        seed=seed,
        layers=layers,
        per_layer=per_layer,
        device=device,
        dtype=dtype,
        output_fn=output_fn,
    )
    x1 = inputs.from_numpy(x1, "x1", fz.param_dtype)  # numpy arrays of floats
    if x2 is not None:
        x2 = inputs.from_numpy(x2, "x2", fz.param_dtype)
        inputs.validate(x2, "x2")
        inputs.check_structure(x1, x2)  # the model decides on shapes
    elif labels2 is not None:
        raise ValueError("labels2= labels the samples of x2; x2 is None (pass labels=)")
    f1 = _features_of(fz, x1, batch_size, progress, "x1", labels, "labels")
    f2 = f1 if x2 is None else _features_of(fz, x2, batch_size, progress, "x2", labels2, "labels2")
    contract = fz.kind.contract_features
    if fz.layers is None:
        return contract(f1, f2)
    return {layer: contract(f1[layer], f2[layer]) for layer in fz.layers}


def kernel(phi1, phi2=None, *, kind: str, out=None, tile: int = 4096, progress: bool = False):
    """Φ1 Φ2ᵀ as `kind` from feature arrays of any size (e.g. memory-mapped stores from
    `open_store`), computed in tiles of `tile` × `tile` samples so that only two tiles of
    features are in memory at once (phi2=None: the tiles on and above the diagonal, mirrored).
    `out`: an optional preallocated array (e.g. `numpy.lib.format.open_memmap`) that receives
    the kernel; otherwise a numpy array is returned, of the features' dtype or float32 if that is
    narrower (float16 stores). The features are checked finite, tile by tile, before anything is
    written."""
    grid = kernel_grid(phi1, phi2, kind=kind, tile=tile)
    dtype = str(grid.dtype).removeprefix("torch.")
    results = grid.allocate(np.empty(grid.shape, dtype=dtype) if out is None else out)
    for name, phi in [("phi1", phi1)] + ([] if phi2 is None else [("phi2", phi2)]):
        for start in range(0, phi.shape[0], grid.tile_size):
            rows = slice(start, min(start + grid.tile_size, phi.shape[0]))
            # a copy: a store's memory map is read-only, which torch warns about
            require_finite(torch.from_numpy(np.array(phi[rows])), f"{name}[{start}:{rows.stop}]")
    grid.fill(results, grid.compute(progress=progress), out)
    return results[None]


def kernel_grid(phi1, phi2=None, *, kind: str, tile: int = 4096) -> Grid:
    """The tile grid of Φ1 Φ2ᵀ (shared with `projections.distributed.kernel`)."""
    kind = kinds.get(kind)
    tile = check_integer(tile, "tile")
    sym = phi2 is None
    phi2 = phi1 if sym else phi2
    want = kind.feature_axes()
    for name, p in (("phi1", phi1), ("phi2", phi2)):
        if not hasattr(p, "shape") or np.asarray(p[:1]).dtype.kind != "f":
            raise TypeError(f"{name} must be a floating-point array of features, got {type(p)}")
        if len(p.shape) != want:
            raise ValueError(f"{name} has shape {tuple(p.shape)}; {kind} features have {want} axes")
    if tuple(phi1.shape[1:]) != tuple(phi2.shape[1:]):
        raise ValueError(
            f"feature shapes differ: {tuple(phi1.shape[1:])} vs {tuple(phi2.shape[1:])}"
        )
    n1, n2 = phi1.shape[0], phi2.shape[0]
    o = phi1.shape[1] if want == 3 else 1

    # features of two dtypes (a float32 store against float64 features) meet in the wider one,
    # float32 at least: a float16 store's kernel overflowed past 65504 (and lost 3e-4 of itself)
    dtype = np.result_type(np.asarray(phi1[:1]).dtype, np.asarray(phi2[:1]).dtype, np.float32)

    def read(phi):
        return lambda rows: torch.from_numpy(np.array(phi[rows], dtype=dtype))

    return Grid(
        n1=n1,
        n2=n2,
        tile_size=tile,
        symmetric=sym,
        kind=kind,
        shape=kind.shape(n1, n2, o),
        keys=[None],
        dtype=getattr(torch, dtype.name),
        device=torch.device("cpu"),
        row_features=read(phi1),
        col_features=read(phi2),
        contract=lambda a, b: {None: kind.contract_features(a, b)},
        cache_ok=False,
        desc="kernel",
    )
