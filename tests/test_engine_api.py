"""Inputs, errors, model safety, out=, memory refusal and spectral helpers of the engine."""

import copy

import numpy as np
import pytest
import torch
import torch.utils.checkpoint
from models import MLP, make
from reference import kernels, of_kind
from torch import nn

import attribution
import ntk
import projections
from ntk.core.model import ModelForwardError, ModelView


def snapshot(model):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [m.training for m in model.modules()],
        [p.requires_grad for p in model.parameters()],
        [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
        # the very objects (a Parameter swapped for a copy with equal values is a changed model)
        [(n, id(t), type(t)) for n, t in model.named_parameters(remove_duplicate=False)],
        [(n, id(t)) for n, t in model.named_buffers(remove_duplicate=False)],
    )


def same(a, b):
    return (
        a[0].keys() == b[0].keys()
        and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
        and a[1:] == b[1:]
    )


@pytest.mark.parametrize("case", ["cnn", "tied"])
@pytest.mark.parametrize("method", ["jacobian", "ntk_vp", "structured"])
def test_model_is_never_modified(method, case):
    model, x1, x2 = make(case)
    before = snapshot(model)
    ntk.empirical_ntk(model, x1, x2, kind="trace", layers="all", method=method, dtype=torch.float32)
    assert same(before, snapshot(model))


def test_output_fn_and_tuple_inputs():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 6)

        def forward(self, a, b):
            return (self.lin(a) * b).reshape(-1, 2, 3)  # [B, 2, 3]: needs output_fn

    torch.manual_seed(0)
    model = TwoInputs().double().eval()
    a, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="output_fn"):
        ntk.empirical_ntk(model, (a, b))
    pick = lambda out: out[:, -1]  # noqa: E731 - the last "token"
    k = ntk.empirical_ntk(model, (a, b), output_fn=pick, method="structured")

    class Picked(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, a, b):
            return pick(self.inner(a, b))

    ref = kernels(_TupleCaller(Picked()), torch.cat([a, b], 1))[None]
    assert torch.allclose(k, ref, rtol=1e-10, atol=1e-12)


class _TupleCaller(nn.Module):
    """Adapts a two-input model to the reference's single-tensor calling convention."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ab):
        return self.inner(ab[:, :3], ab[:, 3:])


def test_bad_inputs_are_refused_with_clear_messages():
    model, x1, x2 = make("mlp")
    with pytest.raises(ValueError, match="kind"):
        ntk.empirical_ntk(model, x1, kind="nope")
    with pytest.raises(ValueError, match="valid methods are auto, jacobian, ntk_vp, structured"):
        ntk.empirical_ntk(model, x1, method="nope")
    with pytest.raises(ValueError, match=r"unknown layer name.*\['fc1', 'fc2', 'head'\]"):
        ntk.empirical_ntk(model, x1, layers=["fc9"])
    tied, x, _ = make("tied")
    with pytest.raises(
        ValueError, match=r"'again' shares its trainable parameters with \['twice'\]"
    ):
        ntk.empirical_ntk(tied, x, layers=["again"])
    seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(ValueError, match="'1' owns no trainable parameters; layers owning"):
        ntk.empirical_ntk(seq, torch.randn(2, 3), layers=["1"])
    bad = x1.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        ntk.empirical_ntk(model, bad)
    with pytest.raises(ValueError, match=r"^x2: .*per-sample shape \(6,\)"):
        ntk.empirical_ntk(model, x1, torch.randn(3, 6, dtype=torch.float64))
    with pytest.raises(TypeError, match="nn.Module"):
        ntk.empirical_ntk(lambda x: x, x1)
    with pytest.raises(ValueError, match="batch_size"):
        ntk.empirical_ntk(model, x1, batch_size=0)
    frozen = copy.deepcopy(model).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ntk.empirical_ntk(frozen, x1)
    with torch.no_grad():
        model.head.bias[0] = float("inf")
    with pytest.raises(ValueError, match="non-finite outputs"):
        ntk.empirical_ntk(model, x1)


@pytest.mark.parametrize("module", [nn.Dropout(0.5), nn.BatchNorm1d(7)])
def test_training_mode_randomness_and_batch_dependence_are_refused(module):
    model = nn.Sequential(nn.Linear(5, 7), module, nn.Linear(7, 2)).train()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        ntk.empirical_ntk(model, torch.randn(6, 5))
    assert same(before, snapshot(model))


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: ntk.empirical_ntk(m, x, method="jacobian"),
        lambda m, x: projections.features(m, x, dim=8),
        lambda m, x: attribution.KernelSurrogate(m).fit(x),
    ],
    ids=["empirical_ntk", "features", "surrogate"],
)
def test_embedding_with_max_norm_is_refused_before_it_renormalises_the_model(call):
    """Its forward pass renormalises the looked-up rows in place: the model's own weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(9, 4, max_norm=1.0), nn.Flatten(), nn.Linear(12, 2))
    before = snapshot(model.eval())
    with pytest.raises(ValueError, match=r"'0' is an Embedding with max_norm=1\.0"):
        call(model, torch.randint(0, 9, (5, 3)))
    assert same(before, snapshot(model))


def test_a_data_parallel_wrapper_is_refused_naming_the_module_it_wraps():
    """torch.func cannot call nn.DataParallel with other parameters (a failure that blamed x1)."""
    model = nn.DataParallel(MLP()).eval()
    with pytest.raises(TypeError, match=r"nn\.DataParallel wrapper.*`model\.module`"):
        ntk.empirical_ntk(model, torch.randn(4, 5))


