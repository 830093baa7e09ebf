"""Nothing NaN, nothing raw: non-finite gradients are refused by every kernel, projection and
proxy; a model's failure on the given inputs is reported naming the argument, the shapes and
dtypes it got and the model's own error; devices, Embedding ids, checkpoints and single-output
models get clear errors; numpy arrays are accepted wherever tensors are; the report never
overwrites its HTML with its JSON."""

import numpy as np
import pytest
import torch
from models import MLP, TinyTransformer
from test_store_integrity import SqrtNet

import attribution
import ntk
import projections
from ntk import proxies


def sqrt_net_and_zero_sample():
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    x[3] = 0.0
    return SqrtNet().eval(), x


@pytest.mark.parametrize("method", ntk.METHODS)
@pytest.mark.parametrize("kind", ["full", "trace"])
def test_kernels_refuse_nan_gradients(method, kind):
    model, x = sqrt_net_and_zero_sample()
    assert bool(torch.isfinite(model(x)).all())  # the outputs are finite, the gradients not
    with pytest.raises(ValueError, match="not finite.*gradients"):
        ntk.empirical_ntk(model, x, kind=kind, method=method)
    with pytest.raises(ValueError, match="not finite"):
        ntk.empirical_ntk(model, x[:2], x, kind=kind, method=method, batch_size=2)


def test_projections_refuse_nan_gradients():
    model, x = sqrt_net_and_zero_sample()
    with pytest.raises(ValueError, match="projected features .* not finite"):
        projections.features(model, x, dim=8)
    with pytest.raises(ValueError, match="not finite"):
        projections.projected_ntk(model, x, dim=8, kind="sum_logits")


def test_kernel_of_nan_features_is_refused():
    phi = np.ones((5, 3, 4), dtype="float32")
    phi[2, 1, 0] = np.nan
    with pytest.raises(ValueError, match=r"phi1\[0:5\] is not finite"):
        projections.kernel(phi, kind="trace")


def test_trak_refuses_nan_gradients():
    model, x = sqrt_net_and_zero_sample()
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    for dim in (16, None):
        with pytest.raises(ValueError, match="not finite"):
            attribution.trak(model, x, y, x[:2], dim=dim)


