"""`ntk kernel` as a user runs it: a subprocess, every format, saving, and usage errors."""

import json
import subprocess
import sys

import numpy as np
import torch

import ntk


def run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "attribution.cli", "kernel", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


FACTORY = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
"""


def test_kernel_on_a_factory_file_in_every_format(tmp_path):
    (tmp_path / "factory.py").write_text(FACTORY)
    x = np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x)
    common = ["--model", str(tmp_path / "factory.py:build"), "--data", str(tmp_path / "data.npz")]

    out = run(*common, "--kind", "trace", "--format", "json", "--save", str(tmp_path / "k.npy"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["samples"] == 12 and report["rows"][0]["shape"] == "12x12"
    assert abs(sum(row["share"] for row in report["layers"]) - 1) < 1e-6

    namespace = {}
    exec(FACTORY, namespace)
    expected = ntk.empirical_ntk(namespace["build"]().eval(), torch.from_numpy(x), kind="trace")
    assert np.allclose(np.load(tmp_path / "k.npy"), expected.numpy(), rtol=1e-5)
    assert not list(tmp_path.glob("*.part"))

    csv_out = run(*common, "--format", "csv")
    assert csv_out.returncode == 0
    assert csv_out.stdout.splitlines()[0].startswith("kind,shape,seconds")
    assert len(csv_out.stdout.splitlines()) == 5  # header + four kinds
    table = run(*common, "--kind", "sum_logits")
    assert table.returncode == 0 and "sum_logits" in table.stdout and "per-layer" in table.stdout


def test_usage_errors_exit_2_with_one_line(tmp_path):
    cases = [
        ["--model", "no_colon"],
        ["--model", str(tmp_path / "missing.py:f")],
        ["--model", "json:nothing_here"],
        ["--kind", "bogus"],
        ["--save", str(tmp_path / "k.npy")],
    ]
    for args in cases:
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
