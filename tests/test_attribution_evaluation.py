"""The LDS, the vmapped retraining harness (checked on linear regression, where the trained
weights and the influence are known in closed form) and mislabel detection."""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from attribution import (
    calibration_metrics,
    expected_calibration_error,
    flip_labels,
    lds,
    mislabel_auc,
    random_subsets,
    reliability,
    train_on_subsets,
)


def test_lds_is_the_mean_spearman_of_subset_sums():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 40, generator=gen, dtype=torch.float64)
    subsets = random_subsets(40, 30, 0.5, seed=1)
    assert subsets.shape == (30, 40) and bool((subsets.sum(1) == 20).all())
    linear = subsets.double() @ scores.T
    assert lds(scores, subsets, linear) == pytest.approx(1.0)
    noisy = linear + torch.randn(30, 6, generator=gen, dtype=torch.float64)
    expected = np.mean([spearmanr(linear[:, z], noisy[:, z]).statistic for z in range(6)])
    assert lds(scores, subsets, noisy) == pytest.approx(expected)
    with pytest.raises(ValueError, match="subset_outputs"):
        lds(scores, subsets, noisy[:, :3])
    with pytest.raises(ValueError, match="mask"):
        lds(scores, subsets[:, :10], noisy)


def test_lds_skips_a_test_example_predicted_the_same_up_to_rounding():
    """One score for every training example predicts c·|S| for subsets of equal size: constant,
    but the matrix product differs in the last bits (0.7: 4e-16), and a Spearman ρ of rounding
    noise entered the mean without the skip warning (0.389 instead of 0.984 here)."""
    rng = np.random.default_rng(0)
    subsets = random_subsets(10, 20, 0.5, seed=0).numpy()
    good = rng.normal(size=10)
    scores = np.stack([good, np.full(10, 0.7)])
    outputs = np.stack([subsets @ good + 0.1 * rng.normal(size=20), rng.normal(size=20)], 1)
    alone = lds(scores[:1], subsets, outputs[:, :1])
    with pytest.warns(RuntimeWarning, match="1 test examples have constant outputs or pred"):
        assert lds(scores, subsets, outputs) == alone
    with pytest.raises(ValueError, match=r"scores must be \[N_test, N_train\] with at least one"):
        lds(scores[:0], subsets, outputs[:, :0])
    for name, bad in (
        ("scores", (scores * np.nan, outputs)),
        ("subset_outputs", (scores, outputs * np.inf)),
    ):
        with pytest.raises(ValueError, match=f"^{name} must be finite"):
            lds(bad[0], subsets, bad[1])


def test_harness_and_lds_on_linear_regression():
    """Ridge regression trained by the harness equals its closed form, and the exact influence
    of linear regression reaches an LDS near 1 while random scores do not."""
    gen = torch.Generator().manual_seed(0)
    n, d, wd = 60, 4, 1e-2
    x = torch.randn(n, d, generator=gen)
    y = x @ torch.randn(d, 1, generator=gen) + 0.3 * torch.randn(n, 1, generator=gen)
    xt = torch.randn(8, d, generator=gen)
    subsets = random_subsets(n, 30, 0.5, seed=2)
    models = train_on_subsets(
        lambda: torch.nn.Linear(d, 1),
        x,
        y,
        subsets,
        epochs=700,
        batch_size=n,
        lr=0.05,
        weight_decay=wd,
        loss="mse",
    )
    out = models.outputs(xt)[:, 0, :, 0].double()  # [S, M]
    xa, xta = (
        torch.cat([x, torch.ones(n, 1)], 1).double(),
        torch.cat([xt, torch.ones(8, 1)], 1).double(),
    )
    m = n // 2
    closed = []
    for row in subsets:
        a, b = xa[row], y[row].double()
        theta = torch.linalg.solve(
            a.T @ a + (m * wd / 2) * torch.eye(d + 1, dtype=torch.float64), a.T @ b
        )
        closed.append((xta @ theta)[:, 0])
    torch.testing.assert_close(out, torch.stack(closed), rtol=1e-3, atol=1e-3)
    # influence of including i on the test prediction, at the full-data solution
    h = xa.T @ xa + (n * wd / 2) * torch.eye(d + 1, dtype=torch.float64)
    theta = torch.linalg.solve(h, xa.T @ y.double())
    residual = (y.double() - xa @ theta)[:, 0]
    scores = (xta @ torch.linalg.solve(h, xa.T)) * residual
    assert lds(scores, subsets, out) > 0.9
    assert lds(torch.randn(8, n, generator=gen), subsets, out) < 0.4


