"""KernelSurrogate: the scikit-learn estimator contract, the exact decomposition, faithfulness on
a trained digits MLP, and its error paths."""

import warnings

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.kernel_ridge import KernelRidge
from torch import nn

import ntk
from attribution import KernelSurrogate
from attribution.surrogate import cancellation
from ntk import demo


@pytest.fixture(scope="module")
def trained():
    data = demo.digits(n_train=300)
    torch.manual_seed(0)
    model = demo.train(demo.mlp(hidden=32), data.x_train, data.y_train, epochs=30)
    return model, data.x_train, data.y_train, data.x_test[:120], data.y_test[:120]


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_estimator_params_and_clone(trained):
    model = trained[0]
    s = KernelSurrogate(model, kind="sum_logits", machine="svm", alpha=0.1, normalize=True)
    params = s.get_params()
    assert params["kind"] == "sum_logits" and params["machine"] == "svm" and params["alpha"] == 0.1
    c = clone(s)
    assert c is not s and {k: v for k, v in c.get_params().items() if k != "model"} == {
        k: v for k, v in params.items() if k != "model"
    }
    assert all(torch.equal(a, b) for a, b in zip(_params(c.model), _params(model)))
    assert s.set_params(kind="trace", alpha=1.0) is s and s.kind == "trace" and s.alpha == 1.0
    assert not hasattr(c, "dual_")


def test_unfitted_raises_not_fitted(trained):
    s = KernelSurrogate(trained[0])
    for call in (s.decision_function, s.predict, s.attribute, s.faithfulness, s.coherence):
        with pytest.raises(NotFittedError):
            call(trained[3])
    with pytest.raises(NotFittedError):  # was "needs at least 2" test samples
        s.faithfulness(trained[3][:1])


def test_a_refit_forgets_the_earlier_fit(trained):
    """A refit that failed part-way (one class for the svm) left the new training inputs with
    the earlier coefficients, and predictions moved by 5 without an error; a refit with another
    machine kept the earlier machine's arrays (an (N·O)² Cholesky factor among them)."""
    model, x, y, xt, _ = trained
    s = KernelSurrogate(model, kind="trace", machine="svm").fit(x[:60], y[:60])
    with pytest.raises(ValueError, match="two or more classes"):
        s.fit(x[60:120], np.zeros(60, dtype=np.int64))
    with pytest.raises(NotFittedError):
        s.decision_function(xt)
    s.set_params(machine="gauss_newton").fit(x[:30])
    fitted = {name for name in vars(s) if name.endswith("_")}
    s.set_params(machine="ridge").fit(x[:30])
    fresh = KernelSurrogate(model, kind="trace", machine="ridge").fit(x[:30])
    assert [n for n in vars(s) if n.endswith("_")] == [n for n in vars(fresh) if n.endswith("_")]
    assert {"beta_", "factor_"} <= fitted and not {"beta_", "factor_"} & set(vars(s))
    np.testing.assert_array_equal(s.decision_function(xt), fresh.decision_function(xt))
    # parameters refused by the refit: the earlier fit was kept and read with the new settings
    for refused in (dict(kind="full", machine="svm"), dict(alpha=-1.0)):
        fitted = KernelSurrogate(model, kind="trace", alpha=0.1).fit(x[:30])
        with pytest.raises(ValueError):
            fitted.set_params(**refused).fit(x[:30])
        with pytest.raises(NotFittedError):
            fitted.decision_function(xt)


