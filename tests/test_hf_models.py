"""HuggingFace models (tiny BERT and GPT-2 built from configs, nothing downloaded) called the way
their users call them, with dicts of input_ids and attention_mask, through kernels, features,
layer importance and influence; models that cannot be vmapped; LoRA-style adapters."""

import math
import warnings

import numpy as np
import pytest
import reference
import torch
from torch import nn

import ntk
import projections
from attribution import KernelSurrogate, NTKPosterior, influence, layer_importance, report
from ntk.core import structured
from ntk.core.model import ModelView
from ntk.core.persample import PerSampleFallbackWarning

transformers = pytest.importorskip("transformers")

O = 3


def logits(out):
    return out.logits


def _bert(seed=0, hidden=8):
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=30,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=8,
        num_labels=O,
    )
    return transformers.BertForSequenceClassification(config).eval().double()


def _gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=30,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=8,
        num_labels=O,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    return transformers.GPT2ForSequenceClassification(config).eval().double()


def _tokens(n, seq, seed=1):
    """Token ids with padding at the end of every other sample, and the matching mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 30, (n, seq), generator=g)
    mask = torch.ones(n, seq, dtype=torch.long)
    mask[::2, seq - 2 :] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def bert():
    return _bert()


@pytest.fixture(scope="module")
def gpt2():
    return _gpt2()


@pytest.mark.parametrize("method", ["structured", "jacobian", "ntk_vp"])
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_dict_inputs_match_reference(name, method, request):
    model = request.getfixturevalue(name)
    x = _tokens(3, 3 if name == "gpt2" else 6)
    expected = reference.kernels(model, x, output_fn=logits)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        k = ntk.empirical_ntk(model, x, kind="full", method=method, output_fn=logits)
    torch.testing.assert_close(k, expected[None], rtol=1e-9, atol=1e-12)
    # the attention-mask code cannot be vmapped: one line says why, once per model
    fallback = [w for w in caught if issubclass(w.category, PerSampleFallbackWarning)]
    assert len(fallback) <= 1
    for w in fallback:
        assert "cannot be vmapped" in str(w.message) and "\n" not in str(w.message)


def test_layerwise_kernels_and_two_sets(bert):
    x1, x2 = _tokens(3, 6), _tokens(2, 6, seed=5)
    expected = reference.kernels(bert, x1, x2, output_fn=logits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerSampleFallbackWarning)
        k = ntk.empirical_ntk(bert, x1, x2, kind="trace", layers="all", output_fn=logits)
    assert set(k) == set(expected) - {None}
    for layer, value in k.items():
        torch.testing.assert_close(
            value, reference.of_kind(expected[layer], "trace"), rtol=1e-9, atol=1e-12
        )


def test_gpt2_conv1d_is_factored(gpt2):
    """transformers' Conv1D layers take the structured path, and at these shapes the factored
    contraction (the kernel check above then covers it)."""
    x = _tokens(3, 3)
    plan = structured.plan(ModelView(gpt2, output_fn=logits), x, "full", O, 3, 3)
    conv1d = [n for n, m in gpt2.named_modules() if type(m).__name__ == "Conv1D"]
    assert conv1d and set(conv1d) <= set(plan.covered)
    assert set(conv1d) & plan.factored
    # position embeddings, looked up once for the batch, are expanded per sample: no autodiff
    assert plan.fallback == [] and plan.shared == {"transformer.wpe"}


class _SharedLookups(nn.Module):
    """Two embeddings of positions shared by the batch: one broadcast over the samples, one
    reduced over its first axis (expanding that one per sample would change the output)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.pos = nn.Embedding(7, 4), nn.Embedding(3, 4)
        self.rows = nn.Embedding(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1])
        h = self.tokens(ids) + self.pos(positions[None]) + self.rows(positions).sum(0)
        return self.head(torch.tanh(h).mean(1))


def test_batch_shared_embeddings_are_expanded_only_when_that_is_safe():
    torch.manual_seed(0)
    model = _SharedLookups().double()
    x = torch.randint(0, 7, (5, 3))
    plan = structured.plan(ModelView(model), x, "full", 2, 5, 5)
    assert plan.shared == {"pos"} and plan.fallback == ["rows.weight"]
    k = ntk.empirical_ntk(model, x, kind="full", layers="all", method="structured")
    expected = reference.kernels(model, x)
    for layer in k:
        torch.testing.assert_close(k[layer], expected[layer], rtol=1e-10, atol=1e-12)


