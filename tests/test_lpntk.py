"""kind="lpntk" (s(y)ᵀ Θ s(y'), per-sample cotangents): tiles and layer restriction against the
float64 reference, an independent gradient route, its projected form and its input checks (every
architecture × method against the reference: test_engine_reference.py)."""

import pytest
import torch
from models import make
from reference import kernels, lpntk, rel_err, signs
from test_projections import assert_unbiased

import ntk
import projections

METHODS = ("jacobian", "ntk_vp", "structured", "auto")


def count(x):
    return next(iter(x.values())).shape[0] if isinstance(x, dict) else x.shape[0]


def random_labels(x, num_outputs, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_outputs, (count(x),), generator=g)


@pytest.mark.parametrize("method", METHODS)
def test_lpntk_tiled_and_restricted_to_layers(method):
    """Tiles of 2 samples give the same kernel (per-sample cotangents follow their samples), and
    per_layer=False over a few layers is the sum of their components."""
    model, x1, x2 = make("transformer")
    ref = kernels(model, x1, x2)
    y1, y2 = random_labels(x1, 4, 3), random_labels(x2, 4, 4)
    chosen = ["q", "embed", ""]
    total = ntk.empirical_ntk(
        model,
        x1,
        x2,
        kind="lpntk",
        labels=y1,
        labels2=y2,
        layers=chosen,
        per_layer=False,
        method=method,
        batch_size=2,
    )
    assert rel_err(total, sum(lpntk(ref[layer], y1, y2) for layer in chosen)) <= 1e-9
    sym = ntk.empirical_ntk(model, x1, kind="lpntk", labels=y1, method=method, batch_size=2)
    assert rel_err(sym, lpntk(kernels(model, x1)[None], y1, y1)) <= 1e-9
    assert torch.allclose(sym, sym.T, rtol=1e-12, atol=0)


def test_lpntk_is_signed_gradient_gram():
    """An independent route: the Gram matrix of ∇θ s(y)ᵀ f(x), with labels as a numpy array."""
    model, x, _ = make("mlp")
    y = random_labels(x, 3, 5)
    rows = []
    for i in range(x.shape[0]):
        out = model(x[i : i + 1])[0] @ signs(y[i : i + 1], 3)[0]
        grads = torch.autograd.grad(out, list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    g = torch.stack(rows)
    k = ntk.empirical_ntk(model, x, kind="lpntk", labels=y.numpy())
    assert rel_err(k, g @ g.T) <= 1e-12
    assert bool((k < 0).any())  # contradictory pairs exist: the kernel is signed


def test_lpntk_input_checks():
    model, x1, x2 = make("mlp")
    y1, y2 = random_labels(x1, 3, 1), random_labels(x2, 3, 2)
    with pytest.raises(ValueError, match="needs labels="):
        ntk.empirical_ntk(model, x1, kind="lpntk")
    with pytest.raises(ValueError, match="needs labels2="):
        ntk.empirical_ntk(model, x1, x2, kind="lpntk", labels=y1)
    with pytest.raises(ValueError, match="6 class labels"):
        ntk.empirical_ntk(model, x1, kind="lpntk", labels=y2)
    with pytest.raises(ValueError, match=r"outside 0\.\.2"):
        ntk.empirical_ntk(model, x1, kind="lpntk", labels=y1 + 3)
    with pytest.raises(ValueError, match="integer class labels"):
        ntk.empirical_ntk(model, x1, kind="lpntk", labels=y1 + 0.5)
    with pytest.raises(ValueError, match="x2 is None"):
        ntk.empirical_ntk(model, x1, kind="lpntk", labels=y1, labels2=y1)
    with pytest.raises(ValueError, match="only used by labelled kinds"):
        ntk.empirical_ntk(model, x1, kind="trace", labels=y1)
    scalar, xs, _ = make("scalar")  # one logit: labels 0 and 1
    with pytest.raises(ValueError, match=r"labels holds labels outside 0\.\.1: 2 at sample 0"):
        ntk.empirical_ntk(scalar, xs, kind="lpntk", labels=torch.full((5,), 2))
    with pytest.raises(ValueError, match="needs labels="):
        projections.features(model, x1, dim=8, kind="lpntk")
    with pytest.raises(ValueError, match=r"outside 0\.\.2"):
        projections.projected_ntk(model, x1, x2, dim=8, kind="lpntk", labels=y1, labels2=y2 + 3)
    assert "lpntk" in ntk.LABELLED_KINDS and "lpntk" not in ntk.KINDS


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_projected_lpntk_is_the_signed_projection_of_the_full_features(name):
    """Φ_lpntk(x) = s(y)ᵀ Φ_full(x) with the same random matrices where the projection route of
    every layer is the same for one cotangent as for O (see `projections._sketch`)."""
    model, x1, _ = make(name)
    y1 = random_labels(x1, 3, 6)
    full = projections.features(model, x1, dim=64, kind="full", seed=4)
    phi = projections.features(model, x1, dim=64, kind="lpntk", labels=y1, seed=4, batch_size=2)
    assert phi.shape == (count(x1), 64)
    assert rel_err(phi, torch.einsum("io,iok->ik", signs(y1, 3), full)) <= 1e-10


@pytest.mark.parametrize("name", ["mlp", "transformer", "tied"])
def test_projected_lpntk_is_unbiased(name):
    model, x1, x2 = make(name)
    o = ntk.empirical_ntk(model, x1[:1], kind="full").shape[-1]
    y1 = random_labels(x1, o, 6)
    exact = ntk.empirical_ntk(model, x1, kind="lpntk", labels=y1)
    phi = projections.features(model, x1, dim=2000, kind="lpntk", labels=y1, seed=1)
    assert_unbiased(torch.einsum("ij,kj->jik", phi, phi) * phi.shape[-1], exact)
    k = projections.projected_ntk(model, x1, dim=2000, kind="lpntk", labels=y1, seed=1)
    assert torch.allclose(k, phi @ phi.T, rtol=1e-12, atol=1e-12 * float(k.abs().max()))
    y2 = random_labels(x2, o, 7)
    cross = projections.projected_ntk(
        model, x1, x2, dim=16, kind="lpntk", labels=y1, labels2=y2, seed=1
    )
    assert cross.shape == (count(x1), count(x2))
