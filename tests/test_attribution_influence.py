"""influence(): each method against a direct parameter-space computation with explicit
per-sample Jacobians; TRAK's averaging over models; error paths."""

import copy
import importlib
import warnings

import numpy as np
import pytest
import torch
from models import fitted
from reference import gauss_newton_influence
from torch.func import functional_call, jacrev, vmap

import projections
from attribution import influence, trak
from attribution.kernel_flow import FITTED_FRACTION, flow_logits

O = 3


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, O)
    ).double()
    x, xt = torch.randn(14, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    return model, x, torch.randint(0, O, (14,)), xt, torch.randint(0, O, (4,))


def _jacobian(model, x):
    params = {k: v.detach() for k, v in model.named_parameters()}
    j = vmap(jacrev(lambda p, xi: functional_call(model, p, (xi[None],))[0]), (None, 0))(params, x)
    return torch.cat([j[k].reshape(len(x), O, -1) for k in params], 2)  # [N, O, P]


def _margin_grad(g, y):
    """∂(g_y − logsumexp_{j≠y} g_j)/∂g, written out independently."""
    out = torch.zeros_like(g)
    for n in range(len(y)):
        others = [j for j in range(g.shape[1]) if j != y[n]]
        out[n, others] = -torch.softmax(g[n, others], 0)
        out[n, y[n]] = 1.0
    return out


def _reference(model, x, y, xt, yt):
    j, jt = _jacobian(model, x), _jacobian(model, xt)
    g, gt = model(x).detach(), model(xt).detach()
    p = g.softmax(1)
    r = torch.eye(O, dtype=torch.float64)[y] - p
    left = torch.einsum("mo,moa->ma", _margin_grad(gt, yt), jt)
    return j, left, g, p, r


def test_gauss_newton_matches_parameter_space(setup):
    model, x, y, xt, yt = setup
    j, left, g, p, r = _reference(model, x, y, xt, yt)
    expected = gauss_newton_influence(j, left, g, y, 0.1)
    got = influence(
        model,
        x,
        y,
        xt,
        yt,
        method="gauss_newton",
        kind="full",
        damping=0.1,
        training_logits="network",
    )
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-10)
    trace = influence(model, x, y, xt, yt, kind="trace", damping=0.1)
    torch.testing.assert_close(influence(model, x, y, xt, yt, damping=0.1), trace)  # auto


def _fit(model, x, y, steps):
    """A copy of `model` after `steps` Adam steps on the cross-entropy of (x, y)."""
    return fitted(copy.deepcopy(model), x, y, steps)


def _flow_reference(model, x, y, xt, yt, share, loss_floor=None):
    """The flow of the output-averaged kernel (training and test logits) and u_zᵀ J_z with the
    margin's gradient at the flow's test logits."""
    j, jt = _jacobian(model, x), _jacobian(model, xt)
    kernel = torch.einsum("ioa,joa->ij", j, j) / O
    cross = torch.einsum("moa,joa->mj", jt, j) / O
    flow = flow_logits(kernel, y, O, share, loss_floor=loss_floor, cross=cross)
    return flow, torch.einsum("mo,moa->ma", _margin_grad(flow.test, yt), jt)


@pytest.mark.parametrize("share", [0.1, 0.3])
def test_gauss_newton_reads_the_kernel_flows_logits(setup, share):
    """Residuals and curvature at `flow_logits` of the output-averaged kernel, stopped once it
    has fitted `share` of its directions (the network, fitted to its labels, is far below that
    loss), and the test margins' gradients at the same flow's test logits; the default ("auto")
    is FITTED_FRACTION, for one model and for several."""
    model, x, y, xt, yt = setup
    model = _fit(model, x, y, 200)
    j, left, g, p, r = _reference(model, x, y, xt, yt)
    flow, flow_left = _flow_reference(model, x, y, xt, yt, share)
    ce = torch.nn.functional.cross_entropy
    assert ce(flow.train, y).item() > 0.5 > 100 * ce(g, y).item()  # the share stopped it
    expected = gauss_newton_influence(j, flow_left, flow.train, y, 0.1)
    got = influence(model, x, y, xt, yt, kind="full", damping=0.1, training_logits=share)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-10)
    network_test = gauss_newton_influence(j, left, flow.train, y, 0.1)  # u at the network's
    network_train = gauss_newton_influence(j, flow_left, g, y, 0.1)  # r, Λ at the network's
    assert not torch.allclose(got, network_test, rtol=1e-3)
    assert not torch.allclose(got, network_train, rtol=1e-3)
    trace = influence(model, x, y, xt, yt, damping=0.1, training_logits=FITTED_FRACTION)
    torch.testing.assert_close(influence(model, x, y, xt, yt, damping=0.1), trace)
    several = dict(damping=0.1, checkpoints=[model, model])  # each model its own flow
    torch.testing.assert_close(influence(model, x, y, xt, yt, **several), trace)
    torch.testing.assert_close(
        influence(model, x, y, xt, yt, training_logits=share, **several),
        influence(model, x, y, xt, yt, damping=0.1, training_logits=share),
    )