class _DataDependent(nn.Module):
    """Branches on each sample's values, which vmap cannot trace."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        return torch.stack([self.a(r) if bool(r.sum() > 0) else self.b(r).tanh() for r in x])


def test_unvmappable_model_falls_back_once():
    torch.manual_seed(0)
    model = _DataDependent().double().eval()
    x = torch.randn(6, 4, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        k = ntk.empirical_ntk(model, x, kind="full", method="jacobian", batch_size=2)
        again = ntk.empirical_ntk(model, x, kind="trace", method="jacobian")
    # one warning for the model, not one per block or per call
    assert sum(issubclass(w.category, PerSampleFallbackWarning) for w in caught) == 1
    expected = reference.kernels(model, x)[None]
    torch.testing.assert_close(k, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(again, reference.of_kind(expected, "trace"), rtol=1e-10, atol=0)


class _LoRA(nn.Module):
    """A frozen linear layer plus a trainable low-rank update B A."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.1)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


def test_lora_kernels_cover_the_adapters_only():
    model = _bert(seed=3)
    for p in model.parameters():
        p.requires_grad_(False)
    attention = model.bert.encoder.layer[0].attention.self
    torch.manual_seed(4)
    attention.query = _LoRA(attention.query).double()
    attention.value = _LoRA(attention.value).double()
    x = _tokens(3, 6)
    adapters = {n for n, m in model.named_modules() if n.endswith(("lora_a", "lora_b"))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerSampleFallbackWarning)
        k = ntk.empirical_ntk(model, x, kind="full", layers="all", output_fn=logits)
    assert set(k) == adapters
    expected = reference.kernels(model, x, output_fn=logits)
    for layer in adapters:
        torch.testing.assert_close(k[layer], expected[layer], rtol=1e-9, atol=1e-12)


def test_projected_features_of_dict_inputs(bert):
    x = _tokens(4, 6)
    exact = reference.of_kind(reference.kernels(bert, x, output_fn=logits)[None], "sum_logits")
    phi = projections.features(bert, x, dim=8192, kind="sum_logits", output_fn=logits)
    assert phi.shape == (4, 8192)
    err = torch.linalg.norm(phi @ phi.T - exact) / torch.linalg.norm(exact)
    assert err < 0.1
    # the same features batch by batch
    again = projections.features(
        bert, x, dim=8192, kind="sum_logits", output_fn=logits, batch_size=1
    )
    torch.testing.assert_close(again, phi, rtol=1e-9, atol=1e-12)


def test_layer_importance_of_dict_inputs(bert):
    x = _tokens(4, 6)
    y = torch.tensor([0, 2, 1, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerSampleFallbackWarning)
        rows = layer_importance(bert, x, y, output_fn=logits)
    by_layer = {r["layer"]: r for r in rows}
    assert set(by_layer) == set(ModelView(bert).layers)
    # fisher: the mean squared norm of per-sample loss gradients, by a plain autograd loop
    params = [p for p in bert.classifier.parameters()]
    total = 0.0
    for i in range(4):
        one = {k: v[i : i + 1] for k, v in x.items()}
        loss = nn.functional.cross_entropy(bert(**one).logits, y[i : i + 1])
        total += sum(float((g**2).sum()) for g in torch.autograd.grad(loss, params))
    assert by_layer["classifier"]["fisher"] == pytest.approx(total / 4, rel=1e-8)


def _parameter_space_reference(model, x, y, xt):
    """Jacobians [N, O, P] of all trainable parameters, logits, margin gradients of the
    predicted labels and the softmax residuals r_i, by plain autograd."""
    j = torch.cat(list(reference.jacobians(model, x, logits).values()), 2)
    jt = torch.cat(list(reference.jacobians(model, xt, logits).values()), 2)
    with torch.no_grad():
        g, gt = model(**x).logits, model(**xt).logits
    yt = gt.argmax(1)
    u = torch.zeros_like(gt)
    for m in range(len(yt)):
        others = [c for c in range(O) if c != yt[m]]
        u[m, others] = -gt[m, others].softmax(0)
        u[m, yt[m]] = 1.0
    r = torch.eye(O, dtype=torch.float64)[y] - g.softmax(1)
    return j, torch.einsum("mo,mop->mp", u, jt), g, r


def test_influence_of_dict_inputs(bert):
    x, xt = _tokens(6, 6), _tokens(3, 6, seed=9)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    j, left, g, r = _parameter_space_reference(bert, x, y, xt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerSampleFallbackWarning)
        dot = influence(bert, x, y, xt, method="grad_dot", output_fn=logits)
        gn = influence(
            bert,
            x,
            y,
            xt,
            method="gauss_newton",
            kind="full",
            damping=0.1,
            training_logits="network",  # the reference's residuals and curvature
            output_fn=logits,
        )
    torch.testing.assert_close(dot, left @ torch.einsum("io,iop->pi", r, j), rtol=1e-8, atol=1e-10)
    expected = reference.gauss_newton_influence(j, left, g, y, 0.1)
    torch.testing.assert_close(gn, expected, rtol=1e-6, atol=1e-9)


def test_surrogate_and_report_of_dict_inputs(bert, tmp_path):
    x, xt = _tokens(8, 6), _tokens(4, 6, seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerSampleFallbackWarning)
        surrogate = KernelSurrogate(bert, output_fn=logits, alpha=1e-3).fit(x)
        contributions = surrogate.attribute(xt)
        decision = surrogate.decision_function(xt)
        longer = _tokens(3, 8, seed=4)  # another padded length than the training batch's
        longer_decision = surrogate.decision_function(longer)
        longer_contributions = surrogate.attribute(longer)
        posterior = NTKPosterior(bert, output_fn=logits).fit(x, torch.arange(8) % O)
        probabilities = posterior.predict_proba(longer)
        result = report(
            bert,
            x,
            torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]),
            xt,
            path=tmp_path / "r.html",
            output_fn=logits,
            examples=2,
            top=2,
        )
    assert contributions.shape == (4, 8, O)
    torch.testing.assert_close(
        torch.as_tensor(contributions.sum(1) + surrogate.baseline_), torch.as_tensor(decision)
    )
    np.testing.assert_allclose(
        longer_contributions.sum(1) + surrogate.baseline_, longer_decision, atol=1e-10
    )
    assert probabilities.shape == (3, O) and np.allclose(probabilities.sum(1), 1.0)
    assert (tmp_path / "r.html").exists() and len(result["attribution"]["examples"]) == 2
    assert {r["layer"] for r in result["layers"]["rows"]} == set(ModelView(bert).layers)


