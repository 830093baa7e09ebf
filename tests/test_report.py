"""attribution.report and `ntk report`: the numbers against independent computations, the HTML
self-contained, and the page as headless Chromium renders it."""

import copy
import json
import os
import re
from html import unescape

import browser
import numpy as np
import pytest
import torch
from models import MLP, WideScale, fitted
from torch import nn

import ntk
from attribution import NTKPosterior, expected_calibration_error, mislabel_auc
from attribution._report import _calibration, choose_examples, effective_rank, report
from attribution.cli import main
from attribution.curvature import MAX_DENSE
from attribution.damping import DOF_FRACTION
from attribution.surrogate import KernelSurrogate
from ntk import demo


def _strict_json(path):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def setup():
    data = demo.digits(n_train=200)
    torch.manual_seed(0)
    model = demo.train(demo.mlp(hidden=24), data.x_train, data.y_train, epochs=15)
    return model, data.x_train, data.y_train, data.x_test[:60], data.y_test[:60]


@pytest.fixture(scope="module")
def built(setup, tmp_path_factory):
    model, x_train, y_train, x_test, y_test = setup
    before = copy.deepcopy(model.state_dict())
    path = tmp_path_factory.mktemp("report") / "small.html"
    result = report(
        model,
        x_train,
        y_train,
        x_test,
        y_test,
        path=path,
        image_shape=(8, 8),
        kernel_samples=80,
        examples=6,
        top=3,
    )
    assert not model.training and all(
        torch.equal(v, model.state_dict()[k]) for k, v in before.items()
    )
    return result, path


def test_numbers_match_independent_computations(setup, built):
    model, x_train, y_train, x_test, y_test = setup
    result, path = built
    assert _strict_json(path.with_suffix(".json"))["settings"]["train_samples"] == 200

    k = ntk.empirical_ntk(model, x_train[:80], kind=result["kernel"]["kind"]).double().numpy()
    np.testing.assert_allclose(
        result["kernel"]["eigenvalues"],
        np.linalg.eigvalsh(k)[::-1],
        rtol=1e-4,
        atol=1e-6 * np.abs(k).max(),
    )
    assert result["kernel"]["effective_rank"] == pytest.approx(
        effective_rank(np.linalg.eigvalsh(k)), rel=1e-4
    )
    assert sum(row["share"] for row in result["layers"]["rows"]) == pytest.approx(1.0)

    with torch.no_grad():
        p = model(x_test).double().softmax(1)
    faith, rows = result["faithfulness"], torch.arange(60)
    np.testing.assert_allclose(faith["network_probability"], p[rows, p.argmax(1)], rtol=1e-5)

    surrogate = KernelSurrogate(model).fit(x_train)
    assert faith["surrogate"] == pytest.approx(surrogate.faithfulness(x_test, y_test))
    q = torch.as_tensor(surrogate.decision_function(x_test)).softmax(1)
    np.testing.assert_allclose(faith["surrogate_probability"], q[rows, p.argmax(1)], rtol=1e-6)
    predicted = torch.as_tensor(surrogate.predict(x_test))
    assert faith["surrogate_prediction"] == predicted.tolist()
    assert faith["disagreements"]["count"] == int((predicted != p.argmax(1)).sum())
    assert sum(map(sum, faith["disagreements"]["matrix"])) == faith["disagreements"]["count"]

    contributions = torch.as_tensor(surrogate.attribute(x_test), dtype=torch.float64)
    decisions = surrogate.decision_function(x_test)
    for e in result["attribution"]["examples"]:
        c = contributions[e["index"], :, e["network_prediction"]]
        assert [q["index"] for q in e["proponents"]] == torch.argsort(c, descending=True)[
            :3
        ].tolist()
        assert [q["contribution"] for q in e["opponents"]] == pytest.approx(
            torch.sort(c).values[:3].tolist(),
            rel=1e-5,  # float32 kernels, other tiles
        )
        decision = decisions[e["index"], e["network_prediction"]]
        assert e["sum_of_contributions"] + e["baseline"] == pytest.approx(float(decision), rel=1e-6)
        right = e["label"] == e["network_prediction"]
        assert {"correct": right, "wrong": not right, "uncertain": True}[e["category"]]
    assert {e["category"] for e in result["attribution"]["examples"]} == {
        "correct",
        "wrong",
        "uncertain",
    }
    total = contributions[rows, :, p.argmax(1)].abs().sum(0)
    np.testing.assert_allclose(result["attribution"]["total_influence"], total, rtol=1e-6)
    chosen = contributions[rows, :, p.argmax(1)]
    assert result["attribution"]["cancellation"] == pytest.approx(
        float(np.median((chosen.abs().sum(1) / chosen.sum(1).abs()).numpy())), rel=1e-6
    )
    machine = KernelSurrogate(
        model, kind=surrogate.kind, machine="gauss_newton", effective_parameters=DOF_FRACTION
    ).fit(x_train, y_train)
    for i in (0, 17, 199):  # the machine's drop for i's own label, i removed as a set
        drop = machine.influence(x_train[i : i + 1], [i], output="all")[0, y_train[i]]
        assert result["attribution"]["self_influence"][i] == pytest.approx(
            float(drop), rel=1e-6, abs=1e-9
        )


