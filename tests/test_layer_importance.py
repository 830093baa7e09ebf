"""attribution.layer_importance and its validation harness, against independent computations and
models whose answer is known by construction."""

import copy
import warnings

import numpy as np
import pytest
import torch
from models import Checkpointed, Parametrized, TwoLogits
from torch import nn
from torch.nn.utils import prune

import ntk
from attribution import layer_importance
from attribution.layer_validation import agreement, finetune_gain, reinit_damage
from attribution.layers import layer_groups


class TwoBranch(nn.Module):
    """f(x) = a(x) + c(b(x)) with c's weight zero: b has no effect, so no kernel and no damage."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(3, 3)
        with torch.no_grad():
            self.c.weight.zero_()

    def forward(self, x):
        return self.a(x) + self.c(torch.tanh(self.b(x)))


class Scale(nn.Module):
    """A module owning a parameter but no reset_parameters()."""

    def __init__(self, n):
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.s


class Residual(nn.Module):
    def __init__(self, width, active=True):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)
        if not active:
            with torch.no_grad():
                self.fc2.weight.zero_()
                self.fc2.bias.zero_()

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.inp = nn.Linear(5, 6)
        self.blocks = nn.ModuleList([Residual(6), Residual(6, active=False), Residual(6)])
        self.scale = Scale(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.scale(h))


def data(n=10, features=4, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def per_sample_jacobians(model, x):
    """{parameter name: [N, O, *shape]} by plain autograd, one sample and output at a time."""
    names = [n for n, _ in model.named_parameters()]
    out = {n: [] for n in names}
    for xi in x:
        f = model(xi[None])[0]
        rows = [
            torch.autograd.grad(f[o], list(model.parameters()), retain_graph=True)
            for o in range(len(f))
        ]
        for k, n in enumerate(names):
            out[n].append(torch.stack([r[k] for r in rows]))
    return {n: torch.stack(v) for n, v in out.items()}


def test_a_layer_with_zero_weights_downstream_has_zero_share_and_ranks_last():
    model = TwoBranch().eval()
    x, y = data()
    rows = layer_importance(model, x, y, score="share")
    by = {r["layer"]: r for r in rows}
    assert [r["rank"] for r in rows] == [1, 2, 3] and rows[-1]["layer"] == "b"
    assert by["b"]["share"] == 0 and by["b"]["trace"] == 0 and by["b"]["sensitivity"] == 0
    assert abs(sum(r["share"] for r in rows) - 1) < 1e-6
    assert by["b"]["grad_norm"] == 0 and by["b"]["fisher"] == 0
    assert by["b"]["params"] == 15 and by["a"]["type"] == "Linear"
    # its alignment was 0.0, ranked above layers aligned negatively: undefined, ranked last
    aligned = layer_importance(model, x, y, score="alignment")
    assert aligned[-1]["layer"] == "b" and aligned[-1]["alignment"] is None
    assert aligned[-1]["rank"] is None and all(r["alignment"] is not None for r in aligned[:-1])
    # the validation harness agrees: re-drawing or fine-tuning b changes nothing
    damage = reinit_damage(model, x, y)
    assert damage["b"]["loss_increase"] == 0 and damage["a"]["loss_increase"] != 0
    gain = finetune_gain(model, x, y, x, y, steps=5)
    assert gain["b"]["finetune_gain"] == 0 and gain["a"]["finetune_gain"] > 0


def test_scores_match_independent_autograd_computations():
    model = Stack().eval()
    x, y = data(n=8, features=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = {r["layer"]: r for r in layer_importance(model, x, y, score="fisher")}
    assert (
        all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not model.training
    )

    jac = per_sample_jacobians(model, x)
    owner = {
        "inp": ["inp.weight", "inp.bias"],
        "scale": ["scale.s"],
        "head": ["head.weight", "head.bias"],
        **{
            f"blocks.{b}.{fc}": [f"blocks.{b}.{fc}.weight", f"blocks.{b}.{fc}.bias"]
            for b in range(3)
            for fc in ("fc1", "fc2")
        },
    }
    assert set(rows) == set(owner)
    params = dict(model.named_parameters())
    traces = {}
    for layer, names in owner.items():
        j = torch.cat([jac[n].flatten(2) for n in names], 2)  # [N, O, P_l]
        k = torch.einsum("iop,jop->ij", j, j).double()  # trace kernel
        traces[layer] = float(k.trace())
        r = rows[layer]
        assert r["trace"] == pytest.approx(traces[layer], rel=1e-4)
        assert r["top_eigenvalue"] == pytest.approx(
            float(np.linalg.eigvalsh(k.numpy())[-1]), rel=1e-4
        )
        same = (y[:, None] == y[None, :]).double() * 2 - 1
        if traces[layer] > 0:
            assert r["alignment"] == pytest.approx(
                np.corrcoef(k.flatten(), same.flatten())[0, 1], abs=1e-5
            )
        assert r["param_norm"] == pytest.approx(
            float(torch.cat([params[n].detach().flatten() for n in names]).norm()), rel=1e-5
        )
        per_sample = []
        for xi, yi in zip(x, y):
            loss = nn.functional.cross_entropy(model(xi[None]), yi[None])
            per_sample.append(
                torch.cat(
                    [g.flatten() for g in torch.autograd.grad(loss, [params[n] for n in names])]
                )
            )
        g = torch.stack(per_sample).double()
        assert r["grad_norm"] == pytest.approx(float(g.mean(0).norm()), rel=1e-4)
        assert r["fisher"] == pytest.approx(float((g**2).sum(1).mean()), rel=1e-4)
    total = sum(traces.values())
    for layer in owner:
        assert rows[layer]["share"] == pytest.approx(traces[layer] / total, rel=1e-4)
    # Scale has no reset_parameters: its re-draw is zeros, so sensitivity = tr(Θ_l)·mean(θ_l²)/N
    s = params["scale.s"].detach()
    assert rows["scale"]["sensitivity"] == pytest.approx(
        traces["scale"] * float((s**2).mean()) / len(x), rel=1e-4
    )
    ranks = sorted(rows.values(), key=lambda r: r["rank"])
    assert [r["fisher"] for r in ranks] == sorted((r["fisher"] for r in ranks), reverse=True)
    # the block whose second layer is zero: its fc1 has no kernel at all
    assert rows["blocks.1.fc1"]["trace"] == 0


def test_blocks_sum_their_layers_and_block_influence_sees_identity_blocks():
    model = Stack().eval()
    x, y = data(n=8, features=5)
    layers = {r["layer"]: r for r in layer_importance(model, x, y)}
    blocks = {
        r["layer"]: r
        for r in layer_importance(model, x, y, group="blocks", score="block_influence")
    }
    assert list(layer_groups(model, "blocks")) == [
        "inp",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "scale",
        "head",
    ]
    assert list(layer_groups(model, 1)) == ["inp", "blocks", "scale", "head"]
    for b in range(3):
        members = [layers[f"blocks.{b}.fc1"], layers[f"blocks.{b}.fc2"]]
        row = blocks[f"blocks.{b}"]
        assert row["share"] == pytest.approx(sum(m["share"] for m in members), rel=1e-6)
        assert row["sensitivity"] == pytest.approx(sum(m["sensitivity"] for m in members), rel=1e-6)
        assert row["params"] == 84 and row["type"] == "Residual"
    # blocks.1 returns its input unchanged: cos = 1, influence 0; the others change it
    assert blocks["blocks.1"]["block_influence"] == pytest.approx(0, abs=1e-12)
    assert blocks["blocks.0"]["block_influence"] > 1e-3
    assert blocks["blocks.1"]["rank"] > max(blocks["blocks.0"]["rank"], blocks["blocks.2"]["rank"])
    assert blocks["inp"]["rank"] is None and blocks["head"]["rank"] is None
    h = model.inp(x).detach()
    out = model.blocks[0](h).detach()
    expected = float((1 - nn.functional.cosine_similarity(h, out, dim=1)).mean())
    assert blocks["blocks.0"]["block_influence"] == pytest.approx(expected, rel=1e-5)
    assert (
        blocks["inp"]["block_influence"] is None
        and layers["blocks.0.fc1"]["block_influence"] is None
    )


def test_projected_kernels_estimate_the_shares():
    model = Stack().eval()
    x, y = data(n=8, features=5)
    exact = {r["layer"]: r["share"] for r in layer_importance(model, x, y)}
    approx = {r["layer"]: r["share"] for r in layer_importance(model, x, y, projection_dim=4096)}
    assert max(abs(exact[k] - approx[k]) for k in exact) < 0.05


def test_agreement_is_spearman_over_defined_rows():
    rows = [
        {"layer": str(i), "share": s, "fisher": f, "block_influence": b}
        for i, (s, f, b) in enumerate(
            [(0.1, 3.0, None), (0.2, 2.0, 0.5), (0.3, 1.0, 0.1), (0.4, 0.5, 0.2), (0.5, 0.0, 0.3)]
        )
    ]
    truths = {str(i): {"loss_increase": float(i)} for i in range(5)}
    table = agreement(
        rows, truths, scores=("share", "fisher", "block_influence"), measures=("loss_increase",)
    )
    assert table["share"]["loss_increase"] == pytest.approx(1.0)
    assert table["fisher"]["loss_increase"] == pytest.approx(-1.0)
    # rows 1-4 only: ranks 4,1,2,3 vs 1,2,3,4, ρ = 1 − 6·12/(4·15)
    assert table["block_influence"]["loss_increase"] == pytest.approx(-0.2)


def test_bad_input_is_refused_with_a_clear_message():
    model = TwoBranch().eval()
    x, y = data()
    with pytest.raises(ValueError, match="unknown score"):
        layer_importance(model, x, y, score="magic")
    with pytest.raises(ValueError, match="needs labels"):
        layer_importance(model, x, score="alignment")
    with pytest.raises(ValueError, match="one entry per sample"):
        layer_importance(model, x, y[:3])
    with pytest.raises(ValueError, match=r"^y holds labels outside 0\.\.2: 7 at sample 0 \("):
        layer_importance(model, x, y + 5)
    with pytest.raises(ValueError, match=r"^y holds labels outside 0\.\.2: -1 at sample 3 \("):
        layer_importance(model, x, torch.where(torch.arange(len(y)) == 3, -1, y))
    with pytest.raises(ValueError, match=r"labels of shape \(10, 2\); class labels are one per"):
        layer_importance(model, x, torch.stack([y, y], 1))
    with pytest.raises(ValueError, match="group must be"):
        layer_importance(model, x, y, group="heads")
    with pytest.raises(ValueError, match="'block_influence' compares .* needs group='blocks'"):
        layer_importance(model, x, y, score="block_influence")  # before any kernel
    funnel = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).eval()  # no block keeps
    with pytest.raises(ValueError, match="undefined for every row"):  # its input's shape
        layer_importance(funnel, x, y, score="block_influence", group="blocks")
    for dim in (64.0, 0, True):  # named by its own name, before any kernel (was "dim")
        with pytest.raises(ValueError, match="projection_dim must be a positive integer"):
            layer_importance(model, x, y, projection_dim=dim)
    rows = layer_importance(model, x)  # no labels: label scores None
    assert rows[0]["alignment"] is None and rows[0]["fisher"] is None


def test_the_label_aware_kernel_takes_y_as_its_labels():
    model = TwoBranch().eval()
    x, y = data()
    rows = layer_importance(model, x, y, kind="lpntk", score="share")
    parts = ntk.empirical_ntk(model, x, kind="lpntk", labels=y, layers="all")
    total = sum(float(k.diagonal().sum()) for k in parts.values())
    for row in rows:
        assert row["share"] == pytest.approx(float(parts[row["layer"]].diagonal().sum()) / total)
    with pytest.raises(ValueError, match="kind='lpntk' weights the kernel by class labels"):
        layer_importance(model, x, kind="lpntk")


def test_a_batchnorm_in_training_mode_is_named():
    """The label scores' per-sample passes must not hide the real problem behind a shape error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model.train()
    x, y = torch.randn(10, 6), torch.arange(10) % 3
    with pytest.raises(ValueError, match="BatchNorm that uses batch statistics"):
        layer_importance(model, x, y)