def test_the_flow_goes_no_further_than_the_network(setup):
    """A share the flow would reach only below the network's own training loss stops at that
    loss (a network a few steps into training)."""
    model, x, y, xt, yt = setup
    model = _fit(model, x, y, 10)
    j, left, g, p, r = _reference(model, x, y, xt, yt)
    loss = torch.nn.functional.cross_entropy(g, y).item()
    flow, flow_left = _flow_reference(model, x, y, xt, yt, 0.9, loss_floor=loss)
    ce = torch.nn.functional.cross_entropy
    assert ce(flow.train, y).item() == pytest.approx(loss, rel=1e-6)
    got = influence(model, x, y, xt, yt, kind="full", damping=0.1, training_logits=0.9)
    torch.testing.assert_close(
        got, gauss_newton_influence(j, flow_left, flow.train, y, 0.1), rtol=1e-7, atol=1e-10
    )


def test_training_logits_errors(setup, monkeypatch):
    model, x, y, xt, yt = setup
    for method in ("ekfac", "grad_dot", "surrogate", "trak"):
        with pytest.raises(ValueError, match="training_logits"):
            influence(model, x, y, xt, method=method, training_logits="flow")
        influence(model, x, y, xt, method=method, training_logits="network")
    with pytest.raises(ValueError, match="parameter space"):
        influence(model, x, y, xt, kind="full", dim=32, training_logits=0.05)
    with pytest.raises(ValueError, match="training_logits"):
        influence(model, x, y, xt, training_logits="early")
    for share in (-1.0, 0.0, 1.0, 6.0):
        with pytest.raises(ValueError, match="training_logits"):
            influence(model, x, y, xt, training_logits=share)
    with pytest.raises(TypeError, match="training_logits"):
        influence(model, x, y, xt, training_logits=True)
    module = importlib.import_module("attribution._influence")
    monkeypatch.setattr(module, "_exact_fits", lambda *args: False)
    with pytest.raises(ValueError, match="does not fit in memory"):
        influence(model, x, y, xt, training_logits="flow")
    torch.testing.assert_close(  # "auto" falls back to the network's logits with the projection
        influence(model, x, y, xt, yt, damping=0.1),
        influence(model, x, y, xt, yt, kind="full", damping=0.1, dim=128),
    )


@pytest.mark.parametrize("n_train", [14, 3])
def test_gauss_newton_with_more_or_fewer_test_than_training_samples(setup, n_train):
    """One joint train + test kernel (N_test <= N_train) or two kernels (N_test > N_train): the
    same parameter-space scores, for tensor and tuple inputs."""
    model, x, y, xt, yt = setup
    x, y = x[:n_train], y[:n_train]
    j, left, g, p, r = _reference(model, x, y, xt, yt)
    expected = gauss_newton_influence(j, left, g, y, 0.1)
    network = dict(kind="full", damping=0.1, training_logits="network")
    got = influence(model, x, y, xt, yt, **network)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-10)
    tupled = influence(model, (x,), y, (xt,), yt, **network)
    torch.testing.assert_close(tupled, expected, rtol=1e-7, atol=1e-10)


def test_projected_gauss_newton_is_the_formula_on_features(setup):
    model, x, y, xt, yt = setup
    f, ft = (projections.features(model, v, dim=32, kind="full", seed=1).double() for v in (x, xt))
    g = model(x).detach()
    left = torch.einsum("mo,moa->ma", _margin_grad(model(xt).detach(), yt), ft)
    expected = gauss_newton_influence(f, left, g, y, 0.1)  # the formula on the features
    for batch_size in (None, 3):  # one batch, or streamed in five (14 training samples)
        got = influence(
            model, x, y, xt, yt, kind="full", dim=32, seed=1, damping=0.1, batch_size=batch_size
        )
        torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-10)
    grad_dot = influence(model, x, y, xt, yt, method="grad_dot", dim=32, seed=1, batch_size=3)
    r = torch.eye(O, dtype=torch.float64)[y] - g.softmax(1)
    torch.testing.assert_close(grad_dot, left @ torch.einsum("io,ioa->ai", r, f))


def test_training_features_read_from_a_store(setup, tmp_path):
    """A feature store of x_train (projections.featurize, kind full) gives the formula on its
    features, with the test side projected by the store's dim, seed and projector."""
    model, x, y, xt, yt = setup
    path = tmp_path / "train"
    opts = dict(dim=32, kind="full", seed=4, projector="gaussian")
    projections.featurize(model, x, path, block=5, store_dtype="float64", **opts)
    f, ft = (projections.features(model, v, **opts).double() for v in (x, xt))
    left = torch.einsum("mo,moa->ma", _margin_grad(model(xt).detach(), yt), ft)
    expected = gauss_newton_influence(f, left, model(x).detach(), y, 0.1)
    got = influence(model, x, y, xt, yt, train_features=path, damping=0.1, batch_size=4)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-10)
    # method="auto" uses it too; dim may be repeated
    torch.testing.assert_close(
        influence(
            model,
            x,
            y,
            xt,
            yt,
            method="auto",
            kind="full",
            dim=32,
            train_features=path,
            damping=0.1,
        ),
        expected,
        rtol=1e-7,
        atol=1e-10,
    )