def test_cards_of_few_training_examples_list_each_on_its_side_only(tmp_path):
    """With 8 training examples and top=5 a card's proponents included examples whose
    contribution is negative, the same examples were opponents too, and they counted in the label
    share and the counterfactual."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(14, 5, generator=g)
    y = (x @ torch.randn(5, 3, generator=g)).argmax(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    result = report(
        model, x[:8], y[:8], x[8:], y[8:], path=tmp_path / "r.html", top=5, posterior=False
    )
    for card in result["attribution"]["examples"]:
        up, down = card["proponents"], card["opponents"]
        assert all(p["contribution"] > 0 for p in up) and all(p["contribution"] < 0 for p in down)
        assert not {p["index"] for p in up} & {p["index"] for p in down}
        assert card["sanity"]["removed"] == len(up)
    assert any(len(card["proponents"]) < 5 for card in result["attribution"]["examples"])


def test_self_influence_ranks_flipped_labels_first(tmp_path):
    """The report's "likely mislabelled" list was each training point's own contribution to its
    label's output, which ranks a flipped label last (mislabel AUC 0.16 here); the Gauss–Newton
    machine's drop when the point alone is removed ranks it first."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 5, generator=g)
    y = (x @ torch.randn(5, 3, generator=g)).argmax(1)
    flipped = torch.randperm(120, generator=g)[:12]
    y[flipped] = (y[flipped] + 1 + torch.randint(0, 2, (12,), generator=g)) % 3
    torch.manual_seed(0)
    model = fitted(nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)), x, y, 100, 0.03)
    result = report(
        model.eval(), x, y, x[:10], path=tmp_path / "r.html", examples=1, posterior=False
    )
    mask = torch.zeros(120, dtype=torch.bool)
    mask[flipped] = True
    assert mislabel_auc(result["attribution"]["self_influence"], mask) > 0.85


def test_calibration_section_matches_a_direct_posterior(setup, built):
    """80 kernel samples × 10 classes ≤ POSTERIOR_AUTO_MAX: the section is on by default, and its
    numbers are those of an NTKPosterior fitted on the same samples, its prior precision tuned on
    the even-numbered test samples and scored on the odd-numbered ones."""
    model, x_train, y_train, x_test, y_test = setup
    result, _ = built
    c = result["calibration"]
    assert c["enabled"] and c["samples"] == 80 and "even-numbered" in c["prior_precision_by"]
    post = NTKPosterior(model).fit(
        x_train[:80], y_train[:80], validation=(x_test[0::2], y_test[0::2])
    )
    assert c["prior_precision"] == pytest.approx(post.prior_precision_, rel=1e-6)
    q = post.predict_proba(x_test)
    with torch.no_grad():
        p = model(x_test).double().softmax(1).numpy()
    y = y_test.numpy()
    for name, probs in (("network", p[1::2]), ("posterior", q[1::2])):
        assert c["metrics"][name]["ece"] == pytest.approx(
            expected_calibration_error(probs, y[1::2]), rel=1e-6
        )
        assert c["metrics"][name]["nll"] == pytest.approx(
            -np.mean(np.log(probs[np.arange(30), y[1::2]] / probs.sum(1))), rel=1e-6
        )
        assert sum(c["reliability"][name]["count"]) == 30
    assert c["largest_probability_change"] == pytest.approx(np.abs(q - p).max(), rel=1e-6)
    entropy = -(q * np.log(q)).sum(1)
    assert [r["index"] for r in c["least_sure"]] == np.argsort(-entropy)[:6].tolist()
    assert c["least_sure"][0]["entropy"] == pytest.approx(entropy.max(), rel=1e-6)


