"""Random matrices with unit-variance entries, each a deterministic function of
(projector, seed, key, shape): the same seed gives the same matrix on every device, in every
dtype and whatever the order in which matrices are requested.

Entries r are independent with E[r] = 0 and E[r²] = 1, so that R/√k satisfies E[R Rᵀ/k] = I:

- ``gaussian``:   r ~ N(0, 1); E[r⁴] = 3.
- ``rademacher``: r = ±1 with probability ½ (Achlioptas, 2003); E[r⁴] = 1.
- ``sparse``:     r = ±√s with probability 1/(2s) each, 0 otherwise, s = max(3, √D) for D rows
  ("very sparse random projections", Li, Hastie & Church, KDD 2006); E[r⁴] = s.

For a dense projection φ = Rᵀg/√k of a vector g ∈ ℝ^D, the estimate φ·φ' of g·g' is unbiased
with variance (‖g‖²‖g'‖² + (g·g')² + (κ − 3) Σ_i g_i² g'_i²)/k, where κ = E[r⁴]: the Gaussian
term is (‖g‖²‖g'‖² + (g·g')²)/k, Rademacher removes 2 Σ_i g_i² g'_i²/k of it, and the sparse
projector adds (s − 3) Σ_i g_i² g'_i²/k, which is small when g is spread over many coordinates.

Matrices are generated in float64 on the CPU (Rademacher signs as integers, scaled in the target
dtype by the float64 scale rounded to it: the same values without float64 arithmetic on the
whole chunk), in chunks of rows whose boundaries depend only on the number of columns (so a chunk
is the same whichever rows are needed), then cast. Chunks are cached up to a memory budget, so a
projection used on many batches is generated once.
"""

from __future__ import annotations

import hashlib
import math

import torch

PROJECTORS = ("rademacher", "gaussian", "sparse")
_CHUNK_ENTRIES = 1 << 22  # entries per generated chunk (32 MiB in float64)


def check_projector(projector: str) -> str:
    if projector not in PROJECTORS:
        raise ValueError(
            f"unknown projector {projector!r}; valid projectors are {', '.join(PROJECTORS)}"
        )
    return projector


def stable_seed(*key) -> int:
    """A 63-bit generator seed from a stable hash of `key` (not Python's salted hash())."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _sample(projector: str, rows: int, cols: int, total_rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if projector == "gaussian":
        return torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    if projector == "rademacher":
        return torch.randint(0, 2, (rows, cols), generator=gen, dtype=torch.int8) * 2 - 1
    s = max(3.0, math.sqrt(total_rows))
    u = torch.rand(rows, cols, generator=gen, dtype=torch.float64)
    return math.sqrt(s) * ((u < 0.5 / s).to(torch.float64) - (u > 1 - 0.5 / s).to(torch.float64))


class RandomMatrix:
    """A lazily generated [rows, cols] random matrix times `scale`, identified by `key`."""

    def __init__(self, bank: MatrixBank, key: tuple, rows: int, cols: int, scale: float):
        self.bank, self.key, self.rows, self.cols, self.scale = bank, key, rows, cols, scale
        self.chunk = max(1, _CHUNK_ENTRIES // cols)

    def _chunk(self, i: int) -> torch.Tensor:
        return self.bank.chunk(self, i)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., rows] @ R → [..., cols]."""
        out = None
        for i, start in enumerate(range(0, self.rows, self.chunk)):
            part = x[..., start : start + self.chunk] @ self._chunk(i)
            out = part if out is None else out + part
        return out

    def dense(self) -> torch.Tensor:
        """The whole matrix [rows, cols]."""
        return torch.cat([self._chunk(i) for i in range(math.ceil(self.rows / self.chunk))])

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """Rows R[index] for an integer tensor of row numbers → [*index.shape, cols]."""
        flat = index.reshape(-1).cpu()
        out = torch.empty((flat.numel(), self.cols), dtype=self.bank.dtype, device=self.bank.device)
        which = flat // self.chunk
        for i in torch.unique(which).tolist():
            sel = (which == i).nonzero().squeeze(1)
            out[sel.to(out.device)] = self._chunk(i)[(flat[sel] - i * self.chunk).to(out.device)]
        return out.reshape(*index.shape, self.cols)


class MatrixBank:
    """Generates and caches the chunks of every random matrix of one projection."""

    def __init__(
        self, projector: str, seed: int, *, dtype: torch.dtype, device, cache_bytes: int = 2 << 30
    ):
        self.projector, self.seed = check_projector(projector), int(seed)
        self.dtype, self.device = dtype, torch.device(device)
        self.cache_bytes = cache_bytes
        self._cache: dict[tuple, torch.Tensor] = {}
        self._cached = 0

    def matrix(self, key: tuple, rows: int, cols: int, scale: float = 1.0) -> RandomMatrix:
        return RandomMatrix(self, key, rows, cols, scale)

    def chunk(self, m: RandomMatrix, i: int) -> torch.Tensor:
        ident = (m.key, m.rows, m.cols, i)
        hit = self._cache.get(ident)
        if hit is not None:
            return hit
        rows = min(m.chunk, m.rows - i * m.chunk)
        seed = stable_seed(self.projector, self.seed, m.key, m.rows, m.cols, i)
        value = _sample(self.projector, rows, m.cols, m.rows, seed)
        if value.dtype == torch.int8:  # ±1: exact in any dtype, so scale after the cast
            scale = torch.tensor(m.scale, dtype=torch.float64).to(self.dtype)
            value = value.to(dtype=self.dtype, device=self.device) * scale.to(self.device)
        else:
            value = (value * m.scale).to(dtype=self.dtype, device=self.device)
        size = value.numel() * value.element_size()
        if self._cached + size <= self.cache_bytes:
            self._cache[ident] = value
            self._cached += size
        return value