def test_harness_classification_shapes_and_seeds():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 3, generator=gen), torch.randint(0, 3, (20,), generator=gen)
    subsets = random_subsets(20, 4, 0.5)
    models = train_on_subsets(
        lambda: torch.nn.Linear(3, 3), x, y, subsets, seeds=2, epochs=3, batch_size=4
    )
    assert models.outputs(x).shape == (4, 2, 20, 3) and models.margins(x, y).shape == (4, 20)
    again = train_on_subsets(
        lambda: torch.nn.Linear(3, 3), x, y, subsets, seeds=2, epochs=3, batch_size=4
    )
    torch.testing.assert_close(models.outputs(x), again.outputs(x))  # fixed seeds
    with pytest.raises(ValueError, match="same size"):
        uneven = torch.zeros(2, 20, dtype=torch.bool)
        uneven[0, :3], uneven[1, :5] = True, True
        train_on_subsets(lambda: torch.nn.Linear(3, 3), x, y, uneven)


def test_harness_takes_numpy_and_leaves_the_callers_random_state():
    """numpy data (int32 labels) train and score as tensors do; seeding each model's
    initialisation does not reset the caller's torch random state."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 3, generator=gen), torch.randint(0, 3, (20,), generator=gen)
    subsets = random_subsets(20, 3, 0.5)
    factory = lambda: torch.nn.Linear(3, 3)  # noqa: E731
    as_tensors = train_on_subsets(factory, x, y, subsets, epochs=2, batch_size=4)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    as_arrays = train_on_subsets(
        factory, x.numpy(), y.numpy().astype(np.int32), subsets, epochs=2, batch_size=4
    )
    torch.testing.assert_close(torch.rand(3), expected)
    torch.testing.assert_close(as_arrays.margins(x.numpy(), y.numpy()), as_tensors.margins(x, y))


class _TwoInputNet(torch.nn.Module):
    """Called HuggingFace-style: keyword tensors in, an object with .logits out."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 3)

    def forward(self, features, extra):
        return SimpleNamespace(logits=self.linear(torch.cat([features, extra], -1)))


