"""ntk.proxies: every metric against a direct computation written here, ranking, errors, safety."""

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from ntk import proxies

N, D, O = 12, 5, 3


def tiny(seed=0, bias=True, width=6):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, width, bias=bias), nn.ReLU(), nn.Linear(width, O, bias=bias))


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, D, generator=g), torch.arange(N) % O


def sum_logit_grads(model, x):
    """G [N, P]: per-sample gradients of Σ_o f_o(x) / √O, one autograd call per sample."""
    params = list(model.parameters())
    rows = []
    for i in range(len(x)):
        out = model(x[i : i + 1]).sum() / math.sqrt(O)
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(out, params)]))
    return torch.stack(rows).double().numpy()


def run(model, x, y, metric, **kw):
    """Score on the whole data set (the batch is all of it, in a random order)."""
    return proxies.score(model, x, y, metric=metric, batch_size=len(x), **kw)


def test_kernel_metrics_match_a_direct_computation(data):
    x, y = data
    model = tiny().eval()
    g = sum_logit_grads(model, x)
    k = g @ g.T
    labels = np.where(y.numpy()[:, None] == y.numpy()[None, :], 1.0, -1.0)
    ev = np.linalg.eigvalsh(k)
    assert run(model, x, y, "lga") == pytest.approx(
        np.corrcoef(k.ravel(), labels.ravel())[0, 1], abs=1e-5
    )
    assert run(model, x, y, "condition_number") == pytest.approx(
        -math.log(ev[-1] / ev[0]), rel=1e-3
    )
    assert run(model, x, y, "trace") == pytest.approx(np.trace(k), rel=1e-5)
    assert run(model, x, y, "frobenius") == pytest.approx(np.linalg.norm(k), rel=1e-5)
    assert run(model, x, y, "mean") == pytest.approx(k.mean(), rel=1e-5)
    details = run(model, x, y, "condition_number", return_details=True)
    assert details.raw[0] == pytest.approx(ev[-1] / ev[0], rel=1e-3)


def test_trace_kind_is_the_sum_of_per_output_kernels(data):
    x, y = data
    model = tiny().eval()
    params = list(model.parameters())
    k = np.zeros((N, N))
    for o in range(O):
        rows = [
            torch.cat(
                [g.reshape(-1) for g in torch.autograd.grad(model(x[i : i + 1])[0, o], params)]
            )
            for i in range(N)
        ]
        go = torch.stack(rows).double().numpy()
        k += go @ go.T
    assert run(model, x, y, "trace", kind="trace") == pytest.approx(np.trace(k), rel=1e-5)


def test_gradient_baselines_match_a_direct_computation(data):
    x, y = data
    model = tiny()
    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected_norm = sum(float(g.norm()) for g in grads)
    expected_snip = sum(
        float((p.detach() * g).abs().sum()) for p, g in zip(model.parameters(), grads)
    )
    assert run(model, x, y, "grad_norm") == pytest.approx(expected_norm, rel=1e-5)
    assert run(model, x, y, "snip") == pytest.approx(expected_snip, rel=1e-5)
    assert run(model, x, y, "params") == sum(p.numel() for p in model.parameters())


def test_synflow_of_a_bias_free_relu_net_is_depth_times_the_path_norm(data):
    """With |W| and an all-ones input every ReLU is open, R = 1ᵀ|W2||W1|1 and each layer's
    Σ|θ ⊙ ∂R/∂θ| equals R, so synflow = 2R."""
    x, y = data
    model = tiny(bias=False)
    w1, w2 = (m.weight.detach().double().abs() for m in (model[0], model[2]))
    path = float(torch.ones(O, dtype=torch.float64) @ w2 @ w1 @ torch.ones(D, dtype=torch.float64))
    assert run(model, x, y, "synflow") == pytest.approx(2 * path, rel=1e-9)


def test_jacob_cov_matches_a_direct_computation(data):
    x, y = data
    model = tiny().eval()
    jac = np.stack(
        [
            torch.autograd.functional.jacobian(lambda v: model(v[None]).sum(), x[i]).numpy()
            for i in range(N)
        ]
    )
    v = np.linalg.eigvals(np.corrcoef(jac)).real
    expected = -np.sum(np.log(v + 1e-5) + 1 / (v + 1e-5))
    assert run(model, x, y, "jacob_cov") == pytest.approx(expected, rel=1e-4)


def test_naswot_matches_the_hamming_kernel(data):
    x, y = data
    model = tiny(width=40).eval()
    codes = (model[0](x) > 0).numpy().astype(int)
    hamming = (codes[:, None, :] != codes[None, :, :]).sum(-1)
    expected = np.linalg.slogdet(codes.shape[1] - hamming)[1]
    assert run(model, x, y, "naswot") == pytest.approx(expected, rel=1e-6)


class PaddedTokens(nn.Module):
    """Token ids through an embedding and a ReLU layer, mean-pooled over the attention mask, as
    a HuggingFace encoder is called: model(input_ids=..., attention_mask=...)."""

    def __init__(self, vocab=7, width=16):
        super().__init__()
        self.embed, self.hidden = nn.Embedding(vocab, 4), nn.Linear(4, width)
        self.act, self.head = nn.ReLU(), nn.Linear(width, O)

    def forward(self, input_ids, attention_mask):
        h = self.act(self.hidden(self.embed(input_ids)))  # [B, L, width]
        m = attention_mask.unsqueeze(-1).float()
        return self.head((h * m).sum(1) / m.sum(1))