def test_the_validation_harness_checks_its_inputs_as_layer_importance_does():
    """reinit_damage and finetune_gain took an active Dropout (two calls differed, the global
    random state moved) and a training-mode BatchNorm, failed on numpy inputs ("'numpy.ndarray'
    object has no attribute 'detach'"), divided by zero for no seeds and left a wrong number of
    labels to torch; and reinit_damage redrew frozen parameters, which no score reads."""
    from attribution.layers import redraw

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    model[2].bias.requires_grad_(False)
    x, y = torch.randn(12, 6), torch.arange(12) % 3
    assert set(redraw(model, "2", 100)) == {"2.weight"}
    damage = reinit_damage(model, x, y, seeds=[100])
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[2].weight.copy_(redraw(model, "2", 100)["2.weight"])
        before = nn.functional.cross_entropy(model(x), y)
        after = nn.functional.cross_entropy(twin(x), y)
    assert damage["2"]["loss_increase"] == pytest.approx(float(after - before), abs=1e-5)
    assert reinit_damage(model, x.numpy(), y.numpy(), seeds=[100]) == damage
    numpy_gain = finetune_gain(model, x.numpy(), y.numpy(), x.numpy(), y.numpy(), steps=3)
    assert numpy_gain == finetune_gain(model, x, y, x, y, steps=3)
    with pytest.raises(ValueError, match="seeds is empty"):
        reinit_damage(model, x, y, seeds=())
    with pytest.raises(ValueError, match=r"^y must have one entry per sample \(12\)"):
        reinit_damage(model, x, y[:5])
    with pytest.raises(ValueError, match=r"^y_test must have one entry per sample \(12\)"):
        finetune_gain(model, x, y, x, y[:5], steps=1)
    for training in (
        nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3)),
        nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)),
    ):
        with pytest.raises(ValueError, match="Call model.eval()"):
            reinit_damage(training, x, y)
        with pytest.raises(ValueError, match="Call model.eval()"):
            finetune_gain(training, x, y, x, y, steps=1)


