"""KernelSurrogate's centred default: exact decomposition, the closed-form counterfactual
(`influence`) against refitting without the points, coherence metrics with known answers, the
error paths, and the scikit-learn contract (score, cross_val_score, GridSearchCV,
check_estimator)."""

import warnings

import numpy as np
import pytest
import torch
from models import fitted
from sklearn.kernel_ridge import KernelRidge
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.utils.estimator_checks import check_estimator
from torch import nn

import ntk
from attribution import KernelSurrogate, influence
from attribution.surrogate import (
    ALPHA_STEPS,
    LABEL_ALPHA,
    READABLE_CANCELLATION,
    READABLE_SHARE,
    cancellation,
    label_share,
)
from ntk import demo


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    return model, torch.randn(25, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)


def _refit(s, model, x, xt, keep):
    """The same machine (kernel scale, α) refitted on x[keep] with scikit-learn: kernel ridge on
    the kernel centred over the kept points, intercept the kept targets' mean."""
    k = ntk.empirical_ntk(model, x, kind="trace", dtype=torch.float64).numpy() / s.scale_
    kt = ntk.empirical_ntk(model, xt, x, kind="trace", dtype=torch.float64).numpy() / s.scale_
    g = model(x).detach().numpy()
    t = (g - g.mean(1, keepdims=True) if g.shape[1] > 1 else g)[keep]
    k, kt = k[np.ix_(keep, keep)], kt[:, keep]
    r = k.mean(0)
    ridge = KernelRidge(alpha=s.alpha_, kernel="precomputed").fit(
        k - r[None] - r[:, None] + r.mean(), t - t.mean(0)
    )
    return ridge.predict(kt - kt.mean(1, keepdims=True) - r + r.mean()) + t.mean(0)


def test_centred_decomposition_is_exact_for_every_reference(small):
    model, x, xt = small
    decisions = []
    for q in (0.0, 0.25, 1.0):
        s = KernelSurrogate(model, reference=q, alpha=0.1).fit(x)
        d, c = s.decision_function(xt), s.attribute(xt)
        np.testing.assert_allclose(c.sum(1) + s.baseline_, d, rtol=1e-10, atol=1e-10)
        decisions.append(d)
    np.testing.assert_allclose(decisions[0], decisions[2], rtol=1e-10, atol=1e-10)
    assert abs(s.dual_.sum(0)).max() < 1e-10  # the unpenalised intercept: Σ_i A_i = 0


def test_default_is_refit_of_all_points(small):
    model, x, xt = small
    s = KernelSurrogate(model).fit(x)
    assert s.center_ and s.alpha_ in ALPHA_STEPS
    np.testing.assert_allclose(
        s.decision_function(xt), _refit(s, model, x, xt, np.arange(len(x))), atol=1e-10
    )