def test_naswot_does_not_count_padding_positions():
    """The patterns at padding positions are whatever the padding token gives: they made samples
    agree (or not) on units that belong to no token. With an attention_mask, two samples are
    compared on the positions both hold."""
    torch.manual_seed(0)
    model = PaddedTokens().eval()
    n, length = 10, 6
    ids = torch.randint(1, 7, (n, length))
    mask = (torch.arange(length) < torch.randint(2, length + 1, (n, 1))).long()
    padded = {"input_ids": ids * mask, "attention_mask": mask}  # padding token 0
    refilled = {"input_ids": torch.where(mask == 1, ids, 6 - ids), "attention_mask": mask}

    def score(x):
        return proxies.score(model, x, None, metric="naswot", batch_size=n, repeats=1)

    with torch.no_grad():
        codes = (model.hidden(model.embed(padded["input_ids"])) > 0).double()
    both = mask[:, None, :] * mask[None, :, :]  # [n, n, L]: the positions two samples hold
    agree = (codes[:, None] == codes[None, :]).double().sum(-1)  # [n, n, L]
    expected = np.linalg.slogdet((agree * both).sum(-1).numpy())[1]
    assert score(padded) == pytest.approx(expected, rel=1e-9)
    assert score(refilled) == pytest.approx(expected, rel=1e-9)


def test_a_compiled_model_scores_as_the_model_it_compiles(data):
    """Hooks put on the submodules of a torch.compile wrapper that has run are never called:
    naswot saw no activation and scored −inf, ranking the compiled candidate last."""
    x, y = data
    model = tiny(width=40).eval()
    compiled = torch.compile(model, backend="eager")
    compiled(x)  # compiled before it is scored, as a user's model would be
    for metric in ("naswot", "label_condition"):
        assert run(compiled, x, y, metric) == pytest.approx(run(model, x, y, metric), rel=1e-9)


def test_repeats_report_mean_and_spread_reproducibly(data):
    x, y = data
    factory = lambda: tiny(seed=99)  # noqa: E731 - the seed is overridden per repeat
    a = proxies.score(
        lambda: nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, O)),
        x,
        y,
        metric="lga",
        batch_size=8,
        repeats=3,
        return_details=True,
    )
    b = proxies.score(
        lambda: nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, O)),
        x,
        y,
        metric="lga",
        batch_size=8,
        repeats=3,
        return_details=True,
    )
    assert len(a.values) == 3 and a.values == b.values
    assert a.value == pytest.approx(np.mean(a.values)) and a.std == pytest.approx(np.std(a.values))
    assert a.std > 0
    assert isinstance(proxies.score(factory, x, y), float)


def test_the_model_is_never_modified_and_warm_up_changes_the_score(data):
    x, y = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, O))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cold = run(model, x, y, "lga")
    warm = run(model, x, y, "lga", warmup_steps=5, warmup_lr=0.05)
    run(model, x, y, "synflow")
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert warm != pytest.approx(cold, abs=1e-4)


def test_a_factory_handing_out_the_callers_module_leaves_it_unchanged(data):
    """A factory's module was scored in place: `lambda: model` left the caller's model in eval
    mode, with its BatchNorm statistics calibrated, warmed-up weights, and after synflow in
    float64 with every weight replaced by its absolute value."""
    x, y = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, O))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for metric in ("synflow", "lga"):
        run(lambda: model, x, y, metric, warmup_steps=2)
    proxies.rank({"held": lambda: model}, x, y)
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_dropout_in_warm_up_and_calibration_follows_seed_not_the_global_random_state(data):
    """The training-mode passes (warm-up steps, the calibration of fresh BatchNorm layers) drew
    their dropout masks from the caller's global random state: the score changed with it, not
    with `seed`, and the caller's random stream moved."""
    x, y = data

    def factory():
        return nn.Sequential(
            nn.Linear(D, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, O)
        )

    scores = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        scores.append(run(factory, x, y, "lga", warmup_steps=2))
        after = torch.rand(3)
        torch.manual_seed(global_seed)
        assert torch.equal(after, torch.rand(3))
    assert scores[0] == scores[1]


def test_a_pruned_model_is_copied_and_left_unchanged(data):
    """torch.nn.utils.prune keeps the masked weight as a tensor computed from weight_orig, which
    copy.deepcopy refuses; the private copy recomputes it in its warm-up steps."""
    x, y = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, O))
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert math.isfinite(run(model, x, y, "lga", warmup_steps=3, warmup_lr=0.05))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_fresh_batchnorm_uses_the_batch_statistics(data):
    """An untrained BatchNorm is scored as in training mode: the activation patterns (signs
    after normalisation, which the variance estimate does not change) are the batch's."""
    x, y = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 40), nn.BatchNorm1d(40), nn.ReLU(), nn.Linear(40, O))
    with torch.no_grad():
        model[0].bias += 3.0  # far from the default running mean 0
        codes = (copy.deepcopy(model).train()[:2](x) > 0).numpy().astype(int)
    hamming = (codes[:, None, :] != codes[None, :, :]).sum(-1)
    expected = np.linalg.slogdet(codes.shape[1] - hamming)[1]
    assert run(model, x, y, "naswot") == pytest.approx(expected, rel=1e-6)


def test_fresh_batchnorm_normalises_by_the_batch_variance_as_training_mode(data):
    """The calibrated running variance was torch's unbiased one, while training mode divides by
    the biased one: on a batch of 12 the normalised activations were √(11/12) = 0.957 of the
    training-mode ones. Scored like a model holding the batch's biased statistics."""
    x, y = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, O))
    loaded = copy.deepcopy(model)
    with torch.no_grad():
        h = model[0](x)
        loaded[1].running_mean.copy_(h.mean(0))
        loaded[1].running_var.copy_(h.var(0, unbiased=False))
    loaded[1].num_batches_tracked.fill_(1)
    for metric in ("grad_norm", "jacob_cov"):
        got, expected = run(model, x, y, metric), run(loaded.eval(), x, y, metric)
        assert got == pytest.approx(expected, rel=1e-5), metric


