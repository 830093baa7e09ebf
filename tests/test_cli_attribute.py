"""`ntk attribute` as a subprocess: its rows are the extremes of attribution.influence."""

import json
import subprocess
import sys

import numpy as np
import torch

import attribution

FACTORY = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
"""


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "attribution.cli", "attribute", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def write_files(tmp_path, seed: int, n: int):
    """FACTORY as factory.py, n labelled training samples as train.npz and two test samples as
    test.npz in tmp_path; returns (x, y, xt)."""
    (tmp_path / "factory.py").write_text(FACTORY)
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, n)
    xt = rng.normal(size=(2, 4)).astype(np.float32)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    np.savez(tmp_path / "test.npz", x=xt)
    return x, y, xt


def files(tmp_path, data: str = "train.npz") -> tuple:
    """The --model, --data and --test arguments naming the files of `write_files` (`data`: the
    training file's name)."""
    return (
        "--model",
        str(tmp_path / "factory.py:build"),
        "--data",
        str(tmp_path / data),
        "--test",
        str(tmp_path / "test.npz"),
    )


def build():
    """FACTORY's build function, to compare with the subprocess in this process."""
    namespace = {}
    exec(FACTORY, namespace)
    return namespace["build"]


def test_attribute_lists_the_largest_and_smallest_influence(tmp_path):
    x, y, xt = write_files(tmp_path, seed=0, n=30)
    out = run(*files(tmp_path), "--top", "2", "--format", "json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 2
    # --method auto is recorded as the method it ran, and as requested
    assert result["method"] == "gauss_newton" and result["method_requested"] == "auto"
    table = run(*files(tmp_path), "--top", "2")
    assert table.stdout.startswith("influence (auto: gauss_newton) of 30 training examples")

    scores = attribution.influence(
        build()().eval(), torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(xt)
    )
    for t in range(2):
        order = torch.argsort(scores[t], descending=True).tolist()
        pro = [r["train"] for r in rows if r["test"] == t and r["role"] == "proponent"]
        opp = [r["train"] for r in rows if r["test"] == t and r["role"] == "opponent"]
        assert pro == order[:2] and opp == order[::-1][:2]

    np.savez(tmp_path / "nolabels.npz", x=x)
    bad = run(*files(tmp_path, "nolabels.npz"))
    assert bad.returncode == 2 and "labels" in bad.stderr and "Traceback" not in bad.stderr


def test_proponents_raise_the_margin_and_opponents_lower_it(tmp_path, monkeypatch, capsys):
    """The --top largest scores were listed as proponents whatever their sign (and the smallest
    as opponents): a test prediction that every training example lowers had five "proponents"."""
    import pytest

    import attribution._influence
    from attribution.cli import main

    write_files(tmp_path, seed=0, n=30)
    scores = torch.linspace(-3.0, -0.1, 30).repeat(2, 1)  # test 0: every example lowers it
    scores[1, :4] = torch.tensor([2.0, 1.0, 0.5, 0.2])
    monkeypatch.setattr(attribution._influence, "influence", lambda *a, **k: scores.clone())
    with pytest.raises(SystemExit) as stop:
        main([*"attribute --top 5 --format json".split(), *files(tmp_path)])
    assert stop.value.code == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    for t, expected in ((0, []), (1, [0, 1, 2, 3])):
        pro = [r for r in rows if r["test"] == t and r["role"] == "proponent"]
        assert [r["train"] for r in pro] == expected
    assert all(r["score"] < 0 for r in rows if r["role"] == "opponent")
    assert len([r for r in rows if r["test"] == 0 and r["role"] == "opponent"]) == 5


def test_attribute_averages_over_checkpoint_files(tmp_path):
    x, y, xt = write_files(tmp_path, seed=1, n=24)
    nets = []
    for k in range(2):
        torch.manual_seed(10 + k)
        net = build()()
        for p in net.parameters():
            p.data.normal_()
        torch.save(net.state_dict(), tmp_path / f"c{k}.pt")
        nets.append(net.eval())
    common = (*files(tmp_path), "--top", "3", "--format", "json")
    out = run(
        *common, "--checkpoint", str(tmp_path / "c0.pt"), "--checkpoint", str(tmp_path / "c1.pt")
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    expected = attribution.influence(
        build()().eval(),
        torch.from_numpy(x),
        torch.from_numpy(y),
        torch.from_numpy(xt),
        checkpoints=nets,
    )
    for t in range(2):
        got = [r["score"] for r in rows if r["test"] == t and r["role"] == "proponent"]
        np.testing.assert_allclose(got, expected[t].sort(descending=True).values[:3], rtol=1e-5)

    torch.save({"0.weight": torch.zeros(2, 2)}, tmp_path / "wrong.pt")
    bad = run(*common, "--checkpoint", str(tmp_path / "wrong.pt"))
    assert bad.returncode == 2 and "--checkpoint" in bad.stderr and "does not fit" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert len(bad.stderr.splitlines()) == 1  # the kept warning (no --weights) was printed first

    # a checkpoint saved from a DataParallel / DDP wrapper: read, and said so (it was silent,
    # its warning kept for a moment already past)
    torch.save({f"module.{k}": v for k, v in nets[0].state_dict().items()}, tmp_path / "ddp.pt")
    wrapped = run(*common, "--checkpoint", str(tmp_path / "ddp.pt"))
    assert wrapped.returncode == 0, wrapped.stderr
    assert "--checkpoint: " in wrapped.stderr and "names its tensors module." in wrapped.stderr


def test_attribute_reads_training_features_written_by_ntk_featurize(tmp_path):
    x, y, xt = write_files(tmp_path, seed=2, n=20)
    model = files(tmp_path)[:4]  # --model and --data: featurize takes no test set
    store = str(tmp_path / "features")
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "attribution.cli",
            "featurize",
            store,
            *model,
            "--kind",
            "full",
            "--dim",
            "32",
            "--seed",
            "7",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    out = run(
        *files(tmp_path),
        "--top",
        "2",
        "--format",
        "json",
        "--method",
        "gauss_newton",
        "--train-features",
        store,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    rows = report["rows"]
    # another estimator than the default's, said so (it read as the same result faster)
    assert report["training_logits"] == "network" and report["train_features"] == store
    expected = attribution.influence(
        build()().eval(),
        torch.from_numpy(x),
        torch.from_numpy(y),
        torch.from_numpy(xt),
        kind="full",
        dim=32,
        seed=7,
    )
    for t in range(2):
        got = [r["score"] for r in rows if r["test"] == t and r["role"] == "proponent"]
        np.testing.assert_allclose(got, expected[t].sort(descending=True).values[:2], rtol=1e-4)
    np.savez(tmp_path / "other.npz", x=x + 1.0, y=y)
    bad = run(*files(tmp_path, "other.npz"), "--train-features", store)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr


def test_attribute_passes_dim_to_trak(tmp_path):
    """--dim reaches the projection: TRAK's default dim (2048) is at least the 30 training
    examples and warns that it interpolates; --dim 8 is the library's TRAK at dim=8, silently."""
    x, y, xt = write_files(tmp_path, seed=3, n=30)
    common = (*files(tmp_path), "--top", "2", "--format", "json", "--method", "trak")
    default = run(*common)
    assert default.returncode == 0, default.stderr
    assert "interpolates the training set" in default.stderr
    out = run(*common, "--dim", "8")
    assert out.returncode == 0 and "interpolates" not in out.stderr, out.stderr
    result = json.loads(out.stdout)
    assert result["dim"] == 8
    expected = attribution.trak(
        build()().eval(), torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(xt), dim=8
    )
    for t in range(2):
        got = [r["score"] for r in result["rows"] if r["test"] == t and r["role"] == "proponent"]
        np.testing.assert_allclose(got, expected[t].sort(descending=True).values[:2], rtol=1e-4)


ZERO = """
import torch
from torch import nn

def build():
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    with torch.no_grad():
        net[0].weight.zero_()
        net[0].bias.fill_(-1.0)  # every ReLU off: no trainable parameter moves the outputs
        net[2].bias.requires_grad_(False)
    return net
"""


def test_a_zero_curvature_names_what_the_command_line_can_do(tmp_path):
    """The library's remedy "pass damping= explicitly" names a Python argument the command line
    has no flag for, and blamed saturated outputs where no parameter moves them."""
    write_files(tmp_path, seed=3, n=12)
    (tmp_path / "factory.py").write_text(ZERO)
    out = run(*files(tmp_path), "--top", "2")
    assert out.returncode == 2
    line = out.stderr.splitlines()[-1]
    assert "no trainable parameter moves the outputs" in line
    assert "no flag sets it" in line and "pass damping=" not in line