def test_harness_takes_dict_inputs_and_output_fn():
    """A model called with keyword tensors whose output holds .logits trains to the same models
    as the plain Linear on the joined tensor (same initialisation, same batches)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 5, generator=gen), torch.randint(0, 3, (24,), generator=gen)
    subsets = random_subsets(24, 3, 0.5)
    recipe = dict(seeds=2, epochs=4, batch_size=5)
    plain = train_on_subsets(lambda: torch.nn.Linear(5, 3), x, y, subsets, **recipe)
    split = {"features": x[:, :3], "extra": x[:, 3:]}
    keyed = train_on_subsets(
        _TwoInputNet, split, y, subsets, output_fn=lambda out: out.logits, **recipe
    )
    torch.testing.assert_close(keyed.outputs(split), plain.outputs(x))
    torch.testing.assert_close(keyed.margins(split, y), plain.margins(x, y))
    with pytest.raises(ValueError, match="24 samples but y holds 23"):
        train_on_subsets(_TwoInputNet, split, y[:23], subsets, output_fn=lambda out: out.logits)
    with pytest.raises(ValueError, match="same number of samples"):
        train_on_subsets(_TwoInputNet, {"features": x[:, :3], "extra": x[:5, 3:]}, y, subsets)


def test_flip_labels_and_auc():
    y = torch.arange(100) % 10
    noisy, flipped = flip_labels(y, 0.1, 10, seed=0)
    assert int(flipped.sum()) == 10 and bool((noisy[flipped] != y[flipped]).all())
    assert bool((noisy[~flipped] == y[~flipped]).all())
    assert mislabel_auc(flipped.double(), flipped) == 1.0
    assert mislabel_auc(-flipped.double(), flipped) == 0.0


def test_expected_calibration_error_on_a_hand_computed_case():
    probs = [[0.95, 0.05], [0.75, 0.25], [0.35, 0.65], [0.55, 0.45]]
    labels = [0, 1, 1, 0]
    # 5 bins: {0.95} acc 1 → 0.05; {0.75 wrong, 0.65 right} acc 0.5, conf 0.7 → 2 × 0.2;
    # {0.55 right} → 0.45; weighted by counts over 4 samples
    assert expected_calibration_error(probs, labels, n_bins=5) == pytest.approx(0.9 / 4)
    # one bin: |mean accuracy − mean confidence|
    assert expected_calibration_error(probs, labels, n_bins=1) == pytest.approx(abs(0.75 - 0.725))
    bins = reliability(probs, labels, n_bins=5)
    np.testing.assert_allclose(bins["confidence"], [0.55, 0.7, 0.95])
    np.testing.assert_allclose(bins["accuracy"], [1.0, 0.5, 1.0])
    np.testing.assert_array_equal(bins["count"], [1, 2, 1])
    m = calibration_metrics(probs, labels, n_bins=5)
    assert m["accuracy"] == 0.75 and m["ece"] == pytest.approx(0.9 / 4)
    assert m["nll"] == pytest.approx(-np.mean(np.log([0.95, 0.25, 0.65, 0.55])))
    # the squared distance to the one-hot label, Σ over both classes: 2 (1 − p_label)² (it was
    # scikit-learn's binary default, half that, where three classes got the whole distance)
    assert m["brier"] == pytest.approx(2 * np.mean(np.square([0.05, 0.75, 0.35, 0.45])))
    padded = calibration_metrics(np.pad(probs, ((0, 0), (0, 1))), labels, n_bins=5)
    assert padded["brier"] == pytest.approx(m["brier"])  # a class never predicted adds nothing
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        expected_calibration_error([0.5, 0.5], [0, 1])
    with pytest.raises(ValueError, match="n_bins"):
        expected_calibration_error(probs, labels, n_bins=0)


def test_metrics_take_tensors_that_require_grad():
    """The metrics take a model's outputs as they come (model(x).softmax(1) carries autograd
    history): they failed in numpy() ("Can't call numpy() on Tensor that requires grad")."""
    torch.manual_seed(0)
    model, x, y = torch.nn.Linear(4, 3), torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    probs = model(x).softmax(1)
    plain = probs.detach().numpy()
    assert calibration_metrics(probs, y) == calibration_metrics(plain, y.numpy())
    assert expected_calibration_error(probs, y) == expected_calibration_error(plain, y.numpy())
    assert mislabel_auc(probs[:, 0], y > 0) == mislabel_auc(plain[:, 0], y.numpy() > 0)
    scores, outputs, subsets = model(x).T, model(x)[:4], random_subsets(6, 4)  # [3, 6], [4, 3]
    assert lds(scores, subsets, outputs) == lds(scores.detach(), subsets, outputs.detach())


def test_calibration_checks_labels_and_probability_rows():
    """Labels outside the classes were counted as wrong predictions by reliability and the ECE
    (silently), 1-D probabilities of the positive class failed in scikit-learn ("The number of
    classes in labels is different"), a row of zeros in NaN ("Input contains NaN")."""
    probs = [[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]]
    for metric in (reliability, expected_calibration_error, calibration_metrics):
        with pytest.raises(ValueError, match=r"labels holds labels outside 0\.\.1: 5 at sample 2"):
            metric(probs, [0, 1, 5])
        with pytest.raises(ValueError, match="integer class labels, got 0.5 at sample 1"):
            metric(probs, [0, 0.5, 1])
        with pytest.raises(ValueError, match=r"probs must be \[N, C\].*\[1 − p, p\]"):
            metric([0.1, 0.8, 0.4], [0, 1, 1])
    with pytest.raises(ValueError, match="probs row 1 sums to 0"):
        calibration_metrics([[0.9, 0.1], [0.0, 0.0]], [0, 1])
    assert calibration_metrics(probs, [0.0, 1.0, 0.0]) == calibration_metrics(probs, [0, 1, 0])


def test_nll_counts_confident_mistakes_in_full():
    """scikit-learn's log_loss clips probabilities at 2.2e-16, so a mistake made with logit gaps
    of 46 and 80 counted 36.04 nats each; a probability of exactly 0 counts as float64's
    smallest positive number."""
    logits = torch.tensor([[0.0, 46.0], [0.0, 80.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0])
    nll = calibration_metrics(logits.softmax(1), labels)["nll"]
    assert nll == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)))
    assert calibration_metrics([[1.0, 0.0]], [1])["nll"] == pytest.approx(
        -np.log(np.finfo(np.float64).tiny)
    )


