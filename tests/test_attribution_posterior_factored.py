"""NTKPosterior(curvature="ekfac" / "kfac"): the Laplace posterior of the block-diagonal
Kronecker-factored Gauss–Newton curvature, checked against that posterior written out as dense
matrices from per-sample autograd Jacobians, and against the exact posterior where K-FAC is
exact."""

import math

import numpy as np
import pytest
import scipy.optimize
import torch
from models import DictOutput, WideScale
from torch import nn
from torch.func import functional_call, jacrev

from attribution import NTKPosterior
from attribution.curvature import MAX_DENSE, UnfactorableModelError
from attribution.posterior import EFFECTIVE_PARAMETERS, EVIDENCE_TOL

FACTORED = ["ekfac", "kfac"]


def _layer_jacobians(model, x) -> dict[str, torch.Tensor]:
    """Per Linear layer, the Jacobian of the outputs [N, O, F_out·(F_in + 1)] with respect to its
    weight and bias, laid out as the Kronecker blocks are: rows of [W | b]."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    out = {}
    for name, module in model.named_children():
        if isinstance(module, nn.Linear):
            w, b = jac[f"{name}.weight"], jac[f"{name}.bias"]  # [N, O, F_out, F_in], [N, O, F_out]
            out[name] = torch.cat([w, b[..., None]], -1).flatten(2)
    return out


def _dense_curvature(post) -> dict[str, torch.Tensor]:
    """Each block of the fitted factored curvature as a dense matrix (Q_G ⊗ Q_A) diag(e) (·)ᵀ."""
    dense = {}
    for (_, layer), block in post.kronecker_.blocks.items():
        q = torch.kron(block.qg, block.qa)
        dense[layer] = q @ torch.diag(block.eigenvalues.flatten()) @ q.T
    return dense


@pytest.mark.parametrize("curvature", FACTORED)
def test_covariance_evidence_and_prior_are_those_of_the_factored_laplace_posterior(
    small_classifier, curvature, monkeypatch
):
    """Σ(x) = Σ_W J_W(x)(Ĝ_W + δI)⁻¹J_W(x)ᵀ, the evidence with log det(I + Ĝ/δ) over Ĝ's
    largest N·(O − 1) eigenvalues (the Gauss–Newton matrix's rank; Ĝ's rank is not bounded by
    N), the "auto" δ keeping SHAPE_EFFECTIVE_PARAMETERS effective parameters of Ĝ's spectrum and
    the temperature that spreads the training logits as the δ keeping EFFECTIVE_PARAMETERS does
    (without the
    training-variance cap, tested in test_attribution_posterior.py), each computed here from the
    blocks written out densely and autograd Jacobians."""
    model, x, y, xt, _ = small_classifier
    delta = 0.7
    post = NTKPosterior(model, curvature=curvature, prior_precision=delta).fit(x, y)
    blocks = _dense_curvature(post)
    assert set(blocks) == {"0", "2"}

    def covariance(jac: dict[str, torch.Tensor], d: float) -> torch.Tensor:
        """Σ_W J_W (Ĝ_W + dI)⁻¹ J_Wᵀ [M, O, O] from the dense blocks."""
        return sum(
            torch.einsum(
                "mop,pq,mrq->mor",
                jac[layer],
                torch.linalg.inv(g + d * torch.eye(len(g), dtype=g.dtype)),
                jac[layer],
            )
            for layer, g in blocks.items()
        )

    expected = covariance(_layer_jacobians(model, xt), delta)
    np.testing.assert_allclose(post.predict_variance(xt), expected.numpy(), rtol=1e-8, atol=1e-12)

    e = torch.cat([torch.linalg.eigvalsh(g).clamp_min(0) for g in blocks.values()])
    loglik = -float(nn.functional.cross_entropy(model(x).detach(), y, reduction="sum"))
    sq_norm = sum(float(p.detach().pow(2).sum()) for p in model.parameters())
    rank = len(x) * (model(x).shape[1] - 1)
    assert rank < int((e > 1e-12 * e.max()).sum())  # the truncation matters here
    logdet = float(torch.log1p(e.topk(rank).values / delta).sum())
    evidence = loglik - 0.5 * delta * sq_norm - 0.5 * logdet
    assert post.log_marginal_likelihood() == pytest.approx(evidence, rel=1e-8)

    monkeypatch.setattr("attribution.posterior.TRAINING_VARIANCE_RATIO", math.inf)
    monkeypatch.setattr("attribution.posterior.SHAPE_EFFECTIVE_PARAMETERS", 6.0)
    auto = NTKPosterior(model, curvature=curvature).fit(x, y)
    assert float((e / (e + auto.prior_precision_)).sum()) == pytest.approx(6.0, rel=1e-6)
    j = _layer_jacobians(model, x)
    with torch.no_grad():
        logit = model(x)
    centred = logit - logit.mean(1, keepdim=True)

    def variance_ratio(d: float) -> float:  # Σ_i tr(C Σ_d(x_i) C) / Σ_i ‖C f(x_i)‖²
        cov = covariance(j, d)
        cov = cov - cov.mean(1, keepdim=True)
        return float((cov - cov.mean(2, keepdim=True)).diagonal(dim1=1, dim2=2).sum()) / float(
            centred.pow(2).sum()
        )

    size = 10.0 ** scipy.optimize.brentq(
        lambda log_d: float((e / (e + 10.0**log_d)).sum()) - EFFECTIVE_PARAMETERS, -12.0, 12.0
    )
    temperature = variance_ratio(size) / variance_ratio(auto.prior_precision_)
    assert auto.temperature_ == pytest.approx(temperature, rel=1e-6)


@pytest.mark.parametrize("curvature", FACTORED)
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_equals_the_exact_posterior_where_kfac_is_exact(curvature, likelihood):
    """One Linear layer and one training sample: G = (Σ_c δ_c δ_cᵀ) ⊗ a aᵀ is one Kronecker
    product, so K-FAC and EK-FAC are exact and every output equals the exact posterior's."""
    torch.manual_seed(3)
    model = nn.Linear(5, 3).double().eval()
    x, xt = torch.randn(1, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    y = torch.tensor([1]) if likelihood == "classification" else torch.randn(1, 3).double()
    opts = dict(likelihood=likelihood, noise=0.5)
    fits = {
        prior: [
            NTKPosterior(model, curvature=c, prior_precision=prior, **opts).fit(x, y)
            for c in ("exact", curvature)
        ]
        for prior in (0.3, "auto", "evidence")
    }
    # "auto": the effective-parameters rule (classification), the evidence (regression)
    searched = ("evidence",) if likelihood == "classification" else ("auto", "evidence")
    for prior in [p for p in (0.3, "auto") if p not in searched]:
        exact, factored = fits[prior]
        assert factored.prior_precision_ == pytest.approx(exact.prior_precision_, rel=1e-6)
        np.testing.assert_allclose(
            factored.predict_variance(xt), exact.predict_variance(xt), rtol=1e-8, atol=1e-12
        )
        assert factored.log_marginal_likelihood() == pytest.approx(
            exact.log_marginal_likelihood(), rel=1e-8
        )
    # the evidence's maximiser, found by two searches over different brackets (their sizes are
    # N·O and P): the same to the search tolerance
    for prior in searched:
        exact, factored = fits[prior]
        gap = abs(math.log10(factored.prior_precision_ / exact.prior_precision_))
        assert gap <= 2 * EVIDENCE_TOL
        assert factored.log_marginal_likelihood() == pytest.approx(
            exact.log_marginal_likelihood(), rel=1e-5
        )


def test_evidence_and_validation_choose_the_prior_precision(small_classifier):
    """ "evidence" maximises the factored posterior's evidence and validation data minimise their
    NLL, both against a brute-force grid of fits."""
    model, x, y, xt, yt = small_classifier
    grid = 10.0 ** np.arange(-4.0, 3.01, 0.1)
    fits = [NTKPosterior(model, curvature="ekfac", prior_precision=d).fit(x, y) for d in grid]
    evidence = [f.log_marginal_likelihood() for f in fits]
    best = int(np.argmax(evidence))
    assert 0 < best < len(grid) - 1  # an interior maximum, so the test checks the search
    chosen = NTKPosterior(model, curvature="ekfac", prior_precision="evidence").fit(x, y)
    assert chosen.log_marginal_likelihood() >= max(evidence) - 1e-6
    tuned = NTKPosterior(model, curvature="ekfac").fit(x, y, validation=(xt, yt))
    assert -tuned.score(xt, yt) <= min(-f.score(xt, yt) for f in fits) + 1e-6


def test_output_fn_and_bad_input(small_classifier):
    model, x, y, xt, _ = small_classifier

    plain = NTKPosterior(model, curvature="ekfac", prior_precision=1.0).fit(x, y)
    mapped = NTKPosterior(
        DictOutput(model), curvature="ekfac", prior_precision=1.0, output_fn=lambda o: o["logits"]
    ).fit(x, y)
    np.testing.assert_allclose(mapped.predict_variance(xt), plain.predict_variance(xt), rtol=1e-10)
    with pytest.raises(ValueError, match="curvature must be one of"):
        NTKPosterior(model, curvature="shampoo").fit(x, y)
    with pytest.raises(ValueError, match="needs kind='full' and projection_dim=None"):
        NTKPosterior(model, curvature="ekfac", kind="trace").fit(x, y)
    with pytest.raises(ValueError, match="needs kind='full' and projection_dim=None"):
        NTKPosterior(model, curvature="kfac", projection_dim=16).fit(x, y)


def test_auto_takes_ekfac_where_it_applies_and_the_exact_forms_elsewhere(small_classifier):
    model, x, y, xt, _ = small_classifier
    auto = NTKPosterior(model).fit(x, y)
    assert auto.curvature == "auto" and auto.curvature_ == "ekfac"
    ekfac = NTKPosterior(model, curvature="ekfac").fit(x, y)
    np.testing.assert_array_equal(auto.predict_proba(xt), ekfac.predict_proba(xt))
    assert NTKPosterior(model, kind="trace").fit(x, y).curvature_ == "exact"
    assert NTKPosterior(model, projection_dim=32).fit(x, y).curvature_ == "exact"
    wide = nn.Sequential(WideScale(8, MAX_DENSE + 1), model).double().eval()
    assert NTKPosterior(wide, prior_precision=1.0).fit(x, y).curvature_ == "exact"
    with pytest.raises(UnfactorableModelError, match="without Kronecker structure"):
        NTKPosterior(wide, curvature="ekfac").fit(x, y)


def test_overflowing_activations_are_named_not_a_failed_eigh():
    """Finite inputs whose activations overflow float32 make the Kronecker factors non-finite;
    the fit says so instead of LAPACK's "failed to converge"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    x, y = torch.randn(16, 8), torch.arange(16) % 3
    x[3, 2] = 1e30
    with pytest.raises(ValueError, match="Kronecker factors of the curvature are not finite"):
        NTKPosterior(model, curvature="ekfac").fit(x, y)