def test_a_torchscript_module_is_refused_naming_it():
    """A scripted model failed in the input check's hooks with torch's RuntimeError
    ("register_forward_pre_hook is not supported on ScriptModules")."""
    scripted = torch.jit.script(MLP().eval())
    with pytest.raises(TypeError, match="^module 'RecursiveScriptModule' is a TorchScript"):
        ntk.empirical_ntk(scripted, torch.randn(4, 5))
    inner = nn.Sequential(torch.jit.script(nn.Linear(5, 4)), nn.Tanh(), nn.Linear(4, 2)).eval()
    with pytest.raises(TypeError, match="^module '0' is a TorchScript module"):
        ntk.empirical_ntk(inner, torch.randn(4, 5))


def test_torch_compiled_modules_give_the_kernel_of_their_module():
    """A torch.compile'd model or submodule (wrapped, or compiled in place) runs eagerly: traced
    by dynamo after method='jacobian', the other methods failed in their hooks ("'int' object is
    not subscriptable")."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double().eval()
    x = torch.randn(4, 5, dtype=torch.float64)
    ref = kernels(plain, x)[None]
    inner, in_place = copy.deepcopy(plain), copy.deepcopy(plain)
    inner[0] = torch.compile(inner[0])
    in_place.compile()
    for model in (inner, torch.compile(copy.deepcopy(plain)), in_place):
        for method in ("jacobian", "ntk_vp", "structured"):
            k = ntk.empirical_ntk(model, x, method=method)
            assert float((k - ref).norm() / ref.norm()) <= 1e-10, method


def test_inputs_that_require_grad_are_constants():
    """The kernel is a function of the parameters: an input with requires_grad leaves no graph
    attached to kernels or to the arrays a surrogate hands to scikit-learn."""
    model, x1, _ = make("mlp")
    x = x1.clone().requires_grad_(True)
    for method in ntk.METHODS:
        k = ntk.empirical_ntk(model, x, method=method)
        assert not k.requires_grad
        assert torch.allclose(k, ntk.empirical_ntk(model, x1, method=method), rtol=1e-12)
    surrogate = attribution.KernelSurrogate(model).fit(x)
    assert surrogate.attribute(x).shape == (6, 6, 3)


def test_inference_mode_is_named_and_no_grad_is_fine():
    # under torch.inference_mode() every kernel and attribution failed deep in autograd ("element
    # 0 of tensors does not require grad and does not have a grad_fn")
    model, x1, _ = make("mlp")
    y = torch.arange(6) % 3
    with torch.no_grad():
        k = ntk.empirical_ntk(model, x1)
    torch.testing.assert_close(k, ntk.empirical_ntk(model, x1))
    calls = (
        lambda: ntk.empirical_ntk(model, x1),
        lambda: projections.features(model, x1, dim=8),
        lambda: attribution.influence(model, x1, y, x1[:2]),
        lambda: attribution.KernelSurrogate(model).fit(x1),
        lambda: attribution.layer_importance(model, x1, y),
    )
    for call in calls:
        with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
            call()


def test_batch_norm_without_running_statistics_is_refused_even_in_eval_mode():
    norm = nn.BatchNorm1d(7, track_running_stats=False)
    model = nn.Sequential(nn.Linear(5, 7), norm, nn.Linear(7, 2)).eval()
    with pytest.raises(ValueError, match="track_running_stats=False, so it does even in eval"):
        ntk.empirical_ntk(model, torch.randn(6, 5))


def test_batch_dependence_of_an_unknown_module_is_detected():
    class BatchCentre(nn.Module):
        def forward(self, x):
            return x - x.mean(0, keepdim=True)

    model = nn.Sequential(nn.Linear(5, 7), BatchCentre(), nn.Linear(7, 2)).eval()
    with pytest.raises(ValueError, match="depends on the rest of the batch"):
        ntk.empirical_ntk(model, torch.randn(6, 5))


def test_out_receives_the_kernel_tile_by_tile(tmp_path):
    model, x1, x2 = make("mlp")
    expected = ntk.empirical_ntk(model, x1, x2, kind="full")
    path = tmp_path / "k.npy"
    target = np.lib.format.open_memmap(
        path, mode="w+", dtype=np.float64, shape=tuple(expected.shape)
    )
    got = ntk.empirical_ntk(model, x1, x2, kind="full", batch_size=2, out=target)
    assert got is target
    target.flush()
    assert np.allclose(np.load(path), expected.numpy(), rtol=1e-13, atol=0)
    with pytest.raises(ValueError, match="out has shape"):
        ntk.empirical_ntk(model, x1, x2, kind="trace", out=np.zeros((2, 2)))


def test_out_that_cannot_hold_the_kernel_is_refused():
    """An integer out= received the kernel truncated to integers (a bool one, True), silently; a
    read-only array failed after the first tile, a list inside the shape check."""
    model, x1, _ = make("mlp")
    n = len(x1)
    for dtype in (np.int64, np.bool_):
        with pytest.raises(TypeError, match="out must have a floating-point dtype"):
            ntk.empirical_ntk(model, x1, kind="trace", out=np.zeros((n, n), dtype=dtype))
    with pytest.raises(TypeError, match="floating-point dtype, got torch.int32"):
        ntk.empirical_ntk(model, x1, kind="trace", out=torch.zeros(n, n, dtype=torch.int32))
    with pytest.raises(ValueError, match="read-only"):
        ntk.empirical_ntk(model, x1, kind="trace", out=np.broadcast_to(np.zeros(n), (n, n)))
    with pytest.raises(TypeError, match="torch tensor or a numpy array .* got list"):
        ntk.empirical_ntk(model, x1, kind="trace", out=[[0.0] * n] * n)


def test_an_out_whose_dtype_the_kernel_overflows_is_refused():
    """A float16 out received inf where the kernel exceeds 65504, silently (featurize's float16
    store refuses the same overflow)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(6, 4)
    fits = ntk.empirical_ntk(model, x, kind="trace", out=np.zeros((6, 6), np.float16))
    np.testing.assert_allclose(fits, ntk.empirical_ntk(model, x, kind="trace"), rtol=2e-3)
    with torch.no_grad():
        model[2].weight.mul_(1000)
    for out in (np.zeros((6, 6), np.float16), torch.zeros(6, 6, dtype=torch.float16)):
        with pytest.raises(ValueError, match=r"^the kernel values .* overflow out's dtype .*16"):
            ntk.empirical_ntk(model, x, kind="trace", out=out)