def test_a_pruned_layer_is_redrawn_on_a_copy():
    """torch.nn.utils.prune keeps the masked weight as a tensor computed from weight_orig, which
    copy.deepcopy refused (the sensitivity score's redraws failed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    x, y = torch.randn(10, 6), torch.arange(10) % 3
    rows = layer_importance(model, x, y, group="blocks")
    assert {r["layer"] for r in rows} == {"0", "2"}
    assert all(np.isfinite(r["sensitivity"]) for r in rows)


def test_small_integer_labels_are_class_labels(recwarn):
    """uint8 labels (as images datasets store them) index the outputs like int64 ones, with the
    vmapped path (no per-sample fallback blaming the model)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    x, y = torch.randn(12, 6), torch.arange(12) % 3
    expected = layer_importance(model, x, y, score="grad_norm")
    got = layer_importance(model, x, y.to(torch.uint8).numpy(), score="grad_norm")
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in expected])
    assert not [w for w in recwarn if "vmapped" in str(w.message)]


def test_whole_number_float_labels_are_class_labels_as_elsewhere():
    """One float per sample (labels read from a CSV) for a model of several outputs: class labels,
    as in influence, KernelSurrogate and the NAS proxies; half-integers are still refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    x, y = torch.randn(12, 6), torch.arange(12) % 3
    expected = layer_importance(model, x, y, score="fisher")
    got = layer_importance(model, x, y.double().numpy(), score="fisher")
    assert [r["fisher"] for r in got] == pytest.approx([r["fisher"] for r in expected])
    shares = layer_importance(model, x, y.float(), kind="lpntk", score="share")
    assert [r["share"] for r in shares] == pytest.approx(
        [r["share"] for r in layer_importance(model, x, y, kind="lpntk", score="share")]
    )
    with pytest.raises(ValueError, match="real-valued targets need 3"):
        layer_importance(model, x, y + 0.5, score="fisher")


def test_one_hot_float_labels_are_read_as_targets_with_a_warning():
    """One-hot float labels [N, O] were silently read as regression targets (the label scores
    then use the squared error: a head's grad_norm 4.3 instead of 0.74); they still are, as
    floats are everywhere, with a warning saying how to pass class labels."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    x, y = torch.randn(12, 6), torch.arange(12) % 3
    one_hot = nn.functional.one_hot(y, 3).float()
    with pytest.warns(UserWarning, match=r"y is one-hot .* pass the class indices \(y.argmax"):
        rows = layer_importance(model, x, one_hot, score="fisher")
    assert all(r["fisher"] is not None for r in rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer_importance(model, x, y, score="fisher")
        layer_importance(model, x, one_hot * 0.9, score="fisher")  # real targets


def test_non_finite_targets_are_refused():
    """A NaN among real targets (or float labels) made every label score NaN, silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).eval()
    x, y = torch.randn(12, 6), torch.randn(12, 1)
    y[3] = float("nan")
    with pytest.raises(
        ValueError, match=r"y contains non-finite values \(NaN or inf\), first at sample 3"
    ):
        layer_importance(model, x, y, score="fisher")


def test_a_model_without_a_row_per_sample_is_named_not_its_labels():
    # a model flattening its batch's outputs was blamed on the labels ("y holds labels outside
    # 0..0: 1 at sample 0 (the model has 1 output)")
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x):
            return self.linear(x).reshape(-1)

    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    with pytest.raises(ValueError, match="returned 3 output rows for the 1 samples of x"):
        layer_importance(Flat(), x, y)


def test_a_binary_classifier_with_one_logit_takes_labels_0_and_1():
    """A binary classifier with one logit z was refused its labels ("y holds labels outside
    0..0"), though the proxies take them, and so had no label scores. Its loss is the binary
    cross-entropy of z, the cross-entropy of the two-class scores (0, z)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).eval()
    x, y = torch.randn(10, 4), torch.arange(10) % 2
    rows = {r["layer"]: r for r in layer_importance(model, x, y, score="fisher")}
    twin = {r["layer"]: r for r in layer_importance(TwoLogits(model), x, y, score="fisher")}
    for layer, row in rows.items():
        for score in ("grad_norm", "fisher", "alignment"):
            assert row[score] == pytest.approx(twin[f"net.{layer}"][score], rel=1e-5), score
    with pytest.raises(ValueError, match="outside 0..1: 2 at sample 0 .*one output"):
        layer_importance(model, x, y + 2)


def test_redraw_leaves_the_global_random_state_as_it_was(fake_cuda):
    """redraw seeded with torch.manual_seed, which seeds every GPU, and restored the CPU only."""
    from attribution.layers import redraw

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    cpu = torch.get_rng_state()
    first = redraw(model, "0", seed=5)
    assert torch.equal(torch.get_rng_state(), cpu)
    assert fake_cuda["state"] == "the caller's"
    torch.testing.assert_close(redraw(model, "0", seed=5), first)  # the seed decides the draw


@pytest.mark.filterwarnings("ignore::UserWarning")  # the fallback to torch.autograd
def test_a_model_under_activation_checkpointing_gets_every_score():
    """The label scores' per-sample gradients ran under torch.func, which refuses
    torch.utils.checkpoint's saved-tensor hooks ("torch.func.{grad, vjp, jacrev, hessian} don't
    yet support saved tensor hooks"): layer_importance failed. Every score equals the plain
    twin's."""
    torch.manual_seed(0)
    net = Checkpointed().double().eval()
    twin = Checkpointed(checkpointed=False).double().eval()
    twin.load_state_dict(net.state_dict())
    x = torch.randn(24, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (24,))
    got, want = layer_importance(net, x, y), layer_importance(twin, x, y)
    assert [r["layer"] for r in got] == [r["layer"] for r in want]
    for a, b in zip(got, want):
        for score in ("sensitivity", "share", "alignment", "grad_norm", "fisher"):
            assert a[score] == pytest.approx(b[score], rel=1e-9, abs=1e-15), (a["layer"], score)


def test_a_parametrized_layer_is_one_row_redrawn_through_its_parametrization():
    """A weight_norm / spectral_norm layer is one row with all its parameters; its redraw is the
    plain layer's initialiser mapped to the parametrization's parameters by its right inverse
    (before: its bias one row, a "ParametrizationList" another, redrawn as zeros)."""
    from attribution.layers import redraw

    torch.manual_seed(0)
    model = Parametrized().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(12, 5), torch.arange(12) % 3
    rows = layer_importance(model, x, y)
    assert sorted((r["layer"], r["params"]) for r in rows) == [("l1", 42), ("l2", 42), ("out", 21)]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model(x)  # removing the twin's parametrization left the model's class as it was
    fresh = redraw(model, "l1", seed=3)
    plain = redraw(nn.ModuleDict({"l1": nn.Linear(5, 6)}), "l1", seed=3)
    g, v = (
        fresh["l1.parametrizations.weight.original0"],
        fresh["l1.parametrizations.weight.original1"],
    )
    torch.testing.assert_close(g * v / v.norm(dim=1, keepdim=True), plain["l1.weight"])
    torch.testing.assert_close(fresh["l1.bias"], plain["l1.bias"])
    spectral = redraw(model, "l2", seed=3)["l2.parametrizations.weight.original"]
    assert torch.equal(
        spectral, redraw(nn.ModuleDict({"l2": nn.Linear(6, 6)}), "l2", 3)["l2.weight"]
    )
