"""The oracle tests on a GPU: kernels, projected features and attribution computed with
`device="cuda"` against the float64 per-sample-autograd reference and against the same call on
the CPU. Skipped where CUDA is absent (CI); run on a lent GPU machine. NTK_TEST_DEVICE names
another device to run them on (e.g. `cpu`, to check this file itself)."""

import copy
import os

import pytest
import torch
from models import CASES, make
from reference import kernels, layer_params, lpntk, of_kind, rel_err

import attribution
import ntk
import projections

DEVICE = os.environ.get("NTK_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs a CUDA device"
)
METHODS = ("jacobian", "ntk_vp", "structured", "auto")


def cpu_params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def unchanged(model, before):
    after = model.state_dict()
    return all(v.device.type == "cpu" and torch.equal(v, after[k]) for k, v in before.items())


@pytest.fixture(scope="module", params=CASES)
def case(request):
    model, x1, x2 = make(request.param)
    return request.param, model, x1, x2, kernels(model, x1), kernels(model, x1, x2)


@pytest.mark.parametrize("method", METHODS)
def test_float64_kernels_on_device_match_reference(case, method):
    name, model, x1, x2, ref_sym, ref_cross = case
    before = cpu_params(model)
    for kind in ntk.KINDS:
        total = ntk.empirical_ntk(model, x1, kind=kind, method=method, device=DEVICE)
        assert total.device.type == torch.device(DEVICE).type
        assert rel_err(total, of_kind(ref_sym[None], kind)) <= 1e-10, kind
    parts = ntk.empirical_ntk(
        model, x1, x2, kind="full", method=method, layers="all", device=DEVICE
    )
    assert list(parts) == list(layer_params(model))
    for layer, value in parts.items():
        expected = ref_cross[layer]
        if float(expected.abs().max()) > 0:
            assert rel_err(value, expected) <= 1e-10, layer
        else:
            assert float(value.abs().max()) == 0.0, layer
    assert unchanged(model, before)  # computed on the device without moving the model


@pytest.mark.parametrize("method", METHODS)
def test_lpntk_on_device_matches_reference(case, method):
    name, model, x1, x2, ref_sym, ref_cross = case
    classes = max(ref_sym[None].shape[-1], 2)  # one output: a binary classifier's logit
    g = torch.Generator().manual_seed(3)
    y1 = torch.randint(0, classes, (ref_sym[None].shape[0],), generator=g)
    y2 = torch.randint(0, classes, (ref_cross[None].shape[1],), generator=g)
    k = ntk.empirical_ntk(
        model, x1, x2, kind="lpntk", labels=y1, labels2=y2, method=method, device=DEVICE
    )
    assert rel_err(k, lpntk(ref_cross[None], y1, y2)) <= 1e-10


def test_float32_kernels_on_device_match_reference(case):
    """float32 on the device, TF32 off (its 10-bit mantissa is not float32)."""
    name, model, x1, x2, ref_sym, ref_cross = case
    model32 = make(name, dtype=torch.float32)[0]
    x1_32 = (
        {k: v.float() for k, v in x1.items()}
        if isinstance(x1, dict)
        else (x1.float() if x1.is_floating_point() else x1)
    )
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        for method in METHODS:
            k = ntk.empirical_ntk(model32, x1_32, method=method, device=DEVICE)
            assert k.dtype == torch.float32
            assert rel_err(k, ref_sym[None]) <= 1e-5, method
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.parametrize("projector", projections.PROJECTORS)
def test_projected_features_on_device_equal_the_cpu_ones(case, projector):
    """The same seed draws the same matrices on every device: features agree to rounding."""
    name, model, x1, x2, ref_sym, ref_cross = case
    for per_layer in (False, True):
        opts = dict(dim=64, kind="trace", projector=projector, per_layer=per_layer)
        here = projections.features(model, x1, device="cpu", **opts)
        there = projections.features(model, x1, device=DEVICE, **opts)
        if not per_layer:
            here, there = {None: here}, {None: there}
        assert list(there) == list(here)
        for layer, value in here.items():
            assert rel_err(there[layer], value) <= 1e-10, layer


