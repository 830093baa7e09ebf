"""NTKPosterior: the kernel form equals the parameter-space linearised Laplace posterior, the
evidence-maximising prior precision against a brute-force grid, the links, the estimator contract
and the error paths."""

import copy
import math
import warnings
from functools import partial

import numpy as np
import pytest
import scipy.optimize
import torch
from models import DictOutput, TwoLogits, fitted
from sklearn.base import clone, is_classifier, is_regressor
from sklearn.exceptions import NotFittedError
from torch import nn
from torch.func import functional_call, jacrev

import attribution
from ntk import demo

# This file checks the exact posterior (kernel and parameter-space forms) against the Laplace
# posterior written out; the Kronecker-factored one (the default "auto") is checked in
# test_attribution_posterior_factored.py.
NTKPosterior = partial(attribution.NTKPosterior, curvature="exact")


def _jacobian(model, x):
    """J [N, O, P] of the outputs with respect to all parameters (float64)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    return torch.cat(
        [j.reshape(x.shape[0], -1, v.numel()) for j, v in zip(jac.values(), params.values())], dim=2
    )


def _parameter_space(model, x, xt, lam, delta):
    """J* (Σ_i J_iᵀ Λ_i J_i + δI)⁻¹ J*ᵀ and log det(GGN + δI) − P log δ."""
    j, jt = _jacobian(model, x), _jacobian(model, xt)
    p = j.shape[2]
    h = torch.einsum("iop,ioq,iqr->pr", j, lam, j) + delta * torch.eye(p, dtype=torch.float64)
    cov = torch.einsum("mop,pq,mrq->mor", jt, torch.linalg.inv(h), jt)
    return cov, float(torch.logdet(h)) - p * math.log(delta)


def _sq_norm(model):
    return sum(float(p.detach().pow(2).sum()) for p in model.parameters())


@pytest.mark.parametrize("delta", [0.05, 2.0])
def test_classification_equals_parameter_space_laplace(small_classifier, delta):
    model, x, y, xt, _ = small_classifier
    post = NTKPosterior(model, prior_precision=delta).fit(x, y)
    g = model(x).detach()
    p = g.softmax(1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    cov, logdet = _parameter_space(model, x, xt, lam, delta)
    assert np.allclose(post.predict_variance(xt), cov.numpy(), atol=1e-9, rtol=1e-8)
    assert np.allclose(post.predict_variance(xt, diagonal=True), cov.diagonal(0, 1, 2).numpy())
    loglik = -float(nn.functional.cross_entropy(g, y, reduction="sum"))
    evidence = loglik - 0.5 * delta * _sq_norm(model) - 0.5 * logdet
    assert post.log_marginal_likelihood() == pytest.approx(evidence, rel=1e-9, abs=1e-9)


def test_regression_equals_parameter_space_laplace(small_classifier):
    model, x, _, xt, _ = small_classifier
    targets = torch.randn(
        len(x), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    post = NTKPosterior(model, likelihood="regression", prior_precision=0.3).fit(x, targets)
    assert is_regressor(post) and not is_classifier(post)
    noise = float(((targets - model(x).detach()) ** 2).mean())
    assert post.noise_ == pytest.approx(noise)
    lam = torch.eye(3, dtype=torch.float64).expand(len(x), 3, 3) / noise
    cov, logdet = _parameter_space(model, x, xt, lam, 0.3)
    assert np.allclose(post.predict_variance(xt), cov.numpy(), atol=1e-9, rtol=1e-8)
    residual = ((targets - model(x).detach()) ** 2).sum()
    loglik = -0.5 * float(residual) / noise - 0.5 * targets.numel() * math.log(2 * math.pi * noise)
    evidence = loglik - 0.5 * 0.3 * _sq_norm(model) - 0.5 * logdet
    assert post.log_marginal_likelihood() == pytest.approx(evidence, rel=1e-9)
    assert np.allclose(post.predict(xt), model(xt).detach().numpy())
    total = post.predict_variance(xt) + noise * np.eye(3)
    mean = model(xt).detach().numpy()
    yt = mean + 0.5
    expected = np.mean(
        [
            -0.5 * (d @ np.linalg.solve(c, d)) - 0.5 * np.linalg.slogdet(2 * np.pi * c)[1]
            for d, c in zip(yt - mean, total)
        ]
    )
    assert post.score(xt, yt) == pytest.approx(expected)


def test_evidence_prior_precision_maximises_the_evidence(small_classifier):
    model, x, y, _, _ = small_classifier
    auto = NTKPosterior(model, prior_precision="evidence").fit(x, y)
    grid = 10.0 ** np.arange(-4.0, 3.01, 0.1)
    evidence = [
        NTKPosterior(model, prior_precision=d).fit(x, y).log_marginal_likelihood() for d in grid
    ]
    best = int(np.argmax(evidence))
    assert 0 < best < len(grid) - 1  # an interior maximum, so the test checks the search
    assert abs(math.log10(auto.prior_precision_) - math.log10(grid[best])) <= 0.1
    assert auto.log_marginal_likelihood() >= max(evidence) - 1e-6


def _effective_parameters(e: torch.Tensor, delta: float) -> float:
    return float((e / (e + delta)).sum())


def _training_variance_ratio(cov: torch.Tensor, logit: torch.Tensor) -> float:
    """Σ_i tr(C Σ(x_i) C) / Σ_i ‖C f(x_i)‖², C = I − 11ᵀ/O."""
    o = logit.shape[1]
    centre = torch.eye(o, dtype=torch.float64) - 1 / o
    spread = float((logit - logit.mean(1, keepdim=True)).pow(2).sum())
    return float(torch.einsum("ab,nbc,ca->", centre, cov, centre)) / spread


@pytest.mark.parametrize("ratio", [math.inf, 1e-3])
def test_auto_prior_takes_its_shape_from_many_effective_parameters_and_its_size_from_few(
    small_classifier, monkeypatch, ratio
):
    """Without validation data δ solves Σ_k e_k/(e_k + δ) = SHAPE_EFFECTIVE_PARAMETERS, with e
    the eigenvalues of the parameter-space Gauss–Newton matrix G = Σ_i J_iᵀ Λ_i J_i (the same
    nonzero eigenvalues as SΘS), and Σ(x) = T·J(x)(G + δI)⁻¹J(x)ᵀ with T·v(δ) =
    min(v(δ_size), ratio): v the centred logits' posterior variance on the training inputs over
    their mean square, δ_size keeping EFFECTIVE_PARAMETERS; all computed here in parameter space
    from per-sample Jacobians. ratio 1e-3 is below v(δ_size) (the cap binds), inf never binds."""
    from attribution.posterior import EFFECTIVE_PARAMETERS

    monkeypatch.setattr("attribution.posterior.SHAPE_EFFECTIVE_PARAMETERS", 6.0)
    monkeypatch.setattr("attribution.posterior.TRAINING_VARIANCE_RATIO", ratio)
    model, x, y, xt, _ = small_classifier
    post = NTKPosterior(model, curvature="exact").fit(x, y)
    j, jt = _jacobian(model, x), _jacobian(model, xt)
    with torch.no_grad():
        logit = model(x)
    p = logit.softmax(1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    g = torch.einsum("iop,ioq,iqr->pr", j, lam, j)
    e = torch.linalg.eigvalsh(g).clamp_min(0)
    delta = post.prior_precision_
    assert _effective_parameters(e, delta) == pytest.approx(6.0, rel=1e-6)

    def covariance(jac: torch.Tensor, d: float) -> torch.Tensor:
        inverse = torch.linalg.inv(g + d * torch.eye(len(g), dtype=torch.float64))
        return torch.einsum("mop,pq,mrq->mor", jac, inverse, jac)

    size = 10.0 ** scipy.optimize.brentq(
        lambda log_d: _effective_parameters(e, 10.0**log_d) - EFFECTIVE_PARAMETERS, -12.0, 12.0
    )
    unscaled = _training_variance_ratio(covariance(j, size), logit)
    assert (unscaled > ratio) == (ratio < math.inf)
    target = min(unscaled, ratio)
    temperature = target / _training_variance_ratio(covariance(j, delta), logit)
    assert post.temperature_ == pytest.approx(temperature, rel=1e-6)
    np.testing.assert_allclose(
        post.predict_variance(xt), temperature * covariance(jt, delta).numpy(), rtol=1e-6
    )


def _sized(post: NTKPosterior, x, y) -> tuple[NTKPosterior, float]:
    """The posterior (T = 1) at the δ keeping EFFECTIVE_PARAMETERS of the fitted `post`'s
    curvature, which sets the default's size, and that δ."""
    from attribution import damping
    from attribution.posterior import EFFECTIVE_PARAMETERS

    if post.curvature_ == "exact":
        size = damping.damping_keeping(post._system(), post._rank(), EFFECTIVE_PARAMETERS)
    else:
        size = damping.damping_for(post.kronecker_.eigenvalues, EFFECTIVE_PARAMETERS)
    sized = NTKPosterior(post.model, curvature=post.curvature_, prior_precision=size)
    return sized.fit(x, y), size