@pytest.fixture(scope="module")
def trained():
    """A small classifier fitted to three classes, whose readable α lies inside ALPHA_STEPS."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(60, 4, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return fitted(model, x, y, 200), x, y


def _readable(model, x, alpha, decomposition) -> bool:
    """Whether the centred ridge at `alpha` reads as an explanation of its own training samples."""
    ratio, shares = _readability(model, x, alpha, decomposition)
    return bool(ratio <= READABLE_CANCELLATION and shares.mean() >= READABLE_SHARE)


def _readability(model, x, alpha, decomposition) -> tuple[float, np.ndarray]:
    """(median cancellation, each sample's top-5 share of the network's predicted labels) of the
    centred ridge
    at `alpha` on its own training samples, written from the definitions: each sample's
    contributions to its predicted column, its own term left out (for the smoother, the other
    weights re-centred to sum to 0 as a test sample's do)."""
    s = KernelSurrogate(model, alpha=alpha, decomposition=decomposition).fit(x)
    n, predicted = len(x), model(x).argmax(1).numpy()
    column = s.decision_function(x).argmax(1)
    if decomposition == "dual":
        c = s.attribute(x)[np.arange(n), :, column]
    else:  # the hat matrix of kernel ridge on the centred kernel, from scikit-learn
        k = ntk.empirical_ntk(model, x, kind="trace", dtype=torch.float64).numpy()
        k = k / k.diagonal().mean()
        r = k.mean(0)
        kc = k - r[None] - r[:, None] + r.mean()
        w = KernelRidge(alpha=alpha, kernel="precomputed").fit(kc, np.eye(n)).predict(kc)
        np.fill_diagonal(w, 0.0)
        w -= w.sum(1, keepdims=True) / (n - 1)
        np.fill_diagonal(w, 0.0)
        g = model(x).detach().numpy()
        t = g - g.mean(1, keepdims=True)
        c = w * (t - np.quantile(t, 0.25, axis=0))[:, column].T
    np.fill_diagonal(c, 0.0)
    ratio = np.abs(c).sum(1) / np.abs(c.sum(1))
    top = np.argsort(-c, axis=1)[:, :5]
    return float(np.median(ratio)), np.mean(predicted[top] == column[:, None], axis=1)


@pytest.mark.parametrize("decomposition", ["smoother", "dual"])
def test_default_alpha_is_the_first_readable_step(trained, decomposition):
    model, x, y = trained
    chosen = KernelSurrogate(model, decomposition=decomposition).fit(x).alpha_
    step = list(ALPHA_STEPS).index(chosen)
    assert 0 < step < len(ALPHA_STEPS) - 1  # the case exercises the search, not its ends
    assert _readable(model, x, chosen, decomposition)
    assert not _readable(model, x, ALPHA_STEPS[step - 1], decomposition)
    assert KernelSurrogate(model, decomposition=decomposition).fit(x, y).alpha_ == LABEL_ALPHA


def test_where_no_alpha_is_readable_the_fit_is_kept_and_a_warning_says_so():
    """An untrained network's predicted labels follow no kernel neighbourhood: no step is
    readable. The rule returned the largest step (α 10: the surrogate lost the network for a
    share no better); it keeps the smallest step whose contributions do not cancel and whose
    label share is within a standard error of the highest such share, and warns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    x = torch.randn(40, 5, dtype=torch.float64)
    with pytest.warns(UserWarning, match="no alpha of ALPHA_STEPS makes the decomposition"):
        chosen = KernelSurrogate(model).fit(x).alpha_
    found = [_readability(model, x, float(a), "smoother") for a in ALPHA_STEPS]
    assert not any(r <= READABLE_CANCELLATION and s.mean() >= READABLE_SHARE for r, s in found)
    kept = [(a, s) for a, (r, s) in zip(ALPHA_STEPS, found) if r <= READABLE_CANCELLATION]
    top, error = max((s.mean(), s.std() / np.sqrt(s.size)) for _, s in kept)
    assert chosen == min(a for a, s in kept if s.mean() >= top - error) < ALPHA_STEPS[-1]


def test_smoother_contributions_are_weights_times_levelled_targets(trained):
    model, x, _ = trained
    xt = x[:7] + 0.1
    for q in (0.0, 0.25, 1.0):
        s = KernelSurrogate(model, reference=q, alpha=0.05).fit(x)
        assert s.decomposition_ == "smoother"
        k = ntk.empirical_ntk(model, x, kind="trace", dtype=torch.float64).numpy()
        kt = ntk.empirical_ntk(model, xt, x, kind="trace", dtype=torch.float64).numpy()
        scale = k.diagonal().mean()
        r = k.mean(0) / scale
        kc = k / scale - r[None] - r[:, None] + r.mean()
        ktc = kt / scale - (kt / scale).mean(1, keepdims=True) - r[None] + r.mean()
        weights = KernelRidge(alpha=0.05, kernel="precomputed").fit(kc, np.eye(len(x))).predict(ktc)
        g = model(x).detach().numpy()
        t = g - g.mean(1, keepdims=True)
        expected = weights[:, :, None] * (t - np.quantile(t, q, axis=0))[None]
        c = s.attribute(xt)
        np.testing.assert_allclose(c, expected, atol=1e-10)
        np.testing.assert_allclose(c.sum(1) + s.baseline_, s.decision_function(xt), atol=1e-10)
        np.testing.assert_allclose(s.baseline_, t.mean(0), atol=1e-12)


def test_smoother_decomposition_needs_the_centred_ridge(small):
    model, x, _ = small
    for options in (dict(machine="svm"), dict(center=False), dict(kind="full")):
        with pytest.raises(ValueError, match="decomposition='smoother' needs the centred ridge"):
            KernelSurrogate(model, decomposition="smoother", alpha=0.1, **options).fit(x)
    assert KernelSurrogate(model, machine="gauss_newton").fit(x).decomposition_ == "dual"


def test_removal_equals_refitting_without_the_points(small):
    model, x, xt = small
    s = KernelSurrogate(model, alpha=0.01).fit(x)
    d, single = s.decision_function(xt), s.influence(xt, output="all")
    assert single.shape == (len(xt), len(x), 3)
    for i in (0, 7, 24):
        keep = np.delete(np.arange(len(x)), i)
        np.testing.assert_allclose(single[:, i], d - _refit(s, model, x, xt, keep), atol=1e-8)
    mask = np.zeros(len(x), bool)
    mask[[1, 4, 9, 16]] = True
    expected = d - _refit(s, model, x, xt, np.flatnonzero(~mask))
    np.testing.assert_allclose(s.influence(xt, mask, output="all"), expected, atol=1e-8)
    np.testing.assert_allclose(
        s.influence(xt, np.array([16, 1, 9, 4]), output="all"), expected, atol=1e-8
    )
    # the default output is the drop of each test example's predicted column, [N_test, N_train]
    rows, predicted = np.arange(len(xt)), d.argmax(1)
    np.testing.assert_allclose(s.influence(xt), single[rows, :, predicted], atol=1e-12)
    np.testing.assert_allclose(s.influence(xt, mask), expected[rows, predicted], atol=1e-8)
    np.testing.assert_allclose(s.influence(xt, mask, output=2), expected[:, 2], atol=1e-8)
    # removing all but one point leaves the intercept alone: d_{−S} = that point's target
    keep_one = np.ones(len(x), bool)
    keep_one[3] = False
    g = model(x[3:4]).detach().numpy()
    np.testing.assert_allclose(
        d - s.influence(xt, keep_one, output="all"),
        np.repeat(g - g.mean(), len(xt), 0),
        atol=1e-8,
    )


def test_test_sequences_of_another_length_are_explained_and_removed_exactly():
    """Test sequences of 7 tokens after training sequences of 5 (as padded HF batches of another
    length) were refused ("x_test and x_train have different per-sample shapes"), and 2-D token
    ids of another length as "X has 7 features, but KernelSurrogate is expecting 5". The
    decision is the machine refitted by scikit-learn on the cross kernel, the contributions add
    up to it and the closed-form removal equals refitting without the points."""
    from models import SharedPositions

    torch.manual_seed(0)
    model = SharedPositions(seq=8).double().eval()
    g = torch.Generator().manual_seed(5)
    x, xt = torch.randint(0, 5, (12, 5), generator=g), torch.randint(0, 5, (3, 7), generator=g)
    s = KernelSurrogate(model, alpha=0.01).fit(x)
    d = s.decision_function(xt)
    np.testing.assert_allclose(d, _refit(s, model, x, xt, np.arange(12)), atol=1e-10)
    np.testing.assert_allclose(s.attribute(xt).sum(1) + s.baseline_, d, atol=1e-10)
    keep = np.arange(4, 12)
    removed = s.influence(xt, np.arange(4), output="all")
    np.testing.assert_allclose(removed, d - _refit(s, model, x, xt, keep), atol=1e-8)


def test_removal_errors(small):
    model, x, xt = small
    s = KernelSurrogate(model).fit(x)
    with pytest.raises(ValueError, match="every training point"):
        s.influence(xt, np.ones(len(x), bool))
    with pytest.raises(ValueError, match=r"shape \(25,\)"):
        s.influence(xt, np.ones(24, bool))
    with pytest.raises(ValueError, match="no training point"):
        s.influence(xt, np.zeros(len(x), bool))
    with pytest.raises(ValueError, match="no training point"):  # was "a boolean mask or … indices"
        s.influence(xt, [])
    with pytest.raises(ValueError, match="indices must be in"):
        s.influence(xt, np.array([3, 25]))
    with pytest.raises(ValueError, match=r"output must be 'all', None or a column in 0\.\.2"):
        s.influence(xt, output=3)
    with pytest.raises(ValueError, match="center=True"):
        KernelSurrogate(model, center=False, alpha=0.1).fit(x).influence(xt)
    with pytest.raises(ValueError, match="center=True needs"):
        KernelSurrogate(model, center=True, machine="svm").fit(x)


def test_representer_coefficients_are_the_scaled_loss_residuals(small):
    model, x, xt = small
    y = torch.arange(len(x)) % 3
    s = KernelSurrogate(model, machine="representer").fit(x, y)
    g = model(x).detach()
    residual = torch.nn.functional.one_hot(y, 3).double() - g.softmax(1)
    ratio = s.dual_ / residual.numpy()
    np.testing.assert_allclose(ratio, ratio[0, 0], rtol=1e-10)  # one scale for all
    c, d = s.attribute(xt), s.decision_function(xt)
    np.testing.assert_allclose(c.sum(1) + s.baseline_, d, rtol=1e-10, atol=1e-10)
    # the scale and intercept are the least-squares fit to the centred logits
    k = ntk.empirical_ntk(model, x, kind="trace", dtype=torch.float64).numpy() / s.scale_
    t = (g - g.mean(1, keepdim=True)).numpy()
    design = np.stack(
        [(k @ residual.numpy()).ravel()] + [np.tile(np.eye(3)[o], len(x)) for o in range(3)], 1
    )
    coef = np.linalg.lstsq(design, t.ravel(), rcond=None)[0]
    np.testing.assert_allclose([ratio[0, 0], *s.intercept_], coef, rtol=1e-8)
    assert (s.predict(xt) == d.argmax(1)).all()


def test_nan_kernel_is_refused():
    class Sqrt(nn.Module):  # finite output, NaN gradient at Wx = 0
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2, bias=False)

        def forward(self, x):
            return torch.sqrt(self.lin(x).abs())

    with pytest.raises(ValueError, match="not finite"):
        KernelSurrogate(Sqrt()).fit(torch.zeros(6, 3))


def test_cv_settings_are_checked(small):
    model, x, _ = small
    with pytest.raises(ValueError, match="'cv' parameter"):
        KernelSurrogate(model, alpha="cv", cv=1).fit(x)
    with pytest.raises(ValueError, match="cv=40 folds"):
        KernelSurrogate(model, alpha="cv", cv=40).fit(x)
    with pytest.raises(ValueError, match="'cv' parameter"):
        KernelSurrogate(model, cv=1).fit(x)
    with pytest.raises(ValueError, match="cv=26 folds"):
        KernelSurrogate(model, machine="svm", cv=26).fit(x)  # alpha=None: searched by CV
    with pytest.raises(ValueError, match="'alpha' parameter"):
        KernelSurrogate(model, alpha="best").fit(x)
    with pytest.raises(ValueError, match="'reference' parameter"):
        KernelSurrogate(model, reference=1.5).fit(x)


def test_coherence_metrics_known_answers(small):
    np.testing.assert_allclose(
        cancellation(np.array([[3.0, -1.0, 2.0], [1.0, 1.0, 0.0]])), [1.5, 1]
    )
    c = np.array([[5.0, 4.0, 3.0, -1.0], [-2.0, 0.0, 1.0, 2.0]])
    y = np.array([0, 1, 0, 0])
    np.testing.assert_allclose(label_share(c, y, np.array([0, 1]), 2), [0.5, 0.0])
    np.testing.assert_allclose(label_share(c, y, np.array([0, 0]), 3), [2 / 3, 2 / 3])
    with pytest.raises(ValueError, match="k must be"):
        label_share(c, y, np.array([0, 0]), 5)
    # the method reads the predicted column of `attribute`
    model, x, xt = small
    s = KernelSurrogate(model).fit(x)
    y_train = torch.arange(len(x)) % 3
    got = s.coherence(xt, y_train, k=4)
    col = s.decision_function(xt).argmax(1)
    chosen = s.attribute(xt)[np.arange(len(xt)), :, col]
    np.testing.assert_allclose(got["cancellation"], abs(chosen).sum(1) / abs(chosen.sum(1)))
    top = np.argsort(-chosen, 1)[:, :4]
    np.testing.assert_allclose(got["label_share"], (y_train.numpy()[top] == col[:, None]).mean(1))
    assert got["median_cancellation"] == np.median(got["cancellation"])


@pytest.fixture(scope="module")
def digits():
    data = demo.digits(n_train=150)
    torch.manual_seed(0)
    model = demo.train(demo.mlp(hidden=16), data.x_train, data.y_train, epochs=10)
    return model, data.x_train, data.y_train


def test_score_cross_val_and_grid_search(digits):
    model, x, y = digits
    s = KernelSurrogate(model, alpha=0.1).fit(x, y)
    assert s.score(x, y) == np.mean(s.predict(x) == y.numpy()) and s.n_features_in_ == 64
    scores = cross_val_score(KernelSurrogate(model, alpha=0.1), x.numpy(), y.numpy(), cv=3)
    assert scores.shape == (3,) and ((scores >= 0) & (scores <= 1)).all()
    search = GridSearchCV(KernelSurrogate(model), {"alpha": [0.01, 1.0]}, cv=3).fit(x, y)
    assert search.best_params_["alpha"] in (0.01, 1.0) and hasattr(search.best_estimator_, "dual_")
    # numpy inputs are the model's tensors
    np.testing.assert_allclose(
        KernelSurrogate(model).fit(x.numpy()).decision_function(x[:5].numpy()),
        KernelSurrogate(model).fit(x).decision_function(x[:5]),
    )


class _AnyWidth(nn.Module):
    """A network on any number (≤ 64) of features, for scikit-learn's generated data."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(64, 16) / 4)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.tanh(x @ self.w[: x.shape[1]]))


# Checks that do not apply to an estimator whose classes are the outputs of a given network.
NOT_APPLICABLE = {
    "check_dtype_object": "labels are indices of the network's outputs (0..O-1), not any objects",
    "check_classifiers_classes": "string class labels: classes are the network's output indices",
    "check_classifiers_regression_target": "continuous y is read as output indices (refused as "
    "out of range, not with scikit-learn's 'Unknown label type' wording)",
    "check_supervised_y_2d": "y is a 1-D vector of output indices; a column vector is refused",
    "check_classifiers_train": "the surrogate follows a fixed random network on generated data, "
    "so it cannot reach the accuracy thresholds this check asks of a trained classifier",
    "check_estimators_overwrite_params": "joblib.hash of a torch module changes when it runs "
    "(its parameters do not: tests/test_attribution_surrogate.py checks them)",
    "check_estimator_sparse_array": "the network takes dense tensors; sparse input is refused",
    "check_estimator_sparse_matrix": "the network takes dense tensors; sparse input is refused",
    "check_estimator_sparse_tag": "the network takes dense tensors; sparse input is refused",
    "check_classifier_data_not_an_array": "y of a non-array type is read as output indices",
}


def test_check_estimator_with_the_checks_that_apply():
    with np.errstate(all="ignore"):
        results = check_estimator(
            # float64 kernels: in the model's float32, a prediction on a subset differs from the
            # whole batch's in the last bits (check_methods_subset_invariance asks 1e-7)
            KernelSurrogate(_AnyWidth(), dtype=torch.float64),
            expected_failed_checks=NOT_APPLICABLE,
            on_fail=None,
        )
    failed = [r["check_name"] for r in results if r["status"] == "failed"]
    assert not failed, failed
    assert sum(r["status"] == "passed" for r in results) >= 40


def _gauss_newton_refit(s, model, x, xt, y, keep):
    """The Gauss–Newton machine (same kernel scale and λ) refitted on x[keep] from its definition:
    S_i = Λ_i^½ at the network's logits, working responses t_i = g_i + e_{y_i}/p_{i,y_i},
    (SKS + λI) β = S t over the kept rows, d(x) = Σ_j K(x, x_j) S_j β_j."""
    k = ntk.empirical_ntk(model, x, kind="trace", dtype=torch.float64).numpy() / s.scale_
    kt = ntk.empirical_ntk(model, xt, x, kind="trace", dtype=torch.float64).numpy() / s.scale_
    g = model(x).detach().numpy()
    p = np.exp(g - g.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    roots = []
    for pi in p:
        e, v = np.linalg.eigh(np.diag(pi) - np.outer(pi, pi))
        roots.append((v * np.sqrt(e.clip(min=0))) @ v.T)
    roots = np.array(roots)[keep]
    t = g.copy()
    t[np.arange(len(y)), y] += 1 / p[np.arange(len(y)), y]
    n, o = len(keep), g.shape[1]
    a = np.einsum("iop,ij,jpq->iojq", roots, k[np.ix_(keep, keep)], roots).reshape(n * o, n * o)
    beta = np.linalg.solve(
        a + s.alpha_ * np.eye(n * o), np.einsum("iop,ip->io", roots, t[keep]).ravel()
    )
    return kt[:, keep] @ np.einsum("iop,ip->io", roots, beta.reshape(n, o))


def test_gauss_newton_machine_solves_its_objective_and_decomposes_exactly(small):
    model, x, xt = small
    y = torch.arange(len(x)) % 3
    s = KernelSurrogate(model, machine="gauss_newton").fit(x, y)
    d, c = s.decision_function(xt), s.attribute(xt)
    np.testing.assert_allclose(c.sum(1) + s.baseline_, d, rtol=1e-10, atol=1e-10)
    assert not s.intercept_.any() and s.alpha_ > 0  # the effective-parameter damping
    # stationarity of Σ_i ½ (F_i − t_i)ᵀ Λ_i (F_i − t_i) + (λ/2)‖F‖²: Λ_i (F_i − t_i) + λ A_i = 0
    g = model(x).detach()
    p = g.softmax(1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    t = g + torch.nn.functional.one_hot(y, 3) / p[torch.arange(len(y)), y][:, None]
    f = torch.as_tensor(s.decision_function(x))
    residual = torch.einsum("iop,ip->io", lam, f - t) + s.alpha_ * torch.as_tensor(s.dual_)
    assert float(residual.abs().max()) < 1e-9
    np.testing.assert_allclose(
        d, _gauss_newton_refit(s, model, x, xt, y.numpy(), np.arange(len(x))), atol=1e-9
    )
    # fitted to the outputs, the targets are the logits themselves: Λ_i (F_i − g_i) + λ A_i = 0
    outputs = KernelSurrogate(model, machine="gauss_newton").fit(x)
    f = torch.as_tensor(outputs.decision_function(x))
    residual = torch.einsum("iop,ip->io", lam, f - g) + outputs.alpha_ * torch.as_tensor(
        outputs.dual_
    )
    assert float(residual.abs().max()) < 1e-9


def test_gauss_newton_removal_equals_refitting_without_the_points(small):
    model, x, xt = small
    y = (torch.arange(len(x)) * 7) % 3
    s = KernelSurrogate(model, machine="gauss_newton", alpha=0.05).fit(x, y)
    assert s.alpha_ == 0.05
    d, single = s.decision_function(xt), s.influence(xt, output="all")
    assert single.shape == (len(xt), len(x), 3)
    rows = np.arange(len(xt))
    np.testing.assert_allclose(s.influence(xt), single[rows, :, d.argmax(1)], atol=1e-12)
    for i in (0, 7, 24):
        keep = np.delete(np.arange(len(x)), i)
        expected = d - _gauss_newton_refit(s, model, x, xt, y.numpy(), keep)
        np.testing.assert_allclose(single[:, i], expected, atol=1e-8)
    mask = np.zeros(len(x), bool)
    mask[[1, 4, 9, 16]] = True
    expected = d - _gauss_newton_refit(s, model, x, xt, y.numpy(), np.flatnonzero(~mask))
    np.testing.assert_allclose(s.influence(xt, mask, output="all"), expected, atol=1e-8)
    np.testing.assert_allclose(
        s.influence(xt, np.array([16, 1, 9, 4]), output=1), expected[:, 1], atol=1e-8
    )
    with pytest.raises(ValueError, match="every training point"):
        s.influence(xt, np.ones(len(x), bool))
    with pytest.raises(ValueError, match="machine='gauss_newton' needs"):
        KernelSurrogate(model, machine="gauss_newton", alpha="cv").fit(x, y)


@pytest.mark.parametrize("machine", ["ridge", "gauss_newton"])
def test_self_influence_is_each_training_points_own_refit(small, machine):
    """self_influence: d(x_i) − d_{−i}(x_i) from the fitted kernel, against refitting without
    i (the ridge by scikit-learn, the Gauss–Newton machine by its own solve) and the diagonal of
    `influence` on the training inputs."""
    model, x, _ = small
    y = (torch.arange(len(x)) * 7) % 3
    if machine == "ridge":
        s = KernelSurrogate(model, alpha=0.01).fit(x)
    else:
        s = KernelSurrogate(model, machine="gauss_newton", alpha=0.05).fit(x, y)
    own = s.self_influence(output="all")
    assert own.shape == (len(x), 3)
    d = s.decision_function(x)
    for i in (0, 7, 24):
        keep = np.delete(np.arange(len(x)), i)
        if machine == "ridge":
            without = _refit(s, model, x, x[i : i + 1], keep)
        else:
            without = _gauss_newton_refit(s, model, x, x[i : i + 1], y.numpy(), keep)
        np.testing.assert_allclose(own[i], d[i] - without[0], atol=1e-8)
    rows = np.arange(len(x))
    np.testing.assert_allclose(own, s.influence(x, output="all")[rows, rows], atol=1e-10)
    # by default each point's own column: its label, or the network's prediction (fitted to it)
    columns = y.numpy() if machine == "gauss_newton" else model(x).argmax(1).numpy()
    np.testing.assert_allclose(s.self_influence(), own[rows, columns], atol=1e-12)
    np.testing.assert_allclose(s.self_influence(output=2), own[:, 2], atol=1e-12)
    with pytest.raises(ValueError, match=r"output must be 'all', None or a column in 0\.\.2"):
        s.self_influence(output=3)
    with pytest.raises(ValueError, match="self_influence needs"):
        KernelSurrogate(model, center=False, alpha=0.1).fit(x).self_influence()


def test_gauss_newton_machine_that_does_not_fit_is_refused(small, monkeypatch):
    model, x, _ = small
    monkeypatch.setattr("attribution.surrogate.available_bytes", lambda device: 10_000)

    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel was computed before the system was refused")

    monkeypatch.setattr("attribution._kernels.compute", no_kernel)
    with pytest.raises(MemoryError, match=r"\(N·O\)² = 75² system.*machine='ridge'"):
        KernelSurrogate(model, machine="gauss_newton").fit(x, torch.arange(len(x)) % 3)


@pytest.mark.parametrize("fraction", [None, 0.015])
def test_gauss_newton_damping_keeps_the_chosen_effective_number_of_parameters(small, fraction):
    """machine="gauss_newton" with alpha=None: λ solves Σ_k e_k/(e_k + λ) = f · N·(O − 1), at
    most half the numerical rank Σ_k e_k²/(e_k² + (RANK_FLOOR · e_max)²), e the eigenvalues of
    SΘS (written out here), f = effective_parameters or GAUSS_NEWTON_DOF_FRACTION."""
    from attribution.damping import RANK_FLOOR
    from attribution.surrogate import GAUSS_NEWTON_DOF_FRACTION

    model, x, _ = small
    y = torch.arange(len(x)) % 3
    s = KernelSurrogate(model, machine="gauss_newton", effective_parameters=fraction).fit(x, y)
    n, o = len(x), 3
    k = ntk.empirical_ntk(model, x, kind="trace").numpy()
    k = k / k.diagonal().mean()  # the machine's kernel: unit mean diagonal
    a = np.einsum("iop,ij,jpq->iojq", s.root_, k, s.root_).reshape(n * o, n * o)
    e = np.linalg.eigvalsh(a).clip(min=0)
    gamma = float((e / (e + s.alpha_)).sum())
    f = GAUSS_NEWTON_DOF_FRACTION if fraction is None else fraction
    rank = float((e**2 / (e**2 + (RANK_FLOOR * e.max()) ** 2)).sum())
    assert gamma == pytest.approx(min(f * n * (o - 1), rank / 2), rel=1e-6)
    with pytest.raises(ValueError, match="effective_parameters sets the damping"):
        KernelSurrogate(model, effective_parameters=0.1).fit(x)
    with pytest.raises(ValueError, match="effective_parameters sets the damping"):
        KernelSurrogate(model, machine="gauss_newton", alpha=0.1, effective_parameters=0.1).fit(x)


def test_single_output_model_is_fitted_to_its_output():
    """A model with one output ([B] or [B, 1]): the default surrogate fits the output itself
    (centring over outputs would leave zeros), its faithfulness compares the outputs, its
    removal effect equals refitting; classification machines are refused with the reason."""
    torch.manual_seed(3)
    body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x, xt = torch.randn(30, 4, dtype=torch.float64), torch.randn(9, 4, dtype=torch.float64)
    for model, output_fn in ((body, None), (body, lambda out: out.squeeze(-1))):
        s = KernelSurrogate(model, output_fn=output_fn).fit(x)
        d = s.decision_function(xt)
        assert d.shape == (9, 1) and np.abs(d).max() > 1e-3
        np.testing.assert_allclose(s.attribute(xt).sum(1) + s.baseline_, d, atol=1e-10)
        net = body(xt).detach().numpy()
        np.testing.assert_allclose(d, net, atol=0.5 * np.abs(net).max())
        f = s.faithfulness(xt)
        assert set(f) == {"tau_logits", "spearman_logits", "r2_logits"}
        assert f["tau_logits"] > 0.5 and f["r2_logits"] < 1
        keep = np.delete(np.arange(30), [2, 5])
        expected = d - _refit(s, body, x, xt, keep)
        np.testing.assert_allclose(s.influence(xt, np.array([2, 5])), expected[:, 0], atol=1e-8)
    with pytest.raises(ValueError, match="machine='svm' needs a classifier with two or more"):
        KernelSurrogate(body, machine="svm").fit(x)
    # predict (and score, its accuracy) was the argmax of one column: class 0 for every sample
    with pytest.raises(ValueError, match="single output .*decision_function"):
        s.predict(xt)
    with pytest.raises(ValueError, match="single output .*decision_function"):
        s.score(xt, np.zeros(9))


def test_coherence_of_a_single_output_model_has_no_label_share():
    """A single-output model has no classes: coherence gave label_share 1.0 for every test
    sample (every training 'label' the argmax of one column, class 0) and took y_train."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x, xt = torch.randn(12, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    s = KernelSurrogate(model).fit(x)
    got = s.coherence(xt)
    assert set(got) == {"cancellation", "median_cancellation"}
    c = s.attribute(xt)[:, :, 0]
    np.testing.assert_allclose(got["cancellation"], np.abs(c).sum(1) / np.abs(c.sum(1)))
    with pytest.raises(ValueError, match="y_train needs a classifier; the model has a single"):
        s.coherence(xt, np.zeros(12))
    # both name the class scores a one-logit binary classifier has
    with pytest.raises(ValueError, match="single output .*output_fn=lambda z: torch.stack"):
        s.coherence(xt, np.zeros(12))
    with pytest.raises(ValueError, match="y_test needs a classifier.*output_fn=lambda z: torch"):
        s.faithfulness(xt, np.zeros(5))


def test_classification_machine_with_one_predicted_class_is_refused(small):
    model, x, _ = small
    shifted = nn.Sequential(model, _Shift())
    with pytest.raises(ValueError, match="two or more classes.*pass labels y"):
        KernelSurrogate(shifted, machine="logistic").fit(x)


class _Shift(nn.Module):
    """Adds 100 to the first output: every sample is predicted as class 0."""

    def forward(self, g):
        return g + torch.tensor([100.0, 0.0, 0.0], dtype=g.dtype)


def test_machines_without_cross_validation_fit_one_or_two_samples(small):
    # cv (unused unless alpha is searched) refused fewer than 3 training samples for every
    # machine, and so `influence(method="surrogate")`, which has no cv, on N = 1 or 2
    model, x, xt = small
    y = torch.tensor([0, 2])
    for machine in ("ridge", "gauss_newton"):
        s = KernelSurrogate(model, machine=machine).fit(x[:2], y)
        np.testing.assert_allclose(s.attribute(xt).sum(1) + s.baseline_, s.decision_function(xt))
        assert s.influence(xt).shape == (6, 2)
    assert influence(model, x[:1], y[:1], xt, method="surrogate").shape == (6, 1)
    with warnings.catch_warnings():  # the readability rule with one sample (nothing to read)
        warnings.simplefilter("error")
        one = KernelSurrogate(model).fit(x[:1])
    np.testing.assert_allclose(one.attribute(xt).sum(1) + one.baseline_, one.decision_function(xt))
    with pytest.raises(ValueError, match="cannot remove the only training point"):
        KernelSurrogate(model).fit(x[:1], y[:1]).influence(xt)
    with pytest.raises(ValueError, match="cv=3 folds need at least 3"):
        KernelSurrogate(model, alpha="cv").fit(x[:2], y)