def test_training_feature_store_errors(setup, tmp_path):
    model, x, y, xt, yt = setup
    path = tmp_path / "train"
    projections.featurize(model, x, path, dim=16, kind="full")
    with pytest.raises(ValueError, match="not dim=32"):
        influence(model, x, y, xt, dim=32, train_features=path)
    with pytest.raises(ValueError, match="holds 14 samples, x_train has 10"):
        influence(model, x[:10], y[:10], xt, train_features=path)
    with pytest.raises(ValueError, match="serves method 'gauss_newton' or 'grad_dot'"):
        influence(model, x, y, xt, method="ekfac", train_features=path)
    with pytest.raises(ValueError, match="not to checkpoints"):
        influence(model, x, y, xt, train_features=path, checkpoints=[model])
    trace = tmp_path / "trace"
    projections.featurize(model, x, trace, dim=16, kind="trace")
    with pytest.raises(ValueError, match="kind='trace' features"):
        influence(model, x, y, xt, train_features=trace)
    other = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, O)
    ).double()
    with pytest.raises(projections.StoreError):  # other weights
        influence(other, x, y, xt, train_features=path)
    with pytest.raises(projections.StoreError):  # other inputs
        influence(model, x + 1.0, y, xt, train_features=path)


def test_projection_when_exact_kernels_do_not_fit(setup, monkeypatch):
    module = importlib.import_module("attribution._influence")
    model, x, y, xt, yt = setup
    assert module.default_dim(model) == 128  # 66 parameters → next power of two
    monkeypatch.setattr(module, "_exact_fits", lambda *args: False)
    projected = influence(model, x, y, xt, yt, kind="full", damping=0.1, dim=128)
    for method in ("gauss_newton", "auto"):  # auto too: the projected path, not EK-FAC
        torch.testing.assert_close(
            influence(model, x, y, xt, yt, method=method, damping=0.1), projected
        )


def test_surrogate_method_is_its_counterfactual_on_the_margin(setup):
    from attribution import KernelSurrogate
    from attribution.damping import DOF_FRACTION

    model, x, y, xt, yt = setup
    # at influence's damping (chosen for LDS), not the surrogate's default (for faithfulness)
    surrogate = KernelSurrogate(model, machine="gauss_newton", effective_parameters=DOF_FRACTION)
    c = torch.as_tensor(surrogate.fit(x, y).influence(xt, output="all"))
    expected = torch.einsum("mio,mo->mi", c, _margin_grad(model(xt).detach(), yt))
    torch.testing.assert_close(influence(model, x, y, xt, yt, method="surrogate"), expected)
    default = KernelSurrogate(model, machine="gauss_newton").fit(x, y)
    assert default.alpha_ < surrogate.alpha_  # the surrogate's own default damps less


def test_grad_dot_matches_parameter_space(setup):
    model, x, y, xt, yt = setup
    j, left, _, _, r = _reference(model, x, y, xt, yt)
    expected = left @ torch.einsum("io,ioa->ai", r, j)
    torch.testing.assert_close(influence(model, x, y, xt, yt, method="grad_dot"), expected)


def test_trak_exact_and_projected(setup):
    model, x, y, xt, yt = setup
    j, left, g, p, _ = _reference(model, x, y, xt, yt)
    phi = torch.einsum("io,ioa->ia", _margin_grad(g, y), j)
    q = 1 - p[torch.arange(len(y)), y]
    expected = left @ torch.linalg.pinv(phi) * q
    torch.testing.assert_close(trak(model, x, y, xt, yt, dim=None), expected, rtol=1e-6, atol=1e-9)
    # projected: the same formula on the projections package's features
    f, ft = (projections.features(model, v, dim=16, kind="full", seed=3).double() for v in (x, xt))
    phi_p = torch.einsum("io,iok->ik", _margin_grad(g, y), f)
    phi_t = torch.einsum("mo,mok->mk", _margin_grad(model(xt).detach(), yt), ft)
    expected_p = (
        phi_t
        @ torch.linalg.solve(phi_p.T @ phi_p + 0.5 * torch.eye(16, dtype=torch.float64), phi_p.T)
        * q
    )
    got = influence(model, x, y, xt, yt, method="trak", dim=16, seed=3)
    torch.testing.assert_close(trak(model, x, y, xt, yt, dim=16, seed=3, damping=0.5), expected_p)
    assert got.shape == (4, 14) and bool(torch.isfinite(got).all())