def test_feature_store_written_on_device_equals_the_cpu_store(tmp_path):
    model, x, _ = make("cnn")
    opts = dict(dim=32, kind="trace", block=2, store_dtype="float64", progress=False)
    projections.featurize(model, x, tmp_path / "cpu", device="cpu", **opts)
    projections.featurize(model, x, tmp_path / "device", device=DEVICE, **opts)
    a = torch.tensor(projections.open_store(tmp_path / "cpu"))
    b = torch.tensor(projections.open_store(tmp_path / "device"))
    assert a.shape[0] == len(x) and rel_err(b, a) <= 1e-10


def _classifier(name: str):
    model, x, _ = make(name)
    with torch.no_grad():
        y = model(x).argmax(-1)
    return model, x, y


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize(
    "options",
    [{}, {"kind": "full"}, {"method": "ekfac"}, {"method": "trak", "dim": 64}],
    ids=["auto", "full", "ekfac", "trak"],
)
def test_influence_on_device_equals_cpu(name, options):
    model, x, y = _classifier(name)
    before = cpu_params(model)
    here = attribution.influence(model, x, y, x[:3], device="cpu", **options)
    there = attribution.influence(model, x, y, x[:3], device=DEVICE, **options)
    assert rel_err(there, here) <= 1e-8
    assert unchanged(model, before)


@pytest.mark.parametrize("curvature", ["exact", "ekfac"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_posterior_on_device_equals_cpu(name, curvature):
    model, x, y = _classifier(name)
    here = attribution.NTKPosterior(model, curvature=curvature, device="cpu").fit(x, y)
    there = attribution.NTKPosterior(model, curvature=curvature, device=DEVICE).fit(x, y)
    assert abs(there.prior_precision_ - here.prior_precision_) <= 1e-8 * here.prior_precision_
    p, q = here.predict_proba(x[:3]), there.predict_proba(x[:3])
    assert rel_err(torch.as_tensor(q), torch.as_tensor(p)) <= 1e-8


def test_surrogate_and_layer_importance_on_device_equal_cpu():
    model, x, y = _classifier("mlp")
    here = attribution.KernelSurrogate(model, device="cpu").fit(x, y)
    there = attribution.KernelSurrogate(model, device=DEVICE).fit(x, y)
    a, b = here.decision_function(x[:3]), there.decision_function(x[:3])
    assert rel_err(torch.as_tensor(b), torch.as_tensor(a)) <= 1e-8
    rows_here = attribution.layer_importance(model, x, y, device="cpu")
    rows_there = attribution.layer_importance(model, x, y, device=DEVICE)
    assert [r["layer"] for r in rows_here] == [r["layer"] for r in rows_there]
    for r, s in zip(rows_here, rows_there):
        assert s["sensitivity"] == pytest.approx(r["sensitivity"], rel=1e-8)


@pytest.mark.parametrize("method", ["auto", "ekfac"])
def test_influence_of_a_model_living_on_the_device_equals_cpu(method):
    model, x, y = _classifier("cnn")
    here = attribution.influence(model, x, y, x[:3], method=method)
    moved = copy.deepcopy(model).to(DEVICE)
    there = attribution.influence(
        moved, x.to(DEVICE), y.to(DEVICE), x[:3].to(DEVICE), method=method
    )
    assert there.device.type == "cpu" and rel_err(there, here) <= 1e-8


def test_report_on_device_equals_cpu(tmp_path):
    from ntk import demo

    data = demo.digits(n_train=80)
    torch.manual_seed(0)
    model = demo.train(demo.mlp(hidden=12), data.x_train, data.y_train, epochs=5).double()
    args = (model, data.x_train.double(), data.y_train, data.x_test[:20].double(), data.y_test[:20])
    opts = dict(image_shape=(8, 8), kernel_samples=40, examples=3, top=3)
    here = attribution.report(*args, path=tmp_path / "cpu.html", device="cpu", **opts)
    there = attribution.report(*args, path=tmp_path / "device.html", device=DEVICE, **opts)
    a = torch.as_tensor(here["kernel"]["eigenvalues"])
    b = torch.as_tensor(there["kernel"]["eigenvalues"])
    assert rel_err(b, a) <= 1e-8
    assert [r["layer"] for r in there["layers"]["rows"]] == [
        r["layer"] for r in here["layers"]["rows"]
    ]
    assert (tmp_path / "device.html").stat().st_size > 0