def test_a_tile_that_fails_part_way_says_that_out_is_incomplete():
    """A tile failing after others were written into `out` left it partly filled, looking
    complete; the error says so (out is the caller's, left as it is)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(8, 4)
    x[6] *= 1000  # the kernel of sample 6 overflows float16, in the second row of tiles
    out = np.zeros((8, 8), np.float16)
    with pytest.raises(ValueError, match="overflow .*; out holds only the tiles before this one"):
        ntk.empirical_ntk(model, x, kind="trace", out=out, batch_size=4)
    assert out[:4, :4].all()


def test_kernels_that_cannot_fit_are_refused_with_size_and_alternatives(monkeypatch):
    monkeypatch.setattr("ntk.empirical.available_bytes", lambda device: 1000)
    model, x1, _ = make("mlp")
    with pytest.raises(
        ntk.KernelTooLargeError, match=r"\[6, 6, 3, 3\].*needs 2\.5 KiB.*projections"
    ):
        ntk.empirical_ntk(model, x1, kind="full")


def test_kernel_fn_follows_training():
    model, x1, _ = make("mlp")
    fn = ntk.empirical_ntk_fn(model, kind="trace")
    before = fn(x1)
    with torch.no_grad():
        model.head.weight.mul_(2.0)
    after = fn(x1)
    assert torch.allclose(after, of_kind(kernels(model, x1)[None], "trace"), rtol=1e-10)
    assert not torch.allclose(before, after)


def test_scalar_output_counts_as_one_output():
    model, x1, _ = make("scalar")
    full = ntk.empirical_ntk(model, x1, kind="full")
    assert full.shape == (5, 5, 1, 1)
    trace = ntk.empirical_ntk(model, x1, kind="trace")
    assert torch.allclose(full[..., 0, 0], trace)
    assert torch.allclose(ntk.empirical_ntk(model, x1, kind="sum_logits"), trace)


def test_spectral_helpers_against_numpy():
    torch.manual_seed(0)
    a = torch.randn(6, 6, dtype=torch.float64)
    k = a @ a.T + 0.1 * torch.eye(6, dtype=torch.float64)
    ev = ntk.eigenvalues(k)
    assert np.allclose(ev.numpy(), np.sort(np.linalg.eigvalsh(k.numpy()))[::-1])
    assert np.isclose(ntk.condition_number(k), ev[0] / ev[-1])
    model, x1, _ = make("mlp")
    full = ntk.empirical_ntk(model, x1, kind="full")
    flat = full.permute(0, 2, 1, 3).reshape(18, 18).numpy()
    assert np.allclose(ntk.eigenvalues(full).numpy(), np.sort(np.linalg.eigvalsh(flat))[::-1])
    singular = torch.ones(3, 3, dtype=torch.float64)
    assert ntk.condition_number(singular) == float("inf")


def test_kernel_alignment_matches_its_formulas():
    torch.manual_seed(1)
    a = torch.randn(8, 4, dtype=torch.float64)
    k = a @ a.T
    y = torch.tensor([0, 1, 0, 2, 1, 0, 2, 2])
    lab = (y[:, None] == y[None, :]).double() * 2 - 1
    kc, lc = k - k.mean(), lab - lab.mean()
    pearson = float((kc * lc).sum() / (kc.norm() * lc.norm()))
    assert np.isclose(ntk.kernel_alignment(k, y, centering="mean"), pearson)
    assert np.isclose(pearson, np.corrcoef(k.reshape(-1), lab.reshape(-1))[0, 1])
    h = torch.eye(8, dtype=torch.float64) - 1 / 8
    onehot = torch.nn.functional.one_hot(y).double()
    kh, lh = h @ k @ h, h @ onehot @ onehot.T @ h
    assert np.isclose(ntk.kernel_alignment(k, y), float((kh * lh).sum() / (kh.norm() * lh.norm())))
    with pytest.raises(ValueError, match="centering"):
        ntk.kernel_alignment(k, y, centering="nope")


def _gradient_descent_share(k, targets, steps):
    """‖f_T − Y‖² / ‖Y‖² after `steps` steps f ← f − K (f − Y) / λmax from f = 0, Y centred."""
    y = targets - targets.mean(0)
    f = torch.zeros_like(y)
    step = 1.0 / torch.linalg.eigvalsh(k)[-1]
    for _ in range(steps):
        f = f - step * (k @ (f - y))
    return float((f - y).square().sum() / y.square().sum())


def test_descent_residual_is_the_residual_of_explicit_gradient_descent():
    torch.manual_seed(2)
    a = torch.randn(9, 4, dtype=torch.float64)
    k = a @ a.T  # rank 4 < 9: directions outside the kernel's range are never fitted
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2])
    onehot = torch.nn.functional.one_hot(y).double()
    for steps in (1, 7, 40):
        share = ntk.descent_residual(k, y, steps)
        assert share == pytest.approx(_gradient_descent_share(k, onehot, steps), rel=1e-10)
    assert ntk.descent_residual(k, y, 40) < ntk.descent_residual(k, y, 7) < 1.0
    # labels named by other integers (or booleans) are the same classes
    assert ntk.descent_residual(k, y * 5 - 3, 7) == pytest.approx(ntk.descent_residual(k, y, 7))
    binary = y == 1
    assert ntk.descent_residual(k, binary, 7) == pytest.approx(
        _gradient_descent_share(k, binary.double()[:, None], 7), rel=1e-10
    )
    targets = torch.randn(9, 2, dtype=torch.float64)  # real targets: their columns, centred
    assert ntk.descent_residual(k, targets, 7) == pytest.approx(
        _gradient_descent_share(k, targets, 7), rel=1e-10
    )
    # labels along the kernel's top direction are fitted in one step; a zero kernel fits nothing
    centred = binary.double() - binary.double().mean()
    assert ntk.descent_residual(torch.outer(centred, centred), binary, 1) < 1e-12
    assert ntk.descent_residual(torch.zeros(9, 9), y, 3) == 1.0


@pytest.mark.parametrize(
    "kernel, y, steps, message",
    [
        (torch.eye(4), torch.tensor([0, 1, 0, 1]), 0, "steps must be a positive integer"),
        (torch.eye(4), torch.tensor([0, 1, 0, 1]), 2.5, "steps must be a positive integer"),
        # failed in torch's pow ("OverflowError: int too big to convert")
        (torch.eye(4), torch.tensor([0, 1, 0, 1]), 10**30, r"steps must be .* below 2\*\*62"),
        (torch.eye(4), torch.tensor([0, 1, 0]), 3, "kernel is 4 × 4 but y has 3 entries"),
        (torch.eye(4), torch.tensor([1, 1, 1, 1]), 3, "y is constant"),
        (torch.eye(4), torch.tensor([0.0, 1.0, float("nan"), 1.0]), 3, "y contains non-finite"),
        (torch.eye(4), torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]]), 3, "y holds integer class"),
        (torch.ones(2, 2, 3, 3), torch.tensor([0, 1]), 3, r"needs an \[N, N\] kernel"),
        # an indefinite matrix was read with its negative eigenvalues as 0 (−I: 1.0)
        (-torch.eye(4), torch.tensor([0, 1, 0, 1]), 3, "needs a positive semidefinite kernel"),
        (
            torch.diag(torch.tensor([3.0, 2.0, 1.0, -0.5])),
            torch.tensor([0, 1, 0, 1]),
            3,
            "has an eigenvalue -0.5 against a largest 3",
        ),
    ],
)
def test_descent_residual_refuses_bad_input(kernel, y, steps, message):
    with pytest.raises(ValueError, match=message):
        ntk.descent_residual(kernel, y, steps)


def test_spectral_helpers_refuse_complex_and_non_numeric_kernels():
    """A complex Hermitian kernel lost its imaginary part (eigenvalues [2, 2] of [[2, i], [−i, 2]],
    whose eigenvalues are 3 and 1); a string or None failed in torch.as_tensor ("can't convert
    np.ndarray of type numpy.str_")."""
    hermitian = torch.tensor([[2, 1j], [-1j, 2]], dtype=torch.complex128)
    with pytest.raises(TypeError, match="^kernel must be a real array, got dtype torch.complex128"):
        ntk.eigenvalues(hermitian)
    with pytest.raises(TypeError, match="^kernel must be a real array"):
        ntk.condition_number(hermitian.numpy())
    for call, kernel in ((ntk.eigenvalues, "abc"), (ntk.condition_number, None)):
        with pytest.raises(TypeError, match="^kernel must be a numeric array"):
            call(kernel)
    assert ntk.descent_residual(torch.eye(4) + 0.1, torch.tensor([0, 1, 0, 1]), 2**62 - 1) == 0


@pytest.fixture
def autodiff_picks(monkeypatch) -> list:
    """One entry each time a kernel goes to autodiff (structured.Plan.autodiff is called)."""
    import ntk.core.structured as structured

    calls = []
    original = structured.Plan.autodiff.__func__
    monkeypatch.setattr(
        structured.Plan,
        "autodiff",
        classmethod(lambda cls, other: calls.append(True) or original(cls, other)),
    )
    return calls


def test_auto_picks_structured_when_layers_are_known(autodiff_picks):
    model = MLP().eval()
    ntk.empirical_ntk(model, torch.randn(4, 5), method="auto")
    assert not autodiff_picks
    ntk.empirical_ntk(model, torch.randn(4, 5), method="jacobian")
    assert autodiff_picks


def test_auto_follows_the_cost_model(autodiff_picks):
    """A CNN whose convolutions all form explicit per-sample gradients goes to autodiff (the
    structured path would only add copies); an MLP, whose linear layers are factored, does not;
    the kernel is the same either way."""
    import ntk.core.structured as structured

    chosen = autodiff_picks
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 16 * 16, 3),
    ).eval()
    x = torch.randn(4, 3, 16, 16)
    plan = structured.plan(ModelView(cnn), x, "full", 3, 4, 4)
    assert {"0", "2"} <= set(plan.positions) and not {"0", "2"} & plan.factored
    auto = ntk.empirical_ntk(cnn, x, method="auto")
    assert chosen
    # on CUDA the copies weigh nothing (launches dominate there): the same plan stays structured
    assert structured.prefers_autodiff(plan, "full", 3, 4, torch.device("cpu"))
    assert not structured.prefers_autodiff(plan, "full", 3, 4, torch.device("cuda"))
    torch.testing.assert_close(auto, ntk.empirical_ntk(cnn, x, method="structured"))
    chosen.clear()
    ntk.empirical_ntk(MLP().eval(), torch.randn(4, 5), method="auto")
    assert not chosen
    # the factored contraction's saving outweighs the copies: structured stays
    assert not structured.prefers_autodiff(
        structured.plan(ModelView(MLP().eval()), torch.randn(4, 5), "full", 2, 4, 4), "full", 2, 4
    )