def test_batchnorm_statistics_loaded_without_a_batch_count_are_kept(data):
    """Statistics loaded from a checkpoint that does not count batches (num_batches_tracked
    stays 0: torch's loading of old checkpoints, weights converted from other frameworks) were
    replaced by the scored batch's, so a trained model was scored as another function."""
    x, y = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 40), nn.BatchNorm1d(40), nn.ReLU(), nn.Linear(40, O))
    with torch.no_grad():
        model[1].running_mean.fill_(0.5)
        model[1].running_var.fill_(2.0)
    counted = copy.deepcopy(model)
    counted[1].num_batches_tracked.fill_(100)
    for metric in ("naswot", "lga"):
        assert run(model.eval(), x, y, metric) == run(counted.eval(), x, y, metric)


def test_fresh_batchnorm_is_calibrated_without_dropout_whatever_the_candidates_mode(data):
    """The calibration pass of a fresh BatchNorm ran the rest of the candidate in the mode it
    came in: a module in training mode (every factory's) had dropout before the BatchNorm, so
    its statistics, and the score, differed from the same module's in eval mode (grad_norm
    1.28 vs 2.10 on a batch of 64)."""
    x, y = data
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(D, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, O)
    )
    for metric in ("grad_norm", "naswot", "lga"):
        assert run(model.train(), x, y, metric) == run(model.eval(), x, y, metric), metric


def test_rank_orders_best_first_and_matches_score(data):
    x, y = data
    widths = {"w2": 2, "w16": 16, "w4": 4}
    candidates = {name: (lambda w=w: tiny(width=w)) for name, w in widths.items()}
    assert [n for n, _ in proxies.rank(candidates, x, y, metric="params")] == ["w16", "w4", "w2"]
    ranked = proxies.rank(candidates, x, y, metric="lga", batch_size=8)
    values = [s for _, s in ranked]
    assert values == sorted(values, reverse=True)
    for name, value in ranked:  # rank averages RANKING_REPEATS repeats, score DEFAULT_REPEATS
        same = proxies.score(
            candidates[name], x, y, metric="lga", batch_size=8, repeats=proxies.RANKING_REPEATS
        )
        assert value == same
    modules = proxies.rank(
        {"a": tiny(width=3), "b": tiny(width=9)}, x, y, metric="params", return_details=True
    )
    assert modules[0][0] == "b" and modules[0][1].metric == "params"


def test_score_and_rank_average_their_default_numbers_of_repeats(data):
    x, y = data
    one = proxies.score(tiny, x, y, metric="lga", batch_size=8, return_details=True)
    assert len(one.values) == proxies.DEFAULT_REPEATS
    [(_, ranked)] = proxies.rank({"a": tiny}, x, y, metric="lga", batch_size=8, return_details=True)
    assert len(ranked.values) == proxies.RANKING_REPEATS
    [(_, asked)] = proxies.rank(
        {"a": tiny}, x, y, metric="lga", batch_size=8, repeats=3, return_details=True
    )
    assert len(asked.values) == 3


def test_the_first_repeats_of_a_longer_run_score_like_a_shorter_run(data):
    """benchmarks/nas/repeats.py chooses the number of repeats from each repeat's value of one
    4-repeat run, reading the mean of the first r as `score(..., repeats=r)`."""
    x, y = data
    four = proxies.score(tiny, x, y, metric="lga", batch_size=8, repeats=4, return_details=True)
    assert len(set(four.values)) == 4  # each repeat its own initialisation and batch
    for r in (1, 2, 3):
        shorter = proxies.score(tiny, x, y, metric="lga", batch_size=8, repeats=r)
        assert shorter == pytest.approx(np.mean(four.values[:r]), rel=1e-12)


def test_clear_errors(data):
    x, y = data
    with pytest.raises(ValueError, match="empty"):
        proxies.rank({}, x, y)

    def broken():
        raise ZeroDivisionError("no luck")

    with pytest.raises(ValueError, match="candidate 'bad': the factory raised ZeroDivisionError"):
        proxies.rank({"good": tiny, "bad": broken}, x, y, metric="params")
    with pytest.raises(TypeError, match="candidate 'num'"):
        proxies.rank({"num": 3}, x, y)
    # data no candidate can use is refused before any candidate is built, and blamed on none
    built = []
    counted = {"a": lambda: built.append(1) or tiny()}
    with pytest.raises(ValueError, match="^y is missing: metric 'lga' needs class labels"):
        proxies.rank(counted, x, None, metric=["naswot", "lga"])
    with pytest.raises(ValueError, match="^x must hold at least 2 samples"):
        proxies.rank(counted, x[:1], y[:1], metric="naswot")
    assert not built
    with pytest.raises(ValueError, match="12 samples but y has 5"):
        proxies.score(tiny(), x, y[:5])
    with pytest.raises(ValueError, match="integer class labels, got 0.5 at sample 0"):
        proxies.score(tiny(), x, y + 0.5)
    with pytest.raises(ValueError, match="needs class labels"):
        proxies.score(tiny(), x, None, metric="lga")
    with pytest.raises(ValueError, match=r"y holds labels outside 0\.\.2: 3 at sample 2"):
        proxies.score(tiny(), x, y + 1, metric="grad_norm")
    with pytest.raises(ValueError, match="unknown metric"):
        proxies.score(tiny(), x, y, metric="accuracy")
    with pytest.raises(ValueError, match="candidate 'narrow': x: the model failed"):
        proxies.rank({"narrow": tiny}, torch.randn(N, D + 2), y, metric="lga")


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"batch_size": 1}, ValueError, "batch_size must be an integer ≥ 2, got 1"),
        ({"kind": "sum_logit"}, ValueError, "unknown kind 'sum_logit'"),
        ({"metric": "lga", "kind": "full"}, ValueError, r"metric 'lga' needs an \[N, N\] kernel"),
        ({"repeats": 0}, ValueError, "repeats must be a positive integer, got 0"),
        ({"seed": 0.5}, ValueError, "seed must be an integer, got 0.5"),
        ({"warmup_steps": 1, "warmup_lr": -1.0}, ValueError, "warmup_lr must be a positive"),
        (  # rank's own options are listed with score's (only score's were)
            {"batchsize": 8},
            TypeError,
            r"rank\(\) got unknown options batchsize; its options are metric, batch_size, progress",
        ),
        ({"output_fn": "logits"}, TypeError, "output_fn must be a function"),
        (  # a vote weighed it double
            {"metric": ["naswot", "params", "naswot"]},
            ValueError,
            "metric names naswot more than once",
        ),
    ],
)
def test_rank_checks_its_options_before_any_candidate(data, options, error, message):
    """Options no candidate can be scored with were blamed on the first candidate ("candidate
    'a': batch_size must be ...", "candidate 'a': score() got an unexpected keyword argument",
    torch's "manual_seed expected a long" for seed=0.5, Adam's "Invalid learning rate") after
    building it; they are refused first, as score refuses them."""
    x, y = data
    built = []
    with pytest.raises(error, match=f"^{message}"):
        proxies.rank({"a": lambda: built.append(1) or tiny()}, x, y, **options)
    assert not built
    if "batchsize" not in options and not isinstance(options.get("metric"), list):  # rank's own
        with pytest.raises(error, match=f"^{message}"):
            proxies.score(tiny(), x, y, **options)


