"""Kinds as objects: per-sample cotangents (the margin-gradient kernel TRAK featurises once per
sample), `per_layer=` against `layers=`, and a kind given as an object."""

import pytest
import torch
from models import make
from reference import rel_err

import ntk
import projections
from attribution import trak
from attribution.outputs import logits, margin_gradient
from ntk.core import kinds, structured


def test_weighted_kind_is_the_contraction_of_the_full_kernel():
    model, x1, x2 = make("transformer")
    g = torch.Generator().manual_seed(0)
    u1, u2 = torch.randn(5, 4, generator=g).double(), torch.randn(3, 4, generator=g).double()
    full = ntk.empirical_ntk(model, x1, x2, kind="full")
    for method in ("structured", "ntk_vp"):
        k = ntk.empirical_ntk(
            model, x1, x2, kind=kinds.Weighted(), labels=u1, labels2=u2, method=method
        )
        assert rel_err(k, torch.einsum("io,ijoq,jq->ij", u1, full, u2)) <= 1e-12
    with pytest.raises(ValueError, match=r"float array \[5, 4\]"):
        ntk.empirical_ntk(model, x1, kind=kinds.Weighted(), labels=u1[:, :2])


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_trak_featurises_one_cotangent_per_sample_with_unchanged_scores(monkeypatch, name):
    """TRAK's features are each sample's margin gradient times its Jacobian, projected: one
    cotangent per sample, and the scores of the O-cotangent route (full features contracted
    afterwards) to rounding."""
    model, x, _ = make(name)
    xt = x[:2]
    y, yt = torch.tensor([0, 1, 2, 0, 1, 2][: len(x)]), torch.tensor([1, 0])
    seen = []
    original = structured.features

    def recording(view, plan, xb, cot, **checks):
        seen.append(cot.shape[0])
        return original(view, plan, xb, cot, **checks)

    monkeypatch.setattr(structured, "features", recording)
    got = trak(model, x, y, xt, yt, dim=32, seed=5)
    assert seen and set(seen) == {1}
    monkeypatch.undo()
    phi, phi_t = (
        torch.einsum(
            "io,iok->ik",
            margin_gradient(logits(model, v), w),
            projections.features(model, v, dim=32, kind="full", seed=5),
        )
        for v, w in ((x, y), (xt, yt))
    )
    q = 1 - logits(model, x).softmax(1)[torch.arange(len(y)), y]
    assert rel_err(got, phi_t @ torch.linalg.pinv(phi) * q) <= 1e-9


@pytest.mark.parametrize("method", ["structured", "ntk_vp"])
def test_per_layer_splits_and_layers_restricts(method):
    model, x1, x2 = make("cnn")
    parts = ntk.empirical_ntk(model, x1, x2, kind="trace", layers="all", method=method)
    chosen = ["conv1", "gn", "head"]
    total = ntk.empirical_ntk(
        model, x1, x2, kind="trace", layers=chosen, per_layer=False, method=method
    )
    assert rel_err(total, sum(parts[layer] for layer in chosen)) <= 1e-12
    split = ntk.empirical_ntk(model, x1, x2, kind="trace", per_layer=True, method=method)
    assert list(split) == list(parts)
    assert all(rel_err(split[k], parts[k]) <= 1e-12 for k in parts)
    whole = ntk.empirical_ntk(model, x1, x2, kind="trace", layers="all", per_layer=False)
    assert rel_err(whole, ntk.empirical_ntk(model, x1, x2, kind="trace")) <= 1e-12
    with pytest.raises(TypeError, match="per_layer"):
        ntk.empirical_ntk(model, x1, kind="trace", per_layer="yes")


def test_projected_per_layer_false_is_the_sum_of_the_layers():
    model, x1, _ = make("mlp")
    parts = projections.features(model, x1, dim=16, layers=["fc1", "head"], seed=2)
    total = projections.features(model, x1, dim=16, layers=["fc1", "head"], per_layer=False, seed=2)
    assert rel_err(total, parts["fc1"] + parts["head"]) <= 1e-12
    k = projections.projected_ntk(model, x1, dim=16, layers=["fc1"], per_layer=False, seed=2)
    assert rel_err(k, torch.einsum("iok,jok->ij", parts["fc1"], parts["fc1"])) <= 1e-12


def test_labels_for_a_single_output_model_name_the_one_logit_remedy():
    """0/1 labels for a one-logit binary classifier were refused as labels only ("y holds labels
    outside 0..0: 1 at sample 1 (the model has 1 output)", by KernelSurrogate, layer_importance,
    train_on_subsets); the message now says how to give it a score per class.
    (sample_interactions takes the logit as it is: test_interactions.)"""
    from attribution import KernelSurrogate

    with pytest.raises(
        ValueError, match=r"outside 0\.\.0: 1 at sample 1 \(the model has 1 output;"
    ):
        kinds.class_labels(torch.tensor([0, 1, 0]), 3, 1, "y")
    torch.manual_seed(0)
    model, x, y = torch.nn.Linear(4, 1), torch.randn(6, 4), torch.tensor([0, 1] * 3)
    with pytest.raises(ValueError, match=r"one logit z .*output_fn=lambda z: torch\.stack"):
        KernelSurrogate(model).fit(x, y)
