"""Random-projection features and kernels: unbiasedness against the exact eNTK, shapes,
determinism, the structured (Kronecker) and dense paths, and input checks."""

import copy
import math
import re
import warnings

import numpy as np
import pytest
import torch
from models import Chunked, PackedGRU, SharedPositions, TwoDtypes, make
from torch import nn

import ntk
import projections
from ntk.core import kinds
from ntk.core.structured import Factored
from projections._projectors import INTEGER_MIN_ROWS, PROJECTORS, MatrixBank, integer_matmul
from projections._sketch import Sketcher

KINDS = ("full", "diagonal", "trace", "sum_logits")


def per_column(phi: torch.Tensor, kind: str) -> torch.Tensor:
    """k·φ_j(x)φ_j(x') for each projected coordinate j (iid over j, each unbiased for Θ):
    shape [k, *kernel shape]."""
    k = phi.shape[-1]
    if kind == "sum_logits":
        return k * torch.einsum("ij,kj->jik", phi, phi)
    if kind == "trace":
        return k * torch.einsum("ioj,koj->jik", phi, phi)
    if kind == "diagonal":
        return k * torch.einsum("ioj,koj->jiko", phi, phi)
    return k * torch.einsum("iaj,kbj->jikab", phi, phi)


def assert_unbiased(samples: torch.Tensor, exact: torch.Tensor, z_max: float = 5.0):
    """The mean of iid unbiased samples matches `exact` within its standard error."""
    mean = samples.mean(0)
    se = samples.std(0) / math.sqrt(samples.shape[0])
    scale = exact.abs().max()
    live = se > 1e-9 * scale  # entries that are exactly zero in every sample
    assert torch.allclose(mean[~live], exact[~live], atol=1e-8 * float(scale))
    z = (mean - exact)[live] / se[live]
    assert z.abs().max() < z_max, f"max |z| = {z.abs().max():.2f}"
    # entries share the random matrix, so their errors are correlated: rms z ≈ |one z|
    assert z.pow(2).mean().sqrt() < 3.0, f"rms z = {z.pow(2).mean().sqrt():.2f}"