LABEL_METRICS = "lga lga_cosine lga_centred label_condition descent grad_norm snip".split()


@pytest.mark.parametrize(
    "metric, options",
    [(m, {}) for m in LABEL_METRICS]
    + [("condition_number", {"kind": "lpntk"}), ("trace", {"warmup_steps": 1})],
)
def test_labels_outside_the_outputs_are_refused_naming_y(data, metric, options):
    """Every metric reading y (lga silently scored labels ≥ O) refuses labels that do not index
    the model's O outputs, naming y, the first offending label and the range; integral floats
    are labels."""
    x, y = data
    bad = y.clone()
    bad[4] = O
    with pytest.raises(ValueError, match=r"^y holds labels outside 0\.\.2: 3 at sample 4 \("):
        run(tiny(), x, bad, metric, **options)
    bad[4] = -1
    with pytest.raises(ValueError, match=r"^y holds a negative label: -1 at sample 4"):
        run(tiny(), x, bad, metric, **options)
    fractional = y.double()
    fractional[4] = 1.5
    with pytest.raises(
        ValueError, match=r"^y must hold integer class labels, got 1\.5 at sample 4"
    ):
        run(tiny(), x, fractional, metric, **options)
    assert run(tiny(), x, y.double(), metric, **options) == run(tiny(), x, y, metric, **options)
    with pytest.raises(
        ValueError, match=r"candidate 'a': y holds labels outside 0\.\.2: 3 at sample 0"
    ):
        proxies.rank({"a": tiny}, x, y + 3, metric=[metric, "params"], batch_size=N, **options)


@pytest.mark.parametrize("metric", ["naswot", "params", "trace", "condition_number", "synflow"])
def test_metrics_that_never_read_labels_ignore_any_y(data, metric):
    """Regression targets were refused ("y must hold integer class labels") by metrics that do
    not read y; they are ignored, while a vote with a metric reading y still refuses them."""
    x, y = data
    targets = torch.randn(N, generator=torch.Generator().manual_seed(2))
    assert run(tiny(), x, targets, metric) == run(tiny(), x, None, metric)
    run(tiny(), x, y + O, metric)  # labels outside the outputs: not read, not refused
    run(tiny(), x, targets, "params", kind="lpntk")  # the kind is that of the kernel metrics
    with pytest.raises(ValueError, match="^y must hold integer class labels, got"):
        proxies.rank({"a": tiny}, x, targets, metric=[metric, "lga"], batch_size=N)


def test_a_binary_classifier_with_one_logit_takes_labels_0_and_1(data):
    """A single output is a binary classifier's logit: lga compares labels 0 and 1 (it reads
    only their agreement); a label 2 is refused naming y."""
    x, y = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1))
    binary = (y > 0).long()
    value = proxies.score(model, x, binary, metric="lga", batch_size=N)
    assert math.isfinite(value)
    with pytest.raises(ValueError, match=r"^y holds labels outside 0\.\.1: 2 at sample"):
        proxies.score(model, x, y, metric="lga", batch_size=N)


class TwoLogits(nn.Module):
    """The two-class scores (0, z) of a binary classifier with one logit z; `flat`: z as [B]."""

    def __init__(self, model, flat=False):
        super().__init__()
        self.model, self.flat = model, flat

    def forward(self, x):
        z = self.model(x)
        return z[:, 0] if self.flat else torch.cat([torch.zeros_like(z), z], 1)


def test_the_defaults_score_and_rank_a_binary_classifier_with_one_logit(data):
    """The default metric (lpNTK κ) refused a one-logit classifier ("at least two outputs"), so
    `rank` with its defaults failed on such a space; its lpNTK is that of the class scores
    (0, z), so the default score equals the two-score model's."""
    x, y = data
    binary = (y > 0).long()

    def net():
        return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1))

    one = proxies.score(net, x, binary, batch_size=N)
    assert math.isfinite(one)
    assert one == pytest.approx(proxies.score(lambda: TwoLogits(net()), x, binary, batch_size=N))
    ranked = proxies.rank({"a": net, "b": lambda: TwoLogits(net())}, x, binary, batch_size=N)
    assert sorted(name for name, _ in ranked) == ["a", "b"]


