"""Random matrices with unit-variance entries, each a deterministic function of
(projector, seed, key, shape): the same seed gives the same matrix on every device, in every
dtype and whatever the order in which matrices are requested.

Entries r are independent with E[r] = 0 and E[r²] = 1, so that R/√k satisfies E[R Rᵀ/k] = I:

- ``gaussian``:   r ~ N(0, 1); E[r⁴] = 3.
- ``rademacher``: r = ±1 with probability ½ (Achlioptas, 2003); E[r⁴] = 1.
- ``sparse``:     r = ±√s with probability 1/(2s) each, 0 otherwise, s = max(3, √D) for D rows
  ("very sparse random projections", Li, Hastie & Church, KDD 2006); E[r⁴] = s.

- ``srht``:       every projection of vectors (whole gradients in `Sketcher.explicit`, and the
  Kronecker factors in `Sketcher.factored`; embeddings' gathered rows stay Rademacher) is a
  subsampled randomized Hadamard transform (Ailon & Chazelle, STOC 2006; Tropp, 2011):
  R = [D_1 H S_1, …], D_j a diagonal of random signs, H the d × d Walsh–Hadamard matrix (d the
  power of two ≥ D, the vector zero-padded), S_j a choice of min(d, k − j·d) of its columns
  without replacement, one block j per d columns. Every entry is ±1 and
  E_D[R[:, c] R[:, c]ᵀ] = I for each column, so the estimate is unbiased like the others; the
  columns of one block are dependent and orthogonal (a block that keeps all d columns preserves
  inner products exactly), and the cost per vector is d·(1 + Σ s_i) multiply-adds per block
  (`hadamard`, H_d = ⊗ H_{s_i}) instead of D·k.

For a dense projection φ = Rᵀg/√k of a vector g ∈ ℝ^D, the estimate φ·φ' of g·g' is unbiased
with variance (‖g‖²‖g'‖² + (g·g')² + (κ − 3) Σ_i g_i² g'_i²)/k, where κ = E[r⁴]: the Gaussian
term is (‖g‖²‖g'‖² + (g·g')²)/k, Rademacher removes 2 Σ_i g_i² g'_i²/k of it, and the sparse
projector adds (s − 3) Σ_i g_i² g'_i²/k, which is small when g is spread over many coordinates.

Matrices are generated on the CPU (Gaussian and sparse entries in float64, then cast; Rademacher
signs as random bytes, one bit per entry, expanded on the target device to ±the float64 scale
rounded once to the target dtype: the same values everywhere without float64 arithmetic on the
whole chunk), in chunks of rows whose boundaries depend only on the number of columns (so a chunk
is the same whichever rows are needed), then cast. Chunks are cached up to a memory budget, so a
projection used on many batches is generated once.

Integer products. On a CPU with int8 dot-product instructions (AMX or VNNI), a float32
Rademacher projection of vectors with ≥ `INTEGER_MIN_ROWS` entries multiplies integers: the
matrix is held as int8 signs ±1 (the same signs), each vector x is split row-wise into two int8
levels, x ≈ (q₀ + q₁/254)/c with c = 127/max|x|, and q R is exact in int32 (`integer_matmul`).
Each entry of x is represented to within max|x|/(2·127·254) ≈ 1.6·10⁻⁵·max|x|, below the
projection's own error at any k a user would choose (at k = 4096 the estimate's error is ~10⁻²),
at a third of the float32 product's time on the benchmark CNN's 4,608-parameter convolution
(`python benchmarks/projection_speed.py`). float64 (and other dtypes and devices) stay float.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch

PROJECTORS = ("rademacher", "gaussian", "sparse", "srht")
# Integer products for Rademacher matrices of at least this many rows (below, the float product
# is as cheap as splitting the vectors), on CPUs whose int8 dot products beat float32 FMAs.
INTEGER_MIN_ROWS = 256
_INT8_INSTRUCTIONS = ("amx_int8", "avx512_vnni", "avx_vnni")
_INT8_LEVEL = 127  # q₀, q₁ ∈ [−127, 127]
_SECOND_LEVEL = 2 * _INT8_LEVEL  # q₁'s unit is 1/254 of q₀'s
# rows for which |254·q₀R + q₁R| ≤ 127·255·rows stays within int32
_INT32_ROWS = (1 << 31) // (_INT8_LEVEL * (_SECOND_LEVEL + 1))
# The default, as in the API contract (../shared/DESIGN.md). "srht" is more accurate on the
# benchmark CNN (0.015 against 0.033) and about as fast since its convolutions' gradients are
# projected with the factors' matrices (0.40 s against 0.36 s; before, 0.28 s):
# `python benchmarks/projection_speed.py` (numbers in benchmarks/README.md).
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


# row v: the bits of the byte v, lowest first, as signs: bit 1 → +1, bit 0 → −1
_BYTE_SIGNS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) * 2.0 - 1


def _signs(out: torch.Tensor, seed: int, scale: float) -> None:
    """Fill the contiguous [rows, cols] tensor `out` with entries ±scale (the float64 scale
    rounded once to its dtype), one random bit each: entry 8i + j (row-major) is bit j of the
    i-th random byte. The bytes are drawn on the CPU and expanded on out's device by a table
    lookup, 1/8 of a draw per entry."""
    gen = torch.Generator().manual_seed(seed)
    size = out.numel()
    packed = torch.randint(0, 256, (-(-size // 8),), generator=gen, dtype=torch.uint8)
    scaled = torch.tensor(scale, dtype=torch.float64).to(out.dtype)
    table = (_BYTE_SIGNS.to(out.dtype) * scaled).to(out.device)
    index = packed.to(device=out.device, dtype=torch.int32)
    if size % 8 == 0:  # straight into `out`
        torch.index_select(table, 0, index, out=out.view(-1, 8))
    else:
        out.view(-1).copy_(table.index_select(0, index).reshape(-1)[:size])


def integer_products() -> bool:
    """Whether this CPU multiplies int8 matrices faster than float32 ones (AMX or VNNI)."""
    caps = torch.cpu.get_capabilities()
    return hasattr(torch, "_int_mm") and any(caps.get(name) for name in _INT8_INSTRUCTIONS)


def integer_matmul(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x [M, D] (float32) @ signs [D, k] (int8 ±1) → [M, k] float32, through two int8 levels
    per row: with c = 127/max|x|, q₀ = round(c·x) and q₁ = round(254·(c·x − q₀)) (|c·x − q₀| ≤ ½,
    so |q₁| ≤ 127), x = (q₀ + q₁/254)/c to within 1/(2·254·c) per entry, and both products are
    exact int32 sums. A row holding inf or NaN gives NaN (as the float product would, up to
    the sign of an infinite sum)."""
    top = x.abs().amax(1, keepdim=True)
    finite = torch.isfinite(top)
    every = bool(finite.all())
    c = _INT8_LEVEL / torch.where(finite & (top > 0), top, 1.0)
    scaled = x * c
    if not every:
        scaled.masked_fill_(~finite, 0.0)
    levels = torch.empty((2, *x.shape), dtype=torch.int8, device=x.device)
    first = scaled.round()
    levels[0].copy_(first)
    levels[1].copy_(scaled.sub_(first).mul_(_SECOND_LEVEL).round_())
    sums = torch._int_mm(levels.view(-1, x.shape[1]), signs).view(2, x.shape[0], -1)
    # 254·(q₀ R) + q₁ R, exact in int32 (`_INT32_ROWS`)
    out = torch.add(sums[1], sums[0], alpha=_SECOND_LEVEL).to(x.dtype).div_(c * _SECOND_LEVEL)
    return out if every else out.masked_fill_(~finite, float("nan"))