@pytest.mark.parametrize("case", ["mlp", "cnn", "transformer", "tied"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_coordinate_is_unbiased(case, kind):
    """E[Φ Φᵀ] = Θ: the k coordinates are iid unbiased estimates (structured, gathered
    embedding rows, norms and autodiff fallback terms all included)."""
    model, x, _ = make(case)
    x = x[:4] if not isinstance(x, dict) else x
    exact = ntk.empirical_ntk(model, x, kind=kind)
    phi = projections.features(model, x, dim=2000, kind=kind, seed=1)
    assert_unbiased(per_column(phi, kind), exact)


@pytest.mark.parametrize("projector", PROJECTORS)
def test_every_projector_is_unbiased(projector):
    model, x, _ = make("cnn")
    exact = ntk.empirical_ntk(model, x, kind="diagonal")
    phi = projections.features(model, x, dim=3000, kind="diagonal", projector=projector, seed=2)
    assert_unbiased(per_column(phi, "diagonal"), exact)


@pytest.mark.parametrize("case", ["transformer", "tied"])
def test_srht_is_unbiased_with_embeddings_and_shared_weights(case):
    """srht pairs Hadamard factors with gathered Rademacher rows (embeddings) and projects
    weights used at several places; each coordinate stays unbiased."""
    model, x, _ = make(case)
    x = x[:4] if not isinstance(x, dict) else x
    exact = ntk.empirical_ntk(model, x, kind="trace")
    phi = projections.features(model, x, dim=2000, kind="trace", projector="srht", seed=1)
    assert_unbiased(per_column(phi, "trace"), exact)


def test_mean_over_seeds_converges():
    model, x, _ = make("mlp")
    exact = ntk.empirical_ntk(model, x, kind="trace")
    runs = torch.stack(
        [projections.projected_ntk(model, x, dim=8, kind="trace", seed=s) for s in range(60)]
    )
    assert_unbiased(runs, exact)
    assert (runs[0] - runs[1]).abs().max() > 1e-3 * exact.abs().max()  # seeds differ


def test_shapes_match_the_engine():
    model, x1, x2 = make("mlp")
    o = 3
    for kind in KINDS:
        phi = projections.features(model, x1, dim=16, kind=kind)
        assert phi.shape == ((6, 16) if kind == "sum_logits" else (6, o, 16))
        k = projections.projected_ntk(model, x1, x2, dim=16, kind=kind)
        assert k.shape == ntk.empirical_ntk(model, x1, x2, kind=kind).shape
    per_layer = projections.projected_ntk(model, x1, x2, dim=16, layers="all")
    assert list(per_layer) == ["fc1", "fc2", "head"]
    assert all(v.shape == (6, 4) for v in per_layer.values())
    only = projections.features(model, x1, dim=16, layers=["fc2"])
    assert list(only) == ["fc2"] and only["fc2"].shape == (6, o, 16)


def test_layerwise_components_are_unbiased():
    model, x, _ = make("cnn")
    exact = ntk.empirical_ntk(model, x, kind="trace", layers="all")
    phis = projections.features(model, x, dim=3000, kind="trace", layers="all")
    for layer, phi in phis.items():
        assert_unbiased(per_column(phi, "trace"), exact[layer])


def test_same_seed_same_features_whatever_the_batching_order_and_dtype():
    model, x, _ = make("cnn")
    ref = projections.features(model, x, dim=64, seed=3)
    for batch in (1, 2, 5):
        assert torch.allclose(
            projections.features(model, x, dim=64, seed=3, batch_size=batch),
            ref,
            rtol=1e-10,
            atol=1e-12,
        )
    order = torch.tensor([4, 2, 0, 3, 1])
    assert torch.allclose(
        projections.features(model, x[order], dim=64, seed=3), ref[order], rtol=1e-10, atol=1e-12
    )
    single = copy.deepcopy(model).float()
    assert torch.allclose(
        projections.features(single, x.float(), dim=64, seed=3).double(),
        ref,
        rtol=1e-3,
        atol=1e-4 * float(ref.abs().max()),
    )
    assert torch.allclose(
        projections.features(model, x, dim=64, seed=3, dtype=torch.float32).double(),
        ref,
        rtol=1e-3,
        atol=1e-4 * float(ref.abs().max()),
    )
    assert not torch.allclose(projections.features(model, x, dim=64, seed=4), ref)


def test_random_matrix_chunks_do_not_depend_on_request_order(monkeypatch):
    monkeypatch.setattr("projections._projectors._CHUNK_ENTRIES", 64)
    cols = 8  # 8 rows per generated chunk
    a = MatrixBank("gaussian", 5, dtype=torch.float64, device="cpu").matrix(("in", "x"), 20, cols)
    b = MatrixBank("gaussian", 5, dtype=torch.float64, device="cpu").matrix(("in", "x"), 20, cols)
    rows = torch.tensor([17, 3, 9])
    picked = b.gather(rows)  # chunks 2, 0, 1 generated in this order
    assert torch.equal(picked, a.dense()[rows])
    other = MatrixBank("gaussian", 5, dtype=torch.float64, device="cpu").matrix(
        ("in", "y"), 20, cols
    )
    assert not torch.equal(other.gather(rows), picked)


@pytest.mark.parametrize("projector", ["rademacher", "gaussian"])
def test_a_matrix_within_the_cache_is_held_whole_once_and_projects_like_its_chunks(
    monkeypatch, projector
):
    """Within the cache budget a matrix is held whole (its chunks' entries, stored once) and
    multiplies a batch in one product; beyond it, chunk by chunk: the same projection."""
    monkeypatch.setattr("projections._projectors._CHUNK_ENTRIES", 64)
    rows, cols = 37, 8  # 8 rows per chunk, the last one partial
    x = torch.randn(5, rows, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    fits = MatrixBank(projector, 2, dtype=torch.float64, device="cpu")
    tight = MatrixBank(projector, 2, dtype=torch.float64, device="cpu", cache_bytes=8 * 64)
    a, b = fits.matrix(("in", "x"), rows, cols, 0.5), tight.matrix(("in", "x"), rows, cols, 0.5)
    b.gather(torch.tensor([20]))  # a chunk cached first is taken into the whole matrix
    a.gather(torch.tensor([20]))
    whole = fits.whole(a)
    assert whole is not None and tight.whole(b) is None
    assert fits._cached == rows * cols * 8  # the chunks are not held beside it
    assert torch.equal(whole, b.dense()) and torch.equal(a.dense(), whole)
    assert torch.equal(a.gather(torch.tensor([36, 0])), whole[[36, 0]])
    assert torch.allclose(a.matmul(x), b.matmul(x), rtol=1e-12, atol=1e-12)
    assert torch.equal(a.matmul(x), x @ whole)


@pytest.mark.parametrize("projector", PROJECTORS)
def test_projector_entries_have_zero_mean_and_unit_variance(projector):
    r = (
        MatrixBank(projector, 0, dtype=torch.float64, device="cpu")
        .matrix(("t",), 400, 2000)
        .dense()
    )
    assert abs(float(r.mean())) < 5 / math.sqrt(r.numel()) * float(r.std())
    assert abs(float(r.pow(2).mean()) - 1) < 0.02
    if projector == "sparse":
        assert float((r != 0).double().mean()) == pytest.approx(1 / 20, rel=0.05)  # s = √400
    else:  # independent entries: rows and columns uncorrelated (each product has variance 1)
        for gram, n in ((r @ r.T, r.shape[1]), (r.T @ r, r.shape[0])):
            off = (gram / n - torch.eye(gram.shape[0], dtype=gram.dtype)).abs().max()
            assert float(off) < 6.5 / math.sqrt(n), projector


@pytest.mark.parametrize("projector", PROJECTORS)
def test_projector_entries_are_the_float64_entries_rounded_to_the_dtype(projector):
    """A float32 or bfloat16 bank holds its float64 twin's matrix rounded once to the dtype (the
    same random matrix whatever the dtype), with the scale applied."""
    scale = 1 / math.sqrt(3000)
    ref = MatrixBank(projector, 1, dtype=torch.float64, device="cpu").matrix(("t",), 30, 50, scale)
    for dtype in (torch.float32, torch.bfloat16):
        r = MatrixBank(projector, 1, dtype=dtype, device="cpu").matrix(("t",), 30, 50, scale)
        assert r.dense().dtype == dtype
        assert torch.equal(r.dense(), ref.dense().to(dtype))


def test_integer_products_are_within_the_two_level_bound():
    """x @ signs through two int8 levels per row: every output within rows·max|x_row|/(2·127·254)
    of the float64 product (one level would miss it by ~10×), whatever the row's scale; a zero
    row gives zeros, a row holding inf or NaN gives NaN."""
    g = torch.Generator().manual_seed(0)
    rows, cols = 300, 40
    signs = (torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1).to(torch.int8)
    x = torch.randn(7, rows, generator=g)
    x[:3] *= torch.tensor([[1e-6], [1.0], [1e4]])
    x[3, 0] = 1e3  # one entry dominates its row
    x[4] = 0
    x[5, 7], x[6, 9] = float("inf"), float("nan")
    out = integer_matmul(x, signs)
    assert out.dtype == torch.float32 and out.shape == (7, cols)
    exact = x[:4].double() @ signs.double()
    top = x[:4].abs().amax(1, keepdim=True).double()
    bound = rows * top / (2 * 127 * 254) + 1e-6 * x[:4].abs().sum(1, keepdim=True).double()
    assert ((out[:4].double() - exact).abs() <= bound).all()
    assert (out[:4].double() - exact).abs().max(1).values.gt(bound.squeeze(1) / 100).any()
    assert torch.equal(out[4], torch.zeros(cols))
    assert out[5:].isnan().all()


def test_float32_rademacher_features_through_integer_products(monkeypatch):
    """A float32 Rademacher bank on a CPU with fast int8 products multiplies matrices of at least
    INTEGER_MIN_ROWS rows by integers: the features differ from the float products' by the
    two-level rounding only; float64, other projectors and small matrices stay float."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(INTEGER_MIN_ROWS + 44, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    x = torch.randn(6, INTEGER_MIN_ROWS + 44) * torch.logspace(-2, 1, 6).unsqueeze(1)
    monkeypatch.setattr("projections._projectors.integer_products", lambda: True)
    bank = MatrixBank("rademacher", 0, dtype=torch.float32, device="cpu")
    assert bank.signs(bank.matrix(("t",), INTEGER_MIN_ROWS, 16)) is not None
    assert bank.signs(bank.matrix(("t",), INTEGER_MIN_ROWS - 1, 16)) is None
    for projector, dtype in (("gaussian", torch.float32), ("rademacher", torch.float64)):
        assert not MatrixBank(projector, 0, dtype=dtype, device="cpu").integer
    integer = projections.features(model, x, dim=256, kind="trace", seed=1)
    one_by_one = projections.features(model, x, dim=256, kind="trace", seed=1, batch_size=1)
    # each row's levels are its own (a batch-wide scale would move them by ~10⁻⁵ of the largest)
    assert torch.allclose(one_by_one, integer, rtol=0, atol=1e-6 * float(integer.abs().max()))
    monkeypatch.setattr("projections._projectors.integer_products", lambda: False)
    floats = projections.features(model, x, dim=256, kind="trace", seed=1)
    assert not torch.equal(integer, floats)
    assert torch.allclose(integer, floats, rtol=0, atol=1e-4 * float(floats.abs().max()))


@pytest.mark.parametrize("projector", ["gaussian", "srht"])
@pytest.mark.parametrize("block", [1, 2])
def test_kronecker_projection_of_factors(block, projector):
    """Projected factors equal the stacked Kronecker projection of the gradient written out
    (with srht, each factor's projection is itself a subsampled Hadamard transform)."""
    g = torch.Generator().manual_seed(0)
    c, b, s, f_in, f_out, dim = 2, 3, 2, 40, 30, 8  # P ≫ S·(F_in + F_out): factors
    a = torch.randn(b, s, f_in, generator=g, dtype=torch.float64)
    d = torch.randn(c, b, s, f_out, generator=g, dtype=torch.float64)
    bank = MatrixBank(projector, 0, dtype=torch.float64, device="cpu")
    got = Sketcher(bank, dim, {}, kron=block).factored(Factored("w", a, d))
    m, r = block, dim // (block * block)

    def factor(side, rows):
        return bank.projection((side, "w"), rows, r * m, 1 / math.sqrt(m)).dense()

    r_in, r_out = factor("in", f_in).reshape(f_in, r, m), factor("out", f_out).reshape(f_out, r, m)
    if projector == "srht":  # ±1/√m entries, not a dense Rademacher draw
        assert torch.allclose(r_in.abs(), torch.full_like(r_in, 1 / math.sqrt(m)))
    grad = torch.einsum("cbso,bsi->cboi", d, a)
    want = torch.einsum("orp,cboi,irq->cbrpq", r_out, grad, r_in).reshape(c, b, dim) / math.sqrt(r)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("projector", PROJECTORS)
def test_a_weight_projected_through_its_gradient_gets_its_factors_projection(projector):
    """With S·(F_in + F_out) > P the weight's per-sample gradient is projected, with the
    Khatri–Rao product of the factors' matrices: the same features as the factors' route, so
    samples of different numbers of positions (sequences of other lengths), which may take
    different routes, are projected alike (a dense matrix of its own made their cross terms 0 in
    expectation). Float32 Rademacher and srht on an int8 CPU go through integer products."""
    g = torch.Generator().manual_seed(0)
    for dtype, f_in, tol in ((torch.float64, 2, 1e-12), (torch.float32, 40, 2e-4)):
        a = torch.randn(3, 50, f_in, generator=g, dtype=dtype)
        d = torch.randn(2, 3, 50, 7, generator=g, dtype=dtype)
        sketch = Sketcher(MatrixBank(projector, 0, dtype=dtype, device="cpu"), 16, {})
        assert sketch.via_gradient("w", 50, f_in, 7, 2)
        through_gradient = sketch.factored(Factored("w", a, d))
        factors = Sketcher(MatrixBank(projector, 0, dtype=dtype, device="cpu"), 16, {})
        factors.via_gradient = lambda *args: False
        expected = factors.factored(Factored("w", a, d))
        scale = float(expected.abs().max())
        torch.testing.assert_close(through_gradient, expected, rtol=0, atol=tol * scale)


def test_sequences_of_different_lengths_are_projected_alike():
    """A token-wise Linear inside a model of sequences: 2 tokens take the factors' route, 8 the
    gradient's (`Sketcher.via_gradient`), and the mean over seeds of that layer's projected
    cross kernel between them was about 0 (exact entries 0.28, 0.08, −0.06, 0.69)."""

    class Tokenwise(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 2)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)).mean(1))

    torch.manual_seed(0)
    model = Tokenwise().double().eval()
    short, long = torch.randn(3, 2, 16).double(), torch.randn(3, 8, 16).double()
    fz = projections.Featurizer(model, dim=64).prepare(short)
    assert not fz._sketcher.via_gradient("a", 2, 16, 16, 2)
    assert fz._sketcher.via_gradient("a", 8, 16, 16, 2)
    exact = ntk.empirical_ntk(model, short, long, kind="trace", layers=["a"])["a"]
    seeds = [
        projections.projected_ntk(model, short, long, dim=64, seed=s, layers=["a"])["a"]
        for s in range(40)
    ]
    mean, spread = torch.stack(seeds).mean(0), torch.stack(seeds).std(0) / math.sqrt(40)
    assert float(((mean - exact) / spread).abs().max()) < 4.5


def test_routes_count_the_factors_memory_passes():
    """A convolution over 8 × 8 positions with 10 cotangents (F_in 145, F_out 32, k 2048) writes
    S·k·(1 + 2C) elements on its factors' route for fewer multiply-adds than its gradient's:
    counted at PASS_COST each, the gradient's route wins; a Linear weight (one position) and a
    768 × 768 attention projection over 128 tokens keep their factors."""
    bank = MatrixBank("rademacher", 0, dtype=torch.float32, device="cpu")
    sketch = Sketcher(bank, 2048, {})
    multiply_adds = 64 * (145 * 2048 + 10 * 32 * 2048) + 10 * 64 * 2048
    assert multiply_adds < 10 * (64 * 145 * 32 + 145 * 32 * 2048)  # factors: fewer multiply-adds
    assert sketch.via_gradient("conv", 64, 145, 32, 10)
    assert not sketch.via_gradient("linear", 1, 512, 10, 10)
    assert not sketch.via_gradient("attention", 128, 768, 768, 1)


def test_kronecker_and_dense_paths_agree_in_expectation():
    """A Linear weight projected from its factors and the same weight's explicit per-sample
    gradient projected densely both converge to the exact kernel (and so to each other)."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(4, 1, 6, generator=g, dtype=torch.float64)
    d = torch.randn(1, 4, 1, 5, generator=g, dtype=torch.float64)
    grad = torch.einsum("cbso,bsi->cboi", d, a).reshape(1, 4, -1)
    exact = grad[0] @ grad[0].T
    sketch = Sketcher(MatrixBank("rademacher", 2, dtype=torch.float64, device="cpu"), 4000, {})
    kron = sketch.factored(Factored("w", a, d))[0]
    dense = sketch.explicit("w", 0, grad)[0]
    assert_unbiased(per_column(kron, "sum_logits"), exact)
    assert_unbiased(per_column(dense, "sum_logits"), exact)
    diff = per_column(kron, "sum_logits") - per_column(dense, "sum_logits")
    assert_unbiased(diff, torch.zeros_like(exact))


def test_embedding_padding_rows_contribute_nothing():
    emb = (
        nn.Sequential(nn.Embedding(7, 3, padding_idx=0), nn.Flatten(), nn.Linear(6, 2))
        .double()
        .eval()
    )
    x = torch.tensor([[0, 0], [1, 2], [0, 5]])
    only = projections.features(emb, x, dim=32, kind="sum_logits", layers=["0"])["0"]
    assert torch.count_nonzero(only[0]) == 0
    assert torch.count_nonzero(only[2]) > 0


def test_numpy_integer_sizes_are_sizes(tmp_path):
    """Sizes from numpy (np.int64: array lengths, arithmetic on shapes) act as Python ints
    everywhere a size is taken; bools and non-positive sizes are refused."""
    model, x, _ = make("mlp")
    size = np.int64(3)
    torch.testing.assert_close(
        ntk.empirical_ntk(model, x, kind="trace", batch_size=size),
        ntk.empirical_ntk(model, x, kind="trace", batch_size=3),
    )
    phi = projections.features(model, x, dim=np.int64(8), batch_size=size, seed=np.int64(1))
    torch.testing.assert_close(phi, projections.features(model, x, dim=8, seed=1))
    projections.featurize(model, x, tmp_path / "s", dim=np.int64(8), block=size)
    assert projections.open_store(tmp_path / "s").shape == phi.shape
    for bad in (True, 0, 2.0):
        with pytest.raises(ValueError, match="batch_size must be a positive integer or None"):
            ntk.empirical_ntk(model, x, batch_size=bad)


def test_bad_input_is_refused_and_model_untouched():
    model, x, _ = make("mlp")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="dim"):
        projections.features(model, x, dim=0)
    with pytest.raises(ValueError, match="projector"):
        projections.features(model, x, dim=4, projector="orthogonal")
    with pytest.raises(ValueError, match="kind"):
        projections.features(model, x, dim=4, kind="trace_norm")
    with pytest.raises(ValueError, match="unknown layer"):
        projections.features(model, x, dim=4, layers=["nope"])
    with pytest.raises(ValueError, match="non-finite"):
        projections.features(model, torch.full_like(x, float("nan")), dim=4)
    with pytest.raises(ValueError, match="batch_size"):
        projections.features(model, x, dim=4, batch_size=0)
    with pytest.raises(TypeError):
        projections.features(lambda t: t, x, dim=4)
    dropout = nn.Sequential(nn.Linear(5, 5), nn.Dropout(0.5), nn.Linear(5, 2)).train()
    with pytest.raises(ValueError, match="eval"):
        projections.features(dropout, x.float(), dim=4)
    assert dropout.training
    projections.projected_ntk(model, x, dim=8, kind="full", layers="all")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and not model.training


def test_a_projection_that_does_not_compress_warns_naming_the_parameter_count():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))  # 16 + 10 parameters
    with pytest.warns(UserWarning, match="dim=26 is not below the model's 26 trainable"):
        projections.Featurizer(model, dim=26)
    # per layer every projection expands only when the largest layer's 16 do not exceed dim
    with pytest.warns(UserWarning, match="dim=16 is not below its largest layer's 16"):
        projections.Featurizer(model, dim=16, per_layer=True)
    with pytest.warns(UserWarning, match="dim=10 is not below the model's 10"):
        projections.Featurizer(model, dim=10, layers=["2"], per_layer=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        projections.Featurizer(model, dim=25)
        projections.Featurizer(model, dim=15, per_layer=True)


def test_labels_are_checked_once_by_the_callers_name(monkeypatch):
    """A set's labels are checked once, under the name the caller gave them (labels2 for x2), not
    again per batch under block's own name; a direct block call checks its labels."""
    model, x, _ = make("mlp")
    lpntk = kinds.get("lpntk")
    checked = []

    def check_labels(labels, n, num_outputs, name="labels"):
        checked.append(name)
        return type(lpntk).check_labels(lpntk, labels, n, num_outputs, name)

    monkeypatch.setattr(lpntk, "check_labels", check_labels)
    y = torch.arange(len(x)) % 3
    projections.projected_ntk(
        model, x, x[:4], dim=4, kind="lpntk", labels=y, labels2=y[:4], batch_size=2
    )
    assert checked == ["labels", "labels2"]
    fz = projections.Featurizer(model, dim=4, kind="lpntk").prepare(x)
    with pytest.raises(ValueError, match="labels holds labels outside 0..2: 5 at sample 1"):
        fz.block(x[:2], torch.tensor([0, 5]))


def test_kernel_in_tiles_matches_projected_ntk():
    model, x1, x2 = make("mlp")
    for kind in KINDS:
        f1 = projections.features(model, x1, dim=32, kind=kind)
        f2 = projections.features(model, x2, dim=32, kind=kind)
        want = projections.projected_ntk(model, x1, x2, dim=32, kind=kind)
        got = projections.kernel(f1.numpy(), f2.numpy(), kind=kind, tile=4)
        assert torch.allclose(torch.from_numpy(got), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="axes"):
        projections.kernel(f1.numpy(), kind="trace")


def test_srht_is_a_signed_subsampled_hadamard_transform():
    """The srht dense projection: x R for R = [D_1 H S_1, …]·scale with H the Walsh–Hadamard
    matrix (scipy's), ±scale entries, whole blocks preserving inner products exactly, the same
    matrix for the same (seed, key) and another for another key."""
    import scipy.linalg

    from projections._projectors import hadamard

    x = torch.randn(3, 16, dtype=torch.float64)
    h = torch.tensor(scipy.linalg.hadamard(16), dtype=torch.float64)
    torch.testing.assert_close(hadamard(x), x @ h)
    for d in (1 << 8, 1 << 15):  # Sylvester's recursion x H_2d = [(x1 + x2) H_d, (x1 − x2) H_d]
        x1, x2 = torch.randn(2, 2, d // 2, dtype=torch.float64)
        h1, h2 = hadamard(x1), hadamard(x2)
        whole = hadamard(torch.cat([x1, x2], 1))
        torch.testing.assert_close(whole, torch.cat([h1 + h2, h1 - h2], 1))
    bank = MatrixBank("srht", 3, dtype=torch.float64, device="cpu")
    sketch = bank.projection(("dense", "w", 0), 20, 100, 0.1)  # d = 32: 3 whole blocks + 4
    r = sketch.dense()
    assert r.shape == (20, 100) and torch.allclose(r.abs(), torch.full_like(r, 0.1))
    whole = r[:, sketch.columns < 96]  # the columns of the three whole blocks
    torch.testing.assert_close(whole @ whole.T, 96 * 0.01 * torch.eye(20, dtype=torch.float64))
    y = torch.randn(2, 5, 20, dtype=torch.float64)
    torch.testing.assert_close(sketch.matmul(y), y @ r)
    again = MatrixBank("srht", 3, dtype=torch.float64, device="cpu")
    assert torch.equal(again.projection(("dense", "w", 0), 20, 100, 0.1).dense(), r)
    assert not torch.equal(again.projection(("dense", "w", 1), 20, 100, 0.1).dense(), r)


def test_outputs_beyond_the_probe_are_checked_in_every_batch():
    """`prepare` runs only a few samples through the model; every batch's own forward pass
    still refuses a non-finite output row and names the argument of a failing sample."""

    class NanAt(nn.Module):
        def __init__(self, row):
            super().__init__()
            self.row, self.fc = row, nn.Linear(5, 3)

        def forward(self, x):
            out = self.fc(x)
            bad = (x[:, 0] == self.row).unsqueeze(1)  # the sample whose first input is `row`
            return torch.where(bad, float("nan"), out)

    x = torch.randn(12, 5)
    x[:, 0] = torch.arange(12.0)
    with pytest.raises(ValueError, match="non-finite outputs .* on x"):
        projections.features(NanAt(9).eval(), x, dim=8, batch_size=4)
    emb = nn.Sequential(nn.Embedding(10, 3), nn.Flatten(), nn.Linear(6, 2)).eval()
    ids = torch.randint(0, 10, (12, 2))
    ids[10, 1] = 10  # beyond the table, in the third batch
    with pytest.raises(ValueError, match="x: the ids reaching embedding '0' range from"):
        projections.features(emb, ids, dim=8, batch_size=4, kind="sum_logits")


def test_each_weights_route_follows_the_projectors_cost():
    """A 64 × 64 Linear weight at k = 4096 and one position: projecting its factors costs
    (64 + 64)·k per cotangent against 64·64·k for its gradient, so its factors are projected;
    over 200 positions the gradient (S·P to form, P·k to project) is cheaper, for every
    projector."""
    for projector in PROJECTORS:
        sketch = Sketcher(MatrixBank(projector, 0, dtype=torch.float64, device="cpu"), 4096, {})
        assert not sketch.via_gradient("w", 1, 64, 64, 1), projector
        assert sketch.via_gradient("w", 2000, 8, 8, 1), projector


def test_default_batch_counts_the_route_each_weight_takes(monkeypatch):
    """A convolution over 28 × 28 positions is projected through its small per-sample gradient
    (`Sketcher.via_gradient`), so the memory of projecting its factors at every position
    (S·k per sample, 25 MiB here) does not throttle the batch: under a 4 GiB free memory, the
    largest default batch."""
    monkeypatch.setattr("projections.projected.available_bytes", lambda device: 4 << 30)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 14 * 14, 10),
    ).eval()
    x = torch.randn(8, 1, 28, 28)
    fz = projections.Featurizer(model, dim=4096, kind="sum_logits").prepare(x)
    assert fz.default_batch(4096) == 512
    ref = projections.features(model, x, dim=4096, kind="sum_logits", batch_size=3)
    torch.testing.assert_close(projections.features(model, x, dim=4096, kind="sum_logits"), ref)


