"""attribution.curvature (K-FAC / EK-FAC influence): against a dense float64 computation of the same
factored curvature; exact Gauss–Newton where the Kronecker factorisation is exact; the exact trace
and per-example gradients of convolutions, normalisation layers and embeddings; error paths."""

import copy

import pytest
import torch
from models import Chunked, DictOutput, TwoDtypes
from torch import nn
from torch.func import functional_call, jacrev, vmap

from attribution import NTKPosterior, influence
from attribution.curvature import MAX_DENSE, KroneckerCurvature

O = 3
DAMPING = 0.3


def _jacobian(model, x):
    """Per-example Jacobians [N, O, P] in named_parameters() order."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    j = vmap(jacrev(lambda p, xi: functional_call(model, p, (xi[None],))[0]), (None, 0))(params, x)
    return torch.cat([j[k].reshape(len(x), O, -1) for k in params], 2)


def _margin_grad(g, y):
    others = g.scatter(1, y[:, None], float("-inf")).softmax(1)
    return (-others).scatter(1, y[:, None], 1.0)


def _softmax_hessians(g):
    p = g.softmax(1)
    return torch.stack([torch.diag(q) - torch.outer(q, q) for q in p])


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, O)).double().eval()
    x, xt = torch.randn(30, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    return model, x, torch.randint(0, O, (30,)), xt, torch.randint(0, O, (4,))


def _layer_jacobians(model, x):
    """Per layer: inputs with a trailing 1 [N, F_in + 1] and per-example Jacobians of [W b] laid
    out row-major [N, O, F_out·(F_in + 1)] (the bias is the last input column)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    j = vmap(jacrev(lambda p, xi: functional_call(model, p, (xi[None],))[0]), (None, 0))(params, x)
    hidden = torch.tanh(model[0](x)).detach()
    out = []
    for idx, a in ((0, x), (2, hidden)):
        jw, jb = j[f"{idx}.weight"], j[f"{idx}.bias"]  # [N, O, F_out, F_in], [N, O, F_out]
        a1 = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
        out.append((a1, jb, torch.cat([jw, jb[..., None]], -1).flatten(2)))
    return out


def _dense_factored_scores(model, x, y, xt, yt, strategy):
    """The factored curvature built densely (Kronecker products, explicit eigenbasis) and solved
    with torch.linalg.solve."""
    g, gt = model(x).detach(), model(xt).detach()
    lam = _softmax_hessians(g)
    r = torch.eye(O, dtype=torch.float64)[y] - g.softmax(1)
    u = _margin_grad(gt, yt)
    blocks, left, right = [], [], []
    for (a, jb, j), (_, _, jt) in zip(_layer_jacobians(model, x), _layer_jacobians(model, xt)):
        a_cov = a.T @ a
        g_cov = torch.einsum("iop,ioa,ipb->ab", lam, jb, jb)  # Σ_i Σ_c δ_ic δ_icᵀ
        if strategy == "kfac":
            block = torch.kron(g_cov, a_cov) / len(x)
        else:
            q = torch.kron(torch.linalg.eigh(g_cov)[1], torch.linalg.eigh(a_cov)[1])
            exact = torch.einsum("iop,ioa,ipb->ab", lam, j, j)
            block = q @ torch.diag(torch.diagonal(q.T @ exact @ q)) @ q.T
        blocks.append(block)
        left.append(torch.einsum("mo,moa->ma", u, jt))
        right.append(torch.einsum("io,ioa->ia", r, j))
    h = torch.block_diag(*blocks) + DAMPING * torch.eye(sum(b.shape[0] for b in blocks)).double()
    return torch.cat(left, 1) @ torch.linalg.solve(h, torch.cat(right, 1).T)


@pytest.mark.parametrize("strategy", ["kfac", "ekfac"])
@pytest.mark.parametrize("n_test", [4, 60])  # scored in the parameter basis / the eigenbasis
def test_matches_dense_factored_curvature(mlp, strategy, n_test):
    model, x, y, _, _ = mlp
    xt = torch.randn(n_test, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    yt = torch.randint(0, O, (n_test,), generator=torch.Generator().manual_seed(4))
    expected = _dense_factored_scores(model, x, y, xt, yt, strategy)
    got = influence(model, x, y, xt, yt, method=strategy, damping=DAMPING)
    torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-12)
    curvature = KroneckerCurvature(model, strategy=strategy, batch_size=7).fit(x, model(x).detach())
    g, gt = model(x).detach(), model(xt).detach()
    r = torch.eye(O, dtype=torch.float64)[y] - g.softmax(1)
    streamed = curvature.influence(xt, _margin_grad(gt, yt), x, r, DAMPING)
    torch.testing.assert_close(streamed, expected, rtol=1e-8, atol=1e-12)
    assert {b.rotated for b in curvature.blocks.values()} == {n_test > 30}