def test_trak_warns_when_it_interpolates(setup):
    """At least as many features as training examples (dim ≥ N, or P ≥ N with dim=None) and no
    damping: Φ has full row rank and TRAK's solve interpolates; below that, or damped, silent."""
    model, x, y, xt, yt = setup  # N = 14 training examples, P = 66 parameters
    for dim in (None, 14, 2048):
        with pytest.warns(UserWarning, match="interpolates the training set"):
            trak(model, x, y, xt, yt, dim=dim)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trak(model, x, y, xt, yt, dim=8)
        trak(model, x, y, xt, yt, dim=None, damping=0.1)
        # Φ = GR has rank ≤ P: 14 parameters projected to 64 features cannot interpolate 40
        # examples (it was warned about, dim alone compared with N)
        narrow = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)).double()
        x40 = torch.randn(40, 3, dtype=torch.float64)
        with pytest.warns(UserWarning, match="dim=64 is not below the model's 14") as seen:
            trak(narrow.eval(), x40, torch.arange(40) % 2, x40[:3], torch.arange(3) % 2, dim=64)
        assert not any("interpolates" in str(w.message) for w in seen)
        warnings.filterwarnings("ignore", "dim=2048 is not below the model's 66")  # P < dim
        damped = influence(model, x, y, xt, yt, method="trak", damping=0.1)  # dim 2048
    torch.testing.assert_close(damped, trak(model, x, y, xt, yt, damping=0.1))


def test_trak_averages_kernel_and_q_separately(setup):
    model, x, y, xt, yt = setup
    other = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, O)
    ).double()
    parts, qs = [], []
    for m in (model, other):
        j, left, g, p, _ = _reference(m, x, y, xt, yt)
        phi = torch.einsum("io,ioa->ia", _margin_grad(g, y), j)
        parts.append(left @ torch.linalg.pinv(phi))
        qs.append(1 - p[torch.arange(len(y)), y])
    expected = (parts[0] + parts[1]) / 2 * ((qs[0] + qs[1]) / 2)
    got = trak(model, x, y, xt, yt, dim=None, checkpoints=[model, other.state_dict()])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)


def test_checkpoints_of_one_run_average_their_scores():
    """Checkpoints saved along training (demo.train_checkpoints) give the mean of the scores each
    checkpoint gives alone (each with its own kernel flow's training logits on the Gauss–Newton
    path, its own logits on EK-FAC)."""
    from ntk import demo

    d = demo.digits(n_train=40)
    torch.manual_seed(0)
    model = demo.mlp(hidden=8)
    states = demo.train_checkpoints(model, d.x_train, d.y_train, count=3, epochs=3)
    x, y, xt, yt = d.x_train, d.y_train, d.x_test[:24], d.y_test[:24]
    for method in ("gauss_newton", "ekfac"):
        alone = []
        for state in states:
            m = demo.mlp(hidden=8)
            m.load_state_dict(state)
            alone.append(influence(m.eval(), x, y, xt, yt, method=method))
        got = influence(model, x, y, xt, yt, method=method, checkpoints=states)
        torch.testing.assert_close(got, torch.stack(alone).mean(0))
        assert not torch.allclose(alone[0], alone[-1], rtol=1e-3)
    # without test labels every checkpoint explains the class `model` predicts
    first = demo.mlp(hidden=8)
    first.load_state_dict(states[0])
    predicted = model(xt).argmax(1)
    assert not torch.equal(first(xt).argmax(1), predicted)
    torch.testing.assert_close(
        influence(model, x, y, xt, checkpoints=states),
        influence(model, x, y, xt, predicted, checkpoints=states),
    )
    torch.testing.assert_close(
        trak(model, x, y, xt, checkpoints=states, dim=None),
        trak(model, x, y, xt, predicted, checkpoints=states, dim=None),
    )


def test_model_untouched_and_errors(setup):
    model, x, y, xt, yt = setup
    before = [p.detach().clone() for p in model.parameters()]
    model.train()
    influence(model, x, y, xt, method="gauss_newton", kind="trace")
    assert model.training and all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    model.eval()
    with pytest.raises(ValueError, match="unknown method"):
        influence(model, x, y, xt, method="magic")
    with pytest.raises(ValueError, match="damping"):
        influence(model, x, y, xt, damping=-1.0)
    with pytest.raises(ValueError, match="14 class labels"):
        influence(model, x, y[:5], xt)
    with pytest.raises(ValueError, match="outside"):
        influence(model, x, y + 5, xt)
    with pytest.raises(ValueError, match="checkpoints is empty"):
        influence(model, x, y, xt, checkpoints=[])
    with pytest.raises(ValueError, match="positive"):
        influence(model, x, y, xt, damping=0.0)
    # named the surrogate's machine and normalize, which influence does not take
    with pytest.raises(ValueError, match="method='surrogate' .* kind must be 'trace' or"):
        influence(model, x, y, xt, method="surrogate", kind="full")