def test_one_probability_column_and_index_lists_are_named():
    """One column of probabilities was read as one class: its labels were 'outside 0..0' with
    advice about a model's output_fn, or all zeros reached scikit-learn ('needs to contain at
    least two labels'); ragged index lists as subsets failed in numpy ('inhomogeneous shape')."""
    for labels in ([1, 0, 1], [0, 0, 0]):
        with pytest.raises(ValueError, match=r"probs must be \[N, C\] \(a column per class, at"):
            calibration_metrics([[0.9], [0.2], [0.7]], labels)
    with pytest.raises(
        ValueError, match=r"subsets must be a 0/1 \(or bool\) mask \[num_subsets, 6\]"
    ):
        lds(np.zeros((2, 6)), [[0, 1, 2], [3, 4], [1, 5, 2, 0]], np.zeros((3, 2)))


def test_reliability_needs_rows_summing_to_one():
    """Unnormalised scores were binned as confidences (2.0 clipped into the top bin), an ECE of
    nothing; calibration_metrics renormalises its rows and is unaffected."""
    for metric in (reliability, expected_calibration_error):
        with pytest.raises(ValueError, match="summing to 1; row 1 sums to 2.5"):
            metric([[0.9, 0.1], [2.0, 0.5]], [0, 0])
    assert calibration_metrics([[0.9, 0.1], [2.0, 0.5]], [0, 0])["accuracy"] == 1.0


def test_train_on_subsets_checks_its_counts():
    """Fractional counts failed in range() ("'float' object cannot be interpreted as an
    integer"), batch_size=0 or chunk=0 as "range() arg 3 must not be zero", and epochs=-1
    returned untrained models."""
    x, y, subsets = torch.randn(12, 4), torch.tensor([0, 1, 2] * 4), random_subsets(12, 3)
    for setting, integer in (
        (dict(seeds=2.5), "a positive integer"),
        (dict(epochs=1.5), "a non-negative integer"),
        (dict(epochs=-1), "a non-negative integer"),
        (dict(batch_size=0), "a positive integer"),
        (dict(chunk=0), "a positive integer"),
        (dict(seeds=True), "a positive integer"),
    ):
        ((name, value),) = setting.items()
        with pytest.raises(ValueError, match=f"^{name} must be {integer}, got {value}"):
            train_on_subsets(lambda: torch.nn.Linear(4, 3), x, y, subsets, **setting)


def test_random_subsets_takes_integers_only():
    """A float size or count failed inside torch ("zeros(): argument 'size' failed to unpack",
    "zeros() takes 1 positional argument but 2 were given")."""
    with pytest.raises(ValueError, match="n must be a non-negative integer.*got 10.0"):
        random_subsets(10.0, 3)
    with pytest.raises(ValueError, match="num_subsets must be a positive integer, got 2.5"):
        random_subsets(10, 2.5)
    assert random_subsets(np.int64(10), np.int64(3)).shape == (3, 10)


def test_counts_fractions_and_seeds_refuse_bools_and_strings():
    """A bool was read as 1 (random_subsets(16, True): "zeros() takes 1 positional argument",
    n_bins=True one bin), a string fraction failed on `<` ("not supported between instances of
    'int' and 'str'"), a fractional seed inside torch ("manual_seed expected a long")."""
    y = torch.arange(12) % 3
    with pytest.raises(ValueError, match="^num_subsets must be a positive integer, got True"):
        random_subsets(16, True)
    with pytest.raises(ValueError, match=r"^alpha must be a number in \(0, 1\), got '0.5'"):
        random_subsets(16, 4, alpha="0.5")
    with pytest.raises(ValueError, match=r"^fraction must be a number in \(0, 1\), got '0.2'"):
        flip_labels(y, "0.2", 3)
    with pytest.raises(ValueError, match=r"^fraction must be a number in \(0, 1\), got 1"):
        flip_labels(y, 1, 3)
    for call in (lambda: random_subsets(16, 4, seed=1.5), lambda: flip_labels(y, 0.2, 3, seed=1.5)):
        with pytest.raises(ValueError, match="^seed must be an integer, got 1.5"):
            call()
    probs = torch.full((3, 3), 1 / 3)
    with pytest.raises(ValueError, match="^n_bins must be a positive integer, got True"):
        expected_calibration_error(probs, [0, 1, 2], n_bins=True)


