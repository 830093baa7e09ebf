"""Random matrices with unit-variance entries, each a deterministic function of
(projector, seed, key, shape): the same seed gives the same matrix on every device, in every
dtype and whatever the order in which matrices are requested.

Entries r are independent with E[r] = 0 and E[r²] = 1, so that R/√k satisfies E[R Rᵀ/k] = I:

- ``gaussian``:   r ~ N(0, 1); E[r⁴] = 3.
- ``rademacher``: r = ±1 with probability ½ (Achlioptas, 2003); E[r⁴] = 1.
- ``sparse``:     r = ±√s with probability 1/(2s) each, 0 otherwise, s = max(3, √D) for D rows
  ("very sparse random projections", Li, Hastie & Church, KDD 2006); E[r⁴] = s.

- ``srht``:       the dense projections of whole gradients (`Sketcher.explicit`) are subsampled
  randomized Hadamard transforms (Ailon & Chazelle, STOC 2006; Tropp, 2011): R = [D_1 H S_1, …],
  D_j a diagonal of random signs, H the d × d Walsh–Hadamard matrix (d the power of two ≥ D, the
  gradient zero-padded), S_j a choice of min(d, k − j·d) of its columns without replacement, one
  block j per d columns. Every entry is ±1 and E_D[R[:, c] R[:, c]ᵀ] = I for each column, so
  the estimate is unbiased like the others; the columns of one block are dependent (a block that
  keeps all d columns preserves inner products exactly), and the cost per vector is
  d·log₂d additions per block instead of D·k multiply-adds. Kronecker factors (`factored`) stay
  Rademacher.

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

PROJECTORS = ("rademacher", "gaussian", "sparse", "srht")
# The default, as in the API contract (../shared/DESIGN.md). "srht" is as accurate (relative kernel
# error, mean of four seeds on the benchmark CNN, N = 1024, k = 4096: 0.0220 against 0.0217) and
# faster where whole gradients are projected (convolutions: 1.15 s against 1.62 s, and 3.3× on
# a small ResNet): `python benchmarks/projection_speed.py`.
DEFAULT_PROJECTOR = "rademacher"
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
    if projector in ("rademacher", "srht"):  # srht: its Kronecker factors
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


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x H along the last dimension (a power of two), H the unnormalised Walsh–Hadamard matrix
    (entries ±1, H Hᵀ = d·I), by log₂d butterfly passes."""
    d = x.shape[-1]
    y, h = x.reshape(-1, d), 1
    while h < d:
        pairs = y.reshape(-1, d // (2 * h), 2, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), 2)
        h *= 2
    return y.reshape(x.shape)


class HadamardSketch:
    """The `srht` dense projection [rows, cols] times `scale` (module docstring), identified by
    `key`: block j multiplies by random signs, zero-pads to d, applies H and keeps its columns
    (all blocks in one transform)."""

    def __init__(self, bank: MatrixBank, key: tuple, rows: int, cols: int, scale: float):
        self.rows, self.cols, self.scale = rows, cols, scale
        self.d = 1 << max(rows - 1, 0).bit_length()
        signs, columns = [], []
        for j, start in enumerate(range(0, cols, self.d)):
            gen = torch.Generator().manual_seed(stable_seed("srht", bank.seed, key, rows, cols, j))
            signs.append(torch.randint(0, 2, (rows,), generator=gen, dtype=torch.int8) * 2 - 1)
            columns.append(j * self.d + torch.randperm(self.d, generator=gen)[: cols - start])
        self.signs = torch.stack(signs).to(dtype=bank.dtype, device=bank.device)  # [blocks, rows]
        self.columns = torch.cat(columns).to(bank.device)  # [cols] into the blocks' outputs

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., rows] @ R → [..., cols]."""
        flat = x.reshape(1, -1, self.rows) * self.signs[:, None, :]  # [blocks, M, rows]
        y = hadamard(torch.nn.functional.pad(flat, (0, self.d - self.rows)))
        y = y.transpose(0, 1).reshape(flat.shape[1], -1)[:, self.columns]
        out = y * torch.tensor(self.scale, dtype=torch.float64).to(x.dtype)
        return out.reshape(*x.shape[:-1], self.cols)

    def dense(self) -> torch.Tensor:
        """The whole matrix [rows, cols]."""
        return self.matmul(torch.eye(self.rows, dtype=self.signs.dtype, device=self.signs.device))


class MatrixBank:
    """Generates and caches the chunks of every random matrix of one projection."""

    def __init__(
        self, projector: str, seed: int, *, dtype: torch.dtype, device, cache_bytes: int = 2 << 30
    ):
        self.projector, self.seed = check_projector(projector), int(seed)
        self.dtype, self.device = dtype, torch.device(device)
        self.cache_bytes = cache_bytes
        self._cache: dict[tuple, torch.Tensor] = {}
        self._sketches: dict[tuple, HadamardSketch] = {}
        self._cached = 0

    def matrix(self, key: tuple, rows: int, cols: int, scale: float = 1.0) -> RandomMatrix:
        return RandomMatrix(self, key, rows, cols, scale)

    def dense_projection(
        self, key: tuple, rows: int, cols: int, scale: float = 1.0
    ) -> RandomMatrix | HadamardSketch:
        """The projection of whole gradients: a `HadamardSketch` for the srht projector, else a
        `RandomMatrix` of the projector's entries."""
        if self.projector != "srht":
            return RandomMatrix(self, key, rows, cols, scale)
        ident = (key, rows, cols, scale)
        if ident not in self._sketches:  # its signs and columns, drawn once per projection
            self._sketches[ident] = HadamardSketch(self, key, rows, cols, scale)
        return self._sketches[ident]

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