def test_parameters_set_after_fit_are_refused_until_the_next_fit(trained):
    """set_params after fit changed what the fitted coefficients were read with: kind="sum_logits"
    moved predictions silently, normalize=True failed with an AttributeError (no diag_)."""
    model, x, _, xt, _ = trained
    s = KernelSurrogate(model, kind="trace", alpha=0.1).fit(x[:40])
    before = s.decision_function(xt[:10])
    s.set_params(batch_size=7)  # where the kernels are computed: free to change
    np.testing.assert_allclose(s.decision_function(xt[:10]), before, rtol=1e-4, atol=1e-4)
    s.set_params(normalize=True)
    for call in (s.decision_function, s.predict, s.attribute, s.influence, s.coherence):
        with pytest.raises(ValueError, match=r"normalize=True \(fitted with False\).*fit again"):
            call(xt[:10])
    with pytest.raises(ValueError, match="changed since fit"):
        s.self_influence()
    s.set_params(normalize=False, batch_size=None)  # the fitted values again: read as before
    np.testing.assert_array_equal(s.decision_function(xt[:10]), before)
    s.set_params(kind="sum_logits", alpha=1.0)
    with pytest.raises(ValueError, match=r"alpha=1.0 \(fitted with 0.1\), kind='sum_logits' \("):
        s.faithfulness(xt[:10])
    refit = s.fit(x[:40]).decision_function(xt[:10])
    fresh = KernelSurrogate(model, kind="sum_logits", alpha=1.0).fit(x[:40])
    np.testing.assert_array_equal(refit, fresh.decision_function(xt[:10]))


def test_an_svm_leaves_numpy_global_random_state_alone(trained):
    """libsvm drew its seed from numpy's global generator (SVC's random_state=None)."""
    model, x, y, _, _ = trained
    _, key, position, *_ = np.random.get_state()
    KernelSurrogate(model, kind="trace", machine="svm").fit(x[:60], y[:60])
    _, key_after, position_after, *_ = np.random.get_state()
    assert np.array_equal(key_after, key) and position_after == position


@pytest.mark.parametrize(
    "kind,machine,normalize",
    [
        ("trace", "ridge", False),
        ("full", "ridge", False),
        ("trace", "ridge", True),
        ("sum_logits", "svm", False),
        ("trace", "logistic", True),
    ],
)
def test_attribution_is_exact(trained, kind, machine, normalize):
    model, x, y, xt, _ = trained
    before = _params(model)
    if kind == "full":  # a [1000, 1000] kernel: keep it small, skip the CV
        x = x[:100]
    s = KernelSurrogate(
        model,
        kind=kind,
        machine=machine,
        normalize=normalize,
        alpha={"full": 1e-3, "logistic": 1e-2}.get(kind if kind == "full" else machine),
    ).fit(x)
    d = s.decision_function(xt)
    c = s.attribute(xt)
    assert c.shape == (len(xt), len(x), d.shape[1])
    np.testing.assert_allclose(c.sum(1) + s.baseline_, d, rtol=1e-9, atol=1e-9 * np.abs(d).max())
    # the decision is the scikit-learn machine's own, on the independently computed kernel (in
    # the model's dtype, float32, as the surrogate computes it by default)
    k = ntk.empirical_ntk(model, xt, x, kind=kind).double()
    if normalize:
        self_t, self_x = (
            ntk.empirical_ntk(model, v, kind=kind).double().diagonal() for v in (xt, x)
        )
        k = k / torch.sqrt(self_t[:, None] * self_x[None, :])
    if kind == "full":
        k = k.permute(0, 2, 1, 3).reshape(len(xt) * 10, len(x) * 10)
    k = (k / s.scale_).numpy()
    if s.center_:  # feature-space centring, from the independently computed training kernel
        kx = ntk.empirical_ntk(model, x, kind=kind, dtype=torch.float64)
        if normalize:
            kx = kx / torch.sqrt(kx.diagonal()[:, None] * kx.diagonal()[None, :])
        r = (kx / s.scale_).numpy().mean(0)
        k = k - k.mean(1, keepdims=True) - r + r.mean()
    if machine == "ridge":
        offset = r @ s.dual_ if s.center_ else 0.0  # intercept_ is that of K(x, X), uncentred
        expected = s.machine_.predict(k).reshape(len(xt), -1) + s.intercept_ + offset
    elif machine == "svm":
        pairs = s.machine_.decision_function(k)
        np.testing.assert_array_equal(s.predict(xt), s.machine_.predict(k))
        expected = None
        # each class column is the sum of its signed one-vs-one decision values
        pair_list = [(a, b) for a in range(10) for b in range(a + 1, 10)]
        expected = np.zeros((len(xt), 10))
        for p, (a, b) in enumerate(pair_list):
            expected[:, a] += pairs[:, p]
            expected[:, b] -= pairs[:, p]
    else:
        expected = s.machine_.decision_function(k)
    np.testing.assert_allclose(d, expected, rtol=1e-6, atol=1e-6 * np.abs(d).max())
    assert all(torch.equal(a, b) for a, b in zip(_params(model), before)) and not model.training