class _Branching(nn.Module):
    """A CNN with data-dependent control flow, which vmap cannot run."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x).flatten(1)
        return y if bool((x > -100).all()) else -y


def test_auto_keeps_structured_for_models_that_cannot_be_vmapped(autodiff_picks):
    import warnings

    import ntk.core.persample as persample

    model, x = _Branching().eval(), torch.randn(2, 3, 6, 6)
    chosen = autodiff_picks
    with pytest.warns(persample.PerSampleFallbackWarning):
        first = ntk.empirical_ntk(model, x)
    assert chosen  # the cost model's pick, until vmap is found to fail
    chosen.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = ntk.empirical_ntk(model, x)
    assert not chosen
    torch.testing.assert_close(first, second)


class _CheckpointedCNN(nn.Module):
    """The CNN the cost model sends to autodiff (above), its convolutions under activation
    checkpointing."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)
        )
        self.head = nn.Linear(8 * 16 * 16, 3)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return self.head(h.flatten(1))


def test_auto_keeps_structured_for_models_under_activation_checkpointing(autodiff_picks):
    """torch.func cannot run a model under activation checkpointing (saved-tensor hooks), so
    autodiff would be torch.autograd one sample and output at a time: `auto` keeps the structured
    path where the cost model would pick autodiff, and warns of no fallback."""
    import warnings

    import ntk.core.structured as structured

    model, x = _CheckpointedCNN().eval(), torch.randn(4, 3, 16, 16)
    plan = structured.plan(ModelView(model), x, "full", 3, 4, 4)
    assert plan.recomputes and structured.prefers_autodiff(plan, "full", 3, 4, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = ntk.empirical_ntk(model, x)
    assert not autodiff_picks
    with pytest.warns(UserWarning, match="torch.func cannot differentiate"):
        torch.testing.assert_close(auto, ntk.empirical_ntk(model, x, method="jacobian"))


class Prototypes(nn.Module):
    """Logits −‖h(x) − p_c‖_p to learnt prototypes p_c, by torch.cdist."""

    def __init__(self, p: float):
        super().__init__()
        self.embed, self.p = nn.Linear(4, 5), p
        self.prototypes = nn.Parameter(torch.randn(3, 5))

    def forward(self, x):
        return -torch.cdist(torch.tanh(self.embed(x)), self.prototypes, p=self.p)


class TensorPReLU(nn.Module):
    """PReLU by the tensor method x.prelu(w) (torch.Tensor.prelu, not torch.prelu)."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.full((channels,), 0.25))

    def forward(self, x):
        return x.prelu(self.weight)


class LinearSolve(nn.Module):
    """h(x) solved against a learnt matrix A (torch.linalg.solve / solve_ex), or h(x)-dependent
    systems M(x) y = A h(x) solved by LU (torch.linalg.lu_factor + lu_solve)."""

    def __init__(self, op: str):
        super().__init__()
        self.embed, self.head, self.op = nn.Linear(4, 3), nn.Linear(3, 3), op
        self.A = nn.Parameter(torch.randn(3, 3) + 3 * torch.eye(3))

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        if self.op == "solve":
            y = torch.linalg.solve(self.A, h[:, :, None])
        elif self.op == "solve_ex":
            y = torch.linalg.solve_ex(self.A, h[:, :, None])[0]
        else:
            m = 2 * torch.eye(3, dtype=h.dtype) + h[:, :, None] * h[:, None, :]
            y = torch.linalg.lu_solve(*torch.linalg.lu_factor(m), self.A @ h[:, :, None])
        return self.head(y[..., 0])


@pytest.mark.parametrize(
    "op", ["prelu", "prelu_method", "cdist2", "cdist1", "solve", "solve_ex", "lu_solve"]
)
def test_kernels_are_right_where_torch_vmaps_derivatives_wrongly(op):
    """torch's batching rule of prelu mixes the samples with the cotangents when a block holds as
    many samples as the kernel has cotangents (outputs, for full and trace): no error to fall
    back on, and the jacobian method's kernel was off by 14% (3 samples, 3 outputs; 23% with 10
    and 10), structured's by 3%, silently. cdist's is wrong whenever the cotangents are mapped:
    the jacobian method's kernel was off by 100 %, structured's by 10 % (any p). So are
    linalg.solve's and solve_ex's of a learnt [n, n] matrix against per-sample right-hand sides
    (jacobian and structured off by 800 % with 5 samples, 3 outputs), and lu_solve's, whose
    right-hand side's derivative is wrong under vmap over samples of jacrev (both off by a
    factor 1e11 here); prelu called as a tensor method was not recognised. A model whose forward
    calls one is differentiated one cotangent at a time (ntk.core.jacobian.NESTED_VMAP_UNSAFE)."""
    torch.manual_seed(0)
    if op == "prelu":
        model = nn.Sequential(nn.Linear(4, 6), nn.PReLU(6), nn.Linear(6, 3))
    elif op == "prelu_method":
        model = nn.Sequential(nn.Linear(4, 6), TensorPReLU(6), nn.Linear(6, 3))
    elif op.startswith("cdist"):
        model = Prototypes(p=2.0 if op == "cdist2" else 1.0)
    else:
        model = LinearSolve(op)
    model = model.double().eval()
    # solve's shows with samples ≠ outputs (vmap over samples fails, the loop used jacrev)
    x = torch.randn(5 if op.startswith("solve") else 3, 4, dtype=torch.float64)
    reference = kernels(model, x)  # {layer: full kernel} by autograd, one sample at a time
    # ntk_vp: cdist has no forward-mode derivative (refused); solve's pullback mapped over the
    # cotangents was wrong too (off by 200 %)
    methods = ("jacobian", "structured") + (() if op.startswith("cdist") else ("ntk_vp",))
    for method in methods:
        parts = ntk.empirical_ntk(copy.deepcopy(model), x, layers="all", method=method)
        for layer, k in parts.items():
            torch.testing.assert_close(k, reference[layer], msg=f"{method} {layer}")


class ScatterProduct(nn.Module):
    """Products of h(x)'s features over groups, by scatter_reduce(..., "prod")."""

    def __init__(self, method: bool):
        super().__init__()
        self.embed, self.head, self.method = nn.Linear(4, 6), nn.Linear(3, 3), method
        self.register_buffer("group", torch.tensor([0, 0, 1, 1, 2, 2]))

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        index = self.group.expand_as(h)
        start = torch.ones(len(x), 3, dtype=h.dtype)
        if self.method:
            return self.head(start.scatter_reduce(1, index, h, reduce="prod"))
        return self.head(torch.scatter_reduce(start, 1, index, h, "prod"))


