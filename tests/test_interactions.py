"""attribution.sample_interactions: scores against a direct computation from per-sample
gradients, the exact contradiction of a flipped duplicate, the projected kernel and input checks."""

import numpy as np
import pytest
import torch
from models import TwoLogits

from attribution import sample_interactions


def _mlp(classes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, classes)]
    return torch.nn.Sequential(*layers)


def _labelled_gradients(model, x, y, classes):
    """g_i = ∇θ s(y_i)ᵀ f(x_i), one autograd call per sample, float64."""
    model = model.double()
    rows = []
    for xi, yi in zip(x.double(), y):
        s = 2 * torch.nn.functional.one_hot(yi, classes).double() - 1
        grads = torch.autograd.grad(s @ model(xi[None])[0], list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def test_scores_match_a_direct_computation():
    model = _mlp(3)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 5, generator=gen), torch.randint(0, 3, (12,), generator=gen)
    out = sample_interactions(model, x, y, return_kernel=True, dtype=torch.float64)
    g = _labelled_gradients(_mlp(3), x, y, 3)
    k = (g @ g.T).numpy()
    np.testing.assert_allclose(out["kernel"], k, rtol=1e-9, atol=1e-12)
    c = k / np.sqrt(np.outer(np.diag(k), np.diag(k)))
    off = c[~np.eye(12, dtype=bool)].reshape(12, 11)
    np.testing.assert_allclose(out["support"], off.mean(1), rtol=1e-9)
    same = (y[:, None] == y[None, :]).numpy() & ~np.eye(12, dtype=bool)
    agreement = [c[i, same[i]].mean() if same[i].any() else 0.0 for i in range(12)]
    np.testing.assert_allclose(out["agreement"], agreement, rtol=1e-9)
    np.testing.assert_allclose(out["contradiction"], np.maximum(-off, 0).mean(1), rtol=1e-9)
    np.testing.assert_allclose(out["redundancy"], off.max(1), rtol=1e-9)
    masked = np.where(np.eye(12, dtype=bool), -np.inf, c)
    np.testing.assert_array_equal(out["partner"], masked.argmax(1))
    assert "kernel" not in sample_interactions(model, x, y)


def test_a_flipped_duplicate_is_exactly_contradictory():
    """With two classes s(1) = −s(0): a copy of a sample with the other label has cosine −1 with
    it, the most contradicting pair there can be."""
    model = _mlp(2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(10, 5, generator=gen)
    y = torch.randint(0, 2, (10,), generator=gen)
    x = torch.cat([x, x[:1]])
    y = torch.cat([y, 1 - y[:1]])
    out = sample_interactions(model, x, y, return_kernel=True)
    k = out["kernel"]
    assert k[0, 10] / np.sqrt(k[0, 0] * k[10, 10]) == pytest.approx(-1.0, abs=1e-5)
    assert out["contradiction"][10] >= 1 / 10 - 1e-6
    assert out["support"][10] < out["support"][1:10].min()


def test_projected_kernel_approximates_the_exact_one():
    model = _mlp(3)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 5, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    exact = sample_interactions(model, x, y, return_kernel=True)["kernel"]
    projected = sample_interactions(model, x, y, projection_dim=8192, return_kernel=True)
    rel = np.linalg.norm(projected["kernel"] - exact) / np.linalg.norm(exact)
    assert rel < 0.1
    again = sample_interactions(model, x, y, projection_dim=8192, seed=0, return_kernel=True)
    np.testing.assert_array_equal(again["kernel"], projected["kernel"])  # seeded
    # a numpy integer is a dimension (it was refused as "not a positive integer")
    numpy_dim = sample_interactions(model, x, y, projection_dim=np.int64(8192), return_kernel=True)
    np.testing.assert_array_equal(numpy_dim["kernel"], projected["kernel"])


def test_bad_input_is_named():
    model = _mlp(3)
    x, y = torch.randn(6, 5), torch.tensor([0, 1, 2, 0, 1, 2])
    with pytest.raises(ValueError, match="y"):
        sample_interactions(model, x, torch.tensor([0, 1, 2, 0, 1, 3]))
    with pytest.raises(ValueError, match="y"):
        sample_interactions(model, x, y[:5])
    with pytest.raises(ValueError, match="non-finite"):
        sample_interactions(model, torch.full((6, 5), float("nan")), y)
    with pytest.raises(ValueError, match="projection_dim"):
        sample_interactions(model, x, y, projection_dim=0)
    with pytest.raises(ValueError, match="at least 2 samples"):
        sample_interactions(model, x[:1], y[:1])


def test_projection_dim_may_be_a_numpy_integer():
    """A dimension read from numpy (np.int64) was refused as not an integer; True is no size."""
    model = _mlp(3)
    x, y = torch.randn(6, 5), torch.tensor([0, 1, 2, 0, 1, 2])
    expected = sample_interactions(model, x, y, projection_dim=64, return_kernel=True)
    got = sample_interactions(model, x, y, projection_dim=np.int64(64), return_kernel=True)
    np.testing.assert_array_equal(got["kernel"], expected["kernel"])
    with pytest.raises(ValueError, match="projection_dim must be a positive integer"):
        sample_interactions(model, x, y, projection_dim=True)


def test_a_one_logit_classifier_scores_as_its_class_scores():
    """A binary classifier with one logit z (labels 0 and 1) was refused; its interactions are
    those of its class scores (0, z), and labels other than 0 and 1 are refused naming y."""
    model = _mlp(1)
    x = torch.randn(6, 5)
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    got = sample_interactions(model, x, y, return_kernel=True)
    scores = sample_interactions(TwoLogits(model), x, y, return_kernel=True)
    for key, value in scores.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    with pytest.raises(ValueError, match=r"y holds labels outside 0\.\.1: 2 at sample 1"):
        sample_interactions(model, x, torch.tensor([0, 2, 1, 0, 1, 0]))