def test_calibration_section_off_by_choice_or_by_size(setup, tmp_path):
    model, x_train, y_train, x_test, y_test = setup
    opts = dict(examples=1, top=1, kernel_samples=20)
    off = report(
        model, x_train, y_train, x_test, y_test, path=tmp_path / "a.html", posterior=False, **opts
    )
    assert off["calibration"] == {"enabled": False, "note": "turned off (posterior=False)"}
    assert 'id="calibration"' in (tmp_path / "a.html").read_text()
    assert "Calibration section turned off" in (tmp_path / "a.html").read_text()
    # 500 samples × 10 classes > POSTERIOR_AUTO_MAX: on by default with the factored curvature
    # (linear in N); off for a model that does not fit it, and the note says how to turn it on
    p_test = torch.full((4, 10), 0.1, dtype=torch.float64)
    fit = (torch.randn(500, 64), torch.arange(500) % 10)
    test = (x_test[:4], y_test[:4], p_test)
    big = _calibration(model, fit, test, None, 1, {})
    assert big["enabled"] and big["curvature"] == "ekfac"
    wide = nn.Sequential(WideScale(64, MAX_DENSE + 1), model).eval()
    off = _calibration(wide, fit, test, None, 1, {})
    assert not off["enabled"] and "5,000 > 4,096" in off["note"] and "--posterior" in off["note"]
    assert "without Kronecker structure" in off["note"]


def test_a_report_that_fails_while_written_leaves_the_earlier_files(setup, tmp_path, monkeypatch):
    """The HTML and the JSON take their names only once both are ready: a failure (here in the
    JSON) leaves the earlier report as it was and no partial file."""
    model, x_train, y_train, x_test, y_test = setup
    (tmp_path / "r.html").write_text("earlier")
    (tmp_path / "r.json").write_text("{}")

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(json, "dumps", fail)
    with pytest.raises(OSError, match="disk full"):
        report(
            model,
            x_train,
            y_train,
            x_test,
            y_test,
            path=tmp_path / "r.html",
            posterior=False,
            examples=1,
            top=1,
            kernel_samples=20,
        )
    assert (tmp_path / "r.html").read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "r.json"]


