"""The report's per-card sanity strip: cancellation, proponents' label share and the
counterfactual of removing the top proponents, for the surrogate (exact refit) and the network
(retrained)."""

import numpy as np
import torch

from attribution import KernelSurrogate, report
from attribution.damping import DOF_FRACTION
from ntk import demo


def test_sanity_strip_numbers(tmp_path):
    data = demo.digits(n_train=150)
    x, y, xt, yt = data.x_train, data.y_train, data.x_test[:40], data.y_test[:40]

    def retrain(xs, ys):
        torch.manual_seed(0)
        return demo.train(demo.mlp(hidden=16), xs, ys, epochs=5)

    model = retrain(x, y)
    calls = []
    result = report(
        model,
        x,
        y,
        xt,
        yt,
        path=tmp_path / "r.html",
        examples=2,
        top=3,
        kernel_samples=40,
        retrain=lambda xs, ys: calls.append(len(xs)) or retrain(xs, ys),
    )
    assert calls == [150, 147, 147]  # once on everything, once per card without 3 proponents
    s = KernelSurrogate(model).fit(x)
    machine = KernelSurrogate(model, machine="gauss_newton", effective_parameters=DOF_FRACTION)
    machine.fit(x, y)
    html = (tmp_path / "r.html").read_text()
    assert result["attribution"]["counterfactual"].startswith("Gauss–Newton kernel machine")
    assert "sanity: cancellation" in html and "network (retrained)" in html
    for card in result["attribution"]["examples"]:
        i, cls, strip = card["index"], card["network_prediction"], card["sanity"]
        c = s.attribute(xt[i : i + 1])[0, :, cls]
        assert np.isclose(strip["cancellation"], abs(c).sum() / abs(c.sum()))
        gone = np.argsort(-c, kind="stable")[:3]
        assert sorted(p["index"] for p in card["proponents"]) == sorted(gone.tolist())
        assert strip["proponent_label_share"] == np.mean(y.numpy()[gone] == cls)
        drop = machine.influence(xt[i : i + 1], gone, output="all")[0]
        assert np.isclose(strip["counterfactual_change"], -(drop[cls] - drop.mean()))
        keep = np.setdiff1d(np.arange(150), gone)
        nets = [retrain(xs, ys) for xs, ys in ((x, y), (x[keep], y[keep]))]
        with torch.no_grad():
            g_all, g_without = (net(xt[i : i + 1])[0] for net in nets)
        expected = float((g_without[cls] - g_without.mean()) - (g_all[cls] - g_all.mean()))
        assert np.isclose(strip["network_change"], expected, atol=1e-5)


def test_sanity_strip_without_labels_and_without_memory(tmp_path, monkeypatch):
    """Without training labels the counterfactual machine is fitted to the network's
    predictions; when its (N·O)² system does not fit, the strip falls back to the surrogate's own
    exact refit and says so."""
    data = demo.digits(n_train=60)
    x, xt = data.x_train, data.x_test[:20]
    torch.manual_seed(0)
    model = demo.train(demo.mlp(hidden=8), x, data.y_train, epochs=3)
    options = dict(examples=1, top=3, kernel_samples=20, posterior=False)
    predicted = model(x).argmax(1)
    machines = {
        "Gauss–Newton": KernelSurrogate(
            model, machine="gauss_newton", effective_parameters=DOF_FRACTION
        ).fit(x, predicted),
        "the surrogate itself": KernelSurrogate(model).fit(x),
    }
    for name, machine in machines.items():
        if name != "Gauss–Newton":
            monkeypatch.setattr("attribution.surrogate.available_bytes", lambda device: 10_000)
        result = report(model, x, None, xt, path=tmp_path / "r.html", **options)
        assert result["attribution"]["counterfactual"].startswith(name)
        for card in result["attribution"]["examples"]:
            i, cls = card["index"], card["network_prediction"]
            gone = np.array([p["index"] for p in card["proponents"]])
            drop = machine.influence(xt[i : i + 1], gone, output="all")[0]
            assert np.isclose(card["sanity"]["counterfactual_change"], -(drop[cls] - drop.mean()))