@pytest.mark.parametrize("method_call", [True, False])
def test_ntk_vp_refuses_a_forward_mode_derivative_torch_gets_wrong(method_call):
    """torch's forward-mode derivative of scatter_reduce(..., "prod") is wrong (0) even without
    vmap: ntk_vp's kernel was off by 100 %, silently. It is refused, naming the operation; the
    reverse-mode methods are right."""
    torch.manual_seed(0)
    model = ScatterProduct(method_call).double().eval()
    x = torch.randn(4, 4, dtype=torch.float64)
    reference = kernels(model, x)[None]
    torch.testing.assert_close(ntk.empirical_ntk(model, x, method="jacobian"), reference)
    with pytest.raises(NotImplementedError, match=r"scatter_reduce\(\.\.\., reduce='prod'\)"):
        ntk.empirical_ntk(model, x, method="ntk_vp")


def test_spectral_helpers_refuse_a_cross_kernel():
    """eigenvalues / condition_number / effective_rank summarise K(x, x); a cross kernel
    K(x1, x2) of equal batch sizes is square but not symmetric and is refused."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    x1, x2 = torch.randn(5, 4), torch.randn(5, 4)
    cross = ntk.empirical_ntk(net, x1, x2, kind="trace")
    for summary in (ntk.eigenvalues, ntk.condition_number):
        with pytest.raises(ValueError, match="symmetric kernel"):
            summary(cross)
    own = ntk.empirical_ntk(net, x1, kind="trace")
    assert ntk.condition_number(own) >= 1.0 and ntk.eigenvalues(own).shape == (5,)


def test_kernel_alignment_refuses_what_it_cannot_align():
    """kernel_alignment aligned a cross kernel K(x1, x2) with the labels of one set (a number,
    silently), gave 0.0 for NaN targets, failed inside len() on a scalar y and blamed y for the
    size of a flattened full kernel; eigenvalues of an empty kernel failed in torch's max()."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    x1, x2, y = torch.randn(5, 4), torch.randn(5, 4), torch.tensor([0, 1, 1, 0, 1])
    cross = ntk.empirical_ntk(net, x1, x2, kind="trace")
    with pytest.raises(ValueError, match="^kernel_alignment needs a symmetric kernel"):
        ntk.kernel_alignment(cross, y)
    own = ntk.empirical_ntk(net, x1, kind="trace")
    with pytest.raises(ValueError, match="non-finite values .*first at sample 2"):
        ntk.kernel_alignment(own, torch.tensor([0.5, 1.0, float("nan"), 0.0, 1.0]))
    with pytest.raises(ValueError, match="one label or target per sample, got a scalar 3"):
        ntk.kernel_alignment(own, 3)
    full = ntk.empirical_ntk(net, x1, kind="full")  # was: "kernel is 10 × 10 but y has 5"
    with pytest.raises(ValueError, match=r"needs an \[N, N\] kernel, got shape \(5, 5, 2, 2\)"):
        ntk.kernel_alignment(full, y)
    with pytest.raises(ValueError, match="empty"):
        ntk.eigenvalues(torch.zeros(0, 0))