@pytest.mark.parametrize("strategy", ["kfac", "ekfac"])
def test_exact_gauss_newton_where_the_factorisation_is_exact(mlp, strategy):
    """A linear classifier at zero weights: every p_i is uniform, so Λ_i = Λ and the Gauss–Newton
    curvature Σ_i Λ ⊗ a_i a_iᵀ is one Kronecker product; with the same damping both strategies
    give the exact kernel-form influence (and their "auto" damping is 3 × the mean eigenvalue
    of the same curvature)."""
    _, x, y, xt, yt = mlp
    model = nn.Linear(5, O).double()
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    exact = influence(model, x, y, xt, yt, method="gauss_newton", kind="full", damping=DAMPING)
    got = influence(model, x, y, xt, yt, method=strategy, damping=DAMPING)
    torch.testing.assert_close(got, exact, rtol=1e-8, atol=1e-12)
    g = model(x).detach()
    curv = KroneckerCurvature(model, strategy=strategy).fit(x, g)
    mean_eigenvalue = curv.trace / g.numel()
    auto = influence(model, x, y, xt, yt, method=strategy)
    explicit = influence(model, x, y, xt, yt, method=strategy, damping=3 * mean_eigenvalue)
    torch.testing.assert_close(auto, explicit, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("strategy", ["kfac", "ekfac"])
def test_a_body_run_on_chunks_of_the_training_batch_is_left_dense(strategy):
    """A body run on chunks of 32 samples of a batch of 80 was refused ("reads module 'body.0'
    once per forward pass with all 80 samples"); the plan's pass on the largest batch leaves it
    to per-example gradients (dense blocks), as for chunks of 4 that a pass on 16 samples shows."""
    torch.manual_seed(0)
    net = Chunked(32).double().eval()
    seen = Chunked(4).double().eval()
    seen.load_state_dict(net.state_dict())
    gen = torch.Generator().manual_seed(1)
    x, xt = torch.randn(80, 3, dtype=torch.float64, generator=gen).split([72, 8])
    y, yt = torch.randint(0, 2, (80,), generator=gen).split([72, 8])
    got = influence(net, x, y, xt, yt, method=strategy, damping=DAMPING)
    want = influence(seen, x, y, xt, yt, method=strategy, damping=DAMPING)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    assert KroneckerCurvature(net, strategy=strategy).fit(x, net(x).detach()).plan.fallback


def _cnn():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Conv2d(3, 2, 2, stride=2),
        nn.Flatten(),
        nn.Linear(8, O),
    ).double()
    bn = model[1]
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 2.0)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.uniform_(-0.5, 0.5)
    return model.eval(), torch.randn(12, 1, 4, 4, dtype=torch.float64)


def _embedding():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Embedding(6, 4, padding_idx=0), nn.Flatten(), nn.Linear(12, O))
    return model.double().eval(), torch.randint(0, 6, (12, 3))


@pytest.mark.parametrize("build", [_cnn, _embedding], ids=["cnn_batchnorm", "embedding"])
def test_trace_and_per_example_gradients_are_exact(build):
    """EK-FAC's trace is the exact Gauss–Newton trace Σ_i tr(Λ_i J_i J_iᵀ), and with a huge
    damping λ, λ·τ tends to the gradient dot product u_zᵀ J_z J_iᵀ r_i (the per-example gradients
    of convolutions, BatchNorm's dense block and embeddings)."""
    model, x = build()
    g = model(x).detach()
    y = torch.randint(0, O, (len(x),), generator=torch.Generator().manual_seed(0))
    j = _jacobian(model, x)
    curvature = KroneckerCurvature(model, batch_size=5).fit(x, g)
    exact_trace = torch.einsum("iop,iop->", _softmax_hessians(g), j @ j.transpose(1, 2))
    assert curvature.trace == pytest.approx(float(exact_trace), rel=1e-10)
    u = _margin_grad(g, g.argmax(1))
    r = torch.eye(O, dtype=torch.float64)[y] - g.softmax(1)
    lam = 1e10
    got = lam * curvature.influence(x, u, x, r, lam)
    expected = torch.einsum("mo,moa->ma", u, j) @ torch.einsum("io,ioa->ia", r, j).T
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-8)