def test_checkpoint_modules_must_have_the_models_architecture(setup):
    """A module checkpoint of another architecture was scored and averaged in silently (one with
    4 outputs against the model's 3 gave scores); state dicts were already checked."""
    model, x, y, xt, yt = setup
    other = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 4))
    for method in ("auto", "trak", "ekfac"):
        with pytest.raises(ValueError, match=r"checkpoints\[1\] is not a model of the model's"):
            influence(model, x, y, xt, method=method, checkpoints=[model, other])
    wider = copy.deepcopy(model)
    last = [m for m in wider.modules() if isinstance(m, torch.nn.Linear)][-1]
    last.weight = torch.nn.Parameter(torch.randn(last.out_features + 1, last.in_features))
    with pytest.raises(ValueError, match=r"weight has shape \(\d+, \d+\), the model's"):
        trak(model, x, y, xt, checkpoints=[wider], dim=None)


def test_damping_is_refused_where_it_does_not_apply(setup):
    """grad_dot and the surrogate have no damping: damping=0.5 was ignored without a word (the
    same scores as damping='auto')."""
    model, x, y, xt, yt = setup
    for method in ("grad_dot", "surrogate"):
        with pytest.raises(
            ValueError, match=f"method='{method}' takes no damping.*got damping=0.5"
        ):
            influence(model, x, y, xt, method=method, damping=0.5)


def test_infinite_damping_is_refused(setup):
    """damping=inf gave TRAK scores of NaN (and the other methods zeros) without an error."""
    model, x, y, xt, yt = setup
    for method in ("trak", "auto", "ekfac"):
        with pytest.raises(ValueError, match="damping must be .*finite.* got inf"):
            influence(model, x, y, xt, method=method, damping=float("inf"))


@pytest.mark.parametrize("squeezed", [False, True])
def test_a_single_logit_binary_classifier_is_named_not_its_labels(squeezed):
    """A binary classifier with one logit (BCEWithLogitsLoss) and labels 0/1 was told "y_train
    holds labels outside 0..0: 1 at sample 1"; the model is what needs two outputs, and the
    output_fn the message suggests gives its influence, whether the logit is [N, 1] or squeezed
    to [N] (the suggested torch.cat made 2N rows of the latter)."""
    torch.manual_seed(0)
    logit = torch.nn.Linear(4, 1).double()
    if squeezed:
        logit = torch.nn.Sequential(logit, torch.nn.Flatten(0))
    x, xt = torch.randn(8, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    y = torch.tensor([0, 1] * 4)
    for method in ("auto", "trak", "ekfac", "grad_dot", "surrogate"):
        with pytest.raises(ValueError, match=r"at least two outputs.*has 1 output \(a binary") as e:
            influence(logit, x, y, xt, method=method)
    hint = str(e.value).split("output_fn=", 1)[1]
    suggested = eval(hint[: hint.rindex(")")], {"torch": torch})  # the message's own lambda
    scores = influence(logit, x, y, xt, output_fn=suggested)
    assert scores.shape == (3, 8) and bool(torch.isfinite(scores).all())


class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, a, b):
        return self.out(torch.tanh(self.a(a) + self.b(b)))


def test_dict_inputs_are_joined_by_key():
    """x_test with the keys of x_train in another order (e.g. attention_mask before input_ids):
    the joint train + test kernel concatenated the dicts' values by position, so each test
    sample's a was read as b (silently wrong scores when the shapes agree, a torch error when
    they do not)."""
    torch.manual_seed(0)
    model = _TwoInputs().double()
    x = {"a": torch.randn(8, 3, dtype=torch.float64), "b": torch.randn(8, 3, dtype=torch.float64)}
    xt = {"a": torch.randn(3, 3, dtype=torch.float64), "b": torch.randn(3, 3, dtype=torch.float64)}
    y = torch.tensor([0, 1, 2, 0, 1, 2, 1, 0])
    swapped = {"b": xt["b"], "a": xt["a"]}
    torch.testing.assert_close(influence(model, x, y, swapped), influence(model, x, y, xt))


def test_inputs_of_another_structure_are_named_as_train_and_test():
    """A dict x_test that lacks a key of x_train (a model with an optional input, such as an
    attention mask) was refused as "x1 and x2 have different per-sample shapes"."""

    class Optional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, a, b=None):
            return self.lin(a if b is None else a * b)

    torch.manual_seed(0)
    x, xt = {"a": torch.randn(6, 3), "b": torch.ones(6, 3)}, {"a": torch.randn(2, 3)}
    with pytest.raises(
        ValueError,
        match=r"^x_train and x_test must have the same keys, got \['a', 'b'\] and \['a'\]",
    ):
        influence(Optional(), x, torch.tensor([0, 1, 2] * 2), xt)


def test_exact_kernels_are_sized_by_the_computation_device(setup, monkeypatch):
    """Whether exact kernels fit is asked of the device the kernels are computed on (the
    model's, or `device`), not of the host's memory."""
    module = importlib.import_module("attribution._influence")
    model, x, y, xt, yt = setup
    asked = []
    monkeypatch.setattr(module, "available_bytes", lambda device: asked.append(device) or 0)
    got = influence(model, x, y, xt, yt, method="gauss_newton", damping=0.1, device="cpu")
    assert asked == [torch.device("cpu")]
    torch.testing.assert_close(
        got, influence(model, x, y, xt, yt, kind="full", damping=0.1, dim=128)
    )