def integer_dtype(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether float sign matrices in `dtype` on `device` are multiplied through
    `integer_matmul`: float32 on a CPU with fast int8 products."""
    return dtype == torch.float32 and device.type == "cpu" and integer_products()


def integer_rows(rows: int) -> bool:
    """Whether a sign matrix of `rows` rows is worth multiplying by integers (`INTEGER_MIN_ROWS`
    at least) and few enough for exact int32 sums (`_INT32_ROWS`)."""
    return INTEGER_MIN_ROWS <= rows <= _INT32_ROWS


def _sample(projector: str, rows: int, cols: int, total_rows: int, seed: int) -> torch.Tensor:
    """Gaussian or sparse entries in float64."""
    gen = torch.Generator().manual_seed(seed)
    if projector == "gaussian":
        return torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    s = max(3.0, math.sqrt(total_rows))
    u = torch.rand(rows, cols, generator=gen, dtype=torch.float64)
    return math.sqrt(s) * ((u < 0.5 / s).to(torch.float64) - (u > 1 - 0.5 / s).to(torch.float64))


class RandomMatrix:
    """A lazily generated [rows, cols] random matrix times `scale`, identified by `key`. Its
    entries are generated in chunks of rows (`MatrixBank.chunk`); a matrix that fits the bank's
    cache is also held whole (`MatrixBank.whole`), so that a batch is projected by a single
    matrix product."""

    def __init__(self, bank: MatrixBank, key: tuple, rows: int, cols: int, scale: float):
        self.bank, self.key, self.rows, self.cols, self.scale = bank, key, rows, cols, scale
        self.chunk = max(1, _CHUNK_ENTRIES // cols)
        self.cost = rows * cols  # multiply-adds per projected vector
        self.work = cols  # elements held per projected vector (products accumulate in place)

    def _chunk(self, i: int) -> torch.Tensor:
        return self.bank.chunk(self, i)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., rows] @ R → [..., cols]: integer products when the bank multiplies this matrix
        by integers (module docstring), else one matrix product with the whole R when the bank
        holds it (on a 2-core CPU, [256, 4640] @ [4640, 4096] takes 23 % less time than in five
        chunks), else one per chunk of R, accumulated in place."""
        flat = x.reshape(-1, self.rows)
        signs = self.bank.signs(self)
        if signs is not None:
            out = integer_matmul(flat, signs).mul_(self.scale)
            return out.reshape(*x.shape[:-1], self.cols)
        whole = self.bank.whole(self)
        if whole is not None:
            return (flat @ whole).reshape(*x.shape[:-1], self.cols)
        out = flat[:, : self.chunk] @ self._chunk(0)
        for i, start in enumerate(range(self.chunk, self.rows, self.chunk), start=1):
            out.addmm_(flat[:, start : start + self.chunk], self._chunk(i))
        return out.reshape(*x.shape[:-1], self.cols)

    def dense(self) -> torch.Tensor:
        """The whole matrix [rows, cols]."""
        whole = self.bank.whole(self)
        if whole is not None:
            return whole
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


_HADAMARD_FACTOR_BITS = 7  # H_d = H_s1 ⊗ H_s2 ⊗ … with each s ≤ 2⁷ (one matrix product each)


@functools.lru_cache(maxsize=64)
def _sylvester(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h.to(dtype=dtype, device=device)


def hadamard_factors(d: int) -> list[int]:
    """Sizes s_1, …, s_p (powers of two, each ≤ 2⁷) with H_d = H_{s_1} ⊗ … ⊗ H_{s_p}."""
    bits = max(d - 1, 0).bit_length()
    if bits <= _HADAMARD_FACTOR_BITS:
        return [d] if d > 1 else []
    first = 1 << min(_HADAMARD_FACTOR_BITS, bits // 2)
    return [first, *hadamard_factors(d // first)]


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x H along the last dimension (a power of two), H the unnormalised Walsh–Hadamard matrix
    (entries ±1, H Hᵀ = d·I). With H_d = H_a ⊗ H_b (Sylvester's construction) and x read as an
    a × b matrix X, x H_d is H_a X H_b: small matrix products, d·Σ s_i multiply-adds per vector
    (`hadamard_factors`) at matrix-product speed instead of d·log₂d in log₂d memory passes."""
    d = x.shape[-1]
    return _hadamard_rows(x.reshape(-1, d), hadamard_factors(d)).reshape(x.shape)


def _hadamard_rows(y: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    if len(sizes) <= 1:
        return y @ _sylvester(sizes[0], y.dtype, y.device) if sizes else y
    a, d = sizes[0], y.shape[-1]
    inner = _hadamard_rows(y.reshape(-1, d // a), sizes[1:]).reshape(-1, a, d // a)
    return (_sylvester(a, y.dtype, y.device) @ inner).reshape(-1, d)


class HadamardSketch:
    """The `srht` projection [rows, cols] times `scale` (module docstring), identified by `key`:
    block j multiplies by random signs, zero-pads to d, applies H and keeps its columns (all
    blocks in one transform). Each block's columns come in a random order: a whole block's
    inner products do not depend on it, but the Kronecker route pairs the columns of two
    sketches, and pairing Walsh functions in their natural order correlates the pairs."""

    def __init__(self, bank: MatrixBank, key: tuple, rows: int, cols: int, scale: float):
        self.rows, self.cols, self.scale = rows, cols, scale
        self.d = 1 << max(rows - 1, 0).bit_length()
        blocks = -(-cols // self.d)
        gen = torch.Generator().manual_seed(stable_seed("srht", bank.seed, key, rows, cols))
        signs = torch.randint(0, 2, (blocks, rows), generator=gen, dtype=torch.int8) * 2 - 1
        # block j keeps min(d, cols − j·d) of its d columns, drawn without replacement
        order = torch.rand(blocks, self.d, generator=gen, dtype=torch.float64).argsort(1)
        columns = order + self.d * torch.arange(blocks).unsqueeze(1)
        self.columns = columns.reshape(-1)[:cols].to(bank.device)  # [cols] into the outputs
        # ±scale: the float64 scale rounded once to the dtype, exact signs
        scaled = torch.tensor(scale, dtype=torch.float64).to(bank.dtype)
        self.signs = (signs.to(dtype=bank.dtype) * scaled).to(bank.device)  # [blocks, rows]
        # multiply-adds per projected vector: the signs, then `hadamard`'s products, per block
        self.cost = blocks * self.d * (1 + sum(hadamard_factors(self.d)))
        # elements held per vector: the signed, padded copy, its transform, the kept columns
        self.work = 2 * blocks * self.d + cols

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., rows] @ R → [..., cols]."""
        m = x.numel() // self.rows
        signed = x.reshape(m, 1, self.rows) * self.signs  # [M, blocks, rows]
        if self.d > self.rows:
            signed = torch.nn.functional.pad(signed, (0, self.d - self.rows))
        y = hadamard(signed).reshape(m, -1).index_select(1, self.columns)
        return y.reshape(*x.shape[:-1], self.cols)

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
        # Rademacher float32 products on a CPU with fast int8 products go through int8 signs
        self.integer = projector == "rademacher" and integer_dtype(dtype, self.device)
        self._cache: dict[tuple, torch.Tensor] = {}  # chunks of rows
        self._whole: dict[tuple, torch.Tensor] = {}  # whole matrices
        self._chunked: set[tuple] = set()  # matrices too large to hold whole
        self._sketches: dict[tuple, HadamardSketch] = {}
        self._cached = 0

    def matrix(self, key: tuple, rows: int, cols: int, scale: float = 1.0) -> RandomMatrix:
        return RandomMatrix(self, key, rows, cols, scale)

    def projection(
        self, key: tuple, rows: int, cols: int, scale: float = 1.0
    ) -> RandomMatrix | HadamardSketch:
        """A projection of vectors (whole gradients, Kronecker factors): a `HadamardSketch` for
        the srht projector, else a `RandomMatrix` of the projector's entries. Both have
        `matmul`, `dense`, `cost` (multiply-adds per vector) and `work` (elements held per
        vector)."""
        if self.projector != "srht":
            return RandomMatrix(self, key, rows, cols, scale)
        ident = (key, rows, cols, scale)
        if ident not in self._sketches:  # its signs and columns, drawn once per projection
            self._sketches[ident] = HadamardSketch(self, key, rows, cols, scale)
        return self._sketches[ident]

    def chunk(self, m: RandomMatrix, i: int) -> torch.Tensor:
        """Rows [i·m.chunk, (i + 1)·m.chunk) of m, generated once and cached within the budget."""
        start = i * m.chunk
        whole = self._whole.get((m.key, m.rows, m.cols, m.scale))
        if whole is not None:
            return whole[start : start + m.chunk]
        ident = (m.key, m.rows, m.cols, m.scale, i)
        hit = self._cache.get(ident)
        if hit is not None:
            return hit
        value = torch.empty(
            (min(m.chunk, m.rows - start), m.cols), dtype=self.dtype, device=self.device
        )
        self._generate(m, i, value)
        size = value.numel() * value.element_size()
        if self._cached + size <= self.cache_bytes:
            self._cache[ident] = value
            self._cached += size
        return value

    def whole(self, m: RandomMatrix) -> torch.Tensor | None:
        """All of m as one tensor (the same entries as its chunks, which it replaces in the
        cache), cached; None when it would not fit the cache budget, which is then final: the
        cache only grows, by no less than it frees of m's chunks."""
        ident = (m.key, m.rows, m.cols, m.scale)
        if ident in self._whole or ident in self._chunked:
            return self._whole.get(ident)
        chunks = [(*ident, i) for i in range(math.ceil(m.rows / m.chunk))]
        freed = sum(
            self._cache[c].numel() * self._cache[c].element_size()
            for c in chunks
            if c in self._cache
        )
        size = m.rows * m.cols * torch.empty((), dtype=self.dtype).element_size()
        if self._cached - freed + size > self.cache_bytes:
            self._chunked.add(ident)
            return None
        value = torch.empty((m.rows, m.cols), dtype=self.dtype, device=self.device)
        for i, c in enumerate(chunks):
            rows = value[i * m.chunk : (i + 1) * m.chunk]
            if c in self._cache:
                rows.copy_(self._cache.pop(c))
            else:
                self._generate(m, i, rows)
        self._whole[ident] = value
        self._cached += size - freed
        return value

    def signs(self, m: RandomMatrix) -> torch.Tensor | None:
        """m's signs as a whole int8 matrix [rows, cols] (its entries are these times m.scale),
        cached, for `integer_matmul`; None unless this bank multiplies m by integers (at least
        `INTEGER_MIN_ROWS` rows, few enough for int32 sums) and the matrix fits the cache."""
        ident = (m.key, m.rows, m.cols, "signs")
        if not self.integer or not integer_rows(m.rows):
            return None
        if ident in self._whole or ident in self._chunked:
            return self._whole.get(ident)
        if self._cached + m.rows * m.cols > self.cache_bytes:
            self._chunked.add(ident)
            return None
        value = torch.empty((m.rows, m.cols), dtype=torch.int8)
        for i, start in enumerate(range(0, m.rows, m.chunk)):
            _signs(value[start : start + m.chunk], self._chunk_seed(m, i), 1.0)
        self._whole[ident] = value
        self._cached += value.numel()
        return value

    def _chunk_seed(self, m: RandomMatrix, i: int) -> int:
        return stable_seed(self.projector, self.seed, m.key, m.rows, m.cols, i)

    def _generate(self, m: RandomMatrix, i: int, out: torch.Tensor) -> None:
        """Write chunk i of m into `out` (its rows, contiguous)."""
        seed = self._chunk_seed(m, i)
        if self.projector in ("rademacher", "srht"):  # srht: the gathered rows of embeddings
            _signs(out, seed, m.scale)
        else:
            value = _sample(self.projector, out.shape[0], m.cols, m.rows, seed)
            out.copy_(value * m.scale)