def test_float32_model_close_to_float64(mlp):
    model, x, y, xt, yt = mlp
    expected = influence(model, x, y, xt, yt, method="ekfac")
    got = influence(copy.deepcopy(model).float(), x.float(), y, xt.float(), yt, method="ekfac")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_model_is_not_modified(mlp):
    model, x, y, xt, yt = mlp
    before = copy.deepcopy(model.state_dict())
    influence(model, x, y, xt, yt, method="ekfac")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_bad_inputs(mlp):
    model, x, y, xt, yt = mlp
    with pytest.raises(ValueError, match="kind and dim do not apply"):
        influence(model, x, y, xt, yt, method="ekfac", kind="trace")
    with pytest.raises(ValueError, match="kind and dim do not apply"):
        influence(model, x, y, xt, yt, method="kfac", dim=64)
    with pytest.raises(ValueError, match="damping"):
        influence(model, x, y, xt, yt, method="ekfac", damping=-1.0)
    with pytest.raises(ValueError, match="unknown strategy"):
        KroneckerCurvature(model, strategy="shampoo")
    with pytest.raises(ValueError, match="batch_size"):
        KroneckerCurvature(model, batch_size=0)
    with pytest.raises(ValueError, match="logits must be"):
        KroneckerCurvature(model).fit(x, torch.zeros(len(x) - 1, O))
    with pytest.raises(RuntimeError, match="fit"):
        KroneckerCurvature(model).influence(xt, torch.zeros(4, O), x, torch.zeros(30, O), 1.0)
    fitted = KroneckerCurvature(model).fit(x, model(x).detach())
    with pytest.raises(ValueError, match="damping"):
        fitted.influence(xt, torch.zeros(4, O), x, torch.zeros(30, O), 0.0)
    with pytest.raises(ValueError, match="cotangents for"):
        fitted.influence(xt, torch.zeros(3, O), x, torch.zeros(30, O), 1.0)
    training_bn = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, O)).double()
    with pytest.raises(ValueError, match="eval"):
        influence(training_bn, x, y, xt, yt, method="ekfac")
    wide = nn.Sequential(nn.Linear(5, MAX_DENSE), nn.LayerNorm(MAX_DENSE), nn.Linear(MAX_DENSE, O))
    with pytest.raises(ValueError, match="without Kronecker structure"):
        influence(wide.double().eval(), x[:4], y[:4], xt, yt, method="ekfac")


def test_fit_checks_the_logits_and_the_covariances_their_damping(mlp, monkeypatch):
    """Logits with their autograd graph left it on every result (eigenvalues .numpy() failed);
    logits of another width failed in torch ("expanded size ... must match"), NaN ones were
    blamed on the model's Jacobian, one logit gave a zero curvature without a word; a damping
    δ ≤ 0 gave negative (δ = −1) or 1e31 (δ = 0) output variances. A Linear applied twice was
    said to be no Linear."""
    model, x, _, xt, _ = mlp
    fitted = KroneckerCurvature(model).fit(x, model(x))  # with its graph
    assert not any(b.eigenvalues.requires_grad for b in fitted.blocks.values())
    assert not fitted.output_covariance(xt, 1.0).requires_grad
    for logits, message in (
        (torch.zeros(len(x), O + 1), f"logits hold {O + 1} outputs per sample, but the model "),
        (torch.full((len(x), O), float("nan")), "logits contains non-finite values"),
        (torch.zeros(len(x), 1), "logits must hold two class scores at least"),
    ):
        with pytest.raises(ValueError, match=message):
            KroneckerCurvature(model).fit(x, logits)
    with pytest.raises(ValueError, match="roots contains non-finite"):
        KroneckerCurvature(model).fit_roots(x, torch.full((len(x), O, O), float("inf")))
    function = fitted.covariance_function(xt)
    for damping in (-1.0, 0.0):
        with pytest.raises(ValueError, match="damping must be a positive"):
            fitted.output_covariance(xt, damping)
        with pytest.raises(ValueError, match="damping must be a positive"):
            function(damping)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 5), nn.Linear(5, O)

        def forward(self, v):
            return self.b(self.a(self.a(v)))

    twice = Twice().double().eval()
    monkeypatch.setattr("attribution.curvature.MAX_DENSE", 8)  # below the Linear's 30
    with pytest.raises(ValueError, match="a weight applied more than once or tied"):
        KroneckerCurvature(twice).fit(x, twice(x).detach())