def test_the_loss_of_a_binary_classifier_with_one_logit_is_its_cross_entropy(data):
    """grad_norm, snip and warm-up took the logit z [B, 1] as the scores of one class and failed
    in torch's cross_entropy ("Target 1 is out of bounds"; z as [B]: refused) though y was
    checked as the 0/1 labels of a binary classifier. Its loss is now the binary cross-entropy,
    the cross-entropy of the scores (0, z)."""
    x, y = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1))
    binary = (y > 0).long()
    for metric, options in (("grad_norm", {}), ("snip", {}), ("lga", {"warmup_steps": 3})):
        expected = run(TwoLogits(model), x, binary, metric, **options)
        assert run(model, x, binary, metric, **options) == pytest.approx(expected, rel=1e-5)
        flat = run(TwoLogits(model, flat=True), x, binary, metric, **options)
        assert flat == pytest.approx(expected, rel=1e-5)


def test_a_vote_orders_by_the_mean_rank_over_metrics(data):
    x, y = data
    assert proxies.mean_rank([[3.0, 1.0, 2.0], [1.0, float("nan"), 5.0]]).tolist() == [
        2.5,
        1.0,
        2.5,
    ]
    candidates = {f"w{w}": (lambda w=w: tiny(width=w)) for w in (2, 5, 16)}
    metrics = ("params", "lga")
    singles = {m: dict(proxies.rank(candidates, x, y, metric=m, batch_size=8)) for m in metrics}
    names = list(candidates)
    expected = proxies.mean_rank([[singles[m][n] for n in names] for m in metrics])
    ranked = proxies.rank(candidates, x, y, metric=metrics, batch_size=8, return_details=True)
    assert [v.value for _, v in ranked] == sorted(expected.tolist(), reverse=True)
    for name, details in ranked:
        assert details.value == expected[names.index(name)]
        assert {m: p.value for m, p in details.parts.items()} == {
            m: singles[m][name] for m in metrics
        }
    with pytest.raises(ValueError, match="unknown metric"):
        proxies.rank(candidates, x, y, metric=("lga", "accuracy"))


def test_mean_rank_refuses_columns_that_are_not_aligned_sequences():
    """mean_rank([0.3, 0.1, 0.2]), one metric's scores passed as they are, ranked three
    columns of one candidate each: [1.0], silently; columns of different lengths failed in
    numpy ("inhomogeneous shape"), no column at all gave NaN with a warning."""
    with pytest.raises(ValueError, match=r"one sequence of scores per metric.*shapes \[\(\), "):
        proxies.mean_rank([0.3, 0.1, 0.2])
    with pytest.raises(ValueError, match=r"different numbers of candidates: \[3, 2\]"):
        proxies.mean_rank([[0.3, 0.1, 0.2], [1.0, 2.0]])
    with pytest.raises(ValueError, match="got none"):
        proxies.mean_rank([])
    assert proxies.mean_rank([[0.3, 0.1, 0.2]]).tolist() == [3.0, 1.0, 2.0]


def test_normalised_and_per_layer_kernel_metrics_match_a_direct_computation(data):
    x, y = data
    model = tiny().eval()
    g = sum_logit_grads(model, x)
    k = g @ g.T
    labels = np.where(y.numpy()[:, None] == y.numpy()[None, :], 1.0, -1.0)
    d = np.sqrt(np.diag(k))
    cosine = k / d[:, None] / d[None, :]
    assert run(model, x, y, "lga_cosine") == pytest.approx(
        np.corrcoef(cosine.ravel(), labels.ravel())[0, 1], abs=1e-5
    )
    h = np.eye(N) - 1.0 / N
    kc, lc = h @ k @ h, h @ labels @ h
    assert run(model, x, y, "lga_centred") == pytest.approx(
        (kc * lc).sum() / np.linalg.norm(kc) / np.linalg.norm(lc), abs=1e-5
    )
    first = sum(p.numel() for p in model[0].parameters())
    # Linear 2's sum-of-logits kernel has rank ≤ 7 < N: singular, so only Linear 1 counts
    assert np.linalg.matrix_rank(g[:, first:]) < N
    ev = np.linalg.eigvalsh(g[:, :first] @ g[:, :first].T)
    assert run(model, x, y, "layer_condition") == pytest.approx(-math.log(ev[-1] / ev[0]), rel=1e-3)


def test_layer_condition_is_nan_when_every_layer_kernel_is_singular(data):
    x, y = data
    torch.manual_seed(0)
    linear = nn.Linear(D, O)  # sum-of-logits kernel rank ≤ D + 1 < N
    assert math.isnan(run(linear, x, y, "layer_condition"))