def test_ridge_matches_kernel_ridge_on_outputs(trained):
    model, x, _, xt, _ = trained
    s = KernelSurrogate(model, alpha=1e-3, center=False, dtype=torch.float64).fit(x)
    k = ntk.empirical_ntk(model, x, kind="trace", dtype=torch.float64)
    kt = ntk.empirical_ntk(model, xt, x, kind="trace", dtype=torch.float64)
    scale = float(k.diagonal().mean())
    g = model(x).detach().double().numpy()
    ref = KernelRidge(alpha=1e-3, kernel="precomputed").fit(k.numpy() / scale, g - g.mean(0))
    np.testing.assert_allclose(
        s.decision_function(xt), ref.predict(kt.numpy() / scale) + g.mean(0), rtol=1e-6, atol=1e-6
    )


def test_faithful_on_trained_mlp(trained):
    model, x, y, xt, yt = trained
    s = KernelSurrogate(model).fit(x)
    f = s.faithfulness(xt, yt)
    assert f["tau_prob"] > 0.85 and f["tau_logits"] > 0.9 and f["r2_logits"] > 0.9
    assert f["label_agreement"] > 0.95 and abs(f["accuracy_gap"]) < 0.05
    assert 0 <= f["misclassified_jaccard"] <= 1


def test_proponents_and_opponents(trained):
    model, x, _, xt, _ = trained
    s = KernelSurrogate(model, alpha=1e-3).fit(x)
    c = s.attribute(xt[:5])
    column = s.decision_function(xt[:5]).argmax(1)
    idx, val = s.proponents(xt[:5], k=3)
    chosen = c[np.arange(5), :, column]
    np.testing.assert_allclose(val, -np.sort(-chosen, 1)[:, :3])
    np.testing.assert_allclose(np.take_along_axis(chosen, idx, 1), val)
    idx, val = s.opponents(xt[:5], k=3, output=2)
    np.testing.assert_allclose(val, np.sort(c[:, :, 2], 1)[:, :3])
    with pytest.raises(ValueError, match="k must be"):
        s.proponents(xt[:2], k=0)


def test_proponents_take_a_class_when_a_class_is_absent_from_the_labels():
    """svm and logistic have a column per class among the training labels: with class 1 absent,
    output=1 ranked the contributions to class 2 (column 1) silently and output=2 was refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    x, xt, y = torch.randn(12, 4), torch.randn(3, 4), torch.tensor([0, 2] * 6)
    for machine in ("svm", "logistic"):
        s = KernelSurrogate(model, machine=machine).fit(x, y)
        assert s.classes_.tolist() == [0, 2]
        _, val = s.proponents(xt, k=2, output=2)
        np.testing.assert_allclose(val, -np.sort(-s.attribute(xt)[:, :, 1], 1)[:, :2])
        for output in (1, 3, 0.5):
            with pytest.raises(ValueError, match=r"output must be one of the surrogate's classes"):
                s.opponents(xt, output=output)


def test_svm_proponents_and_coherence_explain_its_prediction():
    """SVC predicts by one-vs-one votes, which the argmax of its summed pair values (the decision
    columns) need not match: proponents "of the predicted class" and coherence ranked another
    class for 9 of these 30 test samples."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))
    x, xt, y = torch.randn(20, 4), torch.randn(30, 4), torch.tensor([0, 1, 2, 3] * 5)
    s = KernelSurrogate(model, machine="svm", alpha=0.1).fit(x, y)
    predicted = s.predict(xt)
    assert (s.decision_function(xt).argmax(1) != predicted).any()  # the case in question
    c = s.attribute(xt)[np.arange(30), :, np.searchsorted(s.classes_, predicted)]
    _, val = s.proponents(xt, k=3)
    np.testing.assert_allclose(val, -np.sort(-c, 1)[:, :3])
    np.testing.assert_allclose(s.coherence(xt)["cancellation"], cancellation(c))