@pytest.mark.parametrize("metric", proxies.METRICS)
def test_proxies_refuse_nan_inputs_and_outputs(metric):
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    nan_x = x.clone()
    nan_x[2, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        proxies.score(MLP().eval(), nan_x, y, metric=metric, batch_size=8)

    class NanOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = MLP()

        def forward(self, x):
            out = self.inner(x)
            return torch.where(torch.arange(len(x))[:, None] == 1, float("nan"), out)

    if metric != "params":  # counts parameters, never runs the model's outputs...
        with pytest.raises(ValueError, match="non-finite outputs"):
            proxies.score(NanOut().eval(), x, y, metric=metric, batch_size=8)


@pytest.mark.parametrize("metric", ["grad_norm", "snip", "jacob_cov", "trace", "lga"])
def test_gradient_proxies_refuse_nan_gradients(metric):
    model, x = sqrt_net_and_zero_sample()
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    with pytest.raises(ValueError, match="not finite"):
        proxies.score(model, x, y, metric=metric, batch_size=6)


# -- a model's failure on the given inputs -----------------------------------------------------


def bad_width():
    return MLP().eval(), torch.randn(4, 5), torch.randn(4, 3)


def test_wrong_feature_size_names_the_argument_shape_dtype_and_model_error():
    model, x, bad = bad_width()
    with pytest.raises(ValueError, match="x1: .*per-sample shape \\(3,\\).*mat1 and mat2"):
        ntk.empirical_ntk(model, bad)
    with pytest.raises(ValueError, match=r"^x2: .*per-sample shape \(3,\).*mat1 and mat2"):
        ntk.empirical_ntk(model, x, bad)  # the model, not the kernel, refuses the shape
    with pytest.raises(ValueError, match=r"^x2: .*shape \(5,\) and dtype torch.float64"):
        ntk.empirical_ntk(model, x, x.double())
    with pytest.raises(ValueError, match="^x: .*shape \\(3,\\)"):
        projections.features(model, bad, dim=4)
    with pytest.raises(ValueError, match="^x: .*shape \\(3,\\)"):
        proxies.score(model, bad, metric="jacob_cov", batch_size=4)
    y = torch.tensor([0, 1, 2, 0])
    with pytest.raises(ValueError, match="^x_test: .*shape \\(3,\\)"):
        attribution.influence(model, x, y, bad)
    with pytest.raises(ValueError, match="^x_train: .*shape \\(3,\\)"):
        attribution.trak(model, bad, y, x)
    with pytest.raises(ValueError, match="^x: .*shape \\(3,\\)"):
        attribution.layer_importance(model, bad, y)


def test_report_names_the_data_the_model_fails_on(tmp_path):
    model, x, bad = bad_width()
    target = tmp_path / "r.html"
    with pytest.raises(ValueError, match="^x_train: .*shape \\(3,\\).*mat1 and mat2"):
        attribution.report(model, bad, None, x, None, path=target)
    with pytest.raises(ValueError, match="^x_test: .*shape \\(3,\\).*mat1 and mat2"):
        attribution.report(model, x, None, bad, None, path=target)
    assert not target.exists()


def test_dtype_mismatch_names_both_dtypes():
    model, x, _ = bad_width()
    with pytest.raises(ValueError, match="dtype torch.float64 \\(its parameters are torch.float32"):
        ntk.empirical_ntk(model, x.double())
    with pytest.raises(ValueError, match="dtype torch.int64"):
        ntk.empirical_ntk(model, torch.ones(4, 5, dtype=torch.long))


def test_embedding_ids_out_of_range_name_the_table():
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    ids = torch.randint(1, 11, (3, 5))
    ids[0, 0], ids[1, 2] = 1, 13
    with pytest.raises(
        ValueError, match="x1: the ids reaching embedding 'embed' range from 1 to 13"
    ):
        ntk.empirical_ntk(model, ids, kind="trace")
    with pytest.raises(ValueError, match="11 rows"):
        projections.features(model, ids, dim=4)


@pytest.mark.parametrize("device", ["nonsense", "cuda:99", "meta"])  # meta: no values
def test_unusable_device_is_refused_clearly(device):
    if device.startswith("cuda") and torch.cuda.device_count() > 99:
        pytest.skip("this machine has a cuda:99")
    model, x, _ = bad_width()
    message = f"device='{device}' is not usable"
    with pytest.raises(ValueError, match=message):
        ntk.empirical_ntk(model, x, device=device)
    with pytest.raises(ValueError, match=message):
        projections.features(model, x, dim=4, device=device)
    with pytest.raises(ValueError, match=message):
        proxies.score(model, x, metric="jacob_cov", batch_size=4, device=device)


def test_checkpoint_of_the_wrong_shape_is_named():
    model, x, _ = bad_width()
    y = torch.tensor([0, 1, 2, 0])
    wrong = MLP(hidden=8).state_dict()
    with pytest.raises(ValueError, match=r"checkpoints\[1\] does not fit the model: size mismatch"):
        attribution.influence(model, x, y, x, checkpoints=[model.state_dict(), wrong])


def test_influence_on_a_single_output_model_says_so():
    torch.manual_seed(0)
    model = MLP(d_out=1).eval()
    x = torch.randn(6, 5)
    for method in ("gauss_newton", "grad_dot", "trak"):
        with pytest.raises(ValueError, match="at least two outputs"):
            attribution.influence(model, x, torch.zeros(6), x[:2], method=method)


# -- numpy in ----------------------------------------------------------------------------------


def test_numpy_arrays_are_accepted_wherever_tensors_are(tmp_path):
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(6, 5)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    a = x.numpy()
    assert torch.equal(ntk.empirical_ntk(model, a, a[:2]), ntk.empirical_ntk(model, x, x[:2]))
    assert torch.equal(projections.features(model, a, dim=4), projections.features(model, x, dim=4))
    assert torch.equal(
        projections.projected_ntk(model, a, dim=4), projections.projected_ntk(model, x, dim=4)
    )
    assert np.array_equal(
        projections.featurize(model, a, tmp_path / "a", dim=4, block=4),
        projections.featurize(model, x, tmp_path / "x", dim=4, block=4),
    )
    assert torch.equal(
        attribution.influence(model, a, y.numpy(), a[:2]), attribution.influence(model, x, y, x[:2])
    )
    assert torch.equal(attribution.trak(model, a, y, a[:2]), attribution.trak(model, x, y, x[:2]))
    assert proxies.score(model, a, metric="jacob_cov", batch_size=6) == proxies.score(
        model, x, metric="jacob_cov", batch_size=6
    )
    rows = attribution.layer_importance(model, a, y.numpy())
    assert rows == attribution.layer_importance(model, x, y)
    surrogate = attribution.KernelSurrogate(model, alpha=1.0).fit(a)
    assert surrogate.n_features_in_ == 5
    assert isinstance(surrogate.predict(a), np.ndarray)
    assert np.array_equal(surrogate.predict(a), surrogate.predict(x))
    with pytest.raises(ValueError, match="X has 3 features, but KernelSurrogate is expecting 5"):
        surrogate.predict(a[:, :3])
    with pytest.raises(TypeError, match="dtype <U1, not numbers"):
        ntk.empirical_ntk(model, np.array([["a"] * 5]))


# -- the report --------------------------------------------------------------------------------


def test_report_refuses_a_path_that_is_not_html(tmp_path):
    model, x, _ = bad_width()
    target = tmp_path / "r.json"
    with pytest.raises(ValueError, match="path must name an .html file"):
        attribution.report(model, x, None, x, None, path=target)
    assert not target.exists()