def test_features_of_a_mixed_precision_model():
    # a float32 body with a float64 head failed projecting the head ("expected m1 and m2 to have
    # the same dtype, but got: double != float"), and so did trak's default projected path
    torch.manual_seed(0)
    model, x = TwoDtypes().eval(), torch.randn(8, 5)
    phi = torch.as_tensor(projections.features(model, x, dim=8192, kind="full")).double()
    exact = ntk.empirical_ntk(model, x, kind="full").double()
    estimate = torch.einsum("iak,jbk->ijab", phi, phi)
    assert float((estimate - exact).norm() / exact.norm()) < 0.1


def test_a_featurizer_names_a_missing_prepare_and_an_empty_batch():
    """block before prepare failed inside torch.eye, an empty batch inside the model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    x = torch.randn(6, 4)
    with pytest.raises(RuntimeError, match=re.escape("call prepare(x) first")):
        projections.Featurizer(model, dim=8).block(x)
    with pytest.raises(ValueError, match="^x holds no samples$"):
        projections.Featurizer(model, dim=8).prepare(x).block(x[:0])


def test_kernel_of_features_in_two_dtypes():
    """Φ1 float64 against Φ2 float32 (features against a float32 store) failed inside torch
    ("expected m1 and m2 to have the same dtype"); they meet in the wider dtype. Arrays that
    are not floating-point features are refused naming the argument."""
    g = np.random.default_rng(0)
    a, b = g.standard_normal((3, 2, 4)), g.standard_normal((2, 2, 4)).astype(np.float32)
    k = projections.kernel(a, b, kind="trace")
    assert k.dtype == np.float64
    np.testing.assert_allclose(k, np.einsum("iok,jok->ij", a, b.astype(np.float64)))
    with pytest.raises(TypeError, match="phi1 must be a floating-point array"):
        projections.kernel(np.ones((3, 2, 4), dtype=np.int64), kind="trace")


def test_features_that_are_not_finite_are_refused_before_out_is_written(tmp_path):
    """A NaN row of phi failed at its tile, after the tiles before it were written into `out`
    (a valid .npy memmap, the rest zero, looking complete)."""
    phi = np.random.default_rng(0).standard_normal((16, 8))
    phi2 = phi[:5].copy()
    phi2[3] = np.nan
    phi[10] = np.inf
    for args, message in (((phi[:8], phi2), r"phi2\[0:4\]"), ((phi,), r"phi1\[8:12\]")):
        shape = (len(args[0]), len(args[-1]))
        out = np.lib.format.open_memmap(
            tmp_path / "k.npy", mode="w+", dtype=np.float64, shape=shape
        )
        with pytest.raises(ValueError, match=f"^{message} is not finite"):
            projections.kernel(*args, kind="sum_logits", tile=4, out=out)
        assert not out.any()


def test_projected_kernel_of_sequences_of_other_lengths():
    """x1 and x2 of other sequence lengths were refused ("different per-sample shapes"); the
    projected kernel is the product of each set's features, and the exact one's estimate."""
    torch.manual_seed(0)
    model = SharedPositions(seq=8).double().eval()
    g = torch.Generator().manual_seed(5)
    x1, x2 = torch.randint(0, 5, (4, 5), generator=g), torch.randint(0, 5, (3, 7), generator=g)
    k = projections.projected_ntk(model, x1, x2, dim=4096, kind="sum_logits", seed=1)
    phi1 = projections.features(model, x1, dim=4096, kind="sum_logits", seed=1)
    phi2 = projections.features(model, x2, dim=4096, kind="sum_logits", seed=1)
    torch.testing.assert_close(torch.as_tensor(k), phi1 @ phi2.T)
    exact = ntk.empirical_ntk(model, x1, x2, kind="sum_logits")
    assert float((torch.as_tensor(k) - exact).norm() / exact.norm()) < 0.1


class _SortUnsort(nn.Module):
    """Per sample, but its first layer sees the batch sorted by norm."""

    def __init__(self):
        super().__init__()
        self.a, self.out = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        idx = x.norm(dim=1).argsort()
        return self.out(torch.tanh(self.a(x[idx])[idx.argsort()]))


def test_a_layer_fed_a_reordered_batch_is_projected_from_its_own_samples_rows():
    """The featurizer planned on one sample, which cannot show that a layer's row b is another
    sample's: the projected kernel of a model that sorts its batch was 33 % off (0.8 % now, the
    projection's own error at this dim)."""
    torch.manual_seed(0)
    model = _SortUnsort().double().eval()
    x = torch.randn(7, 3, dtype=torch.float64)
    exact = ntk.empirical_ntk(model, x, kind="trace", method="jacobian")
    got = projections.projected_ntk(model, x, kind="trace", dim=20000, seed=0)
    assert (got - exact).abs().max() / exact.abs().max() < 0.05