def test_proxies_of_dict_inputs(bert):
    from ntk import proxies

    x, y = _tokens(6, 6), torch.tensor([0, 1, 2, 0, 1, 2])
    opts = dict(batch_size=6, output_fn=logits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerSampleFallbackWarning)
        lga = proxies.score(bert, x, y, metric="lga", **opts)
        k = ntk.empirical_ntk(bert, x, kind="sum_logits", output_fn=logits)
        ranked = proxies.rank({"a": bert, "b": _bert(seed=7)}, x, y, metric="grad_norm", **opts)
        by_default = proxies.rank({"a": bert, "b": _bert(seed=7)}, x, y, **opts)
    # the default vote is defined for dict inputs (it holds no FLOAT_INPUT_METRICS)
    assert {n for n, _ in by_default} == {"a", "b"}
    assert all(math.isfinite(v) for _, v in by_default)
    # a batch of all 6 samples in a random order: the alignment of the whole kernel
    assert lga == pytest.approx(ntk.kernel_alignment(k, y, centering="mean"), rel=1e-9)
    assert {name for name, _ in ranked} == {"a", "b"}
    with pytest.raises(ValueError, match="floating-point input tensor"):
        proxies.score(bert, x, metric="jacob_cov", **opts)


BERT_FACTORY = """
import torch
import transformers

def build():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=8, num_labels=3,
    )
    return transformers.BertForSequenceClassification(config)
"""


def _cli(*args):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "attribution.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # three subprocesses that each import transformers
def test_cli_with_dict_data_and_output_fn(tmp_path):
    import json

    import numpy as np

    (tmp_path / "bert.py").write_text(BERT_FACTORY)
    x, xt = _tokens(8, 6), _tokens(2, 6, seed=9)
    y = np.array([0, 1, 2, 0, 1, 2, 0, 1])
    np.savez(tmp_path / "train.npz", y=y, **{f"x.{k}": v.numpy() for k, v in x.items()})
    np.savez(tmp_path / "test.npz", **{f"x.{k}": v.numpy() for k, v in xt.items()})
    common = ["--model", str(tmp_path / "bert.py:build"), "--data", str(tmp_path / "train.npz")]
    out = _cli(
        "kernel", *common, "--output-fn", "logits", "--kind", "trace", "--format", "json",
        "--save", str(tmp_path / "k.npy"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rows"][0]["shape"] == "8x8"
    namespace = {}
    exec(BERT_FACTORY, namespace)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerSampleFallbackWarning)
        expected = ntk.empirical_ntk(namespace["build"]().eval(), x, kind="trace", output_fn=logits)
    assert np.allclose(np.load(tmp_path / "k.npy"), expected.numpy(), rtol=1e-4, atol=1e-7)

    out = _cli(
        "attribute", *common, "--output-fn", "logits", "--test", str(tmp_path / "test.npz"),
        "--top", "2", "--format", "json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert len(rows) == 2 * 2 * 2 and {r["test"] for r in rows} == {0, 1}

    out = _cli("kernel", *common, "--kind", "trace")  # no --output-fn: a usage message
    assert out.returncode != 0 and "pass --output-fn" in out.stderr