def test_auto_damping_keeps_the_chosen_effective_number_of_parameters():
    """Equal eigenvalues c: γ(λ) = K·c/(c + λ) = f·N·(O − 1) has λ = c(K/(f·N·(O − 1)) − 1)."""
    from attribution.damping import DOF_FRACTION, auto_damping

    e = torch.full((60,), 2.0, dtype=torch.float64)
    target = DOF_FRACTION * 100 * 2
    assert auto_damping(e, 100, 3) == pytest.approx(2.0 * (60 / target - 1), rel=1e-3)
    # zeros (the softmax's null directions) do not count
    padded = torch.cat([e, torch.zeros(40, dtype=torch.float64)])
    assert auto_damping(padded, 100, 3) == pytest.approx(auto_damping(e, 100, 3), rel=1e-6)
    with pytest.raises(ValueError, match="curvature is zero"):
        auto_damping(torch.zeros(5), 10, 2)


def test_a_saturated_network_names_the_damping_to_pass(setup):
    """Every training output saturated: ekfac / kfac failed with "damping must be a positive
    finite number, got 0.0", a damping never passed; the surrogate was told to pass damping=,
    which it refuses. Each names the remedy that works, and it does."""
    from attribution import KernelSurrogate, NTKPosterior
    from attribution.damping import ZeroCurvature

    model, x, y, xt, yt = setup
    saturated = copy.deepcopy(model)
    with torch.no_grad():
        saturated[2].weight.mul_(1e5)
        saturated[2].bias.mul_(1e5)
    assert (saturated(x).softmax(1).max(1).values == 1).all()
    for method in ("ekfac", "kfac"):
        with pytest.raises(ZeroCurvature, match="pass damping= explicitly$"):
            influence(saturated, x, y, xt, yt, method=method)
        assert influence(saturated, x, y, xt, yt, method=method, damping=0.1).isfinite().all()
    with pytest.raises(ZeroCurvature, match="use method='gauss_newton' with damping=$"):
        influence(saturated, x, y, xt, yt, method="surrogate")
    assert influence(saturated, x, y, xt, yt, method="gauss_newton", damping=0.1).isfinite().all()
    with pytest.raises(ZeroCurvature, match="pass alpha= explicitly$"):
        KernelSurrogate(saturated, machine="gauss_newton").fit(x, y)
    fitted = KernelSurrogate(saturated, machine="gauss_newton", alpha=0.1).fit(x, y)
    assert np.isfinite(fitted.influence(xt)).all()
    with pytest.raises(ZeroCurvature, match="pass prior_precision= explicitly$"):
        NTKPosterior(saturated).fit(x, y)


def test_randomized_spectrum_gives_the_exact_damping(monkeypatch):
    """Above EXACT_SPECTRUM rows the rule sees a randomized top of the spectrum plus the trace's
    remainder; on a power-law spectrum its λ is within 2 % of the exact one."""
    from attribution import damping

    gen = torch.Generator().manual_seed(0)
    d, n, o = 800, 400, 3  # rank N·(O − 1) = 800
    q = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64)).Q
    e = 100.0 * torch.arange(1, d + 1, dtype=torch.float64) ** -1.5
    a = (q * e) @ q.T
    exact = damping.auto_damping(e, n, o)
    monkeypatch.setattr(damping, "EXACT_SPECTRUM", 100)
    target = damping.DOF_FRACTION * d
    spectrum = damping.spectrum(a, d, int(4 * target) + 64)
    assert len(spectrum) == d and len(spectrum) > int(4 * damping.DOF_FRACTION * d) + 64
    assert damping.auto_damping(spectrum, n, o) == pytest.approx(exact, rel=0.02)
    # the library's path (influence's damped Cholesky) sees that same spectrum
    assert damping.damping_keeping(a, d, target) == damping.auto_damping(spectrum, n, o)


def test_the_damping_helpers_refuse_non_finite_systems():
    """A NaN eigenvalue was taken for a zero curvature (ZeroCurvature: "the Gauss–Newton
    curvature is zero"), an infinite one failed in scipy's brentq; a NaN system came back from
    LAPACK's potrf as a factor of NaN (it reports success), and log det as nan."""
    from attribution import damping

    for bad in (float("nan"), float("inf")):
        eigenvalues = torch.tensor([3.0, 1.0, bad], dtype=torch.float64)
        with pytest.raises(ValueError, match="eigenvalues contains non-finite values"):
            damping.damping_for(eigenvalues, 1.0)
    system = torch.eye(4, dtype=torch.float64)
    system[1, 2] = system[2, 1] = float("nan")
    assert damping.cholesky(system.clone()) is None
    with pytest.raises(ValueError, match="system contains non-finite values"):
        damping.damped_factor(system, 0.1)
    assert damping.damped_factor(torch.eye(4, dtype=torch.float64), 0.1).diagonal().isfinite().all()