def test_files_it_cannot_write_and_another_models_surrogate_are_refused_before_any_work(
    setup, tmp_path, monkeypatch
):
    """A JSON path that is a directory failed after the HTML was written, a missing directory
    after all the work, and a surrogate of another network was used as given."""
    import attribution._report

    model, x_train, y_train, x_test, y_test = setup

    def computed(*args, **kwargs):
        raise AssertionError("the report started its work before checking its arguments")

    monkeypatch.setattr(attribution._report, "logits", computed)
    (tmp_path / "r.json").mkdir()
    os.mkfifo(tmp_path / "p.html")  # a device such as /dev/null, which the rename would replace
    cases = [
        ({"path": tmp_path / "r.html"}, f"{tmp_path / 'r.json'} is a directory"),
        ({"path": tmp_path / "p.html"}, f"{tmp_path / 'p.html'} is not a regular file"),
        ({"path": tmp_path / "nodir" / "r.html"}, f"directory {tmp_path / 'nodir'} does not exist"),
        (
            {"path": tmp_path / "s.html", "surrogate": KernelSurrogate(copy.deepcopy(model))},
            "surrogate is a KernelSurrogate of another model",
        ),
        ({"path": tmp_path / "s.html", "image_shape": (4, -2)}, "image_shape's sizes must be"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            report(model, x_train, y_train, x_test, y_test, **arguments)
    for name in ("surrogate", "retrain", "settings", "image_shape"):  # failed deep inside
        with pytest.raises(TypeError, match=f"^{name} must be .* got (str|'x')"):
            report(model, x_train, y_train, x_test, y_test, path=tmp_path / "s.html", **{name: "x"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.html", "r.json"]


def test_example_choice():
    p = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.55, 0.45], [0.97, 0.03], [0.6, 0.4]])
    y = torch.tensor([0, 0, 0, 0, 1])
    assert choose_examples(p, y, 3) == [(3, "correct"), (1, "wrong"), (2, "uncertain")]
    assert choose_examples(p, None, 2) == [(3, "confident"), (2, "uncertain")]
    assert (
        effective_rank(np.ones(4)) == pytest.approx(4)
        and effective_rank(np.array([2.0, 0, 0])) == 1
    )


def test_example_choice_fills_the_places_of_an_empty_category():
    """A network without mistakes on the test set still gets the n examples asked for (the
    places of the empty `wrong` category used to be dropped: 4 cards of 6), in category order."""
    torch.manual_seed(0)
    p = torch.randn(20, 3).softmax(1)
    chosen = choose_examples(p, p.argmax(1), 6)
    categories = [c for _, c in chosen]
    assert len(chosen) == 6 and len({i for i, _ in chosen}) == 6
    assert categories == sorted(categories, key=["correct", "uncertain"].index)
    assert len(choose_examples(p[:4], p[:4].argmax(1), 6)) == 4  # all there are


def test_html_is_self_contained(built):
    result, path = built
    html = path.read_text()
    assert not re.search(
        r"<script|<link|@import|url\(|https?://|src=\"(?!data:image/png;base64,)", html
    )
    # scatter, spectrum, layers, one row per example, total influence and self-influence rows,
    # reliability diagram and least-sure row
    assert html.count("<img ") == 3 + len(result["attribution"]["examples"]) + 2 + 2
    for e in result["attribution"]["examples"]:
        assert f"test example #{e['index']}" in html


def test_an_infinite_condition_number_is_explained_on_the_page(built):
    """The page showed κ = inf with no word of why, while `ntk report` printed the reason."""
    from attribution._report import SINGULAR_KERNEL, _render

    result, _ = built
    singular = copy.deepcopy(result)
    singular["kernel"]["condition_number"] = float("inf")
    assert f"condition number = inf: {SINGULAR_KERNEL}" in _render(singular, {})
    assert SINGULAR_KERNEL not in _render(result, {})


def test_text_from_the_user_is_escaped_on_the_page(built):
    """The template was rendered without escaping: a title or layer name with markup became
    markup on the page."""
    from attribution._report import _render

    result, _ = built
    marked = copy.deepcopy(result)
    marked["title"] = "<script>alert(1)</script> & co"
    html = _render(marked, {})
    assert "<script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in html


def test_probabilities_near_1_or_0_never_read_as_1_or_0(built):
    """The page rounded a probability of 0.99997 to "p = 1"."""
    from attribution._report import _probability, _render

    result, _ = built
    near = copy.deepcopy(result)
    card = near["attribution"]["examples"][0]
    card["network_probability"], card["surrogate_probability"] = 0.99997, 0.00004
    near["calibration"]["least_sure"][0]["network_probability"] = 0.99997
    html = _render(near, {})
    # as the page's HTML writes them ("&gt;" reads ">")
    assert "(p &gt; 0.999)" in html
    assert f"(p of {card['network_prediction']} &lt; 0.001)" in html
    assert '<td class="n">&gt; 0.999</td>' in html
    assert [_probability(p) for p in (1.0, 0.0, 0.5, 0.9994)] == ["1", "0", "0.5", "> 0.999"]
    assert _probability(0.25, relation=True) == "= 0.25"


@pytest.fixture(scope="module")
def chromium():
    if browser.executable() is None:
        if os.environ.get("NTK_SKIP_BROWSER"):
            pytest.skip("NTK_SKIP_BROWSER is set")
        pytest.fail(
            "chromium is not installed: apt-get install chromium (.ci/run does), or set "
            "NTK_SKIP_BROWSER=1 to skip the browser check deliberately"
        )
    with browser.Chromium() as c:
        yield c


def test_report_in_headless_chromium(built, chromium, tmp_path):
    from matplotlib.image import imread

    result, path = built
    page = chromium.inspect(path.resolve().as_uri())
    assert page.title == result["title"]
    # scatter, spectrum, layers; one per card; total and self influence; reliability, least sure
    assert len(page.images) == 3 + len(result["attribution"]["examples"]) + 2 + 2
    for image in page.images:
        assert image["complete"] and image["error"] is None and image["naturalWidth"] > 0, image
    assert page.errors == []
    assert all(url.startswith(("file:", "data:")) for url in page.requests), page.requests
    shot = tmp_path / "report.png"
    shot.write_bytes(page.screenshot)
    pixels = imread(shot)[..., :3]
    assert pixels.shape[0] == page.height > 2000 and pixels.shape[1] == 1200
    assert (
        pixels.std() > 0.1 and (pixels.mean(-1) < 0.5).mean() > 0.01
    )  # not blank: dark ink on white


MODEL_FILE = """
import torch
from ntk import demo

def net():
    torch.manual_seed(0)
    return demo.mlp(hidden=8)
"""


def test_cli_on_files(tmp_path, capsys):
    data = demo.digits(n_train=60)
    np.savez(tmp_path / "train.npz", x=data.x_train.numpy(), y=data.y_train.numpy())
    np.savez(tmp_path / "test.npz", x=data.x_test[:20].numpy())
    (tmp_path / "m.py").write_text(MODEL_FILE)
    out = tmp_path / "r.html"
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "report",
                "--model",
                f"{tmp_path / 'm.py'}:net",
                "--train",
                str(tmp_path / "train.npz"),
                "--test",
                str(tmp_path / "test.npz"),
                "--out",
                str(out),
                "--examples",
                "2",
                "--alpha",
                "0.5",
                "--format",
                "json",
            ]
        )
    assert exit_.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    saved = _strict_json(out.with_suffix(".json"))
    assert printed["html"] == str(out) and saved["settings"]["test_samples"] == 20
    assert printed["untrained"] is True  # as every subcommand taking --model writes it
    assert saved["settings"]["surrogate"]["alpha"] == 0.5
    assert saved["settings"]["weights"] == "the factory's (untrained: no --weights)"
    assert "the factory's (untrained: no --weights)" in unescape(out.read_text())
    agreement = next(r["value"] for r in printed["rows"] if r["measure"] == "label_agreement")
    assert agreement == pytest.approx(saved["faithfulness"]["surrogate"]["label_agreement"])
    assert "accuracy_net" not in saved["faithfulness"]["surrogate"]  # the test file has no labels
    assert out.read_text().count("<img ") == 3  # flat inputs: attributions as tables, not pictures


