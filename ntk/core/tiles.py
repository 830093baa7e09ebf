"""The tile grid of an N1 × N2 kernel: blocks of rows and columns, the tiles a process computes
(j ≥ i for a symmetric kernel, whose other tiles are mirrors), and writing tiles into results.

The grid only knows how to get the features of a block of samples and how to contract two of
them into a tile; the eNTK engine, projected kernels and the distributed driver share it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from . import kinds


class Grid:
    """Tiles of `tile_size` × `tile_size` samples of a kernel of `kind` and `shape`.

    row_features(slice) / col_features(slice): features of a block of x1 / x2 samples (a
    symmetric grid uses col_features for both sides); contract(left, right) -> {key: tile} with
    key None for the total kernel or a layer name. Column features are cached when `cache_ok`.
    """

    def __init__(
        self,
        *,
        n1: int,
        n2: int,
        tile_size: int,
        symmetric: bool,
        kind: str | kinds.Kind,
        shape,
        keys: Sequence,
        dtype,
        device,
        row_features: Callable,
        col_features: Callable,
        contract: Callable,
        cache_ok: bool,
        desc: str,
    ):
        self.n1, self.n2, self.tile_size, self.symmetric = n1, n2, tile_size, symmetric
        self.kind, self.shape, self.keys = kinds.get(kind), tuple(shape), list(keys)
        self.dtype, self.device = dtype, device
        self.row_features, self.col_features = row_features, col_features
        self.contract = contract
        self.cache_ok, self.desc = cache_ok, desc

    @property
    def rows(self) -> list[slice]:
        size = self.tile_size
        return [slice(s, min(s + size, self.n1)) for s in range(0, self.n1, size)]

    @property
    def cols(self) -> list[slice]:
        return (
            self.rows
            if self.symmetric
            else [
                slice(s, min(s + self.tile_size, self.n2))
                for s in range(0, self.n2, self.tile_size)
            ]
        )

    def tiles(self) -> list[tuple[int, int]]:
        """Every tile to compute, (row block, column block) in row-major order."""
        n_rows, n_cols = len(self.rows), len(self.cols)
        return [(i, j) for i in range(n_rows) for j in range(i if self.symmetric else 0, n_cols)]

    def compute(
        self, owned: Iterable[tuple[int, int]] | None = None, progress: bool = False
    ) -> Iterator[tuple[int, int, dict]]:
        """Yield (i, j, {key: tile}) for the `owned` tiles (default: all), row by row, computing
        each row block's features once."""
        rows, cols = self.rows, self.cols
        owned = self.tiles() if owned is None else sorted(owned)
        by_row: dict[int, list[int]] = {}
        for i, j in owned:
            by_row.setdefault(i, []).append(j)
        cache: dict[int, object] = {}

        def col(j):
            if j in cache:
                return cache[j]
            f = self.col_features(cols[j])
            if self.cache_ok:
                cache[j] = f
            return f

        with tqdm(total=len(owned), disable=not progress, desc=self.desc, unit="tile") as bar:
            for i, js in by_row.items():
                left = col(i) if self.symmetric else self.row_features(rows[i])
                for j in js:
                    right = left if self.symmetric and i == j else col(j)
                    values = self.contract(left, right)
                    if self.symmetric and i == j:  # K(a, b) and K(b, a) rounded alike
                        values = {k: (v + self.kind.transpose(v)) / 2 for k, v in values.items()}
                    for value in values.values():
                        require_finite(
                            value,
                            f"the {self.desc} between samples {_span(rows[i])} and "
                            f"{_span(cols[j])}",
                        )
                    yield i, j, values
                    bar.update()

    def allocate(self, out=None) -> dict:
        """{key: empty result} (or {None: out}, a tensor or numpy array of the kernel's shape)."""
        if out is not None:
            if not isinstance(out, (torch.Tensor, np.ndarray)):
                raise TypeError(
                    "out must be a torch tensor or a numpy array (e.g. numpy.lib.format."
                    f"open_memmap), got {type(out).__name__}"
                )
            if tuple(out.shape) != self.shape:
                raise ValueError(f"out has shape {tuple(out.shape)}, expected {self.shape}")
            floating = (
                out.is_floating_point()
                if isinstance(out, torch.Tensor)
                else np.issubdtype(out.dtype, np.floating)
            )
            if not floating:  # integers would truncate the kernel, complex and bool distort it
                raise TypeError(f"out must have a floating-point dtype, got {out.dtype}")
            if isinstance(out, np.ndarray) and not out.flags.writeable:
                raise ValueError("out is a read-only array; the kernel is written into it")
            return {None: out}
        return {k: torch.empty(self.shape, dtype=self.dtype, device=self.device) for k in self.keys}

    def write(self, results: dict, i: int, j: int, values: dict) -> None:
        """Put tile (i, j) into the results, and its mirror (j, i) for a symmetric kernel."""
        rs, cs = self.rows[i], self.cols[j]
        for key, value in values.items():
            _write(results[key], rs, cs, value)
            if self.symmetric and i != j:
                _write(results[key], cs, rs, self.kind.transpose(value))

    def fill(self, results: dict, tiles: Iterable[tuple[int, int, dict]], out=None) -> None:
        """`write` each (i, j, values) of `tiles` (e.g. `compute`'s); a failure part-way
        through a caller's `out` says that `out` is incomplete (it is left as it is)."""
        try:
            for i, j, values in tiles:
                self.write(results, i, j, values)
        except Exception as e:
            if out is None:
                raise
            if isinstance(e, ValueError):
                raise ValueError(f"{e}; out holds only the tiles before this one") from None
            e.add_note("out holds only the tiles before this one")
            raise

    def result(self, results: dict):
        """The kernel (keys [None]) or the dict of components."""
        return results[None] if self.keys == [None] else {k: results[k] for k in self.keys}


def require_finite(t: torch.Tensor, what: str) -> None:
    """Refuse NaN or inf in a kernel tile, features or gradients computed from the model: every
    kernel, projection, store block and proxy checks its results here."""
    if not bool(torch.isfinite(t).all()):
        raise ValueError(
            f"{what} is not finite (NaN or inf): the model's gradients on those samples are not "
            "finite (e.g. sqrt or log at 0, or an overflow)"
        )


def require_finite_cast(values, what: str, into: str) -> None:
    """Refuse values (a tensor or numpy array), finite before a cast into a narrower floating
    dtype (`require_finite`), that the cast turned into inf: "{what} overflow {into}"."""
    if isinstance(values, torch.Tensor):
        finite = bool(torch.isfinite(values).all())
    else:
        finite = bool(np.isfinite(values).all())
    if not finite:
        raise ValueError(f"{what} overflow {into}")


def _span(s: slice) -> str:
    return f"{s.start}–{s.stop - 1}"


def _write(target, rows: slice, cols: slice, value: torch.Tensor) -> None:
    """Put a tile (finite: `compute` checked it) into the target's rows and columns, in its
    dtype; a narrower dtype that the cast overflows is refused."""
    if isinstance(target, np.ndarray):
        with np.errstate(over="ignore"):  # an overflow is refused just below
            cast = value.detach().cpu().numpy().astype(target.dtype, copy=False)
    else:
        cast = value.to(device=target.device, dtype=target.dtype)
    if cast.dtype.itemsize < value.dtype.itemsize:
        require_finite_cast(
            cast,
            f"the kernel values between samples {_span(rows)} and {_span(cols)}",
            f"out's dtype {target.dtype}; pass an out of a wider dtype",
        )
    target[rows, cols] = cast