def test_spectral_summaries_name_a_dict_of_layer_kernels_and_unequal_output_axes():
    """A dict of per-layer kernels (what layers= gives) failed in numpy ("can't convert
    np.ndarray of type numpy.object_"), a full kernel [N, N, O, O'] in a reshape."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 1, 0, 1])
    parts = ntk.empirical_ntk(net, x, kind="trace", layers=["0"])
    for summary in (ntk.eigenvalues, ntk.condition_number, lambda k: ntk.kernel_alignment(k, y)):
        with pytest.raises(TypeError, match="a dict of 1 per-layer kernels .*per_layer=False"):
            summary(parts)
    with pytest.raises(ValueError, match=r"full kernel \[N, N, O, O\], got shape \(3, 3, 2, 3\)"):
        ntk.eigenvalues(torch.zeros(3, 3, 2, 3))
    assert torch.allclose(ntk.eigenvalues(parts["0"]), ntk.eigenvalues(parts["0"].numpy()))


def test_kernel_alignment_refuses_integer_labels_that_are_not_one_per_sample():
    """Integer class labels as an [N, 1] column were read as real targets, aligned with y yᵀ
    (the products of the label values) instead of the ±1 agreement, silently: 0.23 instead of
    0.47 in a sweep."""
    torch.manual_seed(0)
    a = torch.randn(6, 4, dtype=torch.float64)
    y = torch.tensor([0, 1, 0, 1, 2, 2])
    with pytest.raises(ValueError, match=r"integer class labels of shape \(6, 1\).*shape \(6,\)"):
        ntk.kernel_alignment(a @ a.T, y[:, None])
    assert ntk.kernel_alignment(a @ a.T, y.double()[:, None]) == ntk.kernel_alignment(
        a @ a.T, y.double()
    )


@pytest.mark.parametrize("centering", ["kernel", "mean"])
def test_kernel_alignment_of_a_constant_kernel_or_one_class_is_zero(centering):
    """H K H of a constant K is zero up to the rounding of H = I − 11ᵀ/n (n = 5, 20: 1/n is
    not exact), and the alignment was the ratio of rounding errors: 0.03 for a constant
    kernel, ±0.01 for lga_centred on a batch of one class."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    for n in (5, 20):
        own = ntk.empirical_ntk(net, torch.randn(n, 4), kind="trace")
        labels = torch.arange(n) % 2
        assert ntk.kernel_alignment(torch.full((n, n), 3.0), labels, centering=centering) == 0
        one_class = torch.zeros(n, dtype=torch.long)
        assert ntk.kernel_alignment(own, one_class, centering=centering) == 0
        assert ntk.kernel_alignment(own, labels, centering=centering) != 0