def test_representer_takes_no_alpha():
    """The representer machine has no regularisation: alpha=5.0 or "cv" was ignored (the same
    contributions as alpha=None)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    x, y = torch.randn(12, 4), torch.tensor([0, 1, 2] * 4)
    for alpha in (5.0, "cv"):
        with pytest.raises(ValueError, match="machine='representer' has no regularisation"):
            KernelSurrogate(model, machine="representer", alpha=alpha).fit(x, y)


def test_test_inputs_are_checked_against_the_training_inputs():
    """One test sample without its sample axis, or none, was refused in the kernel's words
    ("x1 and x2 have different per-sample shapes: () vs (4,)", "x1 holds no samples"); the test
    inputs' forward pass now names them before any kernel."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    x, xt = torch.randn(8, 4), torch.randn(3, 4)
    s = KernelSurrogate(model).fit(x, torch.tensor([0, 1, 2, 0, 1, 2, 1, 0]))
    rows = r"^the model returned 3 output rows for the 4 samples of {} \(the first axis"
    for call in (s.attribute, s.influence, s.coherence, s.proponents):
        with pytest.raises(ValueError, match=rows.format("x_test")):
            call(xt[0])
    for call in (s.predict, s.decision_function):
        with pytest.raises(ValueError, match=rows.format("x")):
            call(xt[0])
    with pytest.raises(ValueError, match="^x_test holds no samples"):
        s.attribute(xt[:0])
    with pytest.raises(ValueError, match="^x_test and x_train must have the same structure"):
        s.attribute({"x": xt})
    assert s.attribute(xt[:1]).shape == (1, 8, 3)


def test_bad_input(trained):
    model, x, y, xt, _ = trained
    with pytest.raises(ValueError, match="kind"):
        KernelSurrogate(model, kind="nope").fit(x)
    with pytest.raises(ValueError, match="machine='ridge'"):
        KernelSurrogate(model, kind="full", machine="svm").fit(x)
    with pytest.raises(ValueError, match="300 class labels"):
        KernelSurrogate(model, alpha=1.0).fit(x, y[:10])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        KernelSurrogate("not a model").fit(x)
    s = KernelSurrogate(model, alpha=1.0).fit(x[:50])
    with pytest.raises(ValueError):
        s.decision_function(xt[:, :10])


def test_non_finite_kernel_is_refused():
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    ).double()
    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[2].weight.fill_(1e160)  # finite outputs, kernel entries overflow float64
    with pytest.raises(ValueError, match="not finite"):
        KernelSurrogate(net, alpha=1.0).fit(torch.rand(10, 4, dtype=torch.float64) + 0.5)


def test_ill_conditioned_kernel_warns(trained):
    model, x, _, _, _ = trained
    dup = torch.cat([x[:40], x[:40]])
    with pytest.warns(RuntimeWarning, match="ill-conditioned"):
        KernelSurrogate(model, alpha=1e-18).fit(dup)