@pytest.mark.parametrize(
    "args, message",
    [
        (["--out", "r.txt"], "--out must name an .html file"),
        (["--image-shape", "8by8"], "--image-shape must look like"),
        (["--train", "x.npz"], "needs --model"),
        (["--test-samples", "1"], "'--test-samples': 1 is not in the range x>=2"),
        (["--alpha", "nan"], "'--alpha': nan is not a finite number"),
        (["--alpha", "inf"], "'--alpha': inf is not a finite number"),
    ],
)
def test_cli_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["report", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_demo_without_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["report", "--format", "csv"])
    assert exit_.value.code == 0
    saved = _strict_json(tmp_path / "ntk-report.json")
    assert saved["settings"]["train_samples"] == 1000 and saved["settings"]["test_samples"] == 797
    assert (tmp_path / "ntk-report.html").stat().st_size > 50_000


def test_calibration_section_without_enough_test_labels_uses_the_default_prior(setup):
    """Fewer than VALIDATION_MIN labelled test samples: the posterior keeps NTKPosterior's
    default prior precision, and the section names that rule."""
    model, x_train, y_train, x_test, y_test = setup
    with torch.no_grad():
        p_test = model(x_test[:5]).double().softmax(1)
    c = _calibration(
        model, (x_train[:20], y_train[:20]), (x_test[:5], y_test[:5], p_test), True, 1, {}
    )
    default = NTKPosterior(model).fit(x_train[:20], y_train[:20])
    assert c["prior_precision"] == pytest.approx(default.prior_precision_, rel=1e-9)
    assert "effective parameters" in c["prior_precision_by"] and c["metrics_split"] == "test"


def test_report_of_a_one_logit_classifier_names_the_class_scores_remedy(tmp_path):
    """A binary classifier with one logit (BCE) is refused with the output_fn that gives it class
    scores, as `influence` and the CLI's label check say (the error used to stop at "at least two
    outputs"), and nothing is written."""
    torch.manual_seed(0)
    model = MLP(d_in=4, d_out=1).eval()
    x = torch.randn(12, 4)
    with pytest.raises(ValueError, match=r"has 1 output.*torch\.zeros_like\(z\), z"):
        report(model, x, None, x[:6], path=tmp_path / "r.html")
    assert not list(tmp_path.iterdir())