@pytest.mark.parametrize("centering", ["kernel", "mean"])
def test_kernel_alignment_does_not_depend_on_the_kernels_scale(centering):
    """At 1e±170 the Frobenius norms overflowed or underflowed and the kernel was taken for a
    constant one: alignment 0.0 instead of 0.380. Regression targets of that size too."""
    rng = np.random.default_rng(0)
    b = rng.standard_normal((6, 6))
    k, y = b @ b.T + 0.1 * np.eye(6), np.array([0, 1, 0, 2, 1, 1])
    expected = ntk.kernel_alignment(k, y, centering=centering)
    assert abs(expected) > 0.1
    for scale in (1e-170, 1e170):
        got = ntk.kernel_alignment(k * scale, y, centering=centering)
        assert got == pytest.approx(expected, rel=1e-12)
    targets = rng.standard_normal(6)
    expected = ntk.kernel_alignment(k, targets, centering=centering)
    got = ntk.kernel_alignment(k, targets * 1e170, centering=centering)
    assert got == pytest.approx(expected, rel=1e-12)


def test_eigenvalues_of_a_kernel_with_autograd_history_stay_differentiable_without_a_warning():
    """The symmetry check converted the kernel's entries with float(), and torch warned
    "Converting a tensor with requires_grad=True to a scalar" on every call."""
    import warnings

    from ntk import spectrum

    a = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ev = spectrum.eigenvalues(a @ a.T)
    ev.sum().backward()  # the trace: d tr(AAᵀ)/dA = 2A
    torch.testing.assert_close(a.grad, 2 * a.detach())


def test_an_output_fn_that_is_not_a_function_is_named():
    """output_fn="logits" (a name, not a function) failed inside the forward pass and was
    reported as the model failing on x1 ("'str' object is not callable")."""
    model, x1, _ = make("mlp")
    with pytest.raises(TypeError, match="^output_fn must be a function .* got 'logits'"):
        ntk.empirical_ntk(model, x1, output_fn="logits")


class Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_recurrent_models_in_float32(cell):
    """oneDNN's LSTM backward cannot be batched by vmap (per-sample Jacobians of projections and
    forward-mode products failed inside torch); the methods agree and the flag is restored."""
    import projections

    torch.manual_seed(0)
    model, x = Recurrent(cell).eval(), torch.randn(6, 5, 4)
    enabled = torch.backends.mkldnn.enabled
    reference = ntk.empirical_ntk(model, x, kind="trace", method="jacobian")
    for method in ("ntk_vp", "structured"):
        k = ntk.empirical_ntk(model, x, kind="trace", method=method)
        torch.testing.assert_close(k, reference, rtol=1e-4, atol=1e-5)
    phi = projections.features(model, x, dim=64, kind="trace")
    assert phi.shape == (6, 3, 64) and bool(torch.isfinite(phi).all())
    assert torch.backends.mkldnn.enabled == enabled


def test_ntk_vp_names_an_operation_without_forward_mode():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Linear(4, 5)), nn.Tanh(), nn.Linear(5, 2)
    ).eval()
    x = torch.randn(4, 4)
    with pytest.raises(NotImplementedError, match="method='ntk_vp' needs forward-mode"):
        ntk.empirical_ntk(model, x, method="ntk_vp")
    ntk.empirical_ntk(model, x, method="jacobian")  # the suggested method works


def test_ntk_vp_names_a_forward_mode_derivative_that_fails_in_torch():
    """torch's forward-mode derivative of group_norm fails on a channels_last input ("view size
    is not compatible with input tensor's size and stride"), where the forward pass runs: that
    RuntimeError came out bare; it is refused naming the method and the fix."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)
    ).eval()
    x = torch.randn(3, 3, 6, 6).to(memory_format=torch.channels_last)
    h = torch.randn(2, 4, 3, 3).to(memory_format=torch.channels_last)
    try:
        torch.func.jvp(lambda t: nn.functional.group_norm(t, 2), (h,), (h,))
    except RuntimeError:
        pass
    else:
        pytest.skip("this torch's forward-mode group_norm takes channels_last inputs")
    with pytest.raises(NotImplementedError, match="needs forward-mode.*one fails in torch"):
        ntk.empirical_ntk(model, x, method="ntk_vp")
    reference = ntk.empirical_ntk(model, x.contiguous(), method="jacobian")
    torch.testing.assert_close(ntk.empirical_ntk(model, x, method="structured"), reference)


def test_a_checked_forward_pass_hooks_every_module_only_once_it_has_failed():
    """A checked pass that succeeds hooks the embeddings alone (their ids are checked before the
    model indexes with them); one that fails runs again with hooks on every module to name the
    module that failed."""
    hooks = []

    class Probe(nn.Module):  # records how many hooks it carries when called
        def forward(self, h):
            hooks.append(len(self._forward_pre_hooks) + len(self._forward_hooks))
            return h

    model = nn.Sequential(nn.Embedding(5, 4), Probe(), nn.Flatten(), nn.Linear(8, 2))
    view = ModelView(model)
    assert view.forward_checked(torch.tensor([[1, 2], [3, 4]]), "x").shape == (2, 2)
    assert hooks == [0]
    hooks.clear()
    with pytest.raises(ModelForwardError, match=r"x: .* failed in module '3' \(Linear\)"):
        view.forward_checked(torch.tensor([[1, 2, 3]]), "x")
    assert hooks == [0, 2]  # the plain pass, then the one that finds the module
    with pytest.raises(ValueError, match="ids reaching embedding '0' range from 1 to 7"):
        view.forward_checked(torch.tensor([[1, 7]]), "x")


def test_inputs_found_by_fuzzing_are_refused_with_their_name():
    from ntk import proxies

    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(6, 5)
    bad = torch.eye(6)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        ntk.kernel_alignment(bad, torch.arange(6) % 2)
    with pytest.raises(TypeError, match="output_fn returned a NoneType"):
        ntk.empirical_ntk(model, x, output_fn=lambda out: None)
    for dtype in ("float64", torch.int32):
        with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
            ntk.empirical_ntk(model, x, dtype=dtype)
    names = np.array(list("abcabc"))
    for call, name in [
        (lambda: ntk.kernel_alignment(torch.eye(6), names), "y"),
        (lambda: ntk.empirical_ntk(model, x, kind="lpntk", labels=names), "labels"),
        (lambda: proxies.score(model, x, names), "y"),
    ]:
        with pytest.raises(TypeError, match=f"{name} must hold numbers"):
            call()


@pytest.mark.parametrize("method", ["jacobian", "ntk_vp", "structured"])
def test_kernel_of_one_set_is_exactly_symmetric(method):
    """x2=None gives K(a, b) == K(b, a) to the bit in float32 (the diagonal tiles too, where
    both entries are computed and rounded along different paths)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).eval()
    x = torch.randn(40, 5)
    for kind, perm in (("full", (1, 0, 3, 2)), ("diagonal", (1, 0, 2)), ("trace", (1, 0))):
        for batch_size in (None, 16):
            k = ntk.empirical_ntk(model, x, kind=kind, method=method, batch_size=batch_size)
            assert torch.equal(k, k.permute(*perm)), (kind, batch_size)