def test_numpy_images_and_token_ids_are_taken_as_the_model_takes_them():
    """numpy arrays that are not a 2-D feature table (images, integer ids) reach the model as
    tensors of their own shape and dtype, as they do in the other entry points; faithfulness
    needs two test samples to rank."""
    torch.manual_seed(0)
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(1, 2, 3), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(32, 3)
    ).eval()
    images = np.random.default_rng(0).normal(size=(12, 1, 6, 6)).astype(np.float32)
    from_numpy = KernelSurrogate(cnn, alpha=0.1).fit(images).decision_function(images[:3])
    from_torch = KernelSurrogate(cnn, alpha=0.1).fit(torch.as_tensor(images))
    np.testing.assert_allclose(
        from_numpy, from_torch.decision_function(torch.as_tensor(images[:3]))
    )
    embed = torch.nn.Sequential(
        torch.nn.Embedding(7, 4), torch.nn.Flatten(), torch.nn.Linear(12, 3)
    ).eval()
    ids = np.random.default_rng(1).integers(0, 7, size=(10, 3))
    surrogate = KernelSurrogate(embed, alpha=0.1).fit(ids)
    assert surrogate.decision_function(ids[:2]).shape == (2, 3)
    with pytest.raises(ValueError, match="needs at least 2"):
        surrogate.faithfulness(ids[:1])


def test_binary_logistic_decision_has_a_column_per_class():
    # sklearn's binary LogisticRegression has one log-odds column: its argmax was always class 0,
    # so coherence compared the proponents of class 1 with class 0 and faithfulness dropped its
    # probability metrics
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x, xt = torch.randn(30, 3), torch.randn(8, 3)
    y = (x[:, 0] > 0).long()
    s = KernelSurrogate(model, machine="logistic", alpha=1.0).fit(x, y)
    d = s.decision_function(xt)
    assert d.shape == (8, 2)
    np.testing.assert_array_equal(s.classes_[d.argmax(1)], s.predict(xt))
    k = s._test_kernel(xt)
    np.testing.assert_allclose(d[:, 1] - d[:, 0], s.machine_.decision_function(k), rtol=1e-9)
    np.testing.assert_allclose(s.attribute(xt).sum(1) + s.baseline_, d, rtol=1e-9, atol=1e-9)
    idx, _ = s.proponents(xt, k=1)
    rows = np.arange(len(xt))
    assert (s.attribute(xt)[rows, idx[:, 0], d.argmax(1)] > 0).all()
    assert "tau_prob" in s.faithfulness(xt)


def test_representer_on_identical_training_samples_is_refused_not_nan():
    # identical samples give every row of K·(e_y − p) the same value: the fitted scale was 0/0 and
    # every decision and contribution NaN, silently
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(1, 3).repeat(4, 1)
    with pytest.raises(ValueError, match="does not vary over these"):
        KernelSurrogate(model, machine="representer").fit(x, [0, 1, 2, 0])


def test_changing_the_training_array_after_fit_changes_nothing(trained):
    """The surrogate kept the caller's training inputs (a numpy array shared its memory) and
    computes K(x, x_train) from them at every prediction: standardising the array in place after
    fit changed decision_function and the attributions silently."""
    model, x, y, xt, _ = trained
    for x_train in (x[:60].numpy().copy(), x[:60].clone()):
        s = KernelSurrogate(model).fit(x_train)
        before = s.decision_function(xt[:5])
        x_train *= 2
        np.testing.assert_array_equal(s.decision_function(xt[:5]), before)


def test_a_bool_alpha_is_refused(trained):
    """alpha=True (an int to Python) passed sklearn's Interval(Real) and was read as 1."""
    model, x, y, _, _ = trained
    with pytest.raises(TypeError, match="alpha must be .*number.*, got the bool True"):
        KernelSurrogate(model, alpha=True).fit(x[:40], y[:40])


def test_every_number_parameter_refuses_a_bool():
    """sklearn's Interval(Integral) and Interval(Real) let a bool through (True is 1):
    projection_dim=True was a projection of dimension 1, reference=True the top quantile."""
    from test_attribution_posterior import _bools_the_constraints_take

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    x = torch.randn(10, 4)
    cases = _bools_the_constraints_take(KernelSurrogate)
    expected = {"projection_dim", "seed", "batch_size", "reference", "alpha"}
    assert expected <= {n for n, _ in cases}
    for name, value in cases:
        with pytest.raises((ValueError, TypeError), match=f"^{name} must be .*got.* {value}$"):
            KernelSurrogate(model, **{name: value}).fit(x)
    with pytest.raises(ValueError, match="^projection_dim must be a positive integer or None"):
        KernelSurrogate(model, projection_dim=True).fit(x)