def test_label_condition_is_the_condition_of_the_labelled_kernel(data):
    """−log κ of the lpNTK s(y_i)ᵀ J_i J_jᵀ s(y_j), s(y) = 2e_y − 1, from per-sample Jacobians
    written here; kind="lpntk" gives every kernel metric that kernel."""
    x, y = data
    model = tiny().eval()
    signs = 2.0 * torch.nn.functional.one_hot(y, O).double() - 1.0
    rows = []
    for i in range(N):
        out = (model(x[i : i + 1])[0].double() * signs[i]).sum()
        grads = torch.autograd.grad(out, list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    g = torch.stack(rows).numpy()
    k = g @ g.T
    ev = np.linalg.eigvalsh(k)
    labels = np.where(y.numpy()[:, None] == y.numpy()[None, :], 1.0, -1.0)
    expected = -math.log(ev[-1] / ev[0])
    assert run(model, x, y, "label_condition") == pytest.approx(expected, rel=1e-3)
    assert run(model, x, y, "label_condition", kind="trace") == pytest.approx(expected, rel=1e-3)
    assert run(model, x, y, "condition_number", kind="lpntk") == pytest.approx(expected, rel=1e-3)
    assert run(model, x, y, "lga", kind="lpntk") == pytest.approx(
        np.corrcoef(k.ravel(), labels.ravel())[0, 1], abs=1e-5
    )
    with pytest.raises(ValueError, match="needs class labels"):
        proxies.score(model, x, None)  # the default metric reads the labels
    with pytest.raises(ValueError, match="on kind 'lpntk' needs class labels"):
        proxies.score(model, x, None, metric="condition_number", kind="lpntk")


def test_descent_is_the_label_residual_of_gradient_descent_on_the_direct_kernel(data):
    """−log of ‖f_T − Y‖² / ‖Y‖² after T = DESCENT_STEPS steps f ← f − K (f − Y) / λmax from
    f = 0, with K the sum-of-logits kernel from per-sample gradients and Y the centred one-hot
    labels, iterated here step by step."""
    x, y = data
    model = tiny().eval()
    g = torch.from_numpy(sum_logit_grads(model, x))
    k = g @ g.T
    targets = torch.nn.functional.one_hot(y, O).double()
    targets = targets - targets.mean(0)
    f = torch.zeros_like(targets)
    step = 1.0 / torch.linalg.eigvalsh(k)[-1]
    for _ in range(proxies.DESCENT_STEPS):
        f = f - step * (k @ (f - targets))
    share = float((f - targets).square().sum() / targets.square().sum())
    details = run(model, x, y, "descent", return_details=True)
    assert details.raw[0] == pytest.approx(share, rel=1e-3)
    assert details.value == pytest.approx(-math.log(share), rel=1e-3)
    with pytest.raises(ValueError, match="needs class labels"):
        proxies.score(model, x, None, metric="descent")


def test_float_input_metrics_are_exactly_those_refusing_token_ids():
    """FLOAT_INPUT_METRICS (kept out of the defaults) names every metric that cannot score a
    model fed token ids, and no other."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4), nn.Flatten(), nn.ReLU(), nn.Linear(20, 3))
    x = torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(1))
    y = torch.arange(8) % 3
    refusing = set()
    for metric in proxies.METRICS:
        try:
            proxies.score(model, x, y, metric=metric, batch_size=8)
        except ValueError as error:
            assert "floating-point input tensor" in str(error), metric
            refusing.add(metric)
    assert refusing == set(proxies.FLOAT_INPUT_METRICS)


class FunctionalRelu(nn.Module):
    """Activations as functions (torch.relu), as nn.TransformerEncoderLayer and many user models
    write them: naswot cannot observe them."""

    def __init__(self, width):
        super().__init__()
        self.a, self.b = nn.Linear(D, width), nn.Linear(width, O)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_vote_leaves_out_a_metric_undefined_for_a_candidate(data):
    """The default vote ranks models with functional activations by its other member (with a
    warning naming the candidate); the metric alone still refuses them."""
    x, y = data
    candidates = {"modules": lambda: tiny(width=5), "functional": lambda: FunctionalRelu(7)}
    with pytest.warns(proxies.VoteMemberDroppedWarning, match="naswot.*'functional'"):
        ranked = proxies.rank(candidates, x, y, return_details=True)
    alone = dict(proxies.rank(candidates, x, y, metric="label_condition"))
    assert {name: s.value for name, s in ranked} == alone
    assert all(s.metric == "label_condition" and s.parts is None for _, s in ranked)
    with pytest.raises(proxies.MetricUndefinedError, match="'functional'.*activation modules"):
        proxies.rank(candidates, x, y, metric="naswot")


class Tokens(nn.Module):
    """A per-token MLP over [B, S, D] sequences, mean-pooled; `layout` is how its activation sees
    the tokens: "batch" [B, S, H], "flat" [B·S, H] (batch-major), "sequence" [S, B, H]."""

    def __init__(self, layout):
        super().__init__()
        self.layout, self.a, self.act, self.b = layout, nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, O)

    def forward(self, x):
        h = self.a(x)
        if self.layout == "flat":
            h = self.act(h.reshape(-1, h.shape[-1])).reshape(h.shape)
        elif self.layout == "sequence":
            h = self.act(h.transpose(0, 1)).transpose(0, 1)
        else:
            h = self.act(h)
        return self.b(h).mean(1)


def test_naswot_refuses_activations_that_do_not_hold_the_samples_first(data):
    """An activation that sees [S, B, H] (sequence-first) had its input reshaped to [B, S·H]
    rows that mix samples: the same function scored differently from its batch-first twin,
    silently. It is refused (a vote leaves naswot out); batch-major layouts score alike."""
    _, y = data
    x = torch.randn(N, 4, D, generator=torch.Generator().manual_seed(2))
    nets = {}
    for layout in ("batch", "flat", "sequence"):
        torch.manual_seed(0)
        nets[layout] = Tokens(layout).eval()
    assert run(nets["flat"], x, y, "naswot") == run(nets["batch"], x, y, "naswot")
    with pytest.raises(proxies.MetricUndefinedError, match="'act' .*shape \\(4, 12, 8\\)"):
        run(nets["sequence"], x, y, "naswot")
    with pytest.warns(proxies.VoteMemberDroppedWarning, match="'sequence'"):
        proxies.rank(nets, x, y)


def test_layers_take_all_or_names_never_the_characters_of_a_string(data):
    """A string was split into its characters: layers="02" scored layers '0' and '2' (all of
    them) and layers="all" failed on unknown layers 'a', 'l', 'l'; a generator of names was
    used up by the first repeat."""
    x, y = data
    model = tiny().eval()
    whole = run(model, x, y, "lga")
    assert run(model, x, y, "lga", layers="all") == pytest.approx(whole, rel=1e-6)
    assert run(model, x, y, "layer_condition", layers="all") == run(model, x, y, "layer_condition")
    with pytest.raises(ValueError, match="layers must be None, 'all' or a list of module names"):
        run(model, x, y, "lga", layers="02")
    first = run(model, x, y, "lga", layers=["0"], repeats=2)
    assert run(model, x, y, "lga", layers=(n for n in ["0"]), repeats=2) == first
    ranked = proxies.rank({"a": model, "b": tiny(1)}, x, y, metric="lga", layers=iter(["0"]))
    assert dict(ranked)["b"] == run(
        tiny(1), x, y, "lga", layers=["0"], repeats=proxies.RANKING_REPEATS
    )


class Unused(nn.Module):
    """Outputs that depend on the inputs only (on="x") or on the parameters only (on="params")."""

    def __init__(self, on):
        super().__init__()
        self.on, self.a, self.bias = on, nn.Linear(D, O), nn.Parameter(torch.ones(O))

    def forward(self, x):
        return x[:, :O].relu() if self.on == "x" else self.bias.expand(len(x), O) * 1.0


def test_gradient_metrics_of_outputs_that_do_not_depend_on_what_they_differentiate(data):
    """grad_norm, snip and synflow of an output that depends on no trainable parameter are 0 (a
    RuntimeError from torch, "element 0 of tensors does not require grad"), of a model without
    trainable parameters a ValueError saying so ("`inputs` argument to `grad()` cannot be
    empty"); jacob_cov of an output that ignores x is NaN, as for any constant Jacobian row."""
    x, y = data
    for metric in ("grad_norm", "snip", "synflow"):
        assert run(Unused("x"), x, y, metric) == 0.0
        frozen = Unused("x").requires_grad_(False)
        with pytest.raises(ValueError, match="^the model has no trainable parameters"):
            run(frozen, x, y, metric)
    assert math.isnan(run(Unused("params"), x, y, "jacob_cov"))


def test_warm_up_of_an_output_that_depends_on_no_trainable_parameter_trains_nothing(data):
    """Warm-up failed with torch's RuntimeError ("element 0 of tensors does not require grad")
    on a candidate whose output depends on no trainable parameter, and with Adam's "optimizer
    got an empty parameter list" on one without parameters; its steps now train nothing."""
    x, y = data
    frozen = tiny(width=40).requires_grad_(False)
    for model, metric in ((Unused("x"), "params"), (frozen, "naswot"), (nn.ReLU(), "params")):
        expected = run(model, x, y, metric)
        assert run(model, x, y, metric, warmup_steps=2) == pytest.approx(expected, rel=1e-9)


def test_tse_is_the_mean_loss_of_its_training_steps(data, monkeypatch):
    """tse: −(mean minibatch cross-entropy) over TSE_STEPS Adam steps on minibatches of 64
    drawn from all of x, each loss before its step (raw: their sum), from the candidate's
    initialisation; checked against a plain training loop (on 120 samples: the second minibatch
    of each pass over x is short)."""
    x, y = torch.cat([data[0]] * 10), torch.cat([data[1]] * 10)
    n, steps, lr, seed = len(x), 5, 0.01, 3
    monkeypatch.setattr(proxies, "TSE_STEPS", steps)
    model = tiny(width=8).eval()
    details = proxies.score(
        model, x, y, metric="tse", batch_size=4, repeats=2, warmup_lr=lr, seed=seed,
        return_details=True,
    )  # fmt: skip
    for r in range(2):
        net = copy.deepcopy(model).train()
        opt = torch.optim.Adam(net.parameters(), lr=lr)
        g = torch.Generator().manual_seed(seed + r)  # the repeat's draws of minibatches
        losses, order = [], torch.empty(0, dtype=torch.long)
        for _ in range(steps):
            if len(order) == 0:
                order = torch.randperm(n, generator=g)
            idx, order = order[:64], order[64:]
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert details.values[r] == pytest.approx(-np.mean(losses), rel=1e-6)
        assert details.raw[r] == pytest.approx(np.sum(losses), rel=1e-6)
    assert losses[-1] < losses[0]  # it trained
    for name, value in model.state_dict().items():  # on a copy
        assert torch.equal(value, tiny(width=8).state_dict()[name])
    with pytest.raises(ValueError, match="y is missing: metric 'tse'"):
        proxies.score(model, x, None, metric="tse")


def test_training_on_non_finite_outputs_names_the_outputs_not_the_learning_rate(data):
    """A model whose outputs are NaN before any step was refused as "the warm-up diverged ...
    lower warmup_lr", which no learning rate mends."""
    x, y = data

    class NanOut(nn.Module):
        def forward(self, x):
            return torch.full((len(x), O), float("nan")) + 0 * x.sum()

    for options in ({"metric": "params", "warmup_steps": 2}, {"metric": "tse"}):
        with pytest.raises(ValueError, match="non-finite outputs"):
            proxies.score(NanOut(), x, y, batch_size=4, **options)


def test_a_diverging_warm_up_is_refused_naming_warmup_lr(data):
    """A warm-up whose learning rate blows the parameters up was reported as "the model
    produced non-finite outputs (NaN or inf) on x", one beyond the dtype's range as Adam's bare
    RuntimeError ("value cannot be converted to type float without overflow"); both name
    warmup_lr, in score and in rank."""
    x, y = data
    with pytest.raises(
        ValueError, match=r"^the warm-up diverged: .* lower warmup_lr \(got 1e\+30\)"
    ):
        proxies.score(tiny(), x, y, metric="lga", warmup_steps=20, warmup_lr=1e30)
    with pytest.raises(ValueError, match=r"^warmup_lr=1e\+300 overflows the parameters' dtype"):
        proxies.score(tiny(), x, y, metric="lga", warmup_steps=2, warmup_lr=1e300)
    with pytest.raises(ValueError, match=r"^candidate 'a': the warm-up diverged"):
        proxies.rank({"a": tiny}, x, y, metric="lga", warmup_steps=20, warmup_lr=1e30)
    assert np.isfinite(run(tiny(), x, y, "lga", warmup_steps=20, warmup_lr=1e-2))


def test_numpy_integers_are_integers_for_the_integer_options(data):
    """batch_size, repeats and warmup_steps given as numpy integers were refused ("batch_size
    must be an integer ≥ 2, got np.int64(4)"), a numpy seed failed in torch ("an integer is
    required")."""
    x, y = data
    model = tiny()
    expected = run(model, x, y, "lga", repeats=2, warmup_steps=1, seed=3)
    options = dict(repeats=np.int64(2), warmup_steps=np.int32(1), seed=np.int64(3))
    assert proxies.score(model, x, y, metric="lga", batch_size=np.int64(N), **options) == expected


class Logits(nn.Module):
    """A model whose output is a dict {"logits": scores}."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return {"logits": self.model(x)}


@pytest.mark.parametrize("metric", ["grad_norm", "snip", "synflow", "jacob_cov"])
def test_output_metrics_name_an_output_that_is_not_a_tensor(data, metric):
    """The metrics reading the output failed on a dict output with an AttributeError ("'dict'
    object has no attribute 'dim'"), which rank did not name the candidate in; the kernel
    metrics said to pass output_fn. They now say so too, and take output_fn."""
    x, y = data
    with pytest.raises(TypeError, match="model output is a dict, not a tensor: pass output_fn"):
        run(Logits(tiny()), x, y, metric)
    with pytest.raises(TypeError, match="^candidate 'a': the model output is a dict"):
        proxies.rank({"a": Logits(tiny())}, x, y, metric=metric)
    logits = run(Logits(tiny()), x, y, metric, output_fn=lambda out: out["logits"])
    assert logits == pytest.approx(run(tiny(), x, y, metric), rel=1e-6)


def test_rank_names_the_candidate_whatever_it_raises(monkeypatch):
    # a failure of any type names the candidate and keeps its class (ModelInputError was
    # re-raised as a bare ValueError; a KernelTooLargeError or KeyError did not name it)
    from ntk.core.memory import KernelTooLargeError
    from ntk.core.model import ModelInputError

    x, y = torch.randn(N, D), torch.arange(N) % 3
    with pytest.raises(ModelInputError, match="^candidate 'narrow': x: the model failed"):
        proxies.rank({"narrow": tiny}, torch.randn(N, D + 2), y, metric="trace")
    measure = proxies._MEASURES["trace"]
    # a KeyError (whose message would print quoted) comes back as a RuntimeError
    for error, raised in (
        (KernelTooLargeError("9 TiB"), KernelTooLargeError),
        (KeyError("w"), RuntimeError),
    ):
        calls = []

        def failing(net, *args, error=error, calls=calls, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise error
            return measure(net, *args, **kwargs)

        monkeypatch.setitem(proxies._MEASURES, "trace", failing)
        with pytest.raises(raised, match=f"^candidate 'b' failed: {type(error).__name__}: "):
            proxies.rank(  # one repeat each: the second call is candidate b's
                {"a": tiny, "b": tiny, "c": tiny}, x, y, metric="trace", batch_size=4, repeats=1
            )


def test_factories_leave_the_global_random_state_as_it_was(fake_cuda):
    # the factory ran under fork_rng(devices=[]) and torch.manual_seed, which also seeds every
    # GPU: the CPU state came back, the GPUs' did not
    x, y = torch.randn(N, D), torch.arange(N) % O
    cpu = torch.get_rng_state()
    proxies.rank({"a": tiny, "b": lambda: tiny(1)}, x, y, metric="trace", batch_size=4)
    proxies.score(tiny, x, y, metric="trace", batch_size=4, warmup_steps=1)
    assert torch.equal(torch.get_rng_state(), cpu)
    assert fake_cuda["state"] == "the caller's"


def test_numpy_float64_inputs_take_the_candidates_dtype():
    x = np.random.default_rng(0).standard_normal((N, D))  # numpy's float64, for float32 nets
    y = np.arange(N) % O
    opts = dict(metric="trace", batch_size=4, repeats=1)
    expected = proxies.score(tiny(), torch.from_numpy(x).float(), y, **opts)
    assert proxies.score(tiny(), x, y, **opts) == expected
    assert proxies.rank({"a": tiny}, x, y, **opts) == [("a", expected)]


def test_candidates_tied_at_minus_infinity_are_named_not_ordered_silently():
    """label_condition is −inf for every candidate whose lpNTK is singular (fewer parameters than
    samples); rank listed them in the order given without a word. A vote breaks such ties."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 5), torch.arange(64) % 3

    def mlp(width):
        return lambda: nn.Sequential(nn.Linear(5, width), nn.ReLU(), nn.Linear(width, 3))

    candidates = {"w2": mlp(2), "w3": mlp(3), "w64": mlp(64)}
    with pytest.warns(UserWarning, match=r"2 candidates score -inf by label_condition.*'w2', 'w3'"):
        ranked = proxies.rank(candidates, x, y, metric="label_condition", repeats=1)
    assert [name for name, _ in ranked] == ["w64", "w2", "w3"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        proxies.rank({"w32": mlp(32), "w64": mlp(64)}, x, y, metric="label_condition", repeats=1)