@pytest.mark.parametrize("size", (32, 17))
def test_a_body_run_on_chunks_of_a_batch_is_projected_by_autodiff(size):
    """A body run on chunks of 32 (or 17) samples, which the plan's pass on 16 samples cannot
    show, in batches of 64: the features failed ("the model failed on inputs…"); `prepare` now
    leaves the body to autodiff, so every batch (x1's 3 samples too) is projected as for a body
    the plan sees chunked (chunks of 4) from the start, and the kernel estimates the eNTK."""
    torch.manual_seed(0)
    net = Chunked(size).double().eval()
    seen = Chunked(4).double().eval()
    seen.load_state_dict(net.state_dict())
    x = torch.randn(80, 3, dtype=torch.float64)
    for kind in ("full", "trace"):
        got = projections.features(net, x, dim=64, kind=kind, seed=3, batch_size=64)
        want = projections.features(seen, x, dim=64, kind=kind, seed=3, batch_size=64)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-14), kind
    got = projections.projected_ntk(net, x[:3], x, kind="trace", dim=64, seed=3, batch_size=64)
    want = projections.projected_ntk(seen, x[:3], x, kind="trace", dim=64, seed=3, batch_size=64)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    exact = ntk.empirical_ntk(net, x[:8], kind="trace", method="jacobian")
    close = projections.projected_ntk(net, x[:8], kind="trace", dim=20000, seed=0)
    assert (close - exact).abs().max() / exact.abs().max() < 0.05