def test_k_and_output_are_integers_not_bools_or_strings():
    """output=True was read as class (or column) 1, k=True as 1; k=1.5, "3" or None failed in
    numpy or on `<` with raw TypeErrors."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    x, xt = torch.randn(10, 4), torch.randn(3, 4)
    s = KernelSurrogate(model).fit(x)
    with pytest.raises(ValueError, match="output must be one of the surrogate's classes"):
        s.proponents(xt, output=True)
    with pytest.raises(ValueError, match="output must be 'all', None or a column"):
        s.influence(xt, output=True)
    calls = (s.proponents, s.opponents, s.coherence)
    for call, k in zip(calls * 4, [True] * 3 + [1.5] * 3 + ["3"] * 3 + [None] * 3):
        with pytest.raises(ValueError, match=f"^k must be a positive integer, got {k!r}"):
            call(xt, k=k)


def test_score_refuses_labels_that_are_no_class_of_the_model():
    """score (sklearn's accuracy) took labels outside the outputs as wrong predictions (0.0)
    where faithfulness refuses them, and too few labels got sklearn's words, naming no argument."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    x, xt, yt = torch.randn(10, 4), torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    s = KernelSurrogate(model).fit(x)
    with pytest.raises(ValueError, match=r"^y holds labels outside 0..2: 9 at sample 0"):
        s.score(xt, torch.full((5,), 9))
    with pytest.raises(ValueError, match=r"^y must be a 1-d tensor of 5 class labels, got shape"):
        s.score(xt, yt[:2])
    assert s.score(xt, yt) == np.mean(s.predict(xt) == yt.numpy())
    assert s.score(xt, yt, sample_weight=[1, 0, 0, 0, 0]) == float(s.predict(xt)[0] == 0)


def test_faithfulness_to_a_network_with_constant_outputs_says_why_it_is_nan():
    """A network whose last layer's weight is zero predicts the same probabilities everywhere:
    the rank correlations are undefined. They came out NaN with only scipy's
    ConstantInputWarning; now a warning names the constant side."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    with torch.no_grad():
        model[2].weight.zero_()
    x, xt = torch.randn(20, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    surrogate = KernelSurrogate(model, alpha=0.1).fit(x)
    with pytest.warns(UserWarning, match="network's predicted-class probabilities are the same"):
        result = surrogate.faithfulness(xt)
    assert np.isnan(result["tau_prob"]) and np.isnan(result["spearman_prob"])
    assert result["label_agreement"] == 1.0


@pytest.mark.parametrize("machine", ["svm", "logistic"])
def test_a_class_rarer_than_the_folds_is_warned_about(trained, machine):
    """Cross-validating alpha with a class of fewer training samples than folds chose it over
    folds that never see that class, silently (scikit-learn's own warning was suppressed with the
    folds' convergence warnings); the warning names the class and what to pass, and the command
    line says it in its flags' words."""
    from attribution.cli.main import _message

    model, x, y, _, _ = trained
    rare = y.clone()[:40]
    rare[0] = 9
    rare[1:][rare[1:] == 9] = 8  # class 9 once
    with pytest.warns(RuntimeWarning, match="class 9 has 1 training sample.*3 cross-val") as got:
        KernelSurrogate(model, kind="trace", machine=machine).fit(x[:40], rare)
    (message,) = [str(w.message) for w in got if "cross-validation" in str(w.message)]
    assert message.endswith("pass a number as alpha, or a smaller cv")
    assert _message(message).endswith(
        "that choose the regularisation: some folds never see it, "
        "and the regularisation chosen reflects the other classes; "
        "pass --alpha"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        KernelSurrogate(model, kind="trace", machine=machine, alpha=0.1).fit(x[:40], rare)
        KernelSurrogate(model, kind="trace", machine=machine, cv=2).fit(x[:60], y[:60])