def test_scalar_kernel_system_and_its_product(monkeypatch):
    """A scalar kind's system S(k ⊗ I)S equals the one built from the expanded kernel, its
    structured product equals the dense one, and the randomized spectrum (hence λ) is the same
    through either product."""
    from attribution import damping
    from attribution.outputs import psd_root, softmax_curvature

    gen = torch.Generator().manual_seed(1)
    n, o = 60, 4
    x = torch.randn(n, 5, generator=gen, dtype=torch.float64)
    k = x @ x.T
    s = psd_root(softmax_curvature(3 * torch.randn(n, o, generator=gen, dtype=torch.float64)))
    a, product = damping.scalar_kernel_system(k, s)
    theta = k[:, :, None, None] * torch.eye(o, dtype=torch.float64)
    dense = torch.einsum("iop,ijpr,jrq->iojq", s, theta, s).reshape(n * o, n * o)
    torch.testing.assert_close(a, dense, rtol=1e-12, atol=1e-12)
    y = torch.randn(n * o, 9, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(product(y), dense @ y, rtol=1e-10, atol=1e-10)
    monkeypatch.setattr(damping, "EXACT_SPECTRUM", 50)
    rank = n * (o - 1)
    structured, plain = damping.spectrum(a, rank, 40, product), damping.spectrum(a, rank, 40)
    assert len(plain) == rank  # the randomized route, not the exact eigenvalues
    torch.testing.assert_close(structured, plain, rtol=0, atol=1e-10 * float(plain.max()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cholesky_overwrites_the_system_on_the_cpu(dtype):
    """`damping.cholesky` gives torch's factor, written over the system's own memory on the CPU
    (no second (N·O)² matrix), None for a matrix that is not positive definite; `cholesky_solve`
    solves with it."""
    from attribution import damping

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 70, generator=gen, dtype=torch.float64)
    a = (x @ x.T).to(dtype)
    expected = torch.linalg.cholesky(a)
    storage = a.data_ptr()
    factor = damping.cholesky(a)
    assert factor.data_ptr() == storage
    torch.testing.assert_close(factor, expected)
    b = torch.randn(40, 3, generator=gen, dtype=torch.float64).to(dtype)
    torch.testing.assert_close(damping.cholesky_solve(b, factor), torch.cholesky_solve(b, expected))
    singular = x[:, :5] @ x[:, :5].T
    singular.diagonal().sub_(1.0)
    assert damping.cholesky(singular) is None


@pytest.mark.parametrize("method", ["ekfac", "kfac", "gauss_newton"])
def test_numpy_inputs_give_the_scores_of_tensors(setup, method):
    model, x, y, xt, yt = setup
    expected = influence(model, x, y, xt, yt, method=method)
    got = influence(model, x.numpy(), y.numpy(), xt.numpy(), yt.numpy(), method=method)
    torch.testing.assert_close(got, expected)


def test_influence_and_the_posterior_factor_their_damped_system_alike(setup, small_classifier):
    """One factorisation of a damped system (`damping.damped_factor`) serves influence's damping
    and NTKPosterior's prior precision: in place on the CPU (copy=True keeps the system), and a
    system still singular after damping is refused in the same words, naming each one's option."""
    from attribution import NTKPosterior, damping

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    a = x @ x.T  # rank 8
    kept = a.clone()
    factor = damping.damped_factor(a, 0.5, copy=True)
    assert torch.equal(a, kept)
    expected = torch.linalg.cholesky(kept + 0.5 * torch.eye(30, dtype=torch.float64))
    torch.testing.assert_close(factor, expected)
    assert damping.log_det(factor) == pytest.approx(float(torch.logdet(expected @ expected.T)))
    assert damping.damped_factor(a, 0.5).data_ptr() == a.data_ptr()
    model, x, y, xt, yt = setup
    with pytest.raises(ValueError, match=r"not positive definite at damping=1e-300 .*larger damp"):
        influence(model, x, y, xt, method="gauss_newton", damping=1e-300)
    model, x, y, _, _ = small_classifier
    with pytest.raises(
        ValueError, match=r"not positive definite at prior_precision=1e-300 .*larger prior_prec"
    ):
        NTKPosterior(model, prior_precision=1e-300, curvature="exact").fit(x, y)


def test_numpy_scalars_are_numbers(setup):
    # damping=np.float32(0.5) was refused as "not a positive number" (only int and float were),
    # and trak refused dim=np.int64(16)
    model, x, y, xt, yt = setup
    for method in ("gauss_newton", "ekfac", "trak"):
        torch.testing.assert_close(
            influence(model, x, y, xt, yt, method=method, damping=np.float32(0.5)),
            influence(model, x, y, xt, yt, method=method, damping=0.5),
        )
    torch.testing.assert_close(
        trak(model, x, y, xt, yt, dim=np.int64(16)), trak(model, x, y, xt, yt, dim=16)
    )


class _BatchOut(torch.nn.Module):
    """The batch's outputs pooled (one row) or flattened (B·O rows), not a row per sample."""

    def __init__(self, pool):
        super().__init__()
        self.pool, self.linear = pool, torch.nn.Linear(5, O).double()

    def forward(self, x):
        out = self.linear(x)
        return out.mean(0, keepdim=True) if self.pool else out.reshape(-1)


@pytest.mark.parametrize("method", ["gauss_newton", "trak", "ekfac"])
def test_outputs_that_are_not_a_row_per_sample_are_named(setup, method):
    # a model returning one row per batch was blamed on the labels ("y_train must be a 1-d tensor
    # of 1 class labels"); one test sample without its sample axis (its features taken as
    # samples) on the model's classes ("the margin needs a classifier with at least two outputs;
    # the model has 1 output")
    _, x, y, xt, _ = setup
    for pool, rows in ((True, 1), (False, 14 * O)):
        with pytest.raises(ValueError, match=f"{rows} output rows for the 14 samples of x_train"):
            influence(_BatchOut(pool), x, y, xt, method=method)
    with pytest.raises(ValueError, match="returned 3 output rows for the 5 samples of x_test"):
        influence(setup[0], x, y, xt[0], method=method)
    square = torch.nn.Sequential(torch.nn.Linear(O, 4), torch.nn.Tanh(), torch.nn.Linear(4, O))
    x_square = torch.randn(6, O)
    with pytest.raises(
        ValueError, match=r"3 outputs per sample on x_train but 1 on x_test.*\[None\]"
    ):
        influence(square, x_square, y[:6], x_square[0], method=method)


def test_a_bool_damping_is_refused(setup):
    """damping=True (an int to Python) was read as λ = 1."""
    model, x, y, xt, yt = setup
    for method in ("gauss_newton", "ekfac"):
        with pytest.raises(TypeError, match="damping must be .*number.*, got the bool True"):
            influence(model, x, y, xt, method=method, damping=True)
    with pytest.raises(TypeError, match="damping must be .*number.*, got the bool False"):
        trak(model, x, y, xt, damping=False)


def test_test_sequences_of_another_length_are_scored_exactly():
    """Test inputs of another per-sample shape than the training inputs (sequences of length 7
    against 5, as padded HF batches) were refused ("x_train and x_test have different per-sample
    shapes") though the model takes both. grad_dot equals u_mᵀ Θ(x_m, x_i) r_i from the
    per-sample autograd kernel; gauss_newton scores them too."""
    from models import SharedPositions
    from reference import kernels

    from attribution.outputs import margin_gradient

    torch.manual_seed(0)
    model = SharedPositions(seq=8).double().eval()
    g = torch.Generator().manual_seed(5)
    x, x_test = torch.randint(0, 5, (12, 5), generator=g), torch.randint(0, 5, (3, 7), generator=g)
    y = torch.randint(0, 2, (12,), generator=g)
    with torch.no_grad():
        g_train, g_test = model(x), model(x_test)
    u = margin_gradient(g_test, g_test.argmax(1))
    r = torch.nn.functional.one_hot(y, 2).double() - g_train.softmax(1)
    expected = torch.einsum("mo,mioq,iq->mi", u, kernels(model, x_test, x)[None], r)
    got = influence(model, x, y, x_test, method="grad_dot", kind="full")
    torch.testing.assert_close(torch.as_tensor(got), expected, rtol=1e-9, atol=1e-12)
    scores = torch.as_tensor(influence(model, x, y, x_test))
    assert scores.shape == (3, 12) and bool(torch.isfinite(scores).all())


def test_influence_flushes_subnormal_numbers_and_restores_the_setting(setup, monkeypatch):
    """`influence` runs with subnormal numbers flushed to zero (their products cost microcode
    assists on x86: ntk.core.floats) and leaves the CPU's setting as it found it, either way."""
    from attribution import _influence
    from ntk.core.floats import flush_denormals, flushing

    model, x, y, xt, yt = setup
    seen = []
    real = _influence.curvature.KroneckerCurvature.influence

    def recording(self, *args):
        seen.append(flushing())
        return real(self, *args)

    monkeypatch.setattr(_influence.curvature.KroneckerCurvature, "influence", recording)
    for before in (False, True):
        torch.set_flush_denormal(before)
        try:
            assert flushing() == before
            influence(model, x, y, xt, yt, method="ekfac")
            assert flushing() == before
            with flush_denormals():
                assert flushing()
                assert float(torch.tensor([1e-39]) * 1.0) == 0.0
            assert flushing() == before
        finally:
            torch.set_flush_denormal(False)
    assert seen == [True, True]


def test_a_function_in_place_of_the_model_is_refused_naming_model():
    """A plain function failed reading the parameters' dtype ("'function' object has no attribute
    'parameters'")."""
    x, y, xt = torch.randn(6, 4), torch.arange(6) % 3, torch.randn(2, 4)
    for call in (influence, trak):
        with pytest.raises(TypeError, match="^model must be a torch.nn.Module, got function"):
            call(lambda z: z, x, y, xt)
