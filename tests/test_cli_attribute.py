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


def test_attribute_lists_the_largest_and_smallest_influence(tmp_path):
    (tmp_path / "factory.py").write_text(FACTORY)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 4)).astype(np.float32), rng.integers(0, 3, 30)
    xt = rng.normal(size=(2, 4)).astype(np.float32)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    np.savez(tmp_path / "test.npz", x=xt)
    out = run(
        "--model",
        str(tmp_path / "factory.py:build"),
        "--data",
        str(tmp_path / "train.npz"),
        "--test",
        str(tmp_path / "test.npz"),
        "--top",
        "2",
        "--format",
        "json",
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert len(rows) == 2 * 2 * 2

    namespace = {}
    exec(FACTORY, namespace)
    scores = attribution.influence(
        namespace["build"]().eval(), torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(xt)
    )
    for t in range(2):
        order = torch.argsort(scores[t], descending=True).tolist()
        pro = [r["train"] for r in rows if r["test"] == t and r["role"] == "proponent"]
        opp = [r["train"] for r in rows if r["test"] == t and r["role"] == "opponent"]
        assert pro == order[:2] and opp == order[::-1][:2]

    no_labels = tmp_path / "nolabels.npz"
    np.savez(no_labels, x=x)
    bad = run(
        "--model",
        str(tmp_path / "factory.py:build"),
        "--data",
        str(no_labels),
        "--test",
        str(tmp_path / "test.npz"),
    )
    assert bad.returncode == 2 and "labels" in bad.stderr and "Traceback" not in bad.stderr


def test_attribute_averages_over_checkpoint_files(tmp_path):
    (tmp_path / "factory.py").write_text(FACTORY)
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(24, 4)).astype(np.float32), rng.integers(0, 3, 24)
    xt = rng.normal(size=(2, 4)).astype(np.float32)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    np.savez(tmp_path / "test.npz", x=xt)
    namespace = {}
    exec(FACTORY, namespace)
    nets = []
    for k in range(2):
        torch.manual_seed(10 + k)
        net = namespace["build"]()
        for p in net.parameters():
            p.data.normal_()
        torch.save(net.state_dict(), tmp_path / f"c{k}.pt")
        nets.append(net.eval())
    common = (
        "--model",
        str(tmp_path / "factory.py:build"),
        "--data",
        str(tmp_path / "train.npz"),
        "--test",
        str(tmp_path / "test.npz"),
        "--top",
        "3",
        "--format",
        "json",
    )
    out = run(
        *common, "--checkpoint", str(tmp_path / "c0.pt"), "--checkpoint", str(tmp_path / "c1.pt")
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    expected = attribution.influence(
        namespace["build"]().eval(),
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


def test_attribute_reads_training_features_written_by_ntk_featurize(tmp_path):
    (tmp_path / "factory.py").write_text(FACTORY)
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(20, 4)).astype(np.float32), rng.integers(0, 3, 20)
    xt = rng.normal(size=(2, 4)).astype(np.float32)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    np.savez(tmp_path / "test.npz", x=xt)
    model = ("--model", str(tmp_path / "factory.py:build"), "--data", str(tmp_path / "train.npz"))
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
        *model,
        "--test",
        str(tmp_path / "test.npz"),
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
    rows = json.loads(out.stdout)["rows"]
    namespace = {}
    exec(FACTORY, namespace)
    expected = attribution.influence(
        namespace["build"]().eval(),
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
    other = tmp_path / "other.npz"
    np.savez(other, x=x + 1.0, y=y)
    bad = run(
        "--model",
        str(tmp_path / "factory.py:build"),
        "--data",
        str(other),
        "--test",
        str(tmp_path / "test.npz"),
        "--train-features",
        store,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