class _Sqrt(nn.Module):
    """√|Wx| with W's bias zero: the gradient is infinite at x = 0 while the output is finite."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 4), nn.Linear(4, O)
        with torch.no_grad():
            self.a.bias.zero_()

    def forward(self, x):
        return self.b(self.a(x).abs().sqrt())


def test_non_finite_gradients_of_new_inputs_are_refused(mlp):
    """A test input whose Jacobian is not finite gave NaN rows in influence(method="ekfac") and
    in the EK-FAC posterior's variance and probabilities, silently (the exact paths refuse it)."""
    _, x, y, xt, yt = mlp
    torch.manual_seed(0)
    model = _Sqrt().double().eval()
    bad = xt.clone()
    bad[0] = 0.0
    with pytest.raises(ValueError, match="outputs on x_test is not finite"):
        influence(model, x, y, bad, yt, method="ekfac")
    post = NTKPosterior(model, curvature="ekfac").fit(x, y)
    for predict in (post.predict_variance, post.predict_proba):
        with pytest.raises(ValueError, match="outputs on x is not finite"):
            predict(bad)
    with pytest.raises(ValueError, match="outputs on x_val is not finite"):
        NTKPosterior(model, curvature="ekfac").fit(x, y, validation=(bad, yt))
    with pytest.raises(ValueError, match="outputs on x_train is not finite"):
        post.fit(bad, yt)


@pytest.mark.parametrize("method", ["ekfac", "kfac"])
def test_output_fn_reaches_the_factored_curvature(mlp, method):
    """influence(method="ekfac"/"kfac", output_fn=...) on a model returning a dict equals the
    plain model's scores (the curvature's passes go through output_fn too)."""
    model, x, y, xt, yt = mlp
    plain = influence(model, x, y, xt, yt, method=method)
    mapped = influence(
        DictOutput(model), x, y, xt, yt, method=method, output_fn=lambda out: out["logits"]
    )
    torch.testing.assert_close(mapped, plain, rtol=1e-10, atol=1e-12)


def test_a_mixed_precision_model_is_scored():
    # a float32 body with a float64 head failed in the scoring product ("expected m1 and m2 to
    # have the same dtype, but got: float != double"); with a large damping λ, λ·τ is grad-dot
    torch.manual_seed(0)
    model, x = TwoDtypes().eval(), torch.randn(8, 5)
    y = torch.arange(8) % 3
    expected = influence(model, x, y, x[:3], method="grad_dot")
    for method in ("ekfac", "kfac"):
        scores = influence(model, x, y, x[:3], method=method, damping=1e7) * 1e7
        assert float((scores - expected).abs().max()) <= 1e-5 * float(expected.abs().max())


class _FunctionalDropout(nn.Module):
    """A dropout the eval-mode check cannot see (F.dropout with training=True in forward)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(nn.functional.dropout(x, 0.5, training=True))


class _CentredOverTheBatch(nn.Module):
    """Outputs centred over the batch in forward: each depends on the other samples."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        out = self.net(x)
        return out - out.mean(0, keepdim=True)


@pytest.mark.parametrize(
    "wrap, message",
    [(_FunctionalDropout, "output is random"), (_CentredOverTheBatch, "depends on the rest")],
)
def test_random_or_batch_dependent_outputs_are_refused(mlp, wrap, message):
    """The kernels refuse such models; the factored curvature (the default of NTKPosterior)
    fitted one silently, on a random draw or on the batches it happened to form."""
    from attribution import NTKPosterior

    model, x, y, xt, yt = mlp
    bad = wrap(model).eval()
    with pytest.raises(ValueError, match=message):
        influence(bad, x, y, xt, yt, method="ekfac")
    with pytest.raises(ValueError, match=message):
        NTKPosterior(bad).fit(x, y)
    with pytest.raises(ValueError, match=message):
        KroneckerCurvature(bad).fit(x, torch.zeros(len(x), O, dtype=torch.float64))


def test_a_bool_damping_is_refused():
    """KroneckerCurvature.influence(damping=True) read True as λ = 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).eval()
    x = torch.randn(6, 4)
    curvature = KroneckerCurvature(model).fit(x, model(x).detach())
    with pytest.raises(TypeError, match="damping must be .*number.*, got the bool True"):
        curvature.influence(x[:2], torch.randn(2, 3), x, torch.randn(6, 3), damping=True)