@pytest.mark.parametrize("curvature", ["exact", "ekfac"])
def test_auto_prior_caps_the_logit_variance_on_the_training_inputs(curvature):
    """A tanh network trained to confidence: the curvature collapses and the posterior keeping
    EFFECTIVE_PARAMETERS would spread the centred logits on the training inputs by more than
    TRAINING_VARIANCE_RATIO of their mean square, so the default's spread (computed here from
    predict_variance) equals that ratio. Stopped early, the cap does not bind: the spread is
    that of the posterior at the δ keeping EFFECTIVE_PARAMETERS (T = 1)."""
    from attribution.posterior import TRAINING_VARIANCE_RATIO

    torch.manual_seed(0)
    x = torch.randn(40, 6, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    for epochs, binds in ((300, True), (20, False)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
        model = demo.train(model, x, y, epochs=epochs, batch_size=10, lr=1e-2, weight_decay=0.0)
        post = NTKPosterior(model, curvature=curvature).fit(x, y)
        sized, size = _sized(post, x, y)
        with torch.no_grad():
            logit = model(x)
        unscaled = _training_variance_ratio(torch.as_tensor(sized.predict_variance(x)), logit)
        got = _training_variance_ratio(torch.as_tensor(post.predict_variance(x)), logit)
        assert post.prior_precision_ < size  # the shape keeps more effective parameters
        if binds:
            assert unscaled > 1.2 * TRAINING_VARIANCE_RATIO
            assert got == pytest.approx(TRAINING_VARIANCE_RATIO, rel=1e-6)
        else:
            assert unscaled < TRAINING_VARIANCE_RATIO
            assert got == pytest.approx(unscaled, rel=1e-6)


@pytest.mark.parametrize("curvature", ["exact", "ekfac"])
def test_auto_prior_is_widest_where_the_training_inputs_never_reach(curvature):
    """The training inputs span three of six coordinates. The default posterior (the shape of
    many effective parameters) spreads the logits of inputs in the other three far more than
    those of inputs like the training ones; the posterior of the few effective parameters that
    set its size, mostly the prior, hardly tells them apart."""
    torch.manual_seed(0)
    x = torch.randn(60, 6, dtype=torch.float64)
    x[:, 3:] = 0
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    torch.manual_seed(1)
    inside, outside = torch.randn(2, 20, 6, dtype=torch.float64)
    inside[:, 3:], outside[:, :3] = 0, 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model = demo.train(model, x, y, epochs=100, batch_size=10, lr=1e-2)
    post = NTKPosterior(model, curvature=curvature).fit(x, y)
    sized = _sized(post, x, y)[0]
    centre = torch.eye(3, dtype=torch.float64) - 1 / 3

    def spread(fitted: NTKPosterior, z: torch.Tensor) -> float:
        cov = torch.as_tensor(fitted.predict_variance(z))
        return float(torch.einsum("ab,nbc,ca->", centre, cov, centre))

    shaped = spread(post, outside) / spread(post, inside)
    unshaped = spread(sized, outside) / spread(sized, inside)
    assert shaped > 3 * unshaped and unshaped < 5


@pytest.mark.parametrize("curvature", ["exact", "ekfac"])
def test_a_single_logit_is_a_binary_classifier(curvature):
    """A one-output model is the binary classifier with logits (0, z): the same prior, the same
    probabilities and covariance as the two-output model written out, for both curvatures and
    through output_fn."""
    torch.manual_seed(0)
    x = torch.randn(30, 4, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    xt = torch.randn(7, 4, dtype=torch.float64)
    expected = NTKPosterior(TwoLogits(net), curvature=curvature).fit(x, y)
    for model, output_fn in ((net, None), (DictOutput(net), lambda out: out["logits"])):
        got = NTKPosterior(model, curvature=curvature, output_fn=output_fn).fit(x, y)
        assert got.prior_precision_ == pytest.approx(expected.prior_precision_, rel=1e-9)
        np.testing.assert_allclose(got.predict_proba(xt), expected.predict_proba(xt), rtol=1e-9)
        np.testing.assert_allclose(
            got.predict_variance(xt), expected.predict_variance(xt), rtol=1e-9, atol=1e-15
        )
        assert list(got.classes_) == [0, 1] and got.predict(xt).shape == (7,)


def test_labels_of_a_one_logit_classifier_are_checked_as_0_and_1():
    """The posterior makes a one-logit model's two classes, then checked the labels against
    them: a label 2 was said to lie outside 0..1 of "the model has 2 outputs"."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double().eval()
    x, y = torch.randn(10, 4, dtype=torch.float64), torch.tensor([0, 1] * 5)
    one = "outside 0..1: 2 at sample 3 \\(the model has one output, a binary classifier's logit\\)"
    with pytest.raises(ValueError, match="y_train holds labels " + one):
        NTKPosterior(net).fit(x, torch.where(torch.arange(10) == 3, 2, y))
    fitted_posterior = NTKPosterior(net).fit(x, y)
    for name, call in (
        ("y", lambda bad: fitted_posterior.score(x, bad)),
        ("y_val", lambda bad: NTKPosterior(net).fit(x, y, validation=(x, bad))),
    ):
        with pytest.raises(ValueError, match=f"{name} holds labels " + one):
            call(torch.where(torch.arange(10) == 3, 2, y))


def test_validation_data_choose_the_prior_precision_minimising_their_nll(small_classifier):
    """fit(..., validation=) picks δ whose validation NLL (= −score, computed by the ordinary
    Cholesky path) is the smallest of a brute-force grid, up to the search tolerance."""
    model, x, y, xt, yt = small_classifier
    tuned = NTKPosterior(model).fit(x, y, validation=(xt, yt))
    grid = 10.0 ** np.arange(-4.0, 4.01, 0.1)
    losses = [-NTKPosterior(model, prior_precision=d).fit(x, y).score(xt, yt) for d in grid]
    assert -tuned.score(xt, yt) <= min(losses) + 1e-6
    rule = NTKPosterior(model).fit(x, y)
    assert tuned.prior_precision_ != pytest.approx(rule.prior_precision_, rel=0.1)
    with pytest.raises(ValueError, match="prior_precision='auto'"):
        NTKPosterior(model, prior_precision="evidence").fit(x, y, validation=(xt, yt))
    with pytest.raises(ValueError, match="prior_precision='auto'"):
        NTKPosterior(model, prior_precision=1.0).fit(x, y, validation=(xt, yt))
    with pytest.raises(ValueError, match="pair"):
        NTKPosterior(model).fit(x, y, validation=xt)
    with pytest.raises(ValueError, match="y_val"):
        NTKPosterior(model).fit(x, y, validation=(xt, yt + 5))


def test_validation_data_that_push_the_prior_to_the_bottom_of_its_search_range_are_warned_about(
    small_classifier,
):
    """Validation labels the network ranks last take δ at the bottom of its search range (the
    broadest posterior searched), with a warning saying so, pointing at the caller's fit; labels
    with an inside optimum, or the network's own predictions (the top: no posterior spread, the
    limit those prefer), give none. Validation targets the regression model predicts exactly
    leave σ² nothing to estimate from (a ValueError; was torch's MultivariateNormal failing on a
    zero covariance)."""
    model, x, y, xt, yt = small_classifier
    with torch.no_grad():
        out = model(xt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inside = NTKPosterior(model).fit(x, y, validation=(xt, yt)).prior_precision_
        top = NTKPosterior(model).fit(x, y, validation=(xt, out.argmax(1))).prior_precision_
    with pytest.warns(UserWarning, match="validation loss falls .* down to the edge") as caught:
        bottom = NTKPosterior(model).fit(x, y, validation=(xt, out.argmin(1))).prior_precision_
    assert caught[0].filename == __file__
    assert bottom < 1e-4 * inside < 1e-8 * top
    with torch.no_grad():
        targets = model(x)
    regression = NTKPosterior(model, likelihood="regression")
    with pytest.raises(ValueError, match="predicts the validation targets exactly"):
        regression.fit(x, targets + 0.1, validation=(xt, out))
    assert not hasattr(regression, "factor_")


def test_links_and_uncertainty(small_classifier):
    model, x, y, xt, yt = small_classifier
    probit = NTKPosterior(model, prior_precision=1.0).fit(x, y)
    p = probit.predict_proba(xt)
    errors = []
    for delta in (1.0, 10.0, 100.0):  # the probit approximates the MC average, the closer the
        mc = NTKPosterior(model, prior_precision=delta, link="mc", mc_samples=20000).fit(x, y)
        q = mc.predict_proba(xt)  # smaller the variance
        near = NTKPosterior(model, prior_precision=delta).fit(x, y).predict_proba(xt)
        assert np.allclose(q.sum(1), 1)
        errors.append(np.abs(near - q).max())
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.02
    assert np.allclose(p.sum(1), 1)
    assert np.array_equal(probit.predict(xt), p.argmax(1))
    softmax = model(xt).detach().softmax(1).numpy()
    ent = lambda r: -(r * np.log(r)).sum(1)  # noqa: E731
    assert np.all(ent(p) >= ent(softmax) - 1e-12)  # the posterior only widens the logits
    u = probit.uncertainty(xt)
    assert np.allclose(u["entropy"], ent(p))
    assert np.all(u["mutual_information"] >= 0) and np.all(u["mutual_information"] <= ent(p))
    # a sharper prior leaves less epistemic uncertainty and less change from the softmax
    sharp = NTKPosterior(model, prior_precision=1e4).fit(x, y)
    assert sharp.uncertainty(xt)["mutual_information"].mean() < u["mutual_information"].mean()
    assert np.abs(sharp.predict_proba(xt) - softmax).max() < 1e-2
    logp = np.log(p[np.arange(len(yt)), yt.numpy()]).mean()
    assert probit.score(xt, yt) == pytest.approx(logp)


def test_common_mode_covariance_does_not_change_probit(small_classifier):
    """A covariance along (1, …, 1) shifts all logits together, which no softmax sees."""
    model, x, y, xt, _ = small_classifier
    post = NTKPosterior(model, prior_precision=1.0).fit(x, y)
    mean = torch.as_tensor(model(xt).detach())
    cov = torch.as_tensor(post.predict_variance(xt))
    ones = torch.ones(3, 3, dtype=torch.float64)
    assert torch.allclose(post._proba(mean, cov), post._proba(mean, cov + 7.0 * ones))


def test_a_constant_added_to_every_logit_does_not_change_the_probabilities(small_classifier):
    """Adding c to every head bias leaves the softmax, the curvature and the covariance as they
    are, so the predictive probabilities of both links must not move either."""
    model, x, y, xt, _ = small_classifier
    shifted = copy.deepcopy(model)
    with torch.no_grad():
        shifted[-1].bias += 20.0
    for link in ("probit", "mc"):
        p = NTKPosterior(model, prior_precision=1.0, link=link).fit(x, y).predict_proba(xt)
        q = NTKPosterior(shifted, prior_precision=1.0, link=link).fit(x, y).predict_proba(xt)
        assert np.allclose(p, q, atol=1e-10), link


@pytest.mark.parametrize("kind", ["trace", "sum_logits"])
def test_scalar_kinds(small_classifier, kind):
    model, x, y, xt, _ = small_classifier
    post = NTKPosterior(model, kind=kind, prior_precision=1.0).fit(x, y)
    cov = post.predict_variance(xt)
    assert cov.shape == (len(xt), 3, 3)
    assert np.all(np.linalg.eigvalsh(cov) > -1e-10)
    full = NTKPosterior(model, prior_precision=1.0).fit(x, y).predict_variance(xt)
    assert not np.allclose(cov, full)


def test_estimator_contract_and_model_untouched(small_classifier):
    model, x, y, xt, _ = small_classifier
    before = [p.detach().clone() for p in model.parameters()]
    post = NTKPosterior(model, kind="trace", prior_precision=0.5, link="mc")
    assert is_classifier(post)
    c = clone(post)
    assert c.get_params()["kind"] == "trace" and c.get_params()["prior_precision"] == 0.5
    for call in (post.predict_proba, post.predict_variance, post.uncertainty):
        with pytest.raises(NotFittedError):
            call(xt)
    with pytest.raises(NotFittedError):
        post.log_marginal_likelihood()
    post.fit(x.numpy(), y.numpy())  # numpy inputs
    assert post.predict_proba(xt.numpy()).shape == (len(xt), 3)
    assert model.training is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_parameters_set_after_fit_are_refused_until_the_next_fit(small_classifier):
    """set_params after fit: the fitted factors were read with the new prior precision or kind;
    the link, its draws and (nothing projected) the seed are the predictions' own."""
    model, x, y, xt, _ = small_classifier
    post = NTKPosterior(model, kind="trace", prior_precision=0.5).fit(x, y)
    probit = post.predict_proba(xt)
    post.set_params(link="mc", mc_samples=50, seed=3)
    assert post.predict_proba(xt).shape == probit.shape
    post.set_params(prior_precision=5.0)
    for call in (post.predict_proba, post.predict_variance, post.uncertainty):
        with pytest.raises(ValueError, match=r"prior_precision=5.0 \(fitted with 0.5\)"):
            call(xt)
    with pytest.raises(ValueError, match="call fit again"):
        post.log_marginal_likelihood()
    post.set_params(link="probit", prior_precision=0.5)
    np.testing.assert_array_equal(post.predict_proba(xt), probit)
    projected = NTKPosterior(model, kind="trace", prior_precision=0.5, projection_dim=16)
    projected.fit(x, y).set_params(seed=1)  # the seed drew the projection of the fit
    with pytest.raises(ValueError, match=r"seed=1 \(fitted with 0\)"):
        projected.predict_proba(xt)


def test_bad_input(small_classifier):
    model, x, y, _, _ = small_classifier
    with pytest.raises(ValueError, match="outside 0..2"):
        NTKPosterior(model).fit(x, y + 1)
    with pytest.raises(ValueError, match="integer class labels"):
        NTKPosterior(model).fit(x, torch.rand(len(x)))
    with pytest.raises(ValueError, match="1-d tensor"):
        NTKPosterior(model).fit(x, torch.rand(len(x), 3))
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="prior_precision must be a positive"):
            NTKPosterior(model, prior_precision=bad).fit(x, y)
    with pytest.raises(ValueError, match="prior_precision must be 'auto' or 'evidence'"):
        NTKPosterior(model, prior_precision="marglik").fit(x, y)
    with pytest.raises(ValueError, match="kind must be one of"):
        NTKPosterior(model, kind="diagonal").fit(x, y)
    with pytest.raises(ValueError, match="link must be one of"):
        NTKPosterior(model, link="bridge").fit(x, y)
    with pytest.raises(ValueError, match="noise must be"):
        NTKPosterior(model, likelihood="regression", noise=0).fit(x, torch.zeros(len(x), 3))
    with pytest.raises(ValueError, match=r"shape \[20, 3\]"):
        NTKPosterior(model, likelihood="regression").fit(x, torch.zeros(len(x)))
    nan_at_4 = torch.zeros(len(x), 3).index_fill_(0, torch.tensor([4]), float("nan"))
    with pytest.raises(ValueError, match=r"y_train contains non-finite .*first at sample 4"):
        NTKPosterior(model, likelihood="regression").fit(x, nan_at_4)
    with pytest.raises(ValueError, match="labels outside 0..1"):  # one output: a binary logit
        NTKPosterior(nn.Linear(8, 1).double()).fit(x, y)
    regression = NTKPosterior(model, likelihood="regression", prior_precision=1.0)
    regression.fit(x, torch.randn(len(x), 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="needs likelihood='classification'"):
        regression.predict_proba(x)
    with pytest.raises(TypeError):
        NTKPosterior("not a model").fit(x, y)


@pytest.mark.parametrize("curvature", ["exact", "ekfac"])
def test_a_sample_without_its_sample_axis_is_refused(small_classifier, curvature):
    """x_test[0] ([8], no sample axis) is 8 samples to the library, and the MLP maps it to 3
    outputs: predict returned those as 3 predictions of one output, silently."""
    model, x, y, xt, _ = small_classifier
    post = NTKPosterior(model, curvature=curvature).fit(x, y)
    regression = NTKPosterior(model, curvature=curvature, likelihood="regression")
    regression.fit(x, torch.randn(len(x), 3, dtype=torch.float64))
    for predict in (post.predict_proba, post.predict, regression.predict, post.predict_variance):
        with pytest.raises(ValueError, match="3 output rows for the 8 samples of x"):
            predict(xt[0])


@pytest.mark.parametrize("curvature", ["exact", "ekfac"])
def test_predict_variance_names_its_argument(small_classifier, curvature):
    """The exact posterior's covariance named the test inputs x1 (the kernel's argument) when the
    model failed on them (a float32 x for the float64 model, too few features); the mean's
    checked forward pass now runs first."""
    model, x, y, xt, _ = small_classifier
    post = NTKPosterior(model, curvature=curvature).fit(x, y)
    for bad in (xt.float(), xt[:, :5]):
        for predict in (post.predict_variance, post.predict_proba, post.uncertainty):
            with pytest.raises(ValueError, match="^x: the model failed"):
                predict(bad)


def test_bad_targets_and_weights_are_named(small_classifier):
    """Regression targets of strings raised torch's "can't convert np.ndarray of type
    numpy.str_", a sample_weight of the wrong length numpy's "Axis must be specified"."""
    model, x, y, xt, yt = small_classifier
    regression = NTKPosterior(model, likelihood="regression", prior_precision=1.0)
    with pytest.raises(TypeError, match="y_train must hold numbers"):
        regression.fit(x, np.array([["a", "b", "c"]] * len(x)))
    regression.fit(x, torch.randn(len(x), 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"y: regression targets must have shape \[8, 3\]"):
        regression.score(xt, torch.zeros(len(xt)))
    post = NTKPosterior(model).fit(x, y)
    with pytest.raises(ValueError, match=r"sample_weight must hold one weight per sample"):
        post.score(xt, yt, sample_weight=[1.0, 2.0])
    weights = np.arange(1.0, len(xt) + 1)
    assert post.score(xt, yt, sample_weight=weights) == pytest.approx(
        np.average(np.log(post.predict_proba(xt)[np.arange(len(xt)), yt.numpy()]), weights=weights)
    )


@pytest.mark.parametrize("curvature", ["exact", "ekfac"])
def test_a_model_without_parameters_is_named(small_classifier, curvature):
    """A model with no parameters at all raised a bare StopIteration (the inputs' dtype was read
    from its first parameter)."""
    _, x, y, _, _ = small_classifier
    post = NTKPosterior(nn.Softmax(-1), curvature=curvature)
    with pytest.raises(ValueError, match="no trainable parameters"):
        post.fit(x[:, :3], y)
    with pytest.raises(ValueError, match="no trainable parameters"):
        post.fit(x[:, :3].numpy(), y)


@pytest.mark.parametrize("curvature", ["exact", "ekfac"])
def test_validation_and_training_inputs_are_named(small_classifier, curvature):
    """Errors in the validation inputs named `x` (the inputs of predict), as did a numpy
    x_train of strings."""
    model, x, y, xt, yt = small_classifier
    post = NTKPosterior(model, curvature=curvature)
    with pytest.raises(ValueError, match="x_val contains non-finite"):
        post.fit(x, y, validation=(xt * np.nan, yt))
    with pytest.raises(ValueError, match="x_val: the model failed"):
        post.fit(x, y, validation=(xt[:, :5], yt))
    with pytest.raises(TypeError, match="x_val holds a numpy array"):
        post.fit(x, y, validation=(np.full(tuple(xt.shape), "a"), yt))
    with pytest.raises(TypeError, match="x_train holds a numpy array"):
        post.fit(np.full(tuple(x.shape), "a"), y)


@pytest.mark.parametrize("curvature", ["exact", "ekfac"])
def test_targets_fitted_exactly_need_a_noise(small_classifier, curvature):
    """Targets the network fits exactly (its own outputs): with the default prior the joint
    evidence put σ² at the bottom of its search range (1e-10), silently, where a numeric prior
    already refused them; a given noise, or validation data, is used."""
    model, x, _, xt, _ = small_classifier
    with torch.no_grad():
        own, own_test = model(x), model(xt) + 0.1
    for prior in ("auto", "evidence", 1.0):
        post = NTKPosterior(model, likelihood="regression", curvature=curvature)
        with pytest.raises(ValueError, match="fits the targets exactly"):
            post.set_params(prior_precision=prior).fit(x, own)
        assert post.set_params(noise=0.1).fit(x, own).noise_ == 0.1
    post = NTKPosterior(model, likelihood="regression", curvature=curvature)
    assert post.fit(x, own, validation=(xt, own_test)).noise_ > 1e-4


def test_changing_the_training_array_after_fit_changes_nothing(small_classifier):
    """The posterior kept the caller's training array (a numpy array shared its memory), and its
    kernel form compares new inputs with it at every prediction: standardising the array in
    place after fit changed the predictive covariance silently."""
    model, x, y, xt, _ = small_classifier
    for x_train in (x.numpy().copy(), x.clone()):
        post = NTKPosterior(model, prior_precision=0.5).fit(x_train, y)
        before = post.predict_variance(xt)
        x_train *= 2
        np.testing.assert_array_equal(post.predict_variance(xt), before)


def test_a_numpy_integer_seed_draws_the_monte_carlo_samples(small_classifier):
    """seed=np.int64(3) passes the parameter check (an Integral) but torch.Generator.manual_seed
    raised "TypeError: an integer is required" in predict_proba (link="mc") and uncertainty."""
    model, x, y, xt, _ = small_classifier
    options = dict(link="mc", mc_samples=50, prior_precision=1.0)
    expected = NTKPosterior(model, seed=3, **options).fit(x, y)
    post = NTKPosterior(model, seed=np.int64(3), **options).fit(x, y)
    np.testing.assert_array_equal(post.predict_proba(xt), expected.predict_proba(xt))
    got, want = post.uncertainty(xt), expected.uncertainty(xt)
    np.testing.assert_array_equal(got["mutual_information"], want["mutual_information"])


def test_float32_kernels_below_their_precision_are_refused_or_skipped():
    """The kernel form's Σ = (Θ(x, x) − WᵀW)/δ cancels: from float32 kernels, with a small δ and
    a small noise, it gave negative variances (−0.07 for 0.01), and a validation search over δ
    failed inside torch ("covariance_matrix ... PositiveDefinite"). Now such a variance is
    refused at prediction and skipped by the search, which matches the float64 model's δ."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 256), nn.Tanh(), nn.Linear(256, 3))
    wide = copy.deepcopy(model).double()
    x, y = torch.randn(40, 4), torch.randn(40, 3)
    xv, yv = torch.randn(30, 4), torch.randn(30, 3)
    settings = dict(likelihood="regression", curvature="exact", noise=0.01)
    for delta in (1e-2, 1e-4):
        post = NTKPosterior(model, prior_precision=delta, **settings).fit(x, y)
        exact = NTKPosterior(wide, prior_precision=delta, **settings).fit(x.double(), y.double())
        expected = exact.predict_variance(x[:10].double(), diagonal=True)
        try:
            got = post.predict_variance(x[:10], diagonal=True)
        except ValueError as e:
            assert "below the precision of the kernels (torch.float32)" in str(e)
        else:
            np.testing.assert_allclose(got, expected, rtol=1e-2)
    for kind in ("full", "trace"):
        settings = dict(likelihood="regression", curvature="exact", kind=kind)
        post = NTKPosterior(model, **settings).fit(x, y, validation=(xv, yv))
        validation = (xv.double(), yv.double())
        exact = NTKPosterior(wide, **settings).fit(x.double(), y.double(), validation=validation)
        assert post.prior_precision_ == pytest.approx(exact.prior_precision_, rel=0.05)
        assert post.noise_ == pytest.approx(exact.noise_, rel=0.05)


def test_the_auto_prior_of_a_rank_deficient_system_does_not_depend_on_the_dtype():
    """Fewer parameters (75) than outputs (120): the default prior keeps at most half the
    system's numerical rank, and float32 Jacobians add rounding eigenvalues around 1e-12 of the
    top one. Counted as rank (e > 1e-12 · top), they put the float32 copy of the network at 67
    directions and the float64 copy at 64, 13 % apart in the predictive variance."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, generator=g)
    y = (x @ torch.randn(5, 3, generator=g)).argmax(1)
    torch.manual_seed(0)
    model = fitted(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)), x, y, 200)
    wide = copy.deepcopy(model).double()
    post = NTKPosterior(model).fit(x, y)
    exact = NTKPosterior(wide).fit(x.double(), y)
    assert post.prior_precision_ == pytest.approx(exact.prior_precision_, rel=0.05)
    variance, expected = post.predict_variance(x[:6]), exact.predict_variance(x[:6].double())
    assert np.abs(variance - expected).max() <= 0.02 * np.abs(expected).max()


def test_damping_for_counts_rounding_eigenvalues_as_almost_no_rank():
    """A target beyond half the rank is capped smoothly: three eigenvalues at 3e-12 of the top
    (float32 rounding) beside 64 above 1e-9 move λ by 1.4 %; counted as rank, by 39 %."""
    from attribution import damping

    signal = torch.logspace(0, -9, 64, dtype=torch.float64)
    for noise in (1e-13, 3e-12):
        spectrum = torch.cat([signal, torch.full((3,), noise, dtype=torch.float64)])
        if noise == 1e-13:
            quiet = damping.damping_for(spectrum, 40.0)
        else:
            assert damping.damping_for(spectrum, 40.0) == pytest.approx(quiet, rel=0.02)


@pytest.mark.parametrize("n_train", [12, 64])
def test_sequences_of_another_length_get_the_laplace_covariance(n_train):
    """Test sequences of 7 tokens after training sequences of 5 (as padded HF batches of another
    length) were refused ("x and x_train have different per-sample shapes") though the model
    takes both. Their covariance is the Laplace posterior's written out, in the kernel form
    (12 samples: P = 62 > N·O/2) and in parameter space (64 samples); inputs of another
    structure are still refused, naming both."""
    from models import SharedPositions

    torch.manual_seed(0)
    model = SharedPositions(seq=8).double().eval()
    g = torch.Generator().manual_seed(3)
    x, xt = torch.randint(0, 5, (n_train, 5), generator=g), torch.randint(0, 5, (3, 7), generator=g)
    y = torch.randint(0, 2, (n_train,), generator=g)
    post = NTKPosterior(model, prior_precision=0.5).fit(x, y)
    assert post.parameter_space_ == (n_train == 64)
    p = model(x).detach().softmax(1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    cov, _ = _parameter_space(model, x, xt, lam, 0.5)
    np.testing.assert_allclose(post.predict_variance(xt), cov.numpy(), rtol=1e-8, atol=1e-10)
    with pytest.raises(ValueError, match=r"^x and x_train must have the same structure"):
        post.predict_variance((xt,))


def test_targets_that_require_grad_are_scored(small_classifier):
    """Regression targets taken from a model's output without torch.no_grad (they carry its
    graph) made score fail with torch's "Can't call numpy() on Tensor that requires grad"."""
    model, x, _, xt, _ = small_classifier
    y, yt = model(x) + 0.1 * torch.randn(len(x), 3), model(xt) + 0.1
    assert yt.requires_grad
    post = NTKPosterior(model, likelihood="regression").fit(x, y)
    assert post.score(xt, yt) == post.score(xt, yt.detach())


@pytest.mark.parametrize("curvature", ["exact", "ekfac"])
def test_a_failed_refit_leaves_the_posterior_unfitted(small_classifier, curvature):
    """A refit that failed on its validation data left the new training set and curvature beside
    the previous factor and prior: predict raised a shape error from solve_triangular (exact) or
    returned variances mixing both fits (EK-FAC, 0.19 off), silently."""
    model, x, y, xt, yt = small_classifier
    for likelihood, targets, bad in (
        ("classification", y, yt + 10),
        ("regression", torch.randn(len(x), 3, dtype=torch.float64), torch.zeros(len(xt), 2)),
    ):
        post = NTKPosterior(model, curvature=curvature, likelihood=likelihood).fit(x, targets)
        with pytest.raises(ValueError, match="y_val"):
            post.fit(x[:5], targets[:5], validation=(xt, bad))
        with pytest.raises(NotFittedError):
            post.predict_variance(xt)


def test_output_fn_maps_the_models_output_to_the_logits(small_classifier):
    model, x, y, xt, _ = small_classifier
    plain = NTKPosterior(model, prior_precision=1.0).fit(x, y)
    mapped = NTKPosterior(
        DictOutput(model), prior_precision=1.0, output_fn=lambda out: out["logits"]
    ).fit(x, y)
    np.testing.assert_allclose(mapped.predict_proba(xt), plain.predict_proba(xt), rtol=1e-10)
    np.testing.assert_allclose(
        mapped.predict_variance(xt), plain.predict_variance(xt), rtol=1e-8, atol=1e-12
    )
    with pytest.raises(TypeError, match="output_fn"):
        NTKPosterior(DictOutput(model), prior_precision=1.0).fit(x, y)


def test_cross_val_score_and_grid_search(small_classifier):
    from sklearn.model_selection import GridSearchCV, cross_val_score

    model, x, y, _, _ = small_classifier
    scores = cross_val_score(NTKPosterior(model, prior_precision=1.0), x.numpy(), y.numpy(), cv=2)
    assert scores.shape == (2,) and np.all(scores <= 0)  # mean log predictive density
    search = GridSearchCV(NTKPosterior(model), {"prior_precision": [0.1, 10.0]}, cv=2).fit(x, y)
    assert search.best_params_["prior_precision"] in (0.1, 10.0)


def test_projected_parameter_space_posterior_equals_the_kernel_form(small_classifier):
    """N·O = 60 > projection_dim = 32: the k × k parameter-space system gives the kernel form's
    covariance and evidence with the projected kernel Θ = ΦΦᵀ (push-through identity)."""
    import projections

    model, x, y, xt, yt = small_classifier
    delta, k = 0.7, 32
    post = NTKPosterior(model, prior_precision=delta, projection_dim=k, seed=3).fit(x, y)
    assert post.parameter_space_
    phi = torch.as_tensor(projections.features(model, x, dim=k, kind="full", seed=3)).double()
    phi_t = torch.as_tensor(projections.features(model, xt, dim=k, kind="full", seed=3)).double()
    with torch.no_grad():
        g = model(x).double()
    p = g.softmax(1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    evals, evecs = torch.linalg.eigh(lam)
    s = evecs @ torch.diag_embed(evals.clamp_min(0).sqrt()) @ evecs.transpose(1, 2)
    n, o = g.shape
    theta = torch.einsum("iak,jbk->ijab", phi, phi)  # the projected kernel [N, N, O, O]
    a = torch.einsum("iop,ijpr,jrq->iojq", s, theta, s).reshape(n * o, n * o)
    cross = torch.einsum("mak,jbk->mjab", phi_t, phi)
    b = torch.einsum("mipq,iqr->irmp", cross, s).reshape(n * o, -1)
    explained = b.T @ torch.linalg.solve(a + delta * torch.eye(n * o, dtype=torch.float64), b)
    m = phi_t.shape[0]
    explained = explained.reshape(m, o, m, o).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    prior = torch.einsum("mak,mbk->mab", phi_t, phi_t)
    expected = (prior - explained) / delta
    np.testing.assert_allclose(post.predict_variance(xt), expected.numpy(), rtol=1e-6, atol=1e-9)
    loglik = -float(torch.nn.functional.cross_entropy(g, y, reduction="sum"))
    sq = sum(float(q.detach().double().pow(2).sum()) for q in model.parameters())
    logdet = torch.linalg.slogdet(torch.eye(n * o, dtype=torch.float64) + a / delta)[1]
    evidence = loglik - 0.5 * delta * sq - 0.5 * float(logdet)
    assert post.log_marginal_likelihood() == pytest.approx(evidence, rel=1e-8)
    tuned = NTKPosterior(model, projection_dim=k, seed=3).fit(x, y, validation=(xt, yt))
    assert tuned.parameter_space_ and tuned.prior_precision_ > 0
    kernel_form = NTKPosterior(model, prior_precision=delta, projection_dim=64, seed=3).fit(x, y)
    assert not kernel_form.parameter_space_  # N·O = 60 ≤ 64


def test_exact_parameter_space_when_parameters_are_few(small_classifier, monkeypatch):
    """P = 75 ≤ N·O/2 = 90: the exact posterior runs as a P × P system on the per-sample
    Jacobians, with the kernel form's covariance, evidence and effective-parameter prior (all
    checked against the parameter-space Laplace written out); frozen parameters stay out of P."""
    monkeypatch.setattr("attribution.posterior.SHAPE_EFFECTIVE_PARAMETERS", 6.0)
    model, x20, _, xt, yt = small_classifier
    x = torch.cat(
        [x20, torch.randn(40, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))]
    )
    y = torch.arange(60) % 3
    assert not NTKPosterior(model, prior_precision=0.5).fit(x20, y[:20]).parameter_space_
    with torch.no_grad():
        g = model(x)
    p = g.softmax(1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    for delta in (0.05, 2.0):
        post = NTKPosterior(model, prior_precision=delta).fit(x, y)
        assert post.parameter_space_
        cov, logdet = _parameter_space(model, x, xt, lam, delta)
        assert np.allclose(post.predict_variance(xt), cov.numpy(), atol=1e-9, rtol=1e-8)
        loglik = -float(nn.functional.cross_entropy(g, y, reduction="sum"))
        evidence = loglik - 0.5 * delta * _sq_norm(model) - 0.5 * logdet
        assert post.log_marginal_likelihood() == pytest.approx(evidence, rel=1e-9, abs=1e-9)
    auto = NTKPosterior(model).fit(x, y)
    j = _jacobian(model, x)
    e = torch.linalg.eigvalsh(torch.einsum("iop,ioq,iqr->pr", j, lam, j)).clamp_min(0)
    assert _effective_parameters(e, auto.prior_precision_) == pytest.approx(6.0, rel=1e-6)
    tuned = NTKPosterior(model).fit(x, y, validation=(xt, yt))
    assert tuned.parameter_space_ and np.isfinite(tuned.predict_proba(xt)).all()

    frozen = copy.deepcopy(model)
    frozen[0].requires_grad_(False)  # P = 21 trainable
    post = NTKPosterior(frozen, prior_precision=0.5).fit(x20, y[:20])  # N·O/2 = 30 ≥ 21
    assert post.parameter_space_
    head = {k: v.detach() for k, v in frozen.named_parameters() if v.requires_grad}
    body = {k: v.detach() for k, v in frozen.named_parameters() if not v.requires_grad}

    def jac(inputs):
        j = jacrev(lambda q: functional_call(frozen, {**body, **q}, (inputs,)))(head)
        return torch.cat([v.reshape(len(inputs), 3, -1) for v in j.values()], 2)

    with torch.no_grad():
        q = frozen(x20).softmax(1)
    lam20 = torch.diag_embed(q) - q[:, :, None] * q[:, None, :]
    j20, jt = jac(x20), jac(xt)
    h = torch.einsum("iop,ioq,iqr->pr", j20, lam20, j20) + 0.5 * torch.eye(21, dtype=torch.float64)
    cov = torch.einsum("mop,pq,mrq->mor", jt, torch.linalg.inv(h), jt)
    assert np.allclose(post.predict_variance(xt), cov.numpy(), atol=1e-9, rtol=1e-8)


@pytest.mark.parametrize("curvature", ["auto", "exact"])
def test_tuples_and_dicts_of_numpy_arrays_are_inputs(curvature):
    """numpy arrays inside a tuple or dict (positional or keyword inputs) are converted like a
    bare array, for fitting and prediction, with every curvature."""

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(2, 4)

        def forward(self, xa, xb):
            return torch.tanh(self.a(xa)) + self.b(xb)

    torch.manual_seed(0)
    model = TwoInputs().double().eval()
    xa, xb, y = np.random.default_rng(0).normal(size=(24, 3)), np.ones((24, 2)), np.arange(24) % 4
    tensors = (torch.as_tensor(xa), torch.as_tensor(xb))
    expected = attribution.NTKPosterior(model, curvature=curvature).fit(tensors, y)
    for given in ((xa, xb), {"xa": xa, "xb": xb}):
        fitted = attribution.NTKPosterior(model, curvature=curvature).fit(given, y)
        np.testing.assert_allclose(
            fitted.predict_proba(given), expected.predict_proba(tensors), rtol=1e-10
        )


def test_regression_predictions_have_the_targets_shape():
    """Fitted to targets [N] (one output), predict gives [N] as scikit-learn's regressors do;
    fitted to [N, 1], [N, 1]."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)).double().eval()
    x = torch.randn(20, 3, dtype=torch.float64)
    y = torch.randn(20, dtype=torch.float64)
    flat = NTKPosterior(model, likelihood="regression").fit(x, y)
    column = NTKPosterior(model, likelihood="regression").fit(x, y[:, None])
    assert flat.predict(x).shape == (20,) and column.predict(x).shape == (20, 1)
    np.testing.assert_allclose(flat.predict(x), column.predict(x)[:, 0])


def _overfit_regression():
    """A 1 → 32 → 32 → 1 tanh MLP trained to interpolate 24 noisy points of sin(2x) (noise s.d.
    0.3): training residuals far below the noise. Returns (model, x, y, x_test, y_test)."""
    gen = torch.Generator().manual_seed(0)

    def draw(n):
        x = torch.rand(n, 1, generator=gen, dtype=torch.float64) * 6 - 3
        return x, torch.sin(2 * x) + 0.3 * torch.randn(n, 1, generator=gen, dtype=torch.float64)

    (x, y), (xt, yt) = draw(24), draw(200)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    model = model.double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3000):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return model.eval(), x, y, xt, yt


def test_regression_default_chooses_noise_and_prior_by_the_evidence():
    """noise="auto" with prior_precision="auto" maximises the evidence over (σ², δ) together: no
    grid point of σ² (each with the evidence's own δ, itself checked against a grid above) has a
    larger evidence. On an interpolating network the training residual is no estimate of the
    noise: the previous default (σ² the residual, δ keeping 2.37 effective parameters) was
    overconfident by orders of magnitude; the default stays within 1.5 nats of a Gaussian told
    the test error."""
    model, x, y, xt, yt = _overfit_regression()
    with torch.no_grad():
        residual = float(((model(x) - y) ** 2).mean())
        test_mse = float(((model(xt) - yt) ** 2).mean())
    default = NTKPosterior(model, likelihood="regression").fit(x, y)
    assert NTKPosterior(model, likelihood="regression", prior_precision="evidence").fit(
        x, y
    ).noise_ == pytest.approx(default.noise_)
    grid = 10.0 ** np.arange(-4.0, 1.01, 0.125)
    evidence = [
        NTKPosterior(model, likelihood="regression", noise=s2, prior_precision="evidence")
        .fit(x, y)
        .log_marginal_likelihood()
        for s2 in grid
    ]
    best = int(np.argmax(evidence))
    assert 0 < best < len(grid) - 1 and grid[best] > 10 * residual
    assert default.log_marginal_likelihood() >= max(evidence) - 1e-3
    assert abs(math.log10(default.noise_ / grid[best])) <= 0.125
    oracle = 0.5 * math.log(2 * math.pi * test_mse) + 0.5
    assert -default.score(xt, yt) <= oracle + 1.5


def test_regression_validation_data_choose_noise_and_prior_together():
    """With noise="auto", fit(validation=) minimises the validation NLL over (σ², δ) together: no
    noise of a grid (each with its own validation-tuned δ) does better, and the training
    residual as σ² (an interpolating network's) does far worse."""
    model, x, y, xt, yt = _overfit_regression()
    val, test = (xt[:100], yt[:100]), (xt[100:], yt[100:])
    tuned = NTKPosterior(model, likelihood="regression").fit(x, y, validation=val)
    grid = 10.0 ** np.arange(-4.0, 1.01, 0.125)
    fits = [
        NTKPosterior(model, likelihood="regression", noise=s2).fit(x, y, validation=val)
        for s2 in grid
    ]
    losses = [-f.score(*val) for f in fits]
    best = int(np.argmin(losses))
    assert 0 < best < len(grid) - 1
    assert -tuned.score(*val) <= min(losses) + 1e-6
    assert abs(math.log10(tuned.noise_ / grid[best])) <= 0.125
    with torch.no_grad():
        residual = float(((model(x) - y) ** 2).mean())
    at_residual = NTKPosterior(model, likelihood="regression", noise=residual).fit(
        x, y, validation=val
    )
    assert -at_residual.score(*test) > -tuned.score(*test) + 0.5


def test_bool_prior_precision_and_noise_are_refused(small_classifier):
    """prior_precision=True and noise=True (ints to Python) were read as 1."""
    model, x, y, _, _ = small_classifier
    with pytest.raises(TypeError, match="prior_precision must be .*number.*, got the bool True"):
        NTKPosterior(model, prior_precision=True).fit(x, y)
    with pytest.raises(TypeError, match="noise must be .*number.*, got the bool True"):
        NTKPosterior(model, likelihood="regression", noise=True).fit(x, torch.zeros(len(x), 3))


def test_every_number_parameter_refuses_a_bool(small_classifier):
    """sklearn's Integral and Real constraints let a bool through (True is 1): projection_dim,
    seed and batch_size took True and False as 1 and 0 (a projection of dimension 1, or none)."""
    model, x, y, _, _ = small_classifier
    cases = _bools_the_constraints_take(attribution.NTKPosterior)
    assert {"projection_dim", "seed", "batch_size", "mc_samples"} <= {n for n, _ in cases}
    for name, value in cases:
        with pytest.raises((ValueError, TypeError), match=f"^{name} must be .*got.* {value}$"):
            NTKPosterior(model, **{name: value}).fit(x, y)


def _bools_the_constraints_take(estimator) -> list[tuple[str, bool]]:
    """(parameter, bool) for each bool that a parameter's scikit-learn constraints take though
    the parameter is not a flag."""
    from sklearn.utils._param_validation import make_constraint

    return [
        (name, value)
        for name, constraints in estimator._parameter_constraints.items()
        if constraints != "no_validation" and "boolean" not in constraints
        for value in (True, False)
        if any(make_constraint(c).is_satisfied_by(value) for c in constraints)
    ]


def test_a_bool_mc_samples_is_refused(small_classifier):
    """mc_samples=True passed sklearn's Integral and drew one sample."""
    model, x, y, _, _ = small_classifier
    with pytest.raises(ValueError, match="^mc_samples must be a positive integer, got True"):
        NTKPosterior(model, link="mc", mc_samples=True).fit(x, y)