def test_a_list_of_rows_is_read_as_an_array_and_a_tuple_as_several_inputs():
    """A Python list was read as several positional inputs (one per sample), failing with
    structure errors, while KernelSurrogate read it as a table; now it is an array everywhere."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).eval()
    x, y, xt = torch.randn(6, 3), torch.arange(6) % 2, torch.randn(2, 3)
    torch.testing.assert_close(
        ntk.empirical_ntk(model, x.tolist(), kind="trace"),
        ntk.empirical_ntk(model, x, kind="trace"),
    )
    torch.testing.assert_close(
        attribution.influence(model, x.tolist(), y, xt.tolist(), damping=0.1),
        attribution.influence(model, x, y, xt, damping=0.1),
    )
    posterior = attribution.NTKPosterior(model).fit(x, y)
    np.testing.assert_allclose(
        posterior.predict_proba(xt.tolist()), posterior.predict_proba(xt), rtol=1e-6
    )
    with pytest.raises(ValueError, match=r"^x1 is a list that is not an array .*a tuple means"):
        ntk.empirical_ntk(model, [[1.0, 2.0, 3.0], [1.0]], kind="trace")
    with pytest.raises(ValueError, match="x1: all tensors must have the same number of samples"):
        ntk.empirical_ntk(model, (x, xt), kind="trace")  # a tuple: two inputs of the model


def test_numpy_float64_inputs_take_the_models_dtype():
    """numpy's default float64 arrays to a float32 model failed in its first layer ("mat1 and
    mat2 must have the same dtype"); they are cast to the parameters' dtype, as sklearn casts,
    and the model is left as it is. A float64 tensor is still refused, saying how to fix it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).eval()
    x = np.random.default_rng(0).standard_normal((6, 3))  # float64
    x32 = torch.from_numpy(x).float()
    k = ntk.empirical_ntk(model, x, kind="trace")
    assert k.dtype == torch.float32 and all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(k, ntk.empirical_ntk(model, x32, kind="trace"))
    torch.testing.assert_close(
        projections.projected_ntk(model, x, dim=8), projections.projected_ntk(model, x32, dim=8)
    )
    y = np.arange(6) % 2
    torch.testing.assert_close(
        attribution.influence(model, x, y, x[:2], damping=0.1),
        attribution.influence(model, x32, y, x32[:2], damping=0.1),
    )
    with pytest.raises(ValueError, match=r"x1: .*float64.*cast the inputs to torch\.float32"):
        ntk.empirical_ntk(model, torch.from_numpy(x), kind="trace")


def test_a_cpu_allocation_failure_under_vmap_is_raised_not_taken_for_a_vmap_limit():
    """torch's CPU allocator fails with a plain RuntimeError; under vmap it was taken for a model
    that vmap cannot run: the model was marked and computed one sample at a time from then on
    (slower, other rounding: a resumed feature store's bytes changed), with a warning blaming
    vmap. It passes to the caller, as CUDA's torch.OutOfMemoryError does."""
    import warnings

    from ntk.core import persample
    from ntk.core.memory import out_of_memory
    from ntk.core.model import ModelView

    failure = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert out_of_memory(failure) and out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not out_of_memory(RuntimeError("vmap: It looks like you're calling .item() on a Tensor"))

    def allocate(params, x):
        raise failure

    view = ModelView(nn.Linear(4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no PerSampleFallbackWarning
        with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
            persample.map_samples(view, allocate, view.params, torch.randn(5, 4))
    assert persample.vmappable(view.model)


def test_a_failure_the_loop_over_samples_repeats_is_raised_and_leaves_the_model_vmappable():
    """A function that fails under vmap and one sample at a time alike fails for its own reason,
    not vmap's: it is raised without a fallback warning, and the model is not marked (it was, and
    every later call for it looped over its samples, slower, with a warning blaming vmap)."""
    import warnings

    from ntk.core import persample
    from ntk.core.model import ModelView

    def refuse(params, x):
        raise ValueError("this sample cannot be taken")

    view = ModelView(nn.Linear(4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no PerSampleFallbackWarning
        with pytest.raises(ValueError, match="this sample cannot be taken"):
            persample.map_samples(view, refuse, view.params, torch.randn(5, 4))
    assert persample.vmappable(view.model)

    def first_row(params, x):
        return x[0] * params["weight"].sum()

    rows = persample.map_samples(view, first_row, view.params, torch.randn(5, 4))
    assert rows.shape == (5,) and persample.vmappable(view.model)