@pytest.mark.filterwarnings(
    "ignore::UserWarning"
)  # the fallbacks' warnings, torch's batching notes
def test_a_model_torch_func_cannot_differentiate_is_projected_through_autograd():
    """A packed sequence through nn.GRU (jacrev fails even on one sample): the projected kernel
    estimates the exact one (it failed with "Cannot access data pointer…")."""
    torch.manual_seed(0)
    net = PackedGRU().double().eval()
    x = torch.randn(6, 4, 3, dtype=torch.float64)
    x[0, 3:], x[1, 2:] = 0, 0
    exact = ntk.empirical_ntk(net, x, kind="trace", method="jacobian")
    got = projections.projected_ntk(net, x, kind="trace", dim=20000, seed=0)
    assert (got - exact).abs().max() / exact.abs().max() < 0.05


def test_a_model_whose_outputs_change_width_on_a_later_batch_is_named():
    """Torch's "expanded size of the tensor (2) must match" from inside the engine (features)
    or its allclose (a feature store's probe); each is now a ValueError saying what changed."""

    class Narrows(nn.Module):
        """Two outputs instead of four for a batch holding a sample whose first input > 100."""

        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(5, 4)

        def forward(self, x):
            out = self.linear(x)
            return out[:, :2] if bool((x[:, 0] > 100).any()) else out

    torch.manual_seed(1)
    x = torch.randn(6, 5)
    x[5, 0] = 1000.0
    model = Narrows().eval()
    with pytest.raises(
        ValueError, match="returned 2 outputs per sample on x, earlier batches had 4"
    ):
        projections.features(model, x, dim=4, batch_size=3)
    with pytest.raises(ValueError, match="output depends on the rest of the batch"):
        ntk.empirical_ntk(model, x[2:], kind="trace")