def test_train_on_subsets_with_a_module_registered_under_two_names():
    """A module reachable by two names (self.again = self.twice) and a weight tied across two
    modules: the stacked models train, and each one's outputs are those of the factory's model
    loaded with its parameters (the functional calls leave no copy behind in the base module)."""
    from models import Tied

    torch.manual_seed(0)
    x = torch.randn(40, 4, dtype=torch.float64)
    y = torch.arange(40) % 3
    subsets = random_subsets(40, 3)
    stack = train_on_subsets(lambda: Tied().double(), x, y, subsets, epochs=3, seeds=1)
    assert isinstance(stack.base.again.weight, torch.nn.Parameter)
    outputs = stack.outputs(x[:5])  # [S, seeds, 5, 3]
    for s in range(len(subsets)):
        model = Tied().double().eval()
        model.load_state_dict({**model.state_dict(), **{k: v[s] for k, v in stack.params.items()}})
        torch.testing.assert_close(outputs[s, 0], model(x[:5]).detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["Tied", "MLP"])
def test_modules_are_the_stacked_models_one_by_one(name):
    """SubsetModels.modules(): module s·seeds + r gives model (s, r)'s outputs, tied weights tied
    still, in eval mode, and a module of its own (changing one leaves the others as they were)."""
    import models

    factory = lambda: getattr(models, name)().double()  # noqa: E731
    d = 4 if name == "Tied" else 5
    x = torch.randn(30, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.arange(30) % 3
    stack = train_on_subsets(factory, x, y, random_subsets(30, 3, seed=4), seeds=2, epochs=2)
    outputs = stack.outputs(x[:6])  # [S, seeds, 6, 3]
    members = stack.modules()
    assert len(members) == 6 and not any(m.training for m in members)
    for j, module in enumerate(members):
        want = outputs[j // 2, j % 2]
        torch.testing.assert_close(module(x[:6]).detach(), want, rtol=1e-12, atol=1e-12)
    if name == "Tied":
        assert members[0].dec.weight is members[0].enc.weight
    with torch.no_grad():
        next(members[0].parameters()).add_(1.0)
    torch.testing.assert_close(members[1](x[:6]).detach(), outputs[0, 1], rtol=1e-12, atol=1e-12)


def test_evaluation_inputs_found_by_fuzzing_are_refused_clearly():
    with pytest.raises(ValueError, match="num_subsets must be a positive integer"):
        random_subsets(16, 0)
    subsets = random_subsets(16, 2)
    with pytest.raises(ValueError, match="needs at least 3"):
        lds(torch.randn(4, 16), subsets, torch.randn(2, 4))
    with pytest.raises(ValueError, match="one per row of probs"):
        calibration_metrics(np.full((4, 3), 1 / 3), [0, 1, 2])


def test_subset_training_and_margins_check_class_labels():
    # fractional labels were truncated silently (0.7 → class 0), labels outside the outputs failed
    # deep in torch ("Target 4 is out of bounds", "index 3 is out of bounds for dimension 3")
    torch.manual_seed(0)
    x, y = torch.randn(12, 3), torch.arange(12) % 3
    subsets = random_subsets(12, 3)
    train = lambda labels: train_on_subsets(  # noqa: E731
        lambda: torch.nn.Linear(3, 3), x, labels, subsets, epochs=1
    )
    with pytest.raises(ValueError, match="y must hold integer class labels, got 0.5"):
        train(y + 0.5)
    with pytest.raises(ValueError, match=r"y holds labels outside 0..2: 3 at sample 0"):
        train(y + 3)
    models = train(y.int())
    with pytest.raises(ValueError, match=r"y holds labels outside 0..2: 3 at sample 0"):
        models.margins(x, y + 3)
    with pytest.raises(ValueError, match="y must hold integer class labels, got 1.5"):
        models.margins(x, y + 1.5)
    with pytest.raises(ValueError, match="12 class labels, got shape"):
        models.margins(x, y[:5])
    torch.testing.assert_close(models.margins(x, y.numpy().astype(np.uint8)), models.margins(x, y))


def test_flip_labels_checks_its_labels_and_classes():
    # labels outside 0..num_classes−1 came back unflipped and out of range, numpy or list labels
    # failed on `+` with a torch tensor, num_classes=1 failed inside torch.randint
    y = np.arange(20) % 4
    noisy, flipped = flip_labels(y, 0.25, 4)
    assert int(flipped.sum()) == 5 and bool((noisy[flipped] != torch.as_tensor(y)[flipped]).all())
    torch.testing.assert_close(flip_labels(y.tolist(), 0.25, 4)[0], noisy)
    with pytest.raises(ValueError, match=r"y holds labels outside 0..2: 3 at sample 3"):
        flip_labels(y, 0.25, 3)
    with pytest.raises(ValueError, match="num_classes must be an integer ≥ 2, got 1"):
        flip_labels(y * 0, 0.25, 1)


def test_subset_regression_targets_are_checked():
    # loss="mse" with one target per sample for a 3-output model failed in torch ("shape '[3, 6,
    # 3]' is invalid for input of size 18"), and NaN targets trained every model to NaN silently
    x = torch.randn(12, 3)
    subsets = random_subsets(12, 3)
    train = lambda targets, outputs: train_on_subsets(  # noqa: E731
        lambda: torch.nn.Linear(3, outputs), x, targets, subsets, epochs=1, loss="mse"
    )
    with pytest.raises(ValueError, match=r"y holds 1 target value\(s\) per sample; .* \(3\)"):
        train(torch.randn(12), 3)
    targets = torch.randn(12)
    targets[4] = float("nan")
    with pytest.raises(ValueError, match="non-finite values .* first at sample 4"):
        train(targets, 1)
    assert train(torch.randn(12, 3), 3).outputs(x).shape == (3, 1, 12, 3)


def test_mislabel_auc_refuses_what_has_no_auc():
    # no flipped label (or only flipped ones) gave NaN with an sklearn warning
    scores = [0.1, 0.2, 0.3]
    for flipped in ([0, 0, 0], [True, True, True]):
        with pytest.raises(ValueError, match="needs both flipped and clean samples"):
            mislabel_auc(scores, flipped)
    with pytest.raises(ValueError, match=r"self_influence has 3 scores but flipped has 2"):
        mislabel_auc(scores, [0, 1])
    with pytest.raises(ValueError, match=r"flipped must be a mask of 0/1 or booleans, got 2"):
        mislabel_auc(scores, [0, 2, 1])
    with pytest.raises(ValueError, match=r"self_influence must be finite, got nan at sample 1"):
        mislabel_auc([0.1, float("nan"), 0.3], [0, 1, 1])
    assert mislabel_auc(np.array(scores), np.array([0, 0, 1])) == 1.0


def test_train_on_subsets_leaves_the_global_random_state_as_it_was(fake_cuda):
    """The factory ran under fork_rng(devices=[]) and torch.manual_seed, which seeds every GPU
    too: the CPU's state came back, the GPUs' did not."""
    x, y = torch.randn(8, 3), torch.arange(8) % 2
    cpu = torch.get_rng_state()
    train_on_subsets(
        lambda: torch.nn.Linear(3, 2), x, y, random_subsets(8, 2, 0.5), epochs=1, batch_size=4
    )
    assert torch.equal(torch.get_rng_state(), cpu)
    assert fake_cuda["state"] == "the caller's"


def test_subset_training_casts_numpy_floats_and_names_tensors_of_another_dtype():
    """numpy float64 x for a float32 model failed in torch ("expected scalar type Double but found
    Float"), in training and in `outputs`; it is cast like every other entry point casts it, and a
    float64 tensor gets the library's refusal naming x and the dtypes."""
    from ntk.core.model import ModelInputError

    x, y = np.random.default_rng(0).normal(size=(12, 4)), np.arange(12) % 3
    subsets = random_subsets(12, 3)
    models = train_on_subsets(lambda: torch.nn.Linear(4, 3), x, y, subsets, epochs=1)
    cast = train_on_subsets(
        lambda: torch.nn.Linear(4, 3), torch.as_tensor(x).float(), y, subsets, epochs=1
    )
    torch.testing.assert_close(models.outputs(x), cast.outputs(x.astype(np.float32)))
    assert models.outputs(x).dtype == torch.float32
    with pytest.raises(ModelInputError, match=r"^x: .*dtype torch.float64.*cast the inputs to"):
        train_on_subsets(lambda: torch.nn.Linear(4, 3), torch.as_tensor(x), y, subsets, epochs=1)
    with pytest.raises(ModelInputError, match=r"^x: .*dtype torch.float64.*cast the inputs to"):
        models.outputs(torch.as_tensor(x))


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_train_on_subsets_trains_only_the_parameters_the_factory_leaves_trainable():
    """Every stacked parameter was made trainable: a layer the factory froze was trained."""

    def factory():
        net = _mlp()
        net[0].requires_grad_(False)
        return net

    x, y = torch.randn(16, 4), torch.arange(16) % 3
    stack = train_on_subsets(factory, x, y, random_subsets(16, 3), epochs=2, batch_size=4)
    torch.manual_seed(0)  # model (s, 0) is built under seed 0
    init = factory()
    for j in range(3):
        torch.testing.assert_close(stack.params["0.weight"][j], init[0].weight, rtol=0, atol=0)
        assert not torch.equal(stack.params["2.weight"][j], init[2].weight)


def test_train_on_subsets_leaves_a_module_its_factory_hands_out_as_it_was():
    """A factory returning one shared module (lambda: net): the probe put it in eval mode."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 3))
    net.train()
    before = copy.deepcopy(net.state_dict())
    x, y = torch.randn(16, 4), torch.arange(16) % 3
    train_on_subsets(lambda: net, x, y, random_subsets(16, 3), epochs=1, batch_size=4)
    assert all(m.training for m in net.modules())
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert all(p.requires_grad for p in net.parameters())


def test_train_on_subsets_refuses_a_bad_factory_lr_or_output_fn():
    """lr=inf trained every model to NaN silently; lr="a", output_fn="logits", a factory
    returning 3 and a module in place of a factory failed with raw TypeErrors or
    AttributeErrors."""
    x, y, subsets = torch.randn(12, 4), torch.arange(12) % 3, random_subsets(12, 3)
    for lr in (float("inf"), "a", 0):
        with pytest.raises(ValueError, match="^lr must be a positive finite number"):
            train_on_subsets(_mlp, x, y, subsets, epochs=1, lr=lr)
    with pytest.raises(TypeError, match="^output_fn must be a function"):
        train_on_subsets(_mlp, x, y, subsets, epochs=1, output_fn="logits")
    with pytest.raises(TypeError, match="^the factory returned a int, not an nn.Module"):
        train_on_subsets(lambda: 3, x, y, subsets, epochs=1)
    with pytest.raises(TypeError, match="^factory must be a function that builds a new nn.Module"):
        train_on_subsets(_mlp(), x, y, subsets, epochs=1)
    with pytest.raises(ValueError, match="^the factory raised TypeError: .*in_features"):
        train_on_subsets(torch.nn.Linear, x, y, subsets, epochs=1)


def test_metrics_refuse_no_samples_and_strings_naming_the_argument():
    """No samples gave an ECE of nan, empty reliability bins and sklearn's "Found array with 0
    sample(s)"; strings failed in numpy ("could not convert string to float")."""
    empty, none = torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)
    for metric in (reliability, expected_calibration_error, calibration_metrics):
        with pytest.raises(ValueError, match="^probs holds no samples"):
            metric(empty, none)
        with pytest.raises(TypeError, match="^probs must hold numbers"):
            metric([["a", "b"]], [0])
    with pytest.raises(TypeError, match=r"^self_influence must hold numbers, got str32 .*\['a'\]"):
        mislabel_auc(["a"] * 4, [0, 1, 0, 1])
    with pytest.raises(TypeError, match="^scores must hold numbers"):
        lds([["a"] * 4], random_subsets(4, 3), torch.zeros(3, 1))
